"""Family episodes: what happened over the whole recorded series, not only the window (issue 24
kind 2: "forensic questions scan the whole series — a storm usually ends before anyone takes a
bundle — and the report says when the episode happened"; kind 1: "the concurrency the traffic
needs is the running count before the trouble").

Reads the Timeline's bounded, evenly spaced history (``Scope.history``: every snapshot of a
bundle, at most ``MAX_HISTORY_POINTS`` of a long live run) for this engine's scrapes, else the
log's stats lines of the current run. "Trouble" is a sample where requests were preempted (the
``vllm:num_preemptions_total`` counter rose since the previous sample, or a stats line's
``Preemptions: N`` > 0) or where requests wait while the KV cache is at least
:data:`TROUBLE_KV` full. Whether an episode is a storm is the rule's decision."""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars, engine_stats
from kvdoctor.derive.engines import _pick
from kvdoctor.derive.requests import _seconds

#: KV usage at which waiting requests count as trouble for ``running_before_trouble`` (the
#: KV-full threshold of max-num-seqs-exceeds-kv and preemption-storm)
TROUBLE_KV = 0.9
#: the origin the in-process vLLM plugin gives its scrapes (kvdoctor.integrations.vllm.ORIGIN)
LIVE_PLUGIN_ORIGIN = "vllm in-process"
#: two preempting samples further apart than this belong to different episodes (seconds)
EPISODE_GAP_S = 120.0

WRITES: dict[str, str] = {
    "running_before_trouble": "requests; the most requests running at once before the first trouble sample (preemptions rose, or requests waiting with KV usage ≥ 0.9) over the whole recorded series of this engine's scrapes (vllm:num_requests_running), else over the log's stats lines of the current run ('Running: N reqs'); the peak of every sample when no trouble is seen; None without either",
    "running_before_trouble_source": "str; where running_before_trouble comes from ('vllm:num_requests_running over N scrapes', 'stats lines')",
    "preemption_episode_start": "seconds; unix time of the scrape before the first preemption of the episode with the most preemptions in the whole recorded series (vllm:num_preemptions_total rising in consecutive scrapes, gaps ≤ 120 s)",
    "preemption_episode_end": "seconds; unix time of the episode's last rising scrape",
    "preemption_episode_count": "count; preemptions in that episode (increase of vllm:num_preemptions_total, resets skipped)",
    "preemption_episode_per_min": "per minute; that episode's preemptions / its span in minutes (at least one minute)",
    "preemption_episode_kv_max": "fraction; largest vllm:kv_cache_usage_perc during that episode",
    "preemption_episode_in_window": "bool; the episode reaches into the rule window (its last rising scrape is not older than the window)",
    "series_saved": "bool; this engine's scrapes were read from saved files (a bundle's metrics directory, a metrics file: every 'metrics' source origin is a path, not a URL nor the in-process plugin), so the whole series is a finished record a forensic question may scan; False for live scrapes and replayed recordings (their episodes clear as the window moves on)",
    "log_queued_kv_usages_recent": "list[fraction]; 'GPU KV cache usage' of the stats lines with requests waiting or pending in the window before the log's last stats line of this engine (by their 'MM-DD HH:MM:SS'; lines of an earlier burst are history); None when the lines carry no time",
    "log_prompt_throughput_last": "tokens/s; 'Avg prompt throughput' of the log's last stats line of this engine's current run (prefill was in the recent steps when > 0)",
}
READS: frozenset[str] = frozenset({"dp_engine"})


def _samples(s: Scope) -> list[Any]:
    """This engine's scrapes over the sampled history plus the window, time order, one each."""
    label = s.dp_label
    seen: set[float] = set()
    out: list[Any] = []
    for snap in list(s.history) + [None]:
        ms = [_pick(snap, label)] if snap is not None else list(s.series)
        for m in ms:
            if m is None or m.timestamp is None or m.timestamp in seen:
                continue
            seen.add(m.timestamp)
            out.append(m)
    out.sort(key=lambda m: m.timestamp)
    return out


