"""Family hardware: uncorrectable ECC (nvidia-smi / NVML) and NVIDIA XIDs from the kernel log
(``kvdoctor.sources.dmesg``), by GPU; and what clock throttling costs in generation throughput
over the whole series given (spec/rules.md ``gpu-clock-throttled``)."""

from __future__ import annotations

import itertools
import operator
from bisect import bisect_left
from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars, history_values, snapshot_timestamp
from kvdoctor.derive.engines import bounded_history, engine_series
from kvdoctor.devices import APPLICATION_XIDS, HARDWARE_XIDS, normalize_bus_id
from kvdoctor.facts import Gpu, Snapshot

WRITES: dict[str, str] = {
    "xid_hw_count": "count; hardware XID errors (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 123, 154, …; kvdoctor.devices.HARDWARE_XIDS) in dmesg.txt / --dmesg",
    "xid_app_count": "count; application XIDs (13, 31, 43, 45: kvdoctor.devices.APPLICATION_XIDS)",
    "xid_desc": "str; 'Xid 79 on GPU 1 (00000000:07:00.0, dmesg line 3): GPU has fallen off the bus, …'",
    "ecc_gpus": "list[int]; GPUs with uncorrectable ECC errors (nvidia-smi 'Volatile Uncorr. ECC' / NVML)",
    "ecc_desc": "str; 'GPU 0: 2 uncorrectable ECC errors, …'",
    "hw_error_gpus": "list[int]; GPUs with hardware XIDs or uncorrectable ECC errors",
    "hw_error_bus_ids": "list[str]; their PCI bus ids (XIDs whose bus id matches no listed GPU included)",
    "xid_app_desc": "str; application XIDs (13, 31, 43, 45) with the process the driver names: 'Xid 13 on GPU 0 (pid 4242 python3), dmesg line 7: …'",
    "xid_app_gpus": "list[int]; GPUs named by application XIDs",
    "throttle_tput_loss": "fraction; 1 − median(throttled ÷ unthrottled generation tokens/s at comparable running requests) over the whole series (NVML clock event reasons × rate(vllm:generation_tokens_total)); None when no comparable pair",
    "throttle_tput_throttled": "tokens/s; median generation throughput while throttled, at loads an unthrottled reading matches",
    "throttle_tput_unthrottled": "tokens/s; median generation throughput unthrottled at those loads",
    "throttle_compared": "count; throttled readings that had an unthrottled reading at comparable load",
    "throttle_since_s": "seconds; how long the engine's GPUs have been throttled, up to the newest reading (the series' last unbroken throttled stretch)",
    "throttle_readings": "count; readings (snapshots with GPU clock reasons) the throttle judgement saw",
}
READS: frozenset[str] = frozenset({"engine_gpus"})

#: clock event reasons that slow the GPU (NVML nvmlClocksEventReasons names); gpu_idle and
#: applications_clocks_setting are not a slowdown.
_SLOW = ("thermal", "power", "hw_slowdown", "slowdown")
#: readings at comparable load: running requests within this fraction of each other (at least 1).
_LOAD_TOLERANCE = 0.25


def _slow(gpus: list[Gpu], wanted: set[int]) -> bool | None:
    """Whether the engine's GPUs (``wanted`` indices; every GPU when empty) show a slowdown
    reason in one reading; None when the reading has none of them."""
    seen = False
    for g in gpus:  # runs for every snapshot of the history, every cycle: no lists built
        if wanted and g.index not in wanted:
            continue
        seen = True
        for r in g.clock_event_reasons:
            if any(map(r.__contains__, _SLOW)):  # `k in r` for each k, at C speed
                return True
    return False if seen else None


def _throttle_readings(s: Scope, wanted: set[int]) -> list[tuple[float | None, bool]]:
    """(time, throttled) per reading of the engine's GPUs, oldest first: the nvidia-smi ``-l``
    loop's moments (``Snapshot.gpu_series``, bounded) when the snapshot has them, else the
    bounded history of snapshots that read GPUs."""
    out: list[tuple[float | None, bool]] = []
    moments = s.snapshot.gpu_series
    if moments:
        moments = bounded_history(moments)
        for gpus in moments:
            t = _slow(gpus, wanted)
            if t is not None:
                times = [g.timestamp for g in gpus if g.timestamp is not None]
                out.append((times[0] if times else None, t))
        return out
    if s.history:
        # Per snapshot of a live Timeline once in its life: the sampled history is mostly the
        # same snapshots from one cycle to the next.
        slow = history_values(s, ("throttle_slow", frozenset(wanted)), lambda snap: _slow(snap.gpus, wanted))
        stamps = history_values(s, "timestamp", snapshot_timestamp)
        if None not in slow:
            out = list(zip(stamps, slow, strict=True))
        else:
            out = [(ts, t) for ts, t in zip(stamps, slow, strict=True) if t is not None]
    if not out:
        t = _slow(s.snapshot.gpus, wanted)
        if t is not None:
            out.append((s.snapshot.timestamp, t))
    return out


