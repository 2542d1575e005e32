"""## What
Preemptions per minute over a recent window (a rate of `vllm:num_preemptions_total`, never the
lifetime total) above 10/min, with the KV cache near full at some point in the window.

## Why
V1 preempts by recompute: when a running request needs a block and none is free, the last
scheduled request loses all its blocks and starts over. Thrashing wastes the GPU on prefills.
V1 logs no line per preemption; only the counter (and `Preemptions: N` in stats lines ≥ 0.12)
shows it.

## How to confirm
`rate(vllm:num_preemptions_total[1m])` and `vllm:kv_cache_usage_perc` near 1.

## Fix
More KV per request slot: `--max-num-seqs` ≈ KV tokens / typical request tokens, fp8 KV (2× the
tokens), or TP up.

## Sources
vllm-facts.md §1.2 (num_preemptions), §3.5 ("Preemption"), §7.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import max_num_seqs_for
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    #: preemptions per minute (rate over the window) that make a storm
    min_per_min: float = 10
    #: KV cache usage (fraction) the window must reach
    kv_full: float = 0.9


def _seqs_target(f: Facts) -> int | None:
    """As many sequences as the KV cache holds at the typical request size."""
    kv, typical = f["kv_capacity_tokens"], f["typical_request_tokens"]
    if not kv or not typical or int(typical) < 1:
        return None
    return max_num_seqs_for(kv, int(typical))


def _tp_up(f: Facts) -> int | None:
    """Twice the TP, when that many more GPUs are visible and hold no engine."""
    tp, pp, gpus = f["tp"], f["pp"], f["gpu_count"]
    if not gpus or tp is None or pp is None:
        return None
    if tp * 2 * pp <= gpus and len(f["gpus_without_processes"] or []) >= tp * pp:
        return tp * 2
    return None


def check(f: Facts, t: Thresholds) -> Hit | None:
    # a pooling engine's KV gauge is a placeholder (100 % on V0 pooling runners): no KV pressure
    rate, kv_max = f["preemptions_per_min"], f["kv_usage_max"]
    if f["is_pooling"] or rate is None or rate < t.min_per_min or kv_max is None or kv_max < t.kv_full:
        return None
    kv, typical, in_effect = f["kv_capacity_tokens"], f["typical_request_tokens"], f["max_num_seqs_effective"]
    target = _seqs_target(f)
    # only a limit below the one in effect (a higher one would add preemptions)
    seqs = target if target and (in_effect is None or target < in_effect) else None
    fp8 = f["kv_cache_dtype"] == "auto" and f["fp8_supported"] is not False
    tp_up = _tp_up(f)

    fixes: list[Fix] = []
    if seqs is not None and is_valid(f, "--max-num-seqs", seqs):
        assert kv and typical
        levers = f"--max-num-seqs {seqs} ({kv:,} KV tokens / ~{int(typical):,} tokens per request)"
        fixes.append(Fix(flags={"--max-num-seqs": str(seqs)}, why="as many sequences as the KV cache holds"))
    else:
        levers = "fewer concurrent sequences"
        if seqs is None and target and in_effect:
            levers += f" (the {in_effect:,} in effect already fits the cache)"
    if fp8 and is_valid(f, "--kv-cache-dtype", "fp8"):
        levers += ", --kv-cache-dtype fp8 (about 2x the tokens)"
        fixes.append(
            Fix(flags={"--kv-cache-dtype": "fp8"}, why="about twice the KV tokens in the same memory")
        )
    levers += ", or more tensor parallelism"
    if tp_up is not None and is_valid(f, "--tensor-parallel-size", tp_up):
        levers += f" (--tensor-parallel-size {tp_up})"
        fixes.append(
            Fix(flags={"--tensor-parallel-size": str(tp_up)}, why="the KV cache spread over twice the GPUs")
        )
    window = f["window_seconds"]
    summary = (
        f"{rate:.0f} preemptions per minute over the last {na(window, '.0f')} s while the KV cache reached"
        f" {kv_max:.0%}: running requests are evicted and recomputed because their KV blocks do not fit"
        f" together. Give each request slot more KV: {levers}."
    )
    evidence = [
        Evidence(
            "preemption rate",
            f"{rate:.1f}/min ({na(f['preemptions_in_window'], '.0f')} in {na(window, '.0f')} s)",
            "rate(vllm:num_preemptions_total) over the window",
        ),
        Evidence("KV cache usage (max in window)", f"{kv_max:.0%}", "vllm:kv_cache_usage_perc"),
    ]
    if kv is not None:
        evidence.append(Evidence("KV cache capacity", f"{kv:,} tokens", "vllm:cache_config_info"))
    if typical is not None:
        source = (
            "p50 of vllm:request_prompt_tokens + vllm:request_generation_tokens"
            if f["prompt_p50"]
            else "KV in use / running requests"
        )
        evidence.append(Evidence("typical request", f"{typical:,.0f} tokens", source))
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="preemption-storm",
    family="L",
    severity="warning",
    title="Requests are preempted again and again because the KV cache is full",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("timeline",),
    flags=("--max-num-seqs", "--kv-cache-dtype", "--tensor-parallel-size"),
)
