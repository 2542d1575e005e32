"""## What
A run-time torch OOM (after `init engine … took`) on a vLLM ≥ 0.34 engine that ran with the
extensible KV cache, where torch hit its per-process cap rather than the device: the OOM text has
the allowed-memory part (`{X} allowed; `) or `exceed per_process_memory_fraction limit`, or
allocated by PyTorch + reserved-but-unallocated + the failed allocation passed L (`Torch may
reserve up to L GiB` of `Memory after warmup`) while the device still had the allocation free.

## Why
On 0.34 the extensible KV cache measures the transient peak of its sizing warm-up (kept) and a
margin μ, commits the rest of the memory to the KV pool, then caps torch at L so that a step
cannot eat into the pool. A step whose transient exceeds what warm-up measured — a wider
prefill, a bigger decode batch — fails at the cap although the device may still show free
memory (vllm-facts §9.2 step 8, §3.6).

## How to confirm
The OOM line (`… X allowed; …` or `Allocation was preemptively rejected …`), the
`Memory after warmup: … Torch may reserve up to L GiB.` line, and what the step held (prompt
tokens in the window: prefill; sampler or decode-attention frames: the decode batch).

## Fix
`--max-num-batched-tokens` halved (a multiple of 256, not below 2048) when prefill is in the
step; or `--gpu-memory-utilization` = floor_0.01((R − Δ − 0.5 GiB)/T) with R = u·T and Δ the
torch headroom missing: valid on the extensible cache because it lowers the KV pool and raises
L by the same bytes (vLLM then logs its WARNING about gmu < 1.0, expected here); or
`--max-num-seqs` halved when the decode batch drives it. Never `--kv-cache-memory-bytes` (it
turns the extensible cache off).

Not this rule: an OOM during a weight update (the cap is lifted then), a device OOM with other
processes on the GPU (`shared-gpu-gmu-unset`), a non-extensible engine (no cap), an OOM at
startup (a warm-up or capture rule), a failed allocation that fits the reserved-but-unallocated
memory (`allocator-fragmentation`), and OOMs that `long-context-prefill-oom`,
`prefill-burst-oom` (root causes: they explain this rule), `logprobs-oom` or
`spec-decode-sampler-oom` claim by their frames.

## Sources
spec/vllm-0.34.md §3.4 (N4); vllm-facts.md §9.2 step 8 (μ, kept, L), §3.6 (the OOM text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, fmt_bytes
from kvdoctor.vllm_flags import default_max_num_batched_tokens

#: memory kept outside torch's cap for non-torch allocations (vllm-facts §9.2 step 8)
NON_TORCH_RESERVE = GiB // 2


@dataclass(frozen=True)
class Thresholds:
    #: --max-num-batched-tokens is never halved below this many tokens
    min_batched_tokens: int = 2048


def _halved_mnbt(mnbt: int | None, floor: int) -> int | None:
    """Half the step in effect, rounded down to a multiple of 256 and not below ``floor``; None
    when that does not lower it."""
    if not mnbt:
        return None
    half = max(floor, mnbt // 2 // 256 * 256)
    return half if half < mnbt else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    if f["vllm_sizing_mode"] != "extensible" or not f["runtime_oom"] or f["oom_at_runtime"] is False:
        return None
    hints = f["runtime_oom_hints"] or []
    # claimed by their frames: logprobs-oom, spec-decode-sampler-oom
    if "logprobs" in hints or f["oom_frames_rejection_sampler"]:
        return None
    allowed, overrun, cap = f["oom_allowed_bytes"], f["torch_cap_overrun_bytes"], f["torch_cap_bytes"]
    rejected = f["torch_cap_rejected_line"]
    requested, free, reserved = (
        f["oom_requested_bytes"],
        f["oom_free_bytes"],
        f["oom_reserved_unallocated_bytes"],
    )
    device_had_room = free is None or requested is None or free >= requested
    at_cap = (
        allowed is not None
        or rejected is not None
        or (overrun is not None and overrun > 0 and device_had_room)
    )
    if not at_cap:
        return None
    if requested is not None and reserved is not None and requested <= reserved:
        return None  # allocator-fragmentation: the request fitted the reserved-but-unallocated pool
    if not device_had_room and not allowed and not rejected:
        return None  # a device OOM: shared-gpu-gmu-unset / another process
    delta = overrun if overrun is not None and overrun > 0 else requested
    delta_text = (
        "Δ = allocated by PyTorch + reserved but unallocated + the failed allocation − L"
        if overrun is not None and overrun > 0
        else "Δ taken as the failed allocation (the cap L or the held bytes are not logged)"
    )

    fixes: list[Fix] = []
    levers: list[str] = []
    prefill = bool(
        (f["prompt_tokens_per_s"] or 0) > 0
        or (f["log_prompt_throughput_last"] or 0) > 0
        or "prefill" in hints
        or f["oom_prompt_tokens"]
    )
    mnbt = f["max_num_batched_tokens"]
    if mnbt is None and f["gpu_total_bytes"]:
        # vLLM's default for the version and device (the value the engine ran with)
        mnbt = default_max_num_batched_tokens(f["vllm_defaults_version"], f["gpu_total_bytes"], f["gpu_name"])
    half = _halved_mnbt(mnbt, t.min_batched_tokens) if prefill else None
    if half is not None and is_valid(f, "--max-num-batched-tokens", half):
        levers.append(f"--max-num-batched-tokens {half} halves the prefill step's transient")
        fixes.append(Fix(flags={"--max-num-batched-tokens": str(half)}, why="a smaller prefill step"))
    u, total = f["gmu_resolved"], f["device_total_bytes"]
    gmu_fix = None
    if u and total and delta:
        gmu_fix = math.floor((u * total - delta - NON_TORCH_RESERVE) / total * 100) / 100
        if not 0 < gmu_fix < u or not is_valid(f, "--gpu-memory-utilization", gmu_fix):
            gmu_fix = None
    if gmu_fix is not None:
        levers.append(
            f"--gpu-memory-utilization {gmu_fix:.2f} moves {fmt_bytes(delta)} from the KV pool to torch's cap"
            " (vLLM then logs its WARNING that the gmu caps this instance: expected, the step exceeded what"
            " warm-up measured)"
        )
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": str(flag_value(gmu_fix))},
                why="a smaller KV pool and a torch cap higher by the same bytes",
            )
        )
    seqs = f["max_num_seqs_effective"]
    if "sampler" in hints and seqs and seqs >= 2 and is_valid(f, "--max-num-seqs", seqs // 2):
        levers.append(f"--max-num-seqs {seqs // 2} halves the decode batch")
        fixes.append(Fix(flags={"--max-num-seqs": str(seqs // 2)}, why="a smaller decode batch"))

    how = (
        f"its OOM says {fmt_bytes(allowed)} allowed"
        if allowed is not None
        else "torch rejected the allocation at its per_process_memory_fraction limit"
        if rejected is not None
        else f"it held more than the cap L = {fmt_bytes(cap)}"
    )
    summary = (
        f"A step ran out of torch's per-process cap at run time (vllm.log line {na(f['oom_line'])}): {how},"
        f" while the device still had {fmt_bytes(free)} free. With the extensible KV cache vLLM commits"
        " all but the transient peak its warm-up measured (plus a margin) to the KV pool and caps torch"
        f" there; this step needed about {fmt_bytes(delta)} more."
    )
    if levers:
        summary += " " + "; or ".join(levers) + "."
    evidence = [
        Evidence(
            "run-time OOM",
            f"Tried to allocate {fmt_bytes(requested)}, {fmt_bytes(free)} free",
            f"vllm.log line {na(f['oom_line'])}",
        ),
        Evidence("torch headroom missing", fmt_bytes(delta), delta_text),
    ]
    if allowed is not None:
        evidence.append(Evidence("allowed (torch cap)", fmt_bytes(allowed), "the OOM's 'X allowed' part"))
    if cap is not None:
        evidence.append(
            Evidence("torch cap L", fmt_bytes(cap), "'Memory after warmup: … Torch may reserve up to L'")
        )
    if f["warmup_kept_bytes"] is not None:
        evidence.append(
            Evidence(
                "kept for transients",
                fmt_bytes(f["warmup_kept_bytes"]),
                "'Memory after warmup' (max(Tr, Gr))",
            )
        )
    if f["gmu_assumption"]:
        evidence.append(Evidence("gmu", na(u, ".2f"), f["gmu_assumption"]))
    oom_gpu = f["oom_gpu"]
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=[oom_gpu] if oom_gpu is not None else sorted(set(f["engine_gpus"] or ())),
    )


RULE = Rule(
    id="torch-cap-oom",
    family="L",
    severity="critical",
    title="A step went past torch's cap on vLLM 0.34's extensible KV cache",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    flags=("--max-num-batched-tokens", "--gpu-memory-utilization", "--max-num-seqs"),
)
