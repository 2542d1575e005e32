r"""## What
`Triton Error [CUDA]: out of memory` (a RuntimeError from Triton's driver, with no "Tried to
allocate" figures) during warm-up or on the first requests after startup. Autotuner frames
(`autotuner.py`, `_bench`, `do_bench`), vLLM's FLA / gated-delta-net ops
(`model_executor/layers/fla/ops/`, `chunk_gated_delta_rule`) or vLLM's warning "GDN prefill
kernel warmup (T=…) failed for layer …" strengthen it.

## Why
vLLM's profile run skips attention-type layers, so gated-delta-net kernels (Qwen3-Next,
Qwen3.5) are first run, and first autotuned, on the first real request, after the KV cache
took the memory. Autotuning benchmarks several configs with scratch outside torch's
allocator. From 0.18 vLLM runs a small warm-up through those kernels inside the profile run.
On compute capability 9.0, 0.17 uses FlashInfer's GDN prefill kernel instead.

## How to confirm
`grep "Triton Error \[CUDA\]" vllm.log`. Not this rule: "Triton Error [CUDA]: an illegal
memory access" / "invalid argument" (kernel bugs), the DEBUG "warmup … completed" line, a
torch "CUDA out of memory. Tried to allocate" (the torch-OOM rules).

## Fix
vLLM < 0.18 with a gated-delta-net model off compute capability 9.0: upgrade to ≥ 0.18. In
every case leave room outside the allocator: `--gpu-memory-utilization` =
floor_0.01((B − Δ)/T) with Δ = max(1 GiB − H_idle, 0.5 GiB) (1 GiB when H_idle is unknown;
thresholds `scratch_gib`, `min_delta_gib`).

On vLLM 0.34's extensible KV cache the startup kernel warm-up (autotune) runs before the KV
commit: a startup Triton OOM gets no gmu (it frees nothing then), a run-time one the same
formula with R = u × T (u = 1.0 when gmu is unset): the memory withheld stays free outside
torch's cap. The "< 0.18 → upgrade" branch never applies on 0.34.

## Sources
spec/rules-catalogue2.md §3.2, §2 (B, H_idle); vllm-facts.md §2.1 "Kernels that first run
after KV allocation", §3.7 (Triton and GDN lines).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, floor_to, fmt_bytes

_GMU = "--gpu-memory-utilization"


@dataclass(frozen=True)
class Thresholds:
    #: GiB of scratch autotuning needs outside the allocator (Δ = max(this − H_idle, min_delta_gib))
    scratch_gib: float = 1.0
    #: GiB the budget is lowered by at least
    min_delta_gib: float = 0.5


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def _needs_upgrade(f: Facts) -> bool:
    """A gated-delta-net model on vLLM < 0.18 off compute capability 9.0: its kernels first run
    (and autotune) on the first real request, after the KV cache took the memory."""
    release = f["vllm_release"]
    return (
        bool(f["gdn_model"]) and release is not None and release < 18 and f["gpu_compute_capability"] != "9.0"
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["triton_oom"]:
        return None
    idle, budget, total, gmu = (
        f["idle_headroom_bytes"],
        f["engine_budget_bytes"],
        f["device_total_bytes"],
        f["gmu"],
    )
    delta = (
        max(t.scratch_gib * GiB - idle, t.min_delta_gib * GiB) if idle is not None else t.scratch_gib * GiB
    )
    if not budget or not total or gmu is None:
        return None
    gmu_fix = floor_to((budget - delta) / total, 0.01)
    # vLLM 0.34's extensible KV cache: the startup warm-up (autotune included) runs before the
    # KV commit, where a lower gmu frees nothing (spec/vllm-0.34.md §1 rule 4, §2)
    ext = f["vllm_sizing_mode"] == "extensible"
    before_commit = ext and f["triton_oom_phase"] not in ("runtime", None)
    if not gmu_fix < gmu and not before_commit:
        return None
    upgrade = _needs_upgrade(f)
    hints = f["triton_oom_hints"] or []
    frames = ", ".join(h for h in hints if h in ("triton_autotune", "fla_ops"))
    line = na(f["triton_oom_line"])

    words = (
        f'Triton\'s driver ran out of GPU memory ("Triton Error [CUDA]: out of memory", vllm.log line {line},'
        f" {f['triton_oom_phase'] or 'startup'}){f' in {frames} code' if frames else ''}. This memory is"
        " allocated outside PyTorch's caching allocator, by kernels that autotune on their first run"
    )
    if upgrade:
        words += (
            f": vLLM {na(f['vllm_version'])} runs the gated-delta-net Triton kernels for the first time on the"
            " first real request, after the KV cache took the memory. Upgrade to vLLM ≥ 0.18: its profile run"
            " tunes those kernels before the KV cache is allocated. Also leave"
        )
    else:
        words += ". Leave"
    fixes = []
    if before_commit:
        words = words.removesuffix(". Leave") + (
            ". On vLLM 0.34's extensible KV cache this startup autotuning runs before the KV cache is"
            " committed, so no gpu_memory_utilization frees memory for it: the weights and the warm-up"
            " activations alone left too little on the GPU."
        )
    elif is_valid(f, _GMU, gmu_fix):
        if ext:
            words += (
                " room for run-time autotuning outside torch's cap (it competes for the 0.5 GiB vLLM keeps"
                " outside the cap plus the headroom torch has not grown into):"
            )
        else:
            words += " room for scratch outside the allocator:"
        words += f" {_GMU} {gmu_fix:.2f} (the budget less {fmt_bytes(delta)})."
        if ext:
            words += " The memory withheld stays free for non-torch use."
        fixes.append(
            Fix(flags={_GMU: str(flag_value(gmu_fix))}, why="room outside the allocator for autotuning")
        )
    else:  # the budget cannot spare it (gmu ≤ 0), or the change is too small to make
        words += f" {fmt_bytes(delta)} of room for scratch outside the allocator."

    evidence = [Evidence("Triton OOM", "Triton Error [CUDA]: out of memory", f"vllm.log line {line}")]
    if hints:
        evidence.append(
            Evidence("traceback mentions", ", ".join(hints), f"vllm.log traceback around line {line}")
        )
    if f["gdn_warmup_failed"]:
        evidence.append(
            Evidence(
                "GDN warm-up failed",
                "GDN prefill kernel warmup failed",
                f"vllm.log line {na(f['gdn_warmup_failed_line'])}",
            )
        )
    if f["gdn_model"]:
        evidence.append(Evidence("gated-delta-net model", na(f["model_name"]), "config.json architectures"))
    if idle is not None:
        evidence.append(
            Evidence("free at idle", fmt_bytes(idle), "nvidia-smi / NVML memory.total − memory.used")
        )
    return Hit(summary=words, evidence=evidence, fixes=fixes, gpus=_gpus(f["engine_gpus"]))


RULE = Rule(
    id="triton-autotune-oom",
    family="K",
    severity="critical",
    title="Triton ran out of memory autotuning kernels outside the startup profile",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    flags=(_GMU,),
)
