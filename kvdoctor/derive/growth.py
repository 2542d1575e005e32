"""Family growth: used memory of the engine's GPUs over time (an nvidia-smi ``-l`` loop in a
bundle, or the live snapshots), as least-squares slopes; whether the later half is a plateau
is the rule's threshold (``gpu-memory-growth`` ``plateau_ratio``). The history read is bounded
(``engines.bounded_history``): the cost does not grow with the Timeline."""

from __future__ import annotations

import itertools
import operator
from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars, history_values
from kvdoctor.derive.engines import bounded_history
from kvdoctor.facts import Gpu, Snapshot

WRITES: dict[str, str] = {
    "mem_growth_gpu": "int; the engine GPU whose used memory rises fastest",
    "mem_growth_node": "str; its node (nodes/<host>/ bundles, host-named tables; None on one node)",
    "mem_growth_points": "int; readings of it over time (evenly spaced, at most 60)",
    "mem_growth_span_s": "seconds; time the readings span",
    "mem_growth_rise_bytes": "bytes; last − first used memory",
    "mem_growth_bytes_per_hour": "bytes/hour; least-squares slope of used memory over all readings",
    "mem_growth_recent_bytes_per_hour": "bytes/hour; least-squares slope over the later half of the readings",
    "mem_growth_headroom_bytes": "bytes; total − last used memory of that GPU (None when its total is unknown)",
    "mem_growth_used_bytes": "bytes; last used memory of that GPU",
    "mem_growth_max_step_bytes": "bytes; the largest rise between two consecutive readings of that GPU (a step: a KV commit, a wake's recommit, a restore)",
}
READS: frozenset[str] = frozenset({"engine_gpus", "engine_gpu_keys"})