_TIME = operator.itemgetter(0)
_THROTTLED = operator.itemgetter(1)


def _timestamp_known(snap: Snapshot) -> bool:
    """Whether a snapshot has its time (a column function)."""
    return snap.timestamp is not None


def _nothing_throttled(s: Scope, wanted: set[int], v: Vars) -> bool:
    """The sidecar's case, every cycle: a live history whose readings show no slowdown. Writes
    what :func:`_throttle_cost` would (the readings' count, "compared 0" when one of them is
    timed) from the per-snapshot flags alone, without the readings' times, and says True;
    False (nothing written) in any other case."""
    if s.snapshot.gpu_series or not s.history:
        return False
    slow = history_values(s, ("throttle_slow", frozenset(wanted)), lambda snap: _slow(snap.gpus, wanted))
    if True in slow or False not in slow:
        return False
    known = history_values(s, "timestamp_known", _timestamp_known)
    v["throttle_readings"] = len(slow) - slow.count(None)
    if None not in slow:
        any_timed = True in known
    else:
        any_timed = any(k for k, t in zip(known, slow, strict=True) if t is not None)
    if any_timed:
        v["throttle_compared"] = 0
    return True


def _throttle_cost(s: Scope, v: Vars) -> None:
    """Generation throughput throttled vs unthrottled at comparable load, over the whole series
    (the bounded history, not only the window): consecutive scrapes give a rate of
    ``vllm:generation_tokens_total`` and the running requests (``vllm:num_requests_running``) at
    the later one; each rate is throttled or not by the GPU reading nearest in time (NVML clock
    event reasons). A counter reset, an untimed pair or a rate with no reading near it is skipped."""
    wanted = set(v["engine_gpus"] or [])
    if _nothing_throttled(s, wanted, v):
        return
    readings = _throttle_readings(s, wanted)
    v["throttle_readings"] = len(readings)
    if readings and readings[-1][1]:
        start = len(readings) - 1
        while start > 0 and readings[start - 1][1]:
            start -= 1
        t0, t1 = readings[start][0], readings[-1][0]
        if t0 is not None and t1 is not None:
            v["throttle_since_s"] = max(0.0, t1 - t0)
    if not any(map(_THROTTLED, readings)):
        # Nothing throttled, nothing to compare: the pairs below would all be "cool" (the
        # common case, and the sidecar derives it every cycle; checked at C speed, unsorted).
        if any(map(operator.is_not, map(_TIME, readings), itertools.repeat(None))):
            v["throttle_compared"] = 0
        return
    timed: list[tuple[float, bool]] = sorted((t, thr) for t, thr in readings if t is not None)
    if not timed:
        return
    if not any(thr for _, thr in timed):
        v["throttle_compared"] = 0
        return
    series = engine_series(s.history or [s.snapshot], s.dp_label)
    points: list[tuple[float, float, bool]] = []  # (running, tokens/s, throttled)
    for prev, cur in zip(series, series[1:], strict=False):
        if prev.timestamp is None or cur.timestamp is None or cur.timestamp <= prev.timestamp:
            continue
        if prev.generation_tokens_total is None or cur.generation_tokens_total is None:
            continue
        if cur.generation_tokens_total < prev.generation_tokens_total:
            continue  # counter reset (restart)
        running = cur.num_requests_running or 0.0
        if running <= 0:
            continue
        now = cur.timestamp
        span = now - prev.timestamp
        i = bisect_left(timed, (now, False))
        near = [timed[j] for j in (i - 1, i) if 0 <= j < len(timed)]
        best = min(near, key=lambda r: abs(r[0] - now))
        if abs(best[0] - now) > max(60.0, span):
            continue
        rate = (cur.generation_tokens_total - prev.generation_tokens_total) / span
        points.append((running, rate, best[1]))
    hot = [p for p in points if p[2]]
    cool = [p for p in points if not p[2]]
    ratios: list[float] = []
    thr_rates: list[float] = []
    ref_rates: list[float] = []
    for load, rate, _ in hot:
        tol = max(1.0, _LOAD_TOLERANCE * load)
        comparable = [r for lo, r, _ in cool if abs(lo - load) <= tol]
        if not comparable:
            continue
        from statistics import median  # a throttled series only: not imported to start

        ref = median(comparable)
        if ref <= 0:
            continue
        ratios.append(rate / ref)
        thr_rates.append(rate)
        ref_rates.append(ref)
    v["throttle_compared"] = len(ratios)
    if ratios:
        v["throttle_tput_loss"] = max(0.0, 1.0 - median(ratios))
        v["throttle_tput_throttled"] = median(thr_rates)
        v["throttle_tput_unthrottled"] = median(ref_rates)


