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
`--max-num-seqs` ≈ KV tokens / typical request tokens, rounded down to a step (1, 2, 3, 4, 6,
8, 12, 16, 24, …: a value changes only when its evidence moves past a step). Never below the
requests running before the trouble, and never from a mixed median: when a few huge prompts
fill the cache, cap them (`--max-model-len` at a quarter of the KV), chunk them
(`--max-num-batched-tokens 2048`) or give the cache more tokens (`--kv-cache-dtype fp8`).
Pressure is judged on token occupancy (64-token blocks count padding), and a queue seen only in
stats lines of an earlier burst is history, not pressure now.

## Sources
vllm-facts.md §4.2 (max_num_seqs defaults), §2.4 (KV cache size), §1.2 (preemption counter,
length histograms), §3.4 (stats line).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import max_model_len_for_tokens, max_num_seqs_for
from kvdoctor.rule_functions import concurrency_fix, count_at_least
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid


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


def _tail(f: Facts) -> float | None:
    return max(f["prompt_p99"] or 0, f["prompt_max_bucket"] or 0) or None


def _occupancy_factor(f: Facts) -> float:
    """Token occupancy / block occupancy: n / (n + (B − 1)/2) with n the typical request
    (vllm-facts §9.9); 1.0 when unknown. vllm:kv_cache_usage_perc counts whole blocks."""
    pad, n = f["kv_padding_tokens_per_request"], f["typical_request_tokens"]
    if not pad or not n or n < 1:
        return 1.0
    return n / (n + pad)


def _present_queue(f: Facts) -> list[float]:
    """KV usages (block occupancy) of the samples with requests waiting that say what is
    happening now: the window's scrapes; the log's stats lines (those in the window before the
    last one, by their time) only when no scrape with vLLM stats covers the window and the
    engine's last stats line is not idle (stats lines of an earlier burst are history, issue 24
    kind 2)."""
    now_from_metrics = bool(f["metrics_present"]) and f["stats_enabled"] is not False
    samples = list(f["queued_kv_usages"] or [])
    if not now_from_metrics and (f["log_running_last"] or 0) > 0:
        # the stats lines in the window before the last one (by their time), else all of this run
        recent = f["log_queued_kv_usages_recent"]
        samples += list(recent if recent is not None else (f["log_queued_kv_usages"] or []))
    return samples


def check(f: Facts, t: Thresholds) -> Hit | None:
    if f["is_pooling"] or f["startup_failed"]:
        return None
    seqs, typical, kv = f["max_num_seqs_effective"], f["typical_request_tokens"], f["kv_capacity_tokens"]
    if not seqs or not typical or not kv or int(typical) < 1:
        return None
    tokens = int(typical)
    demand = seqs * tokens
    fits = max(1, max_num_seqs_for(kv, tokens))
    # KV-full decisions on token occupancy: with 64-token blocks the gauge counts padding
    factor = _occupancy_factor(f)
    queue = _present_queue(f)
    queued = count_at_least([u * factor for u in queue], t.kv_full)
    kv_pressure = bool(f["kv_preempted"]) or queued >= t.min_pressure_samples
    # the length histograms are missing and every request is taken to use the whole max_model_len
    worst_case = not f["prompt_p50"] and typical == f["max_model_len"]
    # Without pressure the finding is only worth an info line when the user chose the limit and
    # the request size is measured: vLLM's own default exceeding the KV is the normal case.
    if not (demand > kv and fits < seqs and (kv_pressure or (f["max_num_seqs_explicit"] and not worst_case))):
        return None

    needed = f["running_before_trouble"] or f["log_running_first"]
    # blocks, not tokens, run out: on 0.34 (64-token blocks) the pool's count in blocks
    pool_fit = f["kv_pool_requests_typical"]
    blocks_fit = int(pool_fit) if pool_fit is not None else None
    seqs_fix, why_not = concurrency_fix(kv, tokens, needed, f["prompt_p50"], _tail(f), fits=blocks_fit)
    if seqs_fix is not None and (seqs_fix >= seqs or not is_valid(f, "--max-num-seqs", seqs_fix)):
        seqs_fix = None
    suggest = seqs_fix is not None and (kv_pressure or not worst_case)
    default = "" if f["max_num_seqs_explicit"] else " (vLLM's default for this GPU)"
    summary = (
        f"max_num_seqs {seqs:,}{default} × ~{tokens:,} tokens per request = {demand:,} tokens, but the"
        f" KV cache holds {kv:,}: only about {fits:,} such requests fit at once. "
    )
    fixes: list[Fix] = []
    if kv_pressure:
        if (f["preemptions_in_window"] or 0) > 0 or (f["log_preemptions_sum"] or 0) > 0:
            seen = "requests were preempted"
        else:
            seen = f"requests wait while the KV cache is {max(queue or [0]):.0%} full"
        summary += f"Pressure is visible: {seen}"
        if suggest:
            assert seqs_fix is not None
            summary += (
                f"; set --max-num-seqs {seqs_fix} so the scheduler stops admitting requests it must preempt"
                f" ({kv:,} KV tokens / ~{tokens:,} per request, rounded down to a step)."
            )
            fixes.append(
                Fix(
                    flags={"--max-num-seqs": str(seqs_fix)},
                    why="admit only as many sequences as the KV cache holds at once",
                )
            )
        else:
            summary += "."
            if why_not and seqs_fix is None and "unknown" not in why_not:
                summary += f" A lower sequence limit would not help: {why_not}."
            fixes += _tail_fixes(f, t)
            if fixes:
                summary += " Instead: " + "; or ".join(x.why for x in fixes) + "."
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
            assert seqs_fix is not None
            summary += f"Worth knowing; --max-num-seqs {seqs_fix} states the real concurrency."
            fixes.append(Fix(flags={"--max-num-seqs": str(seqs_fix)}, why="state the real concurrency"))
        else:
            summary += "Worth knowing."
    pad_text, pad_fix = _padding(f, queue)
    if pad_text:
        summary += " " + pad_text
    if pad_fix is not None and kv_pressure:
        fixes.append(pad_fix)

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
    if needed:
        evidence.append(
            Evidence(
                "running before the trouble",
                f"{needed:,.0f} requests",
                f["running_before_trouble_source"] or "first stats line",
            )
        )
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
    if queue and max(queue) >= t.kv_full:
        evidence.append(
            Evidence(
                "waiting with KV usage",
                f"{len(queue)} samples, up to {max(queue):.0%} KV",
                "vllm:num_requests_waiting, vllm:kv_cache_usage_perc (window) / stats lines",
            )
        )
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity=None if kv_pressure else "info",
    )


