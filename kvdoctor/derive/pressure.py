"""Family pressure: the raw signs of KV-cache pressure in the window. Whether they amount to
pressure is the rule's decision (``max-num-seqs-exceeds-kv`` thresholds ``kv_full``, 0.9, and
``min_pressure_samples``, 2): this family only lists what was seen."""

from __future__ import annotations

import itertools
import operator

from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars, engine_stats
from kvdoctor.facts import EngineMetrics

WRITES: dict[str, str] = {
    "kv_preempted": "bool; requests were preempted: increase of vllm:num_preemptions_total in the window, or (without a metrics timeline) 'Preemptions: N' stats lines / V0 preemption warnings of the log's current run",
    "queued_kv_usages": "list[fraction]; KV usage (vllm:kv_cache_usage_perc) of each scrape in the window with requests waiting (vllm:num_requests_waiting > 0), oldest first",
    "log_queued_kv_usages": "list[fraction]; 'GPU KV cache usage' of each stats line of the log's current run with requests waiting or pending",
}
READS: frozenset[str] = frozenset({"preemptions_in_window", "log_preemptions_sum", "dp_engine"})


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_NOT_QUEUED = (False, 0.0)


def _queued_kv(m: EngineMetrics) -> tuple[bool, float]:
    """(requests waiting, KV usage) of one scrape: vllm:num_requests_waiting > 0,
    vllm:kv_cache_usage_perc (0.0 when absent; read only when requests wait)."""
    if (m.num_requests_waiting or 0) > 0:
        return True, float(m.kv_cache_usage or 0.0)
    return _NOT_QUEUED


def derive(s: Scope, v: Vars) -> None:
    """Preemptions, and the KV usage whenever requests queued (metrics window, stats lines)."""
    series = s.series
    if len(series) >= 2 and v["preemptions_in_window"] is not None:
        v["kv_preempted"] = v["preemptions_in_window"] > 0
    else:
        v["kv_preempted"] = (v["log_preemptions_sum"] or 0) > 0
    win = tl.window(series, s.window_s, shared=True) if series else []
    # [float(m.kv_cache_usage or 0.0) for m in win if (m.num_requests_waiting or 0) > 0], each
    # scrape's answer worked out once in its life (the window's are picked at C speed)
    marks = tl.sample_values(win, _queued_kv)
    v["queued_kv_usages"] = list(itertools.compress(map(_SECOND, marks), map(_FIRST, marks)))
    queued: list[float] = []
    if s.log is not None:
        for e in engine_stats(s.log, v["dp_engine"]):
            ev = e.values
            if ((ev.get("waiting") or 0) + (ev.get("pending") or 0)) > 0:
                queued.append(float(ev.get("kv_usage") or 0.0))
    v["log_queued_kv_usages"] = queued


FAMILY = Family("pressure", WRITES, READS, derive)
