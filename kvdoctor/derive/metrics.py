"""Family metrics: the latest /metrics scrape and the window over the engine's scrapes (rates
from counter deltas, quantiles from histogram deltas: ``kvdoctor.timeline``), falling back on
the log's stats lines where no scrape says."""

from __future__ import annotations

import math
from typing import Any

from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars, num
from kvdoctor.vllm_defaults import version_tuple

WRITES: dict[str, str] = {
    "metrics_present": "bool; a /metrics page was read",
    "stats_enabled": "bool; vllm:* metrics present (False with --disable-log-stats)",
    "kv_usage": "fraction; vllm:kv_cache_usage_perc (or gpu_cache_usage_perc), latest",
    "kv_usage_max": "fraction; largest KV usage in the window (metrics, else stats lines)",
    "kv_usage_min": "fraction; smallest KV usage in the window",
    "running": "requests; vllm:num_requests_running, latest",
    "waiting": "requests; vllm:num_requests_waiting, latest",
    "waiting_max": "requests; largest waiting in the window (metrics or stats lines)",
    "running_trend": "requests; last − first running in the window",
    "waiting_trend": "requests; last − first waiting in the window",
    "window_seconds": "seconds; span of the metrics window (0 for one scrape)",
    "preemptions_per_min": "per minute; rate(vllm:num_preemptions_total) over the window",
    "preemptions_in_window": "count; increase of vllm:num_preemptions_total over the window",
    "prompt_tokens_per_s": "tokens/s; rate(vllm:prompt_tokens_total)",
    "generation_tokens_per_s": "tokens/s; rate(vllm:generation_tokens_total)",
    "requests_per_s": "requests/s; rate(vllm:request_success_total)",
    "traffic": "bool; requests running/waiting or tokens flowing in the window (metrics or log)",
    "prompt_p50": "tokens; median prompt length (vllm:request_prompt_tokens, window deltas, else lifetime)",
    "prompt_p99": "tokens; p99 prompt length",
    "prompt_max_bucket": "tokens; upper bound of the highest non-empty prompt-length bucket",
    "generation_p50": "tokens; median generated length (vllm:request_generation_tokens)",
    "prompt_hist_recent": "bool; the prompt quantiles come from window deltas (not lifetime)",
    "cache_num_gpu_blocks": "blocks; vllm:cache_config_info num_gpu_blocks (includes the null block)",
    "kv_capacity_tokens": "tokens per engine; cache_config_info kv_cache_size_tokens, else num_gpu_blocks × block_size, else the log's KV cache size (vLLM 0.9–0.20: the logged concurrency × its max_model_len where the two differ, see kv_capacity_from_concurrency)",
    "kv_capacity_from_concurrency": "bool; kv_capacity_tokens is the log's 'Maximum concurrency for L tokens per request: Cx' × L, because on vLLM 0.9–0.20 the logged 'GPU KV cache size' (num_blocks // num_groups × min block size) differs from it by more than 10 %: a hybrid model's size is logged as low as a quarter of the real capacity (vllm-facts §2.4, issue 24 kind 9)",
    "typical_request_tokens": "tokens; p50 prompt + p50 generation (histograms), else KV in use / running requests, else max_model_len",
}
READS: frozenset[str] = frozenset(
    {
        "block_size",
        "max_model_len",
        "log_kv_usage_max",
        "log_waiting_max",
        "log_running_first",
        "log_running_last",
        "log_kv_tokens",
        "log_kv_concurrency",
        "log_kv_concurrency_len",
        "vllm_version",
        "log_gen_throughput_max",
    }
)


def derive(s: Scope, v: Vars) -> None:
    """Scrape and window variables, then the log fallbacks and the typical request size."""
    _scrapes(v, s)
    _fallbacks(v)
    _typical_request(v)


