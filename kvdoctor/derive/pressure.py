"""Family pressure: the raw signs of KV-cache pressure in the window. Whether they amount to
pressure is the rule's decision (``max-num-seqs-exceeds-kv`` thresholds ``kv_full``, 0.9, and
``min_pressure_samples``, 2): this family only lists what was seen."""

from __future__ import annotations

from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars, engine_stats

WRITES: dict[str, str] = {
    "kv_preempted": "bool; requests were preempted: increase of vllm:num_preemptions_total in the window, or (without a metrics timeline) 'Preemptions: N' stats lines / V0 preemption warnings of the log's current run",
    "queued_kv_usages": "list[fraction]; KV usage (vllm:kv_cache_usage_perc) of each scrape in the window with requests waiting (vllm:num_requests_waiting > 0), oldest first",
    "log_queued_kv_usages": "list[fraction]; 'GPU KV cache usage' of each stats line of the log's current run with requests waiting or pending",
}
READS: frozenset[str] = frozenset({"preemptions_in_window", "log_preemptions_sum", "dp_engine"})


def derive(s: Scope, v: Vars) -> None:
    """Preemptions, and the KV usage whenever requests queued (metrics window, stats lines)."""
    series = s.series
    if len(series) >= 2 and v["preemptions_in_window"] is not None:
        v["kv_preempted"] = v["preemptions_in_window"] > 0
    else:
        v["kv_preempted"] = (v["log_preemptions_sum"] or 0) > 0
    win = tl.window(series, s.window_s) if series else []
    v["queued_kv_usages"] = [float(m.kv_cache_usage or 0.0) for m in win if (m.num_requests_waiting or 0) > 0]
    queued: list[float] = []
    if s.log is not None:
        for e in engine_stats(s.log, v["dp_engine"]):
            ev = e.values
            if ((ev.get("waiting") or 0) + (ev.get("pending") or 0)) > 0:
                queued.append(float(ev.get("kv_usage") or 0.0))
    v["log_queued_kv_usages"] = queued


FAMILY = Family("pressure", WRITES, READS, derive)
