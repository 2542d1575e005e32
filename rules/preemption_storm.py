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

import time
from dataclasses import dataclass

from kvdoctor.kvmath import max_model_len_for_tokens
from kvdoctor.rule_functions import concurrency_fix
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    #: preemptions per minute (rate over the window) that make a storm
    min_per_min: float = 10
    #: KV cache usage (fraction) the window must reach
    kv_full: float = 0.9


def _tp_up(f: Facts) -> int | None:
    """Twice the TP, when that many more GPUs are visible and hold no engine."""
    tp, pp, gpus = f["tp"], f["pp"], f["gpu_count"]
    if not gpus or tp is None or pp is None:
        return None
    if tp * 2 * pp <= gpus and len(f["gpus_without_processes"] or []) >= tp * pp:
        return tp * 2
    return None


def _when(start: float | None, end: float | None) -> str:
    if start is None or end is None:
        return "earlier in the recorded series"
    a = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start))
    b = time.strftime("%H:%M:%S", time.gmtime(end))
    return f"from {a} to {b} UTC"


def check(f: Facts, t: Thresholds) -> Hit | None:
    # a pooling engine's KV gauge is a placeholder (100 % on V0 pooling runners): no KV pressure
    if f["is_pooling"]:
        return None
    rate, kv_max = f["preemptions_per_min"], f["kv_usage_max"]
    present = rate is not None and rate >= t.min_per_min and kv_max is not None and kv_max >= t.kv_full
    # the forensic question scans the whole recorded series: a storm usually ends before anyone
    # takes a bundle (issue 24 kind 2); it is then reported as history, with when it happened
    ep_rate, ep_kv = f["preemption_episode_per_min"], f["preemption_episode_kv_max"]
    # only over a finished record (a bundle's saved scrapes): in a live view or a replay the
    # finding clears when the storm leaves the window (issue 24: a finding whose cause is gone
    # clears, in the sidecar too)
    past = (
        not present
        and bool(f["series_saved"])
        and ep_rate is not None
        and ep_rate >= t.min_per_min
        and ep_kv is not None
        and ep_kv >= t.kv_full
        and (f["preemption_episode_count"] or 0) >= t.min_per_min
    )
    if not (present or past):
        return None
    kv, typical, in_effect = f["kv_capacity_tokens"], f["typical_request_tokens"], f["max_num_seqs_effective"]
    needed = f["running_before_trouble"] or f["log_running_first"]
    tail = max(f["prompt_p99"] or 0, f["prompt_max_bucket"] or 0) or None
    target, why_not = concurrency_fix(kv, int(typical) if typical else None, needed, f["prompt_p50"], tail)
    if past:
        # the traffic now is not the episode's: no sequence limit sized from it
        target, why_not = None, ""
    # only a limit below the one in effect (a higher one would add preemptions)
    seqs = target if target and (in_effect is None or target < in_effect) else None
    fp8 = f["kv_cache_dtype"] == "auto" and f["fp8_supported"] is not False
    tp_up = _tp_up(f)

    fixes: list[Fix] = []
    if seqs is not None and is_valid(f, "--max-num-seqs", seqs):
        assert kv and typical
        levers = (
            f"--max-num-seqs {seqs} ({kv:,} KV tokens / ~{int(typical):,} tokens per request, a step down)"
        )
        fixes.append(Fix(flags={"--max-num-seqs": str(seqs)}, why="as many sequences as the KV cache holds"))
    else:
        levers = "fewer concurrent sequences"
        if target and in_effect and target >= in_effect:
            levers += f" (the {in_effect:,} in effect already fits the cache)"
        elif why_not and "unknown" not in why_not:
            levers = "not fewer sequences (" + why_not + ")"
            mixed = "mixed" in why_not
            cap = _cap(f) if mixed else None
            if cap is not None:
                levers += f", --max-model-len {cap} (four full-length requests fit)"
                fixes.append(Fix(flags={"--max-model-len": str(cap)}, why="caps the tail of huge prompts"))
    if fp8 and is_valid(f, "--kv-cache-dtype", "fp8"):
        levers += ", --kv-cache-dtype fp8 (about 2x the tokens)"
        fixes.append(
            Fix(flags={"--kv-cache-dtype": "fp8"}, why="about twice the KV tokens in the same memory")
        )
    # padding in 64-token blocks: --block-size 16 where the backend takes it (vllm-facts §9.9)
    pad, n, bs = f["kv_padding_tokens_per_request"], f["typical_request_tokens"], f["block_size"]
    ratio = n / (n + pad) if pad and n and n > 0 else 1.0
    if bs and bs > 16 and ratio < 0.8 and f["block_size_16_valid"] and is_valid(f, "--block-size", 16):
        levers += f", --block-size 16 (about {1 - ratio:.0%} of each {bs}-token-block request is padding)"
        fixes.append(Fix(flags={"--block-size": "16"}, why="smaller blocks, less padding per request"))
    levers += ", or more tensor parallelism"
    if tp_up is not None and is_valid(f, "--tensor-parallel-size", tp_up):
        levers += f" (--tensor-parallel-size {tp_up})"
        fixes.append(
            Fix(flags={"--tensor-parallel-size": str(tp_up)}, why="the KV cache spread over twice the GPUs")
        )
    if past and levers.startswith("fewer concurrent sequences, "):
        levers = levers[len("fewer concurrent sequences, ") :]
    window = f["window_seconds"]
    when = _when(f["preemption_episode_start"], f["preemption_episode_end"])
    if present:
        assert rate is not None and kv_max is not None
        summary = (
            f"{rate:.0f} preemptions per minute over the last {na(window, '.0f')} s while the KV cache reached"
            f" {kv_max:.0%}: running requests are evicted and recomputed because their KV blocks do not fit"
            f" together. Give each request slot more KV: {levers}."
        )
    else:
        assert ep_rate is not None and ep_kv is not None
        ended = (
            f"it has ended (under {t.min_per_min:.0f} per minute over the last {na(window, '.0f')} s)."
            if f["preemption_episode_in_window"]
            else f"it has ended (none in the last {na(window, '.0f')} s)."
        )
        summary = (
            f"A preemption storm happened {when}: {f['preemption_episode_count'] or 0:,.0f} preemptions"
            f" ({ep_rate:.0f} per minute) while the KV cache reached {ep_kv:.0%}; {ended} If it comes back, give each request slot more KV: {levers}."
        )
    evidence = []
    if present:
        assert rate is not None and kv_max is not None
        evidence += [
            Evidence(
                "preemption rate",
                f"{rate:.1f}/min ({na(f['preemptions_in_window'], '.0f')} in {na(window, '.0f')} s)",
                "rate(vllm:num_preemptions_total) over the window",
            ),
            Evidence("KV cache usage (max in window)", f"{kv_max:.0%}", "vllm:kv_cache_usage_perc"),
        ]
    if f["preemption_episode_count"]:
        evidence.append(
            Evidence(
                "largest preemption episode",
                f"{f['preemption_episode_count']:,.0f} preemptions {when}",
                "increase of vllm:num_preemptions_total over the whole recorded series",
            )
        )
    if needed:
        evidence.append(
            Evidence(
                "running before the trouble",
                f"{needed:,.0f} requests",
                "vllm:num_requests_running / stats lines",
            )
        )
    if kv is not None:
        evidence.append(Evidence("KV cache capacity", f"{kv:,} tokens", "vllm:cache_config_info"))
    if typical is not None:
        source = (
            "p50 of vllm:request_prompt_tokens + vllm:request_generation_tokens"
            if f["prompt_p50"]
            else "KV in use / running requests"
        )
        evidence.append(Evidence("typical request", f"{typical:,.0f} tokens", source))
    pad, n = f["kv_padding_tokens_per_request"], f["typical_request_tokens"]
    bs = f["block_size"]
    if pad and n and bs and bs > 16 and kv_max is not None:
        occ = kv_max * n / (n + pad)
        evidence.append(
            Evidence(
                "token occupancy behind the KV usage",
                f"≈ {occ:.0%} of {kv_max:.0%} (padding in {bs}-token blocks)",
                "usage × n / (n + (B − 1)/2), vllm-facts §9.9",
            )
        )
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity=None if present else "info",
    )


def _cap(f: Facts) -> int | None:
    kv, bs = f["kv_capacity_tokens"], f["block_size"]
    if not kv or not bs or bs < 1:
        return None
    cap = max_model_len_for_tokens(kv // 4, bs)
    body = f["prompt_p99_body"]
    if not cap or (body is not None and cap < body) or not is_valid(f, "--max-model-len", cap):
        return None
    return cap


RULE = Rule(
    id="preemption-storm",
    family="L",
    severity="warning",
    title="Requests are preempted again and again because the KV cache is full",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("timeline",),
    flags=("--max-num-seqs", "--max-model-len", "--kv-cache-dtype", "--block-size", "--tensor-parallel-size"),
)