def _scrapes(v: Vars, s: Scope) -> None:
    series, window_s = s.series, s.window_s
    v["metrics_present"] = bool(series)
    if not series:
        return
    latest = series[-1]
    v["stats_enabled"] = latest.stats_enabled
    v["kv_usage"] = latest.kv_cache_usage
    v["running"] = latest.num_requests_running
    v["waiting"] = latest.num_requests_waiting
    # the Scope's own series when the window covers it: requests and oom ask it the same things
    win = tl.window(series, window_s, shared=True)
    times, ordered = tl.indexed_times(win)
    # in time order (what a Timeline gives) the newest and oldest are the extremes
    ts: list[Any] = times if ordered else [t for t in times if t is not None]
    v["window_seconds"] = (max(ts) - min(ts)) if len(ts) >= 2 else 0.0
    kv = tl.gauge_stats(win, "kv_cache_usage", window_s)
    if kv is not None:
        v["kv_usage_max"], v["kv_usage_min"] = kv.max, kv.min
    wt = tl.gauge_stats(win, "num_requests_waiting", window_s)
    if wt is not None:
        v["waiting_max"], v["waiting_trend"] = wt.max, wt.last - wt.first
    rn = tl.gauge_stats(win, "num_requests_running", window_s)
    if rn is not None:
        v["running_trend"] = rn.last - rn.first
    rate = tl.counter_rate(win, "num_preemptions_total", window_s)
    v["preemptions_per_min"] = rate * 60 if rate is not None else None
    v["preemptions_in_window"] = tl.counter_increase(win, "num_preemptions_total", window_s)
    v["prompt_tokens_per_s"] = tl.counter_rate(win, "prompt_tokens_total", window_s)
    v["generation_tokens_per_s"] = tl.counter_rate(win, "generation_tokens_total", window_s)
    v["requests_per_s"] = tl.counter_rate(win, "request_success_total", window_s)
    hist = tl.histogram_delta(win, "vllm:request_prompt_tokens", window_s)
    v["prompt_hist_recent"] = hist is not None and hist.count > 0
    if hist is None or hist.count <= 0:
        hist = tl.histogram_latest(series, "vllm:request_prompt_tokens")
    if hist is not None and hist.count > 0:
        v["prompt_p50"] = tl.histogram_quantile(hist, 0.5)
        v["prompt_p99"] = tl.histogram_quantile(hist, 0.99)
        v["prompt_max_bucket"] = tl.histogram_max_bucket(hist)
    gh = tl.histogram_delta(win, "vllm:request_generation_tokens", window_s)
    if gh is None or gh.count <= 0:
        gh = tl.histogram_latest(series, "vllm:request_generation_tokens")
    if gh is not None and gh.count > 0:
        v["generation_p50"] = tl.histogram_quantile(gh, 0.5)
    cc = latest.cache_config
    blocks = num(cc.get("num_gpu_blocks"))
    v["cache_num_gpu_blocks"] = int(blocks) if blocks is not None else None
    tokens = num(cc.get("kv_cache_size_tokens"))
    bs = num(cc.get("block_size")) or v["block_size"] or 16
    if tokens is not None:
        v["kv_capacity_tokens"] = int(tokens)
    elif blocks is not None:
        v["kv_capacity_tokens"] = int(blocks * bs)


def _capacity_from_concurrency(v: Vars) -> int | None:
    """Concurrency × max_model_len where vLLM 0.9–0.20 logged a KV cache size more than 10 % off
    it (tokens = num_blocks // num_groups × min block size undercounts hybrid models, up to 4×;
    vllm-facts §2.4); None otherwise."""
    conc, length, tokens = v["log_kv_concurrency"], v["log_kv_concurrency_len"], v["log_kv_tokens"]
    version = v["vllm_version"]
    if not (conc and length and tokens and version):
        return None
    vt = version_tuple(str(version))
    if vt is None or not ((0, 9) <= vt[:2] <= (0, 20)):
        return None
    capacity = int(conc * length)
    return capacity if abs(capacity - tokens) > 0.1 * max(capacity, tokens) else None


def _fallbacks(v: Vars) -> None:
    # The KV usage and queue: metrics first, the log's stats lines otherwise.
    if v["kv_usage_max"] is None:
        v["kv_usage_max"] = v["log_kv_usage_max"] if v["log_kv_usage_max"] is not None else v["kv_usage"]
    if v["waiting_max"] is None:
        v["waiting_max"] = v["log_waiting_max"] if v["log_waiting_max"] is not None else v["waiting"]
    if (
        v["running_trend"] is None
        and v["log_running_first"] is not None
        and v["log_running_last"] is not None
    ):
        v["running_trend"] = v["log_running_last"] - v["log_running_first"]
    if v["kv_capacity_tokens"] is None and v["log_kv_tokens"] is not None:
        v["kv_capacity_tokens"] = v["log_kv_tokens"]
        from_conc = _capacity_from_concurrency(v)
        if from_conc is not None:
            v["kv_capacity_tokens"], v["kv_capacity_from_concurrency"] = from_conc, True
    tokens_flowing = any(
        (x or 0) > 0 for x in (v["prompt_tokens_per_s"], v["generation_tokens_per_s"], v["requests_per_s"])
    )
    busy = (v["running"] or 0) > 0 or (v["waiting"] or 0) > 0 or (v["waiting_max"] or 0) > 0
    # Traffic is judged in the window: scrapes with vLLM stats say what is happening now, and a
    # log's stats lines from hours before them are history (an idle server is not busy).
    now_from_metrics = bool(v["metrics_present"]) and v["stats_enabled"] is not False
    log_busy = not now_from_metrics and (
        (v["log_gen_throughput_max"] or 0) > 0 or (v["log_running_last"] or 0) > 0
    )
    v["traffic"] = bool(tokens_flowing or busy or log_busy)


def _typical_request(v: Vars) -> None:
    """Tokens a typical request holds in the KV cache, for "how many sequences fit"."""
    total = (v["prompt_p50"] or 0) + (v["generation_p50"] or 0)
    # a quantile read off a +Inf bucket is no size (math.isfinite: int(inf) would raise)
    if v["prompt_p50"] and math.isfinite(total):
        v["typical_request_tokens"] = int(total)
        return
    running = v["running"] if v["running"] else v["log_running_last"]
    usage = v["kv_usage_max"]
    if running and usage and v["kv_capacity_tokens"]:
        # What the running batch actually holds per request (V0 logs without histograms).
        v["typical_request_tokens"] = max(1, int(usage * v["kv_capacity_tokens"] / running))
        return
    v["typical_request_tokens"] = v["max_model_len"]


FAMILY = Family("metrics", WRITES, READS, derive)