def _tail_fixes(f: Facts, t: Thresholds) -> list[Fix]:
    """Where a limit on sequences cannot help: cap the tail (--max-model-len at a quarter of the
    KV, a block multiple), chunk it (--max-num-batched-tokens 2048), or more KV (fp8)."""
    out: list[Fix] = []
    kv, bs, p50 = f["kv_capacity_tokens"], f["block_size"], f["prompt_p50"]
    tail = _tail(f)
    mixed = bool(p50 and tail and tail >= 4 * p50)
    if mixed and kv and bs and bs > 0:
        cap = max_model_len_for_tokens(kv // 4, bs)
        body = f["prompt_p99_body"]
        if cap and (body is None or cap >= body) and is_valid(f, "--max-model-len", cap):
            out.append(
                Fix(
                    flags={"--max-model-len": str(cap)},
                    why=f"--max-model-len {cap} caps the tail so four full-length requests fit the cache",
                )
            )
        mnbt = f["max_num_batched_tokens"]
        if (mnbt is None or mnbt > 2048) and is_valid(f, "--max-num-batched-tokens", 2048):
            out.append(
                Fix(
                    flags={"--max-num-batched-tokens": "2048"},
                    why="--max-num-batched-tokens 2048 prefills the long prompts in chunks",
                )
            )
    if (
        f["kv_cache_dtype"] == "auto"
        and f["fp8_supported"] is not False
        and is_valid(f, "--kv-cache-dtype", "fp8")
    ):
        out.append(
            Fix(flags={"--kv-cache-dtype": "fp8"}, why="--kv-cache-dtype fp8 holds about twice the tokens")
        )
    return out


def _padding(f: Facts, queue: list[float]) -> tuple[str, Fix | None]:
    """How much of the KV usage is padding in partly filled blocks (vllm-facts §9.9), and
    --block-size 16 where the backend takes it and the token/block ratio is below 0.8."""
    bs, factor = f["block_size"], _occupancy_factor(f)
    usage = max(queue) if queue else f["kv_usage_max"]
    if not bs or bs <= 16 or usage is None or factor >= 0.95:
        return "", None
    text = (
        f"With {bs}-token blocks about {usage * (1 - factor):.0%} of the {usage:.0%} KV usage is padding"
        f" (token occupancy ≈ {usage * factor:.0%})."
    )
    if f["block_size_16_valid"] and factor < 0.8:
        text += " --block-size 16 (the attention backend takes it) cuts that padding."
        return text, Fix(flags={"--block-size": "16"}, why="smaller blocks, less padding per request")
    return text, None


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
    explains=("preemption-storm",),
    flags=(
        "--max-num-seqs",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--kv-cache-dtype",
        "--block-size",
    ),
)