def derive(s: Scope, v: Vars) -> None:
    """Hardware XIDs and uncorrectable ECC errors, with the GPUs and bus ids they name."""
    snapshot = s.snapshot
    # Keyed by (node, bus id): identical machines have the same bus ids (nodes/<host>/ dmesg.txt
    # tags its XIDs with the node; a top-level one matches a bus id only one node has).
    # (only XIDs are looked up by bus id: none, none built)
    by_bus = (
        {(g.node, normalize_bus_id(g.bus_id)): g for g in snapshot.gpus if g.bus_id}
        if snapshot.xid_events
        else {}
    )
    # Classified by number here too, so a recording made before a list grew reads the same.
    hw = [x for x in snapshot.xid_events if x.get("hardware") or x.get("xid") in HARDWARE_XIDS]
    hw_ids = {id(x) for x in hw}
    app = [
        x
        for x in snapshot.xid_events
        if id(x) not in hw_ids and (x.get("application") or x.get("xid") in APPLICATION_XIDS)
    ]
    v["xid_hw_count"] = len(hw)
    v["xid_app_count"] = len(app)
    gpus: set[int] = set()
    buses: list[str] = []
    parts: list[str] = []
    seen: set[tuple[Any, Any, Any]] = set()

    def gpu_of(x: dict[str, Any]) -> Any:
        g = by_bus.get((x.get("node"), x.get("bus_id")))
        if g is None and x.get("node") is None:
            same = [gg for (_n, b), gg in by_bus.items() if b == x.get("bus_id")]
            g = same[0] if len(same) == 1 else None
        return g

    for x in hw:
        g = gpu_of(x)
        if g is not None:
            gpus.add(g.index)
        if x.get("bus_id") and x["bus_id"] not in buses:
            buses.append(x["bus_id"])
        key = (x.get("xid"), x.get("bus_id"), x.get("node"))
        if key in seen:
            continue
        seen.add(key)
        node = f" of node {g.node}" if g is not None and g.node else ""
        where = (
            f"GPU {g.index}{node} ({x.get('bus_id')})" if g is not None else f"PCI {x.get('bus_id') or '?'}"
        )
        parts.append(
            f"Xid {x.get('xid')} on {where}, dmesg line {x.get('line')}: {str(x.get('message') or '').rstrip('.')}"
        )
    v["xid_desc"] = "; ".join(parts) if parts else None
    ecc = [g for g in snapshot.gpus if (g.ecc_uncorrectable or 0) > 0]
    v["ecc_gpus"] = [g.index for g in ecc]
    v["ecc_desc"] = (
        ", ".join(f"GPU {g.index}: {g.ecc_uncorrectable} uncorrectable ECC error(s)" for g in ecc)
        if ecc
        else None
    )
    for g in ecc:
        gpus.add(g.index)
        bid = normalize_bus_id(g.bus_id)
        if bid and bid not in buses:
            buses.append(bid)
    v["hw_error_gpus"] = sorted(gpus)
    v["hw_error_bus_ids"] = buses
    # Application XIDs (13, 31, 43, 45): the program's fault, not the device's (rules.md family P).
    app_parts: list[str] = []
    app_gpus: set[int] = set()
    for x in app[:8]:
        g = gpu_of(x)
        if g is not None:
            app_gpus.add(g.index)
        where = f"GPU {g.index}" if g is not None else f"PCI {x.get('bus_id') or '?'}"
        proc = f"pid {x['pid']}" if x.get("pid") is not None else "no pid named"
        if x.get("name"):
            proc += f" {x['name']}"
        app_parts.append(
            f"Xid {x.get('xid')} on {where} ({proc}), dmesg line {x.get('line')}: "
            f"{str(x.get('message') or '').rstrip('.')}"
        )
    v["xid_app_desc"] = "; ".join(app_parts) if app_parts else None
    v["xid_app_gpus"] = sorted(app_gpus)
    _throttle_cost(s, v)


FAMILY = Family("hardware", WRITES, READS, derive)