def derive(s: Scope, v: Vars) -> None:
    """running_before_trouble and the largest preemption episode of the series."""
    samples = _samples(s)
    origins = [x.origin for x in s.snapshot.sources if x.kind == "metrics" and x.status == "ok"]
    v["series_saved"] = bool(origins) and not any("://" in o or o == LIVE_PLUGIN_ORIGIN for o in origins)
    if s.log is not None:
        stats = engine_stats(s.log, v["dp_engine"])
        if stats:
            v["log_prompt_throughput_last"] = stats[-1].values.get("prompt_throughput")
            last = _seconds(stats[-1])
            if last is not None:
                recent: list[float] = []
                for e in stats:
                    ev, at = e.values, _seconds(e)
                    waiting = (ev.get("waiting") or 0) + (ev.get("pending") or 0)
                    if at is not None and 0 <= last - at <= s.window_s and waiting > 0:
                        recent.append(float(ev.get("kv_usage") or 0.0))
                v["log_queued_kv_usages_recent"] = recent
    _running(s, v, samples)
    _episode(s, v, samples)


def _running(s: Scope, v: Vars, samples: list[Any]) -> None:
    runs: list[float] = []
    prev_pre: float | None = None
    peak_all: float | None = None
    trouble_at: int | None = None
    for i, m in enumerate(samples):
        pre = m.num_preemptions_total
        rose = pre is not None and prev_pre is not None and pre > prev_pre
        prev_pre = pre if pre is not None else prev_pre
        queued_full = (m.num_requests_waiting or 0) > 0 and (m.kv_cache_usage or 0) >= TROUBLE_KV
        if (rose or queued_full) and trouble_at is None:
            trouble_at = i
        r = m.num_requests_running
        if r is not None:
            peak_all = r if peak_all is None else max(peak_all, r)
            if trouble_at is None:
                runs.append(r)
    if peak_all is not None:
        v["running_before_trouble"] = max(runs) if runs else (None if trouble_at is not None else peak_all)
        v["running_before_trouble_source"] = f"vllm:num_requests_running over {len(samples)} scrapes"
        if v["running_before_trouble"] is not None:
            return
    if s.log is None:
        return
    before: list[int] = []
    every: list[int] = []
    troubled = False
    for e in engine_stats(s.log, v["dp_engine"]):
        ev = e.values
        r = ev.get("running")
        waiting = (ev.get("waiting") or 0) + (ev.get("pending") or 0)
        if (ev.get("preemptions") or 0) > 0 or (waiting > 0 and (ev.get("kv_usage") or 0) >= TROUBLE_KV):
            troubled = True
        if r is None:
            continue
        every.append(int(r))
        if not troubled:
            before.append(int(r))
    pick = before or ([] if troubled else every)
    if pick:
        v["running_before_trouble"] = max(pick)
        v["running_before_trouble_source"] = "stats lines ('Running: N reqs')"


def _episode(s: Scope, v: Vars, samples: list[Any]) -> None:
    best: tuple[float, float, float, float] | None = None  # count, start, end, kv max
    cur: list[float] | None = None  # count, start, end, kv max
    prev = None
    for m in samples:
        pre = m.num_preemptions_total
        if pre is None:
            continue
        if prev is not None and prev.num_preemptions_total is not None and pre > prev.num_preemptions_total:
            inc = pre - prev.num_preemptions_total
            kv = max(m.kv_cache_usage or 0.0, prev.kv_cache_usage or 0.0)
            if cur is not None and m.timestamp - cur[2] <= EPISODE_GAP_S:
                cur[0] += inc
                cur[2] = m.timestamp
                cur[3] = max(cur[3], kv)
            else:
                cur = [inc, prev.timestamp, m.timestamp, kv]
            if best is None or cur[0] > best[0]:
                best = (cur[0], cur[1], cur[2], cur[3])
        prev = m
    if best is None:
        return
    count, start, end, kv = best
    v["preemption_episode_count"] = count
    v["preemption_episode_start"] = start
    v["preemption_episode_end"] = end
    v["preemption_episode_per_min"] = count / max(1.0, (end - start) / 60.0)
    v["preemption_episode_kv_max"] = kv
    newest = samples[-1].timestamp if samples else None
    v["preemption_episode_in_window"] = newest is not None and newest - end <= s.window_s


FAMILY = Family("episodes", WRITES, READS, derive)
