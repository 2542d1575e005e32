"""## What
The engine was started without tensor (or pipeline) parallelism although its weights do not fit
one GPU's budget, or one GPU filled up and ran out of memory while loading the weights while the
other visible GPUs stayed empty.

## Why
vLLM places the whole model on one GPU unless `--tensor-parallel-size` (TP) or
`--pipeline-parallel-size` (PP) says otherwise. A 70B model in fp16 (~128 GiB) cannot fit one
40 or 80 GB card. This is the seed tutorial's first check: "are the weights spread over the GPUs?".

## How to confirm
`nvidia-smi`: GPU 0 at its limit, the others at a few MiB. The log shows a
`CUDA out of memory` while the model is built or loaded (before any "Model loading took" line).

On vLLM ≥ 0.34 the budget per GPU is min(u × T, F0) − 1 GiB (u the resolved gmu, 1.0 when unset
with the extensible KV cache; F0 the memory free at the engine's start), and the load OOM is a
plain torch OOM with `load_model`/`load_weights` frames (0.33's "Failed to load model" wrapper is
gone). A lower gmu frees nothing while the weights load on 0.34, so it is never the advice.

## Fix
`--tensor-parallel-size N` with the smallest N that divides the attention heads (and the KV heads
where there are at least N), is at most the number of visible GPUs, and leaves room for the KV
cache of one `--max-model-len` request on every GPU (kvmath.smallest_tensor_parallel_size).

## Sources
spec/rules.md family W; spec/vllm-0.34.md §2 weights-not-sharded; vllm-facts.md §2.2 (TP sharding
of KV heads), §3.5 (load OOM message), §9.4.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import smallest_tensor_parallel_size
from kvdoctor.rule_functions import gpus_full, gpus_under
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid, na
from kvdoctor.units import GiB


@dataclass(frozen=True)
class Thresholds:
    #: GiB of KV cache a GPU's budget must keep beside the weights
    min_kv_reserve_gib: float = 1.0
    #: visible GPUs assumed when no nvidia-smi was given
    max_gpus_assumed: int = 8
    #: a GPU holding less than this many GiB, with no process listed, is empty
    empty_max_gib: float = 1.0
    #: a GPU at this share of its total or more is full
    full_fraction: float = 0.95


def _budget(f: Facts, total: int | None) -> tuple[float | None, str]:
    """The bytes per GPU the weights and one request must fit, and how it was computed: gmu ×
    total up to 0.33 (and on an unknown version); on 0.34 min(u × T, F0), u the resolved gmu and
    F0 the memory free at the engine's start (spec/vllm-0.34.md §2)."""
    gmu = f["gmu_resolved"] if f["gmu_resolved"] is not None else f["gmu"]
    if not total or gmu is None:
        return None, ""
    budget = gmu * total
    how = f"gmu {gmu:g} × {gib_text(total, '.1f')} GiB"
    if not f["gmu_explicit"] and not f["vllm_version_known"] and not f["vllm_v34"]:
        how += f", vLLM version unknown: vLLM {f['vllm_defaults_version'] or '0.33'}'s default gmu assumed"
    f0 = f["startup_free_bytes"]
    if f["vllm_v34"]:
        how = f"u {float(gmu)!r} × {gib_text(total, '.1f')} GiB"
        if f0 is not None and f0 < budget:
            budget = float(f0)
            how = f"{gib_text(f0, '.1f')} GiB free at the engine's start, below u {float(gmu)!r} × total"
    return budget, how


def _tp_fit(f: Facts, total: int | None, gpus: int, budget: float | None) -> int | None:
    """The smallest TP whose shards and one request's KV fit each GPU's budget (None when none
    fits or an input is missing)."""
    arch, weights, mml = f["arch"], f["weights_bytes"], f["max_model_len"]
    if arch is None or not weights or not total or budget is None or mml is None:
        return None
    gmu = budget / total
    try:
        return smallest_tensor_parallel_size(
            arch,
            weights_bytes=weights,
            gpu_total_bytes=total,
            gpu_memory_utilization=gmu,
            visible_gpus=gpus,
            max_model_len=mml,
            kv_cache_dtype=f["kv_cache_dtype"] or "auto",
            block_size=f["block_size"] if f["vllm_v34"] else None,
        )
    except (ValueError, TypeError, ZeroDivisionError, KeyError):
        return None


