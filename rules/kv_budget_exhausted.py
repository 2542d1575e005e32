"""## What
The memory available for the KV cache is zero or negative: "No available memory for the cache
blocks", a negative "Available KV cache memory", or (V0) "the rest of the memory reserved for KV
Cache is -1.05GiB".

## Why
available KV = ceil(total × gmu) − (weights + activation peak of the profiling run + non-torch
memory [+ CUDA graph estimate]). When weights and the activation peak already exceed the budget
there is nothing for blocks. An OOM raised *during* the profile run (multimodal, prefill,
sampler) is a different rule.

## How to confirm
The log's memory-profiling lines (V0) or "Available KV cache memory" (V1 ≥ 0.9.1).

## Fix
The gpu_memory_utilization at which KV becomes positive (with room for one request), if it is
≤ 0.95; otherwise tensor parallelism or a quantized model. `--max-num-batched-tokens` lower
shrinks the activation peak.

## Sources
vllm-facts.md §2.1 (pipeline and formula history), §3.3 item 11, §3.5 ("No KV memory").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import gmu_for_bytes, smallest_tensor_parallel_size
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    #: GiB of KV one request needs when the model's KV size per token is unknown
    min_kv_gib: float = 0.5
    #: the highest --gpu-memory-utilization worth suggesting (1.0 on a 0.34 extensible engine)
    max_gmu: float = 0.95
    #: GiB another process must hold on the GPU before an explicit gmu is left for it (0.34, N1)
    foreign_min_gib: float = 0.25


def _mnbt_fix(f: Facts) -> int | None:
    """Half the profiled step (not below 2048; with chunked prefill off never below
    max_model_len, which vLLM rejects)."""
    mnbt = f["max_num_batched_tokens"]
    if not mnbt or mnbt <= 2048:
        return None
    half = max(2048, mnbt // 2)
    if f["chunked_prefill_on"] is False and half < (f["max_model_len"] or 0):
        return None
    return half


def check(f: Facts, t: Thresholds) -> Hit | None:
    negative = any(
        b is not None and b < 0
        for b in (f["log_available_kv_bytes"], f["v0_profile_kv_bytes"], f["mml_error_available_bytes"])
    )
    if not (f["no_kv_memory"] or negative) or f["fi_overflow"]:
        return None
    ext = f["vllm_sizing_mode"] == "extensible"
    if ext and f["kv_error_after_warmup"]:
        # vLLM ≥ 0.34 extensible: no KV after graph capture and warm-up belongs to
        # graphs-warmup-left-no-kv (N2), or to shared-gpu-gmu-unset (N1) with another process
        return None
    gmu = f["gmu_resolved"] if f["gmu_resolved"] is not None else f["gmu"]
    total = f["v0_profile_total_bytes"] or f["gpu_total_bytes"] or f["fbu_total_bytes"]
    non_kv: float | None = None
    if f["v0_profile_weights_bytes"] is not None:
        non_kv = (
            f["v0_profile_weights_bytes"]
            + (f["v0_profile_activation_bytes"] or 0)
            + (f["v0_profile_non_torch_bytes"] or 0)
        )
    elif f["log_available_kv_bytes"] is not None and total and gmu is not None:
        non_kv = gmu * total - f["log_available_kv_bytes"]
    kv_bpt, mml = f["kv_bytes_per_token"], f["max_model_len"]
    one_request_kv = kv_bpt * mml if kv_bpt and mml else t.min_kv_gib * 2**30
    gmu_needed = gmu_for_bytes(int(non_kv + one_request_kv), total) if non_kv is not None and total else None
    if ext and gmu_needed is not None and gmu_needed <= 1.0:
        # the extensible pool is sized after graph capture and warm-up: a gmu that only just fits
        # the reservation fails there (graphs-warmup-left-no-kv); give it the whole GPU
        gmu_needed = 1.0
    arch, weights, gpus = f["arch"], f["weights_bytes"], f["gpu_count"]
    tp_alt = None
    if arch is not None and weights and total and gpus and gmu is not None and mml:
        tp_alt = smallest_tensor_parallel_size(
            arch,
            weights_bytes=weights,
            gpu_total_bytes=total,
            gpu_memory_utilization=gmu,
            visible_gpus=gpus,
            max_model_len=mml,
            kv_cache_dtype=f["kv_cache_dtype"] or "auto",
        )
    mnbt = _mnbt_fix(f)

    fixes: list[Fix] = []
    # On 0.34 extensible (spec/vllm-0.34.md §2): gmu reaches 1.0, and a gmu is advised only for an
    # explicit gmu below 1 with no other process on the GPU; with gmu unset 1.0 is in effect.
    max_gmu = 1.0 if ext else t.max_gmu
    gmu_allowed = not ext or bool(
        f["gmu_explicit"]
        and gmu is not None
        and gmu < 1.0
        and (f["foreign_bytes"] or 0) < t.foreign_min_gib * 2**30
    )
    if (
        gmu_needed is not None
        and gmu_allowed
        and gmu_needed <= max_gmu
        and is_valid(f, "--gpu-memory-utilization", gmu_needed)
    ):
        advice = f"Raise --gpu-memory-utilization to {flag_value(gmu_needed)}."
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": str(flag_value(gmu_needed))},
                why="room for the KV cache of one request",
            )
        )
    elif tp_alt and tp_alt > (f["tp"] or 1) and is_valid(f, "--tensor-parallel-size", tp_alt):
        advice = f"Shard the model (--tensor-parallel-size {tp_alt}) or use a quantized model."
        fixes.append(
            Fix(flags={"--tensor-parallel-size": str(tp_alt)}, why="the weights split over more GPUs")
        )
    else:
        advice = "Use a smaller or quantized model, or more GPUs."
    if mnbt is not None and is_valid(f, "--max-num-batched-tokens", mnbt):
        advice += (
            f" A smaller --max-num-batched-tokens ({mnbt}) shrinks the activation peak of the profiling run."
        )
        fixes.append(Fix(flags={"--max-num-batched-tokens": str(mnbt)}, why="a smaller profiling step"))

    activation = f["v0_profile_activation_bytes"]
    kv = f["v0_profile_kv_bytes"]
    budget = gmu * total if gmu is not None and total else None
    if ext and gmu is not None and gmu >= 1.0:
        advice = "gmu is 1.0 already, so raising it is no fix. " + advice
    summary = (
        f"After weights{f', {gib_text(activation)} GiB of activation peak' if activation else ''}"
        f" and non-torch memory, nothing of the {gib_text(budget)} GiB budget"
        f" (gmu {gmu} × {gib_text(total)} GiB) is left for KV blocks"
        f"{f' ({gib_text(kv)} GiB)' if kv is not None else ''}. {advice}"
    )
    evidence: list[Evidence] = []
    line = f["v0_profile_line"]
    if kv is not None:
        evidence.append(
            Evidence(
                "KV memory left", f"{gib_text(kv)} GiB", f"vllm.log line {na(line)} (V0 memory profiling)"
            )
        )
    if f["v0_profile_weights_bytes"] is not None:
        parts = (f["v0_profile_weights_bytes"], activation, f["v0_profile_non_torch_bytes"])
        evidence.append(
            Evidence(
                "weights / activation peak / non-torch",
                " / ".join(gib_text(p) for p in parts) + " GiB",
                f"vllm.log line {na(line)}",
            )
        )
    if f["log_available_kv_bytes"] is not None:
        evidence.append(
            Evidence(
                "Available KV cache memory",
                f"{gib_text(f['log_available_kv_bytes'])} GiB",
                f"vllm.log line {na(f['log_available_kv_line'])}",
            )
        )
    if f["no_kv_memory"]:
        evidence.append(
            Evidence(
                "No available memory for the cache blocks",
                "logged",
                f"vllm.log line {na(f['no_kv_memory_line'])}",
            )
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=f["engine_gpus"] or ())


RULE = Rule(
    id="kv-budget-exhausted",
    family="K",
    severity="critical",
    title="Nothing is left for the KV cache after weights and activations",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "metrics"),
    flags=("--gpu-memory-utilization", "--tensor-parallel-size", "--max-num-batched-tokens"),
)
