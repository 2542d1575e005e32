"""Family requests: prompt lengths from the log's request lines ("Received request …,
prompt_token_ids: [...]", parsed by the log source), for judging "an OOM while a prompt far
longer than the usual traffic was being prefilled" (``long-request-spike``'s log clause)."""

from __future__ import annotations

import statistics

from kvdoctor.derive.base import Family, Scope, Vars

#: request lines before an OOM whose prompts may still be in prefill when it happens.
IN_FLIGHT = 8

WRITES: dict[str, str] = {
    "log_prompt_tokens_median": "tokens; median prompt length of the run's request lines (prompt_token_ids length / '<redacted N tokens>')",
    "log_request_count": "int; request lines with a prompt length in the run",
    "oom_prompt_tokens": "tokens; longest prompt among the last request lines before the last run-time OOM (being prefilled when it struck)",
    "oom_prompt_line": "int; log line of that request",
}
READS: frozenset[str] = frozenset()


def derive(s: Scope, v: Vars) -> None:
    """Median prompt length of the run's requests, and the longest just before the last OOM."""
    log = s.log
    if log is None:
        return
    reqs = [e for e in log.of("request") if isinstance(e.values.get("prompt_tokens"), int)]
    v["log_request_count"] = len(reqs)
    if not reqs:
        return
    v["log_prompt_tokens_median"] = statistics.median(e.values["prompt_tokens"] for e in reqs)
    runtime = [e for e in log.of("cuda_oom") if e.values.get("phase") == "runtime"]
    if runtime:
        before = [e for e in reqs if e.line < runtime[-1].line][-IN_FLIGHT:]
        if before:
            top = max(before, key=lambda e: e.values["prompt_tokens"])
            v["oom_prompt_tokens"] = top.values["prompt_tokens"]
            v["oom_prompt_line"] = top.line


FAMILY = Family("requests", WRITES, READS, derive)
