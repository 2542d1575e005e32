"""Family swap: V0 swap preemption followed by a stall (vllm-facts §1.5 V0 metrics, §3.4 V0
stats line)."""

from __future__ import annotations

from kvdoctor.derive.base import Family, Scope, Vars

WRITES: dict[str, str] = {
    "swapped": "requests; vllm:num_requests_swapped, latest (V0 engines only)",
    "log_swapped_max": "requests; largest 'Swapped: N reqs' in V0 stats lines",
    "swap_preemptions": "count; V0 'Sequence group … is preempted by PreemptionMode.SWAP mode' warnings",
    "swap_stall": "bool; V0 stats line with Swapped > 0, Running > 0 and 'Avg generation throughput: 0.0' (or a SWAP preemption followed by such a zero-throughput line), or /metrics num_requests_swapped > 0 with running > 0 and no generated tokens in the window",
    "swap_stall_line": "int; log line of the first stalled stats line (None when from /metrics)",
    "swap_space_gib": "GiB; --swap-space (V0 default 4, removed in 0.18)",
}
READS: frozenset[str] = frozenset({"running", "generation_tokens_per_s"})


def derive(s: Scope, v: Vars) -> None:
    """Swapped requests and whether generation stalled while they were."""
    v["swap_space_gib"] = s.cfg.swap_space_gib
    stall_line: int | None = None
    log = s.log
    if log is not None:
        stats = log.of("stats")
        swapped = [int(e.values["swapped"]) for e in stats if e.values.get("swapped") is not None]
        v["log_swapped_max"] = max(swapped) if swapped else None
        swaps = [e for e in log.of("preempted_v0") if "swap" in str(e.values.get("mode") or "")]
        v["swap_preemptions"] = len(swaps)
        first_swap = swaps[0].line if swaps else None
        for e in stats:
            ev = e.values
            stalled = (ev.get("running") or 0) > 0 and (ev.get("generation_throughput") or 0) == 0
            if not stalled:
                continue
            if (ev.get("swapped") or 0) > 0 or (first_swap is not None and e.line > first_swap):
                stall_line = e.line
                break
    if s.series:
        v["swapped"] = s.series[-1].num_requests_swapped
    metric_stall = (
        (v["swapped"] or 0) > 0
        and (v["running"] or 0) > 0
        and v["generation_tokens_per_s"] is not None
        and v["generation_tokens_per_s"] == 0
    )
    v["swap_stall"] = stall_line is not None or bool(metric_stall)
    v["swap_stall_line"] = stall_line


FAMILY = Family("swap", WRITES, READS, derive)
