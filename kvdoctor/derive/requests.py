"""Family requests: prompt lengths from the log's request lines ("Received request …,
prompt_token_ids: [...]", parsed by the log source), for judging "an OOM while a prompt far
longer than the usual traffic was being prefilled" (``long-request-spike``'s log clause), and
``prefill-burst-oom``'s inference when no batch is recorded: a run-time OOM in the forward pass
(MLP / attention frames) of an engine whose one step can hold many prompts (chunked prefill off),
with several requests admitted within a few seconds before it."""

from __future__ import annotations

from datetime import datetime

from kvdoctor import kvmath
from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.facts import HistogramData, LogEvent
from kvdoctor.vllm_flags import version_tuple

#: request lines before an OOM whose prompts may still be in prefill when it happens.
IN_FLIGHT = 8
#: seconds before an OOM within which admitted requests may share its engine step.
BURST_WINDOW_S = 5.0

WRITES: dict[str, str] = {
    "log_prompt_tokens_median": "tokens; median prompt length of the run's request lines (prompt_token_ids length / '<redacted N tokens>')",
    "log_request_count": "int; request lines with a prompt length in the run",
    "oom_prompt_tokens": "tokens; longest prompt among the last request lines before the last run-time OOM (being prefilled when it struck)",
    "oom_prompt_line": "int; log line of that request",
    "oom_forward_frames": "list[str]; model forward-pass frames in the last run-time OOM's traceback ('mlp', 'attention')",
    "oom_burst_requests": "int; request lines within 5 s before the last run-time OOM (by the log's timestamps)",
    "oom_burst_prompt_tokens": "tokens; the sum of their prompt lengths",
    "oom_step_tokens_estimate": "tokens; the failed allocation ÷ (intermediate_size × dtype bytes): the step's tokens if an MLP activation failed (spec/rules.md prefill-burst-oom)",
    "chunked_prefill_off": "bool; chunked prefill is off (--enable-chunked-prefill False, or a V0 < 0.8 engine with max_model_len ≤ 32K that did not log it on)",
    "step_token_cap": "tokens; what one engine step may hold with chunked prefill off: max(max_model_len, max_num_batched_tokens)",
    "prompt_p99_body": "tokens; p99 prompt length of the traffic outside the tail (prompts < 4 × the median): vllm:request_prompt_tokens buckets up to 4 × p50 (window deltas, else lifetime), else the log's request lines",
}
READS: frozenset[str] = frozenset(
    {
        "chunked_prefill_on",
        "max_model_len",
        "max_num_batched_tokens",
        "vllm_version",
        "arch",
        "oom_requested_bytes",
        "prompt_p50",
    }
)


def _seconds(ev: LogEvent) -> float | None:
    """A log event's "MM-DD HH:MM:SS" as seconds (the year does not matter for a difference)."""
    # by hand, not strptime: _strptime builds a dozen regexes on its first call
    t = (ev.time or "")[:14]
    nums = (t[0:2], t[3:5], t[6:8], t[9:11], t[12:14])
    if len(t) != 14 or (t[2], t[5], t[8], t[11]) != ("-", " ", ":", ":"):
        return None
    if not all(n.isascii() and n.isdigit() for n in nums):
        return None
    try:
        mo, d, h, mi, sec = (int(n) for n in nums)
        return datetime(2000, mo, d, h, mi, sec).timestamp()
    except ValueError:  # 02-30, 25:00:00
        return None


