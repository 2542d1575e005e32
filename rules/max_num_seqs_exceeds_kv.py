"""## What
max_num_seqs × a typical request's tokens (p50 prompt + p50 generation from the histograms,
else KV in use per running request, else max_model_len) exceeds the KV cache's tokens: the
configured concurrency cannot be held at once. A warning when pressure is seen in the window
(preemptions, or requests waiting with KV usage ≥ 0.9); info otherwise.

## Why
vLLM's default max_num_seqs is 1024 on ≥70 GiB cards (256 otherwise), far above what the KV
cache of most deployments holds, so on a healthy server this is normal: the scheduler admits
what fits and the rest waits. Under pressure, though, admitting more sequences than fit makes
the V1 scheduler preempt (recompute) running requests, wasting prefill work.

## How to confirm
`vllm:cache_config_info` (num_gpu_blocks × block_size, or kv_cache_size_tokens) or the log's
"GPU KV cache size: N tokens"; the prompt/generation histograms; `rate(vllm:num_preemptions_total)`
and `vllm:num_requests_waiting` with `vllm:kv_cache_usage_perc` ≥ 0.9.

## Fix
`--max-num-seqs` ≈ KV tokens / typical request tokens, rounded down.

## Sources
vllm-facts.md §4.2 (max_num_seqs defaults), §2.4 (KV cache size), §1.2 (preemption counter,
length histograms), §3.4 (stats line).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import max_num_seqs_for
from kvdoctor.rule_functions import count_at_least
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    #: KV cache usage (fraction) at which waiting requests count as pressure
    kv_full: float = 0.9
    #: requests waiting while the KV cache is at least kv_full, in this many samples (scrapes in
    #: the window, or stats lines): one scrape catching two requests in the queue is not pressure
    min_pressure_samples: int = 2


def _typical_from(f: Facts, typical: int) -> str:
    if f["prompt_p50"]:
        return "p50 prompt + p50 generation (vllm:request_prompt_tokens, vllm:request_generation_tokens)"
    if typical == f["max_model_len"]:
        return "max_model_len (no length histograms)"
    return "KV in use / running requests"


def check(f: Facts, t: Thresholds) -> Hit | None:
    if f["is_pooling"] or f["startup_failed"]:
        return None
    seqs, typical, kv = f["max_num_seqs_effective"], f["typical_request_tokens"], f["kv_capacity_tokens"]
    if not seqs or not typical or not kv or int(typical) < 1:
        return None
    tokens = int(typical)
    demand = seqs * tokens
    seqs_fix = max(1, max_num_seqs_for(kv, tokens))
    queued = max(
        count_at_least(f["queued_kv_usages"], t.kv_full), count_at_least(f["log_queued_kv_usages"], t.kv_full)
    )
    kv_pressure = bool(f["kv_preempted"]) or queued >= t.min_pressure_samples
    # the length histograms are missing and every request is taken to use the whole max_model_len
    worst_case = not f["prompt_p50"] and typical == f["max_model_len"]
    # Without pressure the finding is only worth an info line when the user chose the limit and
    # the request size is measured: vLLM's own default exceeding the KV is the normal case.
    if not (
        demand > kv and seqs_fix < seqs and (kv_pressure or (f["max_num_seqs_explicit"] and not worst_case))
    ):
        return None

    suggest = (kv_pressure or not worst_case) and is_valid(f, "--max-num-seqs", seqs_fix)
    default = "" if f["max_num_seqs_explicit"] else " (vLLM's default for this GPU)"
    summary = (
        f"max_num_seqs {seqs:,}{default} × ~{tokens:,} tokens per request = {demand:,} tokens, but the"
        f" KV cache holds {kv:,}: only about {seqs_fix:,} such requests fit at once. "
    )
    if kv_pressure:
        if (f["preemptions_in_window"] or 0) > 0 or (f["log_preemptions_sum"] or 0) > 0:
            seen = "requests were preempted"
        else:
            seen = f"requests wait while the KV cache is {na(f['kv_usage_max'], '.0%')} full"
        summary += f"Pressure is visible: {seen}"
        summary += (
            f"; set --max-num-seqs {seqs_fix} so the scheduler stops admitting requests it must preempt."
            if suggest
            else "."
        )
    else:
        summary += (
            "No pressure is visible (no preemptions, no queue with a full cache): vLLM simply admits"
            " fewer sequences than the limit. "
        )
        if worst_case:
            summary += (
                "This assumes every request uses the whole max_model_len (no length histograms); real"
                " traffic is usually far shorter, so nothing to change."
            )
        elif suggest:
            summary += f"Worth knowing; --max-num-seqs {seqs_fix} states the real concurrency."
        else:
            summary += "Worth knowing."

    explicit = "launch command / log args"
    if not f["max_num_seqs_explicit"]:
        explicit = "vLLM device default (vllm-facts §4.2)"
    evidence = [
        Evidence("max_num_seqs", f"{seqs:,}", explicit),
        Evidence("typical request", f"{tokens:,} tokens", _typical_from(f, typical)),
        Evidence(
            "KV cache capacity", f"{kv:,} tokens", "vllm:cache_config_info / 'GPU KV cache size' log line"
        ),
    ]
    in_window, in_log = f["preemptions_in_window"], f["log_preemptions_sum"]
    if in_window is not None and in_window > 0:
        evidence.append(
            Evidence("preemptions in the window", f"{in_window:,.0f}", "increase(vllm:num_preemptions_total)")
        )
    if in_log is not None and in_log > 0:
        evidence.append(
            Evidence(
                "preemptions in the log",
                f"{in_log:,}",
                "'Preemptions: N' stats lines / V0 preemption warnings",
            )
        )
    waiting, kv_max = f["waiting_max"], f["kv_usage_max"]
    if (waiting or 0) > 0 and (kv_max or 0) >= t.kv_full:
        evidence.append(
            Evidence(
                "waiting with KV usage",
                f"{na(waiting, ',.0f')} waiting at {na(kv_max, '.0%')} KV",
                "vllm:num_requests_waiting, vllm:kv_cache_usage_perc / stats lines",
            )
        )
    fixes = [
        Fix(
            flags={"--max-num-seqs": str(seqs_fix)},
            why="admit only as many sequences as the KV cache holds at once",
        )
    ]
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes if suggest else [],
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity=None if kv_pressure else "info",
    )


RULE = Rule(
    id="max-num-seqs-exceeds-kv",
    family="K",
    severity="warning",
    title="--max-num-seqs admits more sequences than the KV cache can hold",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("metrics", "log"),
    # root cause of these findings when they fire together (reports nest them under this one)
    # root cause of these findings when they fire together (reports nest them under this one)
    explains=("preemption-storm",),
    flags=("--max-num-seqs",),
)
