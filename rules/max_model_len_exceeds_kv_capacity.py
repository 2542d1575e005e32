"""## What
The KV cache cannot hold even one request of `--max-model-len` tokens, so vLLM refuses to start
(V1: "To serve at least one request with the model's max seq len …"; V0: "The model's max seq
len (N) is larger than the maximum number of tokens that can be stored in KV cache (M)").

## Why
After weights, activations and CUDA graphs, what is left of gpu_memory_utilization × total
becomes KV blocks. A long default context (131072 for Llama 3.1) rarely fits a single GPU's
leftover. The figures are per GPU rank: never add up GPUs.

## How to confirm
The log's error line with the needed and available GiB, and vLLM's own estimate of the maximum
length that fits.

## Fix
`--max-model-len` at most vLLM's estimate (when logged) or the capacity rounded down to a block
multiple; alternatively a higher gmu, fp8 KV (`--kv-cache-dtype fp8` halves KV per token), or
more tensor parallelism.

## Sources
vllm-facts.md §2.3 (fit check and estimate), §3.5 (messages, all variants).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import gmu_for_bytes, max_model_len_for_tokens
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    """None: the rule has no tunable thresholds."""


#: the highest --gpu-memory-utilization worth suggesting to keep the full length
_MAX_GMU = 0.95
#: bytes another process must hold on the GPU before an explicit gmu is kept for it (spec N1)
_FOREIGN_MIN = 2**28


def _mml_fix(f: Facts, capacity: int | None) -> int | None:
    """vLLM's estimate of the longest length that fits, else the capacity rounded down to a
    block multiple."""
    block = f["block_size"]
    est = f["mml_error_estimate"]
    if not est and f["vllm_sizing_mode"] == "extensible":
        # the committed pool with the null block held back (spec/vllm-0.34.md §2), never A
        est = f["max_model_len_fit_pool"]
    if est:
        # vLLM's estimate is a multiple of the block size in effect; keep it one
        return max_model_len_for_tokens(est, block) if block and block > 0 else est
    if not capacity or block is None or block < 1:
        return None
    return max_model_len_for_tokens(capacity, block)


def _gmu_alt(f: Facts) -> float | None:
    """The gmu whose budget also holds the KV the error says is missing. On vLLM ≥ 0.34 with the
    extensible KV cache (spec/vllm-0.34.md §2): none with gmu unset (1.0 is in effect), 1.0 for an
    explicit gmu below 1 with no other process on the GPU (the pool is measured after warm-up, so a
    gmu computed from the reservation would not say how much it gains), else none."""
    if f["vllm_sizing_mode"] == "extensible":
        gmu = f["gmu_resolved"]
        if (
            f["gmu_explicit"]
            and gmu is not None
            and gmu < 1.0
            and not (f["foreign_bytes"] or 0) >= _FOREIGN_MIN
        ):
            return 1.0
        return None
    needed, available = f["mml_error_needed_bytes"], f["mml_error_available_bytes"]
    total, gmu = f["gpu_total_bytes"], f["gmu"]
    if not needed or available is None or not total or gmu is None or total <= 0:
        return None
    return gmu_for_bytes(int(gmu * total + needed - available), total)


def _fp8_enough(f: Facts) -> bool:
    """Whether halving the KV per token (fp8 from the model's dtype) makes one request fit."""
    needed, available = f["mml_error_needed_bytes"], f["mml_error_available_bytes"]
    return bool(
        f["kv_cache_dtype"] == "auto"
        and f["fp8_supported"] is not False
        and needed
        and needed > 0
        and available
        and available > 0
        and needed / 2 <= available
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    requested = f["mml_error_max_model_len"] or f["max_model_len"]
    capacity = f["mml_error_estimate"] or f["mml_error_kv_tokens"] or f["kv_capacity_tokens"]
    computed_short = bool(
        not f["mml_error"]
        and not f["no_kv_memory"]
        and capacity is not None
        and capacity > 0
        and requested is not None
        and capacity < requested
    )
    if not (f["mml_error"] or computed_short):
        return None

    alternatives: list[str] = []
    fixes: list[Fix] = []
    mml = _mml_fix(f, capacity)
    if mml is not None and is_valid(f, "--max-model-len", mml):
        alternatives.append(f"cap --max-model-len at {flag_value(mml)}")
        fixes.append(
            Fix(flags={"--max-model-len": str(flag_value(mml))}, why="the longest request the KV cache holds")
        )
    gmu_alt = _gmu_alt(f)
    max_gmu = 1.0 if f["vllm_sizing_mode"] == "extensible" else _MAX_GMU
    if gmu_alt is not None and gmu_alt <= max_gmu and is_valid(f, "--gpu-memory-utilization", gmu_alt):
        text = str(flag_value(gmu_alt))
        alternatives.append(f"raise --gpu-memory-utilization to {text} to keep the full length")
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": text},
                why="a KV cache that holds one request of full length",
            )
        )
    if _fp8_enough(f) and is_valid(f, "--kv-cache-dtype", "fp8"):
        alternatives.append("halve the KV per token with --kv-cache-dtype fp8")
        fixes.append(
            Fix(flags={"--kv-cache-dtype": "fp8"}, why="half the KV bytes per token: the full length fits")
        )
    if alternatives:
        advice = ", or ".join(alternatives)
        advice = advice[0].upper() + advice[1:] + "."
    else:
        advice = "No shorter max_model_len can be sized from what was read."

    tp_pp = f["tp_pp"]
    per_rank = " per GPU rank" if tp_pp is not None and tp_pp > 1 else ""
    summary = (
        f"One request of max_model_len {na(requested, ',')} tokens needs more KV cache than this engine"
        f" has: it holds {na(capacity, ',')} tokens{per_rank}. {advice}"
    )

    line = f"vllm.log line {na(f['mml_error_line'])}"
    evidence: list[Evidence] = []
    if f["mml_error"]:
        evidence.append(Evidence("max_model_len requested", f"{na(requested, ',')} tokens", line))
    if f["mml_error_needed_bytes"] is not None:
        value = f"{gib_text(f['mml_error_needed_bytes'])} / {gib_text(f['mml_error_available_bytes'])} GiB"
        evidence.append(Evidence("KV needed for one request / available", value, line))
    if f["mml_error_estimate"]:
        value = f"{na(f['mml_error_estimate'], ',')} tokens"
        evidence.append(Evidence("vLLM's estimated maximum model length", value, line))
    if f["mml_error_kv_tokens"]:
        value = na(f["mml_error_kv_tokens"], ",")
        evidence.append(Evidence("tokens the KV cache can store", value, f"{line} (V0 message)"))
    if f["kv_capacity_tokens"] is not None and not f["mml_error"]:
        evidence.append(
            Evidence(
                "KV cache capacity",
                f"{na(f['kv_capacity_tokens'], ',')} tokens",
                "vllm.log 'Maximum concurrency for L tokens per request: Cx' × L (vLLM 0.9–0.20 logs a hybrid"
                " model's 'GPU KV cache size' as low as a quarter of the capacity)"
                if f["kv_capacity_from_concurrency"]
                else "vllm:cache_config_info / 'GPU KV cache size' log line",
            )
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="max-model-len-exceeds-kv-capacity",
    family="K",
    severity="critical",
    title="The KV cache holds fewer tokens than --max-model-len",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "metrics"),
    flags=("--max-model-len", "--gpu-memory-utilization", "--kv-cache-dtype"),
)