def derive(s: Scope, v: Vars) -> None:
    """Median prompt length of the run's requests, the longest just before the last OOM, and
    the prefill burst around it."""
    _burst(s, v)
    if v["prompt_p50"]:
        v["prompt_p99_body"] = _body_p99_hist(s, float(v["prompt_p50"]))
    log = s.log
    if log is None:
        return
    reqs = [e for e in log.of("request") if isinstance(e.values.get("prompt_tokens"), int)]
    v["log_request_count"] = len(reqs)
    if not reqs:
        return
    import statistics  # a log with request lines only: not imported to start

    v["log_prompt_tokens_median"] = statistics.median(e.values["prompt_tokens"] for e in reqs)
    if v["prompt_p99_body"] is None:
        bound = TAIL_RATIO * v["log_prompt_tokens_median"]
        body = sorted(e.values["prompt_tokens"] for e in reqs if e.values["prompt_tokens"] < bound)
        if body:
            v["prompt_p99_body"] = body[min(len(body) - 1, int(0.99 * len(body)))]
    runtime = [e for e in log.of("cuda_oom") if e.values.get("phase") == "runtime"]
    if runtime:
        before = [e for e in reqs if e.line < runtime[-1].line][-IN_FLIGHT:]
        if before:
            top = max(before, key=lambda e: e.values["prompt_tokens"])
            v["oom_prompt_tokens"] = top.values["prompt_tokens"]
            v["oom_prompt_line"] = top.line


#: the tail begins at this multiple of the median prompt (spec/rules.md long-request-spike).
TAIL_RATIO = 4


def _body_p99_hist(s: Scope, p50: float) -> float | None:
    """p99 of the prompt-length histogram's observations at or below TAIL_RATIO × p50 (the
    buckets up to that bound, as a histogram of their own)."""
    hist = tl.histogram_delta(s.series, "vllm:request_prompt_tokens", s.window_s) if s.series else None
    if hist is None or hist.count <= 0:
        hist = tl.histogram_latest(s.series, "vllm:request_prompt_tokens") if s.series else None
    if hist is None or hist.count <= 0:
        return None
    bound = TAIL_RATIO * p50
    body = [(le, c) for le, c in sorted(hist.buckets) if le <= bound]
    if not body or body[-1][1] <= 0:
        return None
    return tl.histogram_quantile(HistogramData(buckets=body, count=body[-1][1]), 0.99)


def _burst(s: Scope, v: Vars) -> None:
    """The forward-pass frames of the last run-time OOM, the requests admitted just before it,
    the step's token estimate, and whether one step may hold many prompts."""
    chunked = v["chunked_prefill_on"]
    vt = version_tuple(v["vllm_version"]) or ()
    mml, mnbt = v["max_model_len"], v["max_num_batched_tokens"]
    # V0 < 0.8 turned chunked prefill on by itself only above 32K tokens of context.
    v0_default_off = chunked is None and bool(vt) and vt < (0, 8) and (mml or 0) <= 32768
    v["chunked_prefill_off"] = chunked is False or v0_default_off
    if v["chunked_prefill_off"]:
        v["step_token_cap"] = max(mml or 0, mnbt or 0) or None
    log = s.log
    if log is None:
        return
    runtime = [e for e in log.of("cuda_oom") if e.values.get("phase") == "runtime"]
    if not runtime:
        return
    oom = runtime[-1]
    frames = oom.values.get("frames") or []
    v["oom_forward_frames"] = [f for f in ("mlp", "attention") if f in frames]
    t_oom = _seconds(oom)
    if t_oom is not None:
        near = [
            e
            for e in log.of("request")
            if e.line < oom.line and (t := _seconds(e)) is not None and 0 <= t_oom - t <= BURST_WINDOW_S
        ]
        v["oom_burst_requests"] = len(near)
        v["oom_burst_prompt_tokens"] = sum(int(e.values.get("prompt_tokens") or 0) for e in near)
    arch, a = v["arch"], v["oom_requested_bytes"]
    if arch is not None and a and getattr(arch, "intermediate_size", None):
        dtype_bytes = kvmath.model_dtype_bytes(kvmath.served_dtype(arch.dtype, s.cfg.dtype))
        v["oom_step_tokens_estimate"] = int(a // (arch.intermediate_size * dtype_bytes))


FAMILY = Family("requests", WRITES, READS, derive)