#: a GPU across readings: (node, index) — index 0 of two nodes is two series.
_Key = tuple[str | None, int]


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes) points, in bytes per hour."""
    if len(points) < 2:
        return None
    n = len(points)
    ts, ys = zip(*points, strict=True)
    mt = sum(ts) / n
    my = sum(ys) / n
    dt = list(map(operator.sub, ts, itertools.repeat(mt)))
    # sum((t - mt) ** 2 …) and sum((t - mt) * (y - my) …): the same float operations in the
    # same order, mapped at C speed (this runs for every engine GPU every cycle).
    var = sum(map(pow, dt, itertools.repeat(2)))
    if var <= 0:
        return None
    cov = sum(map(operator.mul, dt, map(operator.sub, ys, itertools.repeat(my))))
    return cov / var * 3600.0


#: a reading: (GPU key, (time, used bytes as float), total bytes or None).
_Reading = tuple[_Key, tuple[float, float], int | None]


def _gpu_readings(gpus: list[Gpu], ts: float | None, wanted: set[_Key]) -> list[_Reading]:
    out: list[_Reading] = []
    for g in gpus:
        key = (g.node, g.index)
        if wanted and key not in wanted:
            continue
        t = g.timestamp if g.timestamp is not None else ts
        if t is not None and g.memory_used_bytes is not None:
            out.append((key, (t, float(g.memory_used_bytes)), g.memory_total_bytes))
    return out


def _snapshot_readings(snap: Snapshot, wanted: set[_Key]) -> list[_Reading]:
    if snap.gpus and (snap.timestamp is not None or all(g.timestamp is not None for g in snap.gpus)):
        return _gpu_readings(snap.gpus, snap.timestamp, wanted)
    return []


def _readings(s: Scope, wanted: set[_Key]) -> list[list[_Reading]]:
    """((node, GPU index), (time, used bytes), total bytes) of the engine's GPUs over time, one
    list per moment: the nvidia-smi ``-l`` loop's moments when the snapshot has them, else the
    bounded history of snapshots (a reading without its own time takes its snapshot's)."""
    moments = s.snapshot.gpu_series
    if moments:
        return [_gpu_readings(m, None, wanted) for m in bounded_history(moments)]
    # Per snapshot of a live Timeline once in its life: the sampled history is mostly the same
    # snapshots from one cycle to the next.
    key = ("gpu_memory_readings", frozenset(wanted))
    return history_values(s, key, lambda snap: _snapshot_readings(snap, wanted))


#: a snapshot with two or more readings of one GPU key (malformed tables): read in full.
_MANY: Any = object()


def _one_point(snap: Snapshot, wanted: set[_Key]) -> Any:
    """The (time, used bytes) reading of the one wanted GPU in a snapshot, None without one,
    _MANY with several (a column function)."""
    got = _snapshot_readings(snap, wanted)
    return got[0][1] if len(got) == 1 else (None if not got else _MANY)


def _one_total(snap: Snapshot, wanted: set[_Key]) -> int | None:
    """The last non-zero total bytes among a snapshot's readings of the wanted GPUs (a column
    function)."""
    return next(filter(None, reversed([r[2] for r in _snapshot_readings(snap, wanted)])), None)


def _one_gpu(
    s: Scope, wanted: set[_Key]
) -> tuple[dict[_Key, list[tuple[float, float]]], dict[_Key, int]] | None:
    """What the readings give for an engine on one GPU of a live history (series and totals as
    :func:`derive` gathers them), from per-snapshot columns of its point and total alone: the
    sampled snapshots' other objects are not read (each cycle samples other snapshots, out of
    the cache). None when a snapshot has several readings of it."""
    fw = frozenset(wanted)
    points = history_values(s, ("gpu_memory_point", fw), lambda snap: _one_point(snap, wanted))
    if any(map(operator.is_, points, itertools.repeat(_MANY))):
        return None
    pts = list(itertools.compress(points, map(operator.is_not, points, itertools.repeat(None))))
    (key,) = wanted
    totals = history_values(s, ("gpu_memory_total", fw), lambda snap: _one_total(snap, wanted))
    last = next(filter(None, reversed(totals)), None)
    return ({key: pts} if pts else {}), ({key: last} if last else {})


def derive(s: Scope, v: Vars) -> None:
    """The fastest-rising engine GPU: slope, recent slope, plateau, hours to full."""
    keys = v["engine_gpu_keys"]
    if keys is not None:
        wanted: set[_Key] = {(node, int(idx)) for node, idx in keys}
    else:
        wanted = {(None, int(i)) for i in v["engine_gpus"] or []}
    one = _one_gpu(s, wanted) if len(wanted) == 1 and not s.snapshot.gpu_series else None
    if one is not None:
        series, totals = one
    else:
        series, totals = {}, {}
        for moment in _readings(s, wanted):
            for idx, point, total in moment:
                pts = series.get(idx)
                if pts is None:
                    series[idx] = pts = []
                pts.append(point)
                if total:
                    totals[idx] = total
    best: tuple[float, _Key, list[tuple[float, float]]] | None = None
    for idx, pts in series.items():
        pts.sort()
        if len(pts) < 3:
            continue
        slope = slope_per_hour(pts)
        if slope is None:
            continue
        if best is None or slope > best[0]:
            best = (slope, idx, pts)
    if best is None:
        return
    slope, idx, pts = best
    half = pts[len(pts) // 2 :]
    recent = slope_per_hour(half) if len(half) >= 2 else None
    v["mem_growth_gpu"] = idx[1]
    v["mem_growth_node"] = idx[0]
    v["mem_growth_points"] = len(pts)
    v["mem_growth_span_s"] = pts[-1][0] - pts[0][0]
    v["mem_growth_rise_bytes"] = int(pts[-1][1] - pts[0][1])
    v["mem_growth_bytes_per_hour"] = slope
    v["mem_growth_recent_bytes_per_hour"] = recent
    v["mem_growth_used_bytes"] = int(pts[-1][1])
    v["mem_growth_max_step_bytes"] = int(max(b[1] - a[1] for a, b in itertools.pairwise(pts)))
    total = totals.get(idx)
    if total:
        v["mem_growth_headroom_bytes"] = max(0, int(total - pts[-1][1]))


FAMILY = Family("growth", WRITES, READS, derive)