def check(f: Facts, t: Thresholds) -> Hit | None:
    if f["tp_pp"] != 1 or f["offload_not_applied"]:
        return None
    empty = gpus_under(f["gpu_used_map"], t.empty_max_gib * GiB, f["gpus_without_processes"])
    weights, gpu_count = f["weights_bytes"], f["gpu_count"]
    total = f["gpu_total_bytes"] or f["oom_total_bytes"]
    budget, how = _budget(f, total)
    too_big = weights is not None and budget is not None and weights > budget - t.min_kv_reserve_gib * 2**30
    lopsided = bool(f["weight_loading_oom"]) and len(empty) >= 1
    if not (too_big or lopsided):
        return None
    gpus_assumed = gpu_count or t.max_gpus_assumed
    tp_fix = _tp_fit(f, total, gpus_assumed, budget)

    fixes: list[Fix] = []
    if tp_fix and is_valid(f, "--tensor-parallel-size", tp_fix):
        fixes.append(
            Fix(flags={"--tensor-parallel-size": str(tp_fix)}, why="the weights split over more GPUs")
        )
        advice = f"Shard the model with --tensor-parallel-size {tp_fix}. "
        if not gpu_count:
            tail = f" ({gpus_assumed} GPUs assumed: no nvidia-smi was given)"
        else:
            tail = ""
    elif tp_fix:
        advice = ""
        tail = (
            f" The smallest tensor-parallel size that fits by the estimate ({tp_fix}) is not one this engine"
            " can take (in effect already, or not valid for its heads or GPUs): use a quantized model or"
            " larger GPUs."
        )
    else:
        advice = ""
        tail = " No tensor-parallel size within the visible GPUs fits: use a quantized model or larger GPUs."
    size = ""
    if weights and budget:
        size = (
            f" - about {gib_text(weights, '.1f')} GiB of weights against a budget of {gib_text(budget, '.1f')}"
            f" GiB per GPU ({how})"
        )
    oom = (
        f", and it ran out of memory while loading them (log line {f['oom_line']})"
        if f["weight_loading_oom"]
        else ""
    )
    idle = f", while {len(empty)} of the {gpu_count} visible GPUs hold nothing" if empty else ""
    summary = (
        f"{advice}The engine runs with tensor_parallel_size × pipeline_parallel_size = 1, so every weight"
        f" must fit one GPU{size}{oom}{idle}.{tail}"
    )

    evidence = [
        Evidence(
            "tensor_parallel_size × pipeline_parallel_size",
            f"{na(f['tp'])} × {na(f['pp'])}",
            "launch command / log args",
        )
    ]
    if weights is not None:
        source = (
            "Model loading took log line"
            if f["weights_logged_bytes"]
            else f"parameter count from {f['model_source']}"
        )
        evidence.append(Evidence("model weights", f"{gib_text(weights)} GiB", source))
    if budget is not None:
        of = "nvidia-smi Memory-Usage total" if f["gpu_total_bytes"] else "the OOM message total capacity"
        name = (
            "budget per GPU (min(u × total, free at start))"
            if f["vllm_v34"]
            else "budget per GPU (gmu × total)"
        )
        src = f"{na(f['gmu_assumption'])} × {of}"
        if f["vllm_v34"] and f["startup_free_bytes"] is not None:
            src += "; 'Free memory on device (F0/T GiB) on startup'"
        evidence.append(Evidence(name, f"{gib_text(budget)} GiB", src))
    if gpu_count is not None:
        full = gpus_full(f["gpu_used_map"], f["gpu_total_map"], t.full_fraction)
        evidence.append(
            Evidence("GPUs full / empty", f"full {full}, empty {empty}", "nvidia-smi Memory-Usage")
        )
    if f["weight_loading_oom"]:
        evidence.append(
            Evidence(
                "OOM while loading weights",
                f"line {na(f['oom_line'])}",
                "vllm.log (torch CUDA out of memory)",
            )
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="weights-not-sharded",
    family="W",
    severity="critical",
    title="The model weights are not sharded over the GPUs",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("gpus", "log"),
    # Root cause of these findings when they fire together (reports nest them under this one).
    explains=("kv-budget-exhausted", "max-model-len-exceeds-kv-capacity"),
    flags=("--tensor-parallel-size",),
)
