"""## What
FlashInfer's "Buffer overflow when allocating memory for NAME with size S and alignment N,
but only R bytes available in AlignedAllocator" in the vLLM log, at startup (usually during
CUDA-graph capture) or at run time. Not a CUDA OOM: `cuda-graph-capture-oom`,
`kv-budget-exhausted` and `allocator-fragmentation` do not claim it.

## Why
FlashInfer carves its temporaries out of one preallocated workspace with a bump allocator and
raises instead of growing. vLLM creates it once: 256 MiB fixed up to 0.11; from 0.12
`VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE` (default 394 MiB); 2 GiB with `VLLM_BATCH_INVARIANT=1`;
from 0.26 the prefill path enlarges it to max_num_batched_tokens × query heads per rank ×
head_dim × 16 B when larger. Large batches (`--max-num-seqs` ≥ 528 on B300) outgrow it.

## How to confirm
`grep "AlignedAllocator" vllm.log`. Not this rule: a real "CUDA out of memory" inside
FlashInfer code; vLLM 0.33's sparse-MLA warning "… is below the N bytes computed …" without a
crash; the same text from SGLang.

## Fix
Need = (W − R) + S; `VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE` = 1.25 × Need rounded up to
64 MiB, in bytes. On ≤ 0.11 upgrade to ≥ 0.12 (its 394 MiB default is enough when 1.25 × Need
≤ 394 MiB). Alternative: `--attention-backend FLASH_ATTN` (≥ 0.13;
`VLLM_ATTENTION_BACKEND=FLASH_ATTN` before). If the extra bytes exceed the idle headroom
− 0.5 GiB, gmu is lowered by ceil_0.01(Δ/T). The factor 1.25 and the 64 MiB rounding are
estimates (thresholds `headroom_factor`, `round_mib`), overridable in the user config.

On vLLM 0.34's extensible KV cache the "lower gmu" part is dropped: the workspace is
allocated when the FlashInfer wrappers are first built, in the warm-up steps before the KV is
measured, so the measurement already accounts for a larger one (spec/vllm-0.34.md §2).

## Sources
spec/rules-catalogue2.md §3.2; vllm-facts.md §2.1 "What the profile run does not see", §3.7
(FlashInfer line), §4.2 env table (`VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`,
`VLLM_BATCH_INVARIANT`, `--attention-backend`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, MiB, ceil_to, fmt_bytes

_WORKSPACE_ENV = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
#: vLLM ≥ 0.12's default workspace
_DEFAULT_WORKSPACE = 394 * MiB
_GMU = "--gpu-memory-utilization"


@dataclass(frozen=True)
class Thresholds:
    #: the workspace suggested is this × the need (an estimate: spec/rules-catalogue2.md §6)
    headroom_factor: float = 1.25
    #: … rounded up to this many MiB (an estimate)
    round_mib: float = 64
    #: GiB kept free at idle beyond the bigger buffer; under it gmu is lowered too
    idle_margin_gib: float = 0.5


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def _gmu_fix(f: Facts, t: Thresholds, delta: int | None) -> float | None:
    """The gmu lowered by ceil_0.01(Δ/T) when the Δ more bytes the bigger buffer takes exceed
    the idle headroom less the margin; None when it fits (or a figure is unknown)."""
    idle, total, gmu = f["idle_headroom_bytes"], f["device_total_bytes"], f["gmu"]
    if delta is None or delta <= 0 or idle is None or not total or not gmu:
        return None
    if f["vllm_sizing_mode"] == "extensible":
        # 0.34: the workspace is allocated in the warm-up steps before the KV is measured, so
        # the measurement already accounts for a bigger one (spec/vllm-0.34.md §2)
        return None
    if delta <= idle - t.idle_margin_gib * GiB:
        return None
    return round(gmu - ceil_to(delta / total, 0.01), 2)


def _backend_fix(f: Facts) -> Fix | None:
    """FlashAttention instead (no FlashInfer workspace): ``--attention-backend`` from vLLM 0.13
    (and when the version is unknown), the environment variable before; None when in effect."""
    if (f["attention_backend"] or "").upper() == "FLASH_ATTN":
        return None
    release = f["vllm_release"]
    why = "FlashAttention needs no FlashInfer workspace"
    if release is None or release >= 13:
        if not is_valid(f, "--attention-backend", "FLASH_ATTN"):
            return None
        return Fix(flags={"--attention-backend": "FLASH_ATTN"}, why=why)
    return Fix(env={"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}, why=why)


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["fi_overflow"]:
        return None
    need, workspace, release = f["fi_need_bytes"], f["fi_workspace_bytes"], f["vllm_release"]
    new_bytes = int(ceil_to(t.headroom_factor * need, t.round_mib * MiB)) if need and need > 0 else None
    old_version = release is not None and release <= 11
    delta = new_bytes - workspace if new_bytes is not None and workspace else None
    gmu_fix = _gmu_fix(f, t, delta)
    idle = f["idle_headroom_bytes"]
    backend = _backend_fix(f)

    words = (
        f"FlashInfer ran out of its fixed workspace buffer (vllm.log line {na(f['fi_overflow_line'])},"
        f" {f['fi_overflow_phase'] or 'startup'}): allocating {na(f['fi_overflow_buffer'])} needed"
        f" {na(f['fi_overflow_size_bytes'], ',')} bytes with only {na(f['fi_overflow_available_bytes'], ',')}"
        f" left of a {na(workspace, ',')}-byte workspace ({na(f['fi_workspace_source'])}). This is not a"
        " CUDA out-of-memory error: the buffer has a fixed size and never grows, so a lower"
        " gpu_memory_utilization alone changes nothing."
        f" It needs {na(need, ',')} bytes ({na(None if need is None else need / MiB, '.1f')} MiB). "
    )
    gmu_ok = gmu_fix is not None and is_valid(f, _GMU, gmu_fix)
    more = (
        f" The bigger buffer takes {fmt_bytes(delta)} more than the {fmt_bytes(idle)} left free at idle"
        if gmu_fix is not None
        else ""
    )
    fixes: list[Fix] = []
    if old_version:
        # No flag of this version enlarges the buffer: the upgrade is advice, not a fix.
        if new_bytes is None:
            words += "Upgrade to vLLM ≥ 0.12."
        elif new_bytes <= _DEFAULT_WORKSPACE:
            words += (
                f"Upgrade to vLLM ≥ 0.12: its default workspace (394 MiB) holds the {new_bytes / MiB:.0f} MiB"
                f" needed with headroom. On ≥ 0.12 the explicit value would be {_WORKSPACE_ENV}={new_bytes}."
            )
        else:
            words += (
                f"Upgrade to vLLM ≥ 0.12 and set {_WORKSPACE_ENV}={new_bytes} ({new_bytes / MiB:.0f} MiB)."
            )
        if more:  # after the upgrade; named by its field name: no fix of this version sets it
            words += more + (f": lower gpu_memory_utilization to {gmu_fix:.2f} with it." if gmu_ok else ".")
    elif new_bytes is not None:
        words += (
            f"Set {_WORKSPACE_ENV}={new_bytes} ({t.headroom_factor:.2f} × need, rounded up to"
            f" {flag_value(t.round_mib)} MiB: {new_bytes / MiB:.0f} MiB)."
        )
        if more:
            words += more + (f": also lower {_GMU} to {gmu_fix:.2f}." if gmu_ok else ".")
        elif f["vllm_sizing_mode"] == "extensible":
            words += (
                " No gpu_memory_utilization change is needed: vLLM 0.34's extensible KV cache measures"
                " memory after the warm-up that allocates the workspace, so a bigger one is accounted for."
            )
        fixes.append(
            Fix(
                env={_WORKSPACE_ENV: str(new_bytes)},
                flags={_GMU: str(flag_value(gmu_fix))} if gmu_ok else {},
                why=f"a workspace of {t.headroom_factor:.2f} × the need, rounded up"
                + (", its bytes taken from vLLM's budget" if gmu_ok else ""),
            )
        )
    if backend is not None:
        alternative = " ".join(backend.parts())
        words += f" Alternative: {alternative} (no FlashInfer workspace)."
        fixes.append(backend)

    evidence = [
        Evidence(
            "FlashInfer overflow",
            f"{na(f['fi_overflow_buffer'])}: size {na(f['fi_overflow_size_bytes'], ',')} B,"
            f" {na(f['fi_overflow_available_bytes'], ',')} B available",
            f"vllm.log line {na(f['fi_overflow_line'])} ('Buffer overflow … AlignedAllocator')",
        ),
        Evidence("workspace in force", f"{na(workspace, ',')} B", na(f["fi_workspace_source"])),
        Evidence("need", f"{na(need, ',')} B = (W − R) + S", "computed"),
    ]
    if idle is not None:
        evidence.append(
            Evidence("free at idle", fmt_bytes(idle), "nvidia-smi / NVML memory.total − memory.used")
        )
    return Hit(summary=words, evidence=evidence, fixes=fixes, gpus=_gpus(f["engine_gpus"]))


RULE = Rule(
    id="flashinfer-workspace-overflow",
    family="K",
    severity="critical",
    title="FlashInfer's fixed workspace buffer overflowed (not a CUDA OOM)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    flags=(_WORKSPACE_ENV, _GMU, "--attention-backend", "VLLM_ATTENTION_BACKEND"),
)
