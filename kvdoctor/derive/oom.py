"""Family oom: which code the OOMs hit (the ``hints`` the log source reads from each
traceback), the biggest engine step, chunked prefill and multimodal profiling."""

from __future__ import annotations

import json

from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars

WRITES: dict[str, str] = {
    "oom_hints": "list[str]; what the traceback of the last OOM mentions: logprobs, sampler, prefill, multimodal",
    "runtime_oom_hints": "list[str]; the same, over every run-time OOM",
    "runtime_oom_line": "int; log line of the last run-time OOM",
    "iteration_tokens_max_bucket": "tokens; upper bound of the highest non-empty bucket of vllm:iteration_tokens_total (tokens per engine step; window deltas, else lifetime)",
    "chunked_prefill_on": "bool; chunked prefill enabled (--enable-chunked-prefill, 'Chunked prefill is enabled' log line, vLLM ≥0.8 default); None when unknown",
    "mm_profile_oom": "bool; an OOM before serving whose traceback is in multimodal encoder / embedding code (the multimodal profile run)",
    "mm_profile_too_short": "bool; 'The sequence length used for profiling … is too short to hold the multi-modal embeddings in the worst case' warning",
    "mm_profile_line": "int; log line of that OOM or warning",
    "limit_mm_per_prompt": "str; --limit-mm-per-prompt as given (None when unset)",
}
READS: frozenset[str] = frozenset()


def derive(s: Scope, v: Vars) -> None:
    """OOM code paths, engine step size, chunked prefill, multimodal profiling."""
    cfg, series, log = s.cfg, s.series, s.log
    v["chunked_prefill_on"] = cfg.enable_chunked_prefill
    limit = cfg.args.get("limit_mm_per_prompt")
    v["limit_mm_per_prompt"] = (
        None
        if limit in (None, "", {})
        else (limit if isinstance(limit, str) else json.dumps(limit, separators=(",", ":")))
    )
    hist = tl.histogram_delta(series, "vllm:iteration_tokens_total", s.window_s) if series else None
    if hist is None or hist.count <= 0:
        hist = tl.histogram_latest(series, "vllm:iteration_tokens_total") if series else None
    if hist is not None and hist.count > 0:
        v["iteration_tokens_max_bucket"] = tl.histogram_max_bucket(hist)
    if log is None:
        return
    if log.of("chunked_prefill"):
        v["chunked_prefill_on"] = True
    ooms = log.of("cuda_oom")
    if ooms:
        v["oom_hints"] = list(ooms[-1].values.get("hints") or [])
    runtime = [e for e in ooms if e.values.get("phase") == "runtime"]
    v["runtime_oom_hints"] = sorted({h for e in runtime for h in (e.values.get("hints") or [])})
    v["runtime_oom_line"] = runtime[-1].line if runtime else None
    mm_oom = [
        e
        for e in ooms
        if e.values.get("phase") not in ("runtime", "sampler_warmup")
        and "multimodal" in (e.values.get("hints") or [])
    ]
    short = [e for e in log.of("mm_profile") if "too short" in e.text]
    v["mm_profile_oom"] = bool(mm_oom)
    v["mm_profile_too_short"] = bool(short)
    picked = mm_oom[-1] if mm_oom else (short[-1] if short else None)
    v["mm_profile_line"] = picked.line if picked is not None else None


FAMILY = Family("oom", WRITES, READS, derive)
