"""What every derive family shares: the :class:`Family` declaration, the :class:`Scope` of one
rule context (the facts a family reads), and read-only views over facts.

A family is one module of ``kvdoctor.derive``: it declares the variables it writes
(``WRITES``: name → "unit; meaning and source") and those it reads from families ordered before
it (``READS``); its ``derive(scope, v)`` fills its variables into ``v``. Families only read facts
and earlier families' variables: they never mutate a fact and never call a source parser.
"""

from __future__ import annotations

import itertools
import operator
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdoctor import catalog
from kvdoctor.catalog import GpuSpec
from kvdoctor.dcmethods import shared_methods
from kvdoctor.devices import visible_devices
from kvdoctor.facts import (
    Engine,
    EngineConfig,
    EngineMetrics,
    Gpu,
    GpuProcess,
    LogEvent,
    ModelArch,
    Snapshot,
    VllmLog,
)
from kvdoctor.lazyre import lazy_re
from kvdoctor.units import GiB, number_in_range

Vars = dict[str, Any]


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class Family:
    """One derive family: ``name``, the variables it ``writes`` (name → "unit; source"), the
    names it ``reads`` from earlier families, and ``run(scope, v)`` that writes them."""

    name: str
    writes: dict[str, str]
    reads: frozenset[str]
    run: Callable[[Scope, Vars], None]


class LogView:
    """A read-only index over a parsed vLLM log (or one run of it): events by kind, built once.

    ``of(kind)`` returns the events of one kind in file order (a shared list: do not modify it);
    ``last(kind)`` the last one or None. Same answers as :meth:`VllmLog.of` / ``last`` without a
    scan of every event per question."""

    def __init__(self, log: VllmLog, events: list[LogEvent]) -> None:
        self.log = log
        self.events = events
        self._by_kind: dict[str, list[LogEvent]] = {}
        for e in events:
            self._by_kind.setdefault(e.kind, []).append(e)

    @property
    def vllm_version(self) -> str | None:
        """The log's vLLM version ("vLLM API server version" line)."""
        return self.log.vllm_version

    @property
    def engine_generation(self) -> str | None:
        """Engine generation ("v0" or "v1") when the log tells."""
        return self.log.engine_generation

    @property
    def args(self) -> dict[str, Any]:
        """The log's parsed launch args (``non-default args`` …)."""
        return self.log.args

    def of(self, kind: str) -> list[LogEvent]:
        """Events of one kind, in file order (do not modify the list)."""
        return self._by_kind.get(kind, [])

    def last(self, kind: str) -> LogEvent | None:
        """The last event of one kind, or None."""
        got = self._by_kind.get(kind)
        return got[-1] if got else None


#: events a server prints while it starts, before it does anything that a restart would repeat.
_CONFIG_KINDS = frozenset({"version", "args", "chunked_prefill", "max_model_len_used"})


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class LogRuns:
    """A log split into server runs: the whole log, its latest run, where runs start (lines),
    and the pids seen in the latest run (``pids_latest``) and before it (``pids_earlier``)."""

    full: LogView
    run: LogView
    starts: list[int]
    pids_latest: frozenset[int]
    pids_earlier: frozenset[int]


#: a column entry not worked out yet.
_MISSING: Any = object()


def _has_missing(values: list[Any]) -> bool:
    # By identity at C speed: ``in`` would call each fact's __eq__ (Python code) in turn.
    return any(map(operator.is_, values, itertools.repeat(_MISSING)))


def _missing_at(values: list[Any]) -> Iterator[int]:
    """The positions of ``values`` not worked out yet, found by identity at C speed."""
    return itertools.compress(itertools.count(), map(operator.is_, values, itertools.repeat(_MISSING)))


class Columns:
    """Per-snapshot answers about one Timeline, aligned with its snapshots (oldest first):
    ``column(key, fn)[i]`` is ``fn(snapshots[i])``. :meth:`sync` follows the Timeline as it
    appends snapshots and drops the oldest (nothing is asked again, and no column is touched:
    the dropped entries stay at the front of each column until a trim, every ``_TRIM`` drops);
    any other change starts the columns afresh. Entries are worked out only when read
    (:meth:`pick`): an evaluation reads the sampled history, never the whole Timeline. Holds
    the snapshots it indexes (until the next sync); answers are shared."""

    __slots__ = ("__weakref__", "_base", "_cols", "_filled", "_getters", "_snaps")

    def __init__(self) -> None:
        self._snaps: list[Snapshot] = []
        #: position p of the synced list is entry p + _base of every column (the entries
        #: before _base are those of dropped snapshots, trimmed now and then).
        self._base = 0
        self._cols: dict[Any, list[Any]] = {}
        #: per column, [a, b): entries (column indices, _base included) known worked out (a
        #: window read cycle after cycle then only looks at what the Timeline appended since).
        self._filled: dict[Any, list[int]] = {}
        #: (id of an index tuple, _base) → (the tuple, an itemgetter of its column entries):
        #: the sampled history is the same positions cycle after cycle, and _base takes at
        #: most _TRIM values.
        self._getters: dict[tuple[int, int], tuple[tuple[int, ...], Callable[[list[Any]], Any]]] = {}

    def sync(self, snapshots: Sequence[Snapshot]) -> None:
        """Align with ``snapshots``: the same list with its oldest dropped and new ones appended
        keeps every answer; anything else resets. Checked item by item in one C-level list
        comparison (identity first; an item that is not the same object is compared by value,
        and a snapshot equal in every field has the same answers)."""
        old, n = self._snaps, len(snapshots)
        if old and n:
            first = snapshots[0]
            drop = next((i for i in range(min(len(old), 64)) if old[i] is first), None)
            if drop is not None and len(old) - drop <= n:
                kept = len(old) - drop
                if not drop and kept == n:
                    if old == snapshots:
                        return  # unchanged
                else:
                    # In place: the kept snapshots are neither copied nor touched (a copy took
                    # and then released a reference to each of them, 600 objects out of the
                    # cache, every cycle). One evaluation at a time reads a Timeline's columns:
                    # the loop that appends to it evaluates it.
                    if drop:
                        del old[:drop]
                    old.extend(snapshots[kept:])
                    if old == snapshots:  # identity first, item by item, at C speed
                        self._base += drop
                        if self._base >= _TRIM:
                            self._trim()
                        return
        self._snaps = list(snapshots)
        self._base = 0
        self._cols = {}
        self._filled = {}

    def _trim(self) -> None:
        """Drop the entries of dropped snapshots from every column (amortised: every _TRIM drops)."""
        base = self._base
        for col in self._cols.values():
            del col[:base]
        for rng in self._filled.values():
            rng[0], rng[1] = max(0, rng[0] - base), max(0, rng[1] - base)
        self._base = 0

    def _column(self, key: Any) -> list[Any]:
        """The column ``key``, as long as the synced list (new entries missing)."""
        col = self._cols.get(key)
        want = self._base + len(self._snaps)
        if col is None:
            col = self._cols[key] = [_MISSING] * want
            self._filled[key] = [0, 0]
        elif len(col) < want:
            col.extend([_MISSING] * (want - len(col)))
        return col

    def pick(self, key: Any, fn: Callable[[Snapshot], Any], index: Sequence[int]) -> list[Any]:
        """``fn(snapshot)`` for the snapshots at ``index`` (positions in the synced list), each
        worked out once while that snapshot stays. ``key`` names ``fn`` and everything else it
        depends on."""
        base = self._base
        col = self._cols.get(key)
        if col is None:
            col = self._column(key)
        elif len(col) < base + len(self._snaps):
            col.extend([_MISSING] * (base + len(self._snaps) - len(col)))
        if type(index) is tuple and len(index) > 8:
            got = list(self._getter(index, base)(col))
        elif base:
            got = list(map(col.__getitem__, map(base.__add__, index)))
        else:
            got = list(map(col.__getitem__, index))
        if _has_missing(got):
            snaps = self._snaps
            for j in _missing_at(got):  # the newest snapshot, mostly: found at C speed
                i = index[j]
                got[j] = col[i + base] = fn(snaps[i])
        return got

    def _getter(self, index: tuple[int, ...], base: int) -> Callable[[list[Any]], Any]:
        """An itemgetter of the column entries at ``index`` (two or more positions) shifted by
        ``base``: one C call instead of a mapped addition and lookup per position."""
        k = (id(index), base)
        hit = self._getters.get(k)
        if hit is None or hit[0] is not index:
            if len(self._getters) > 4 * _TRIM:
                self._getters.clear()
            hit = self._getters[k] = (index, operator.itemgetter(*[i + base for i in index]))
        return hit[1]

    def span(self, key: Any, fn: Callable[[Snapshot], Any], lo: int, hi: int) -> list[Any]:
        """:meth:`pick` of the positions ``lo … hi - 1`` (a new list)."""
        return self._span(key, fn, lo, hi, False)

    def span_steps(
        self, key: Any, fn: Callable[[Snapshot | None, Snapshot], Any], lo: int, hi: int
    ) -> list[Any]:
        """Like :meth:`span`, of a function of two snapshots: entry p is ``fn(snapshots[p - 1],
        snapshots[p])`` (``fn(None, snapshots[0])`` at the first position). Appends and drops
        keep every pair of neighbours, so each entry is worked out once while both stay."""
        return self._span(key, fn, lo, hi, True)

    def _span(self, key: Any, fn: Callable[..., Any], lo: int, hi: int, steps: bool) -> list[Any]:
        snaps = self._snaps
        n, base = len(snaps), self._base
        col = self._cols.get(key)
        if col is None:
            col = self._column(key)
        elif len(col) < base + n:
            col.extend([_MISSING] * (base + n - len(col)))  # the snapshots appended since
        if hi > n:
            hi = n
        a, b = lo + base, hi + base
        got = col[a:b]
        rng = self._filled[key]
        fa, fb = rng
        if fa <= a <= fb == b - 1:
            # the window of the cycle before, slid on by the snapshot appended since: only its
            # newest entry can be missing
            if got[-1] is _MISSING:
                p = hi - 1
                got[-1] = col[b - 1] = (
                    fn(snaps[p - 1] if p > 0 else None, snaps[p]) if steps else fn(snaps[p])
                )
            rng[1] = b
        elif a < fa or b > fb:
            # only what lies outside the filled range can be missing
            head, tail = max(0, min(fa, b) - a), max(0, fb - a)
            missing = list(_missing_at(got[:head])) if head else []
            if tail < len(got):
                missing.extend(map(tail.__add__, _missing_at(got[tail:])))
            if missing:
                for j in missing:
                    p = lo + j
                    if steps:
                        got[j] = col[a + j] = fn(snaps[p - 1] if p > 0 else None, snaps[p])
                    else:
                        got[j] = col[a + j] = fn(snaps[p])
            if a <= fb and b >= fa:
                rng[0], rng[1] = min(fa, a), max(fb, b)
            else:
                rng[0], rng[1] = a, b
        return got


#: drops between trims of the columns (each trim moves every column once).
_TRIM = 64


_COLUMNS: dict[int, tuple[weakref.ref[Any], Columns]] = {}


def timeline_columns(timeline: Any) -> Columns:
    """The :class:`Columns` of a Timeline (one per Timeline object, dropped with it), synced
    with its snapshots."""
    key = id(timeline)
    hit = _COLUMNS.get(key)
    if hit is None or hit[0]() is not timeline:
        if len(_COLUMNS) > 64:
            _COLUMNS.clear()
        hit = (weakref.ref(timeline, lambda _ref: _COLUMNS.pop(key, None)), Columns())
        _COLUMNS[key] = hit
    hit[1].sync(timeline.snapshots)
    return hit[1]


def snapshot_timestamp(snap: Snapshot) -> float | None:
    """``Snapshot.timestamp`` (a column function)."""
    return snap.timestamp


def history_values(s: Scope, key: Any, fn: Callable[[Snapshot], Any]) -> list[Any]:
    """``fn(snapshot)`` for each snapshot of ``s.history``, oldest first; from the Timeline's
    :class:`Columns` when the scope has them (each snapshot asked once in its life), else
    asked here. ``key`` names ``fn`` and what else it depends on."""
    if s.history_columns is not None and s.history_index is not None:
        return s.history_columns.pick(key, fn, s.history_index)
    return [fn(snap) for snap in s.history]


_RUNS_CACHE: dict[int, tuple[weakref.ref[VllmLog], int, LogRuns]] = {}


def _scan_run_starts(log: VllmLog) -> list[int]:
    starts: list[int] = []
    progressed = True
    for e in log.events:
        candidate = (e.kind == "version" and "server version" in e.text.lower()) or (
            e.kind == "args" and e.values.get("source") in ("non_default", "namespace")
        )
        if candidate:
            if progressed:
                starts.append(e.line)
                progressed = False
        elif e.kind not in _CONFIG_KINDS:
            progressed = True
    return starts


def _identity(e: LogEvent) -> tuple[Any, Any] | None:
    """(model, port) a server's args dump names, or None for other events."""
    if e.kind != "args" or e.values.get("source") not in ("non_default", "namespace"):
        return None
    a = e.values.get("args") or {}
    return (a.get("served_model_name") or a.get("model") or a.get("model_tag"), a.get("port"))


def _restarts_only(log: VllmLog, starts: list[int]) -> list[int]:
    """The run starts that restart a server of the run before; a start whose server (model,
    port) differs from every server of the run before is a second engine in the same log."""
    if len(starts) < 2:
        return starts
    ids: list[set[tuple[Any, Any]]] = [set() for _ in starts]
    k = 0
    for e in log.events:
        while k + 1 < len(starts) and e.line >= starts[k + 1]:
            k += 1
        if e.line >= starts[0]:
            ident = _identity(e)
            if ident is not None:
                ids[k].add(ident)
    kept = [starts[0]]
    seen = set(ids[0])
    for start, idents in zip(starts[1:], ids[1:], strict=True):
        if not idents or idents & seen:
            kept.append(start)
            seen = set(idents) | (seen if not idents else set())
        else:
            seen |= idents
    return kept


def log_runs(log: VllmLog) -> LogRuns:
    """The runs of a log. A run begins at its "vLLM API server version" line or its args dump
    (``non-default args`` / ``args: Namespace``) once the previous run had got past its
    configuration lines; a log cut mid-run has no start: all of it is one run.

    Cached per log object and event count (every engine context of every evaluation asks);
    the log itself is never modified."""
    key = id(log)
    hit = _RUNS_CACHE.get(key)
    # The weak reference guards against a new log reusing a dead one's id.
    if hit is not None and hit[0]() is log and hit[1] == len(log.events):
        return hit[2]
    starts = _restarts_only(log, _scan_run_starts(log))
    first = starts[-1] if starts else 0
    run_events = [e for e in log.events if e.line >= first] if len(starts) > 1 else log.events
    full = LogView(log, log.events)
    run = full if run_events is log.events else LogView(log, run_events)
    latest = frozenset(e.pid for e in log.events if e.pid is not None and e.line >= first)
    earlier = (
        frozenset(e.pid for e in log.events if e.pid is not None and e.line < first)
        if len(starts) > 1
        else frozenset()
    )
    runs = LogRuns(full, run, starts, latest, earlier)
    if len(_RUNS_CACHE) > 64:
        _RUNS_CACHE.clear()
    _RUNS_CACHE[key] = (weakref.ref(log), len(log.events), runs)
    return runs


def current_run(log: VllmLog) -> VllmLog:
    """The log's latest run only, as a new :class:`VllmLog` (the given one is not modified): an
    error of an earlier run that was restarted since is history, not the present state."""
    runs = log_runs(log)
    if len(runs.starts) <= 1:
        return log
    return VllmLog(
        origin=log.origin,
        events=list(runs.run.events),
        vllm_version=log.vllm_version,
        engine_generation=log.engine_generation,
        args=log.args,
        line_count=log.line_count,
    )


@shared_methods
@dataclass(repr=False, eq=False)
class Scope:
    """The facts one rule context is about (one engine, or the host when ``engine`` is None).

    ``series``: this engine's /metrics scrapes inside the window (oldest first, each with a
    timestamp where its snapshot had one); ``older_scrapes``: a scrape exists before the window.
    ``history``: a bounded, evenly spaced sample of the Timeline's snapshots (GPU memory growth).
    ``log``: the log's latest run; ``runs``: the whole log split into runs. ``visible``: the GPUs
    CUDA_VISIBLE_DEVICES leaves visible. Nothing here is modified by a family.
    """

    snapshot: Snapshot
    engine: Engine | None
    cfg: EngineConfig
    series: list[EngineMetrics]
    window_s: float
    dp_label: str | None = None
    older_scrapes: bool = False
    history: Sequence[Snapshot] = ()
    all_engines: list[Engine] = field(default_factory=list)
    runs: LogRuns | None = None
    arch: ModelArch | None = None
    model_source: str | None = None
    visible: list[Gpu] = field(default_factory=list)
    engine_pids: frozenset[int] = frozenset()
    #: every data-parallel engine's scrapes in the window, by ``engine`` label (empty without DP).
    peer_series: dict[str, list[EngineMetrics]] = field(default_factory=dict)
    #: pids of a `vllm preload` weights daemon (also in ``engine_pids``): the deployment's, no engine.
    weight_daemon_pids: frozenset[int] = frozenset()
    #: the Timeline's per-snapshot answers, and where ``history`` lies in it (``history_values``).
    history_columns: Columns | None = None
    history_index: Sequence[int] | None = None

    @property
    def log(self) -> LogView | None:
        """The latest run of the log, or None without a log."""
        return self.runs.run if self.runs is not None else None


_VLLM_PROC_RE = lazy_re(r"VLLM::|vllm|VllmWorker|EngineCore", re.IGNORECASE)


#: process name → is_vllm_process (bounded): the same GPU processes are asked about by several
#: families, cycle after cycle.
_VLLM_NAMES: dict[str, bool] = {}


def is_vllm_process(name: str) -> bool:
    """A GPU process whose name says vLLM (``VLLM::Worker_TP0``, ``VLLM::EngineCore``, …)."""
    hit = _VLLM_NAMES.get(name) if isinstance(name, str) else None
    if hit is None:
        hit = bool(_VLLM_PROC_RE.search(name or ""))
        if isinstance(name, str):
            if len(_VLLM_NAMES) > 1024:
                _VLLM_NAMES.clear()
            _VLLM_NAMES[name] = hit
    return hit


#: GPU name → its catalogue spec (bounded): the same name is looked up by several families,
#: cycle after cycle.
_GPU_SPECS: dict[str, GpuSpec] = {}


def gpu_spec(name: str) -> GpuSpec:
    """:func:`kvdoctor.catalog.gpu` of an nvidia-smi / NVML GPU name (the spec shared, like
    the catalogue's). Raises KeyError (or ValueError) as it does, for a name not catalogued."""
    hit = _GPU_SPECS.get(name)
    if hit is None:
        hit = catalog.gpu(name)
        if len(_GPU_SPECS) > 256:
            _GPU_SPECS.clear()
        _GPU_SPECS[name] = hit
    return hit


#: (id of a GPU, weights-daemon pids) → (the GPU, its vllm_holders), for the GPUs of the last
#: cycles (bounded): attribution and colocation both ask, about every visible GPU.
_HOLDERS: dict[tuple[int, frozenset[int]], tuple[Gpu, list[GpuProcess]]] = {}


def vllm_holders(g: Gpu, daemon_pids: frozenset[int]) -> list[GpuProcess]:
    """The processes on ``g`` (NVML running processes / nvidia-smi Processes) named like vLLM
    and holding 1 GiB or more, a `vllm preload` weights daemon's (``daemon_pids``) left out, in
    process order: the engines a GPU holds. A shared list: do not modify it."""
    key = (id(g), daemon_pids)
    hit = _HOLDERS.get(key)
    if hit is not None and hit[0] is g:
        return hit[1]
    got = [
        p
        for p in g.processes
        if is_vllm_process(p.name) and (p.used_bytes or 0) >= GiB and p.pid not in daemon_pids
    ]
    if len(_HOLDERS) > 64:
        _HOLDERS.clear()
    _HOLDERS[key] = (g, got)
    return got


def visible_gpus(snapshot: Snapshot) -> list[Gpu]:
    """The snapshot's GPUs that CUDA_VISIBLE_DEVICES (env.txt / live env) leaves visible; all of
    them when it is unset or names none of them."""
    gpus = snapshot.gpus
    vis = visible_devices(snapshot.env) if snapshot.env else None
    if vis is not None:
        chosen = [g for g in gpus if g.index in vis]
        if chosen:
            return chosen
    return gpus


#: (pid, name, used bytes, GPU index) of each process → describe_processes' text (bounded): the
#: same processes are described cycle after cycle.
_DESCRIBED: dict[tuple[tuple[int, str | None, int | None, int], ...], str] = {}


def describe_processes(items: list[tuple[GpuProcess, int]]) -> str:
    """'pid 48213 (/opt/conda/bin/python3.10) 15.42 GiB on GPU 0, …' (NVML / nvidia-smi
    process pid, name and used memory)."""
    key = tuple([(proc.pid, proc.name, proc.used_bytes, idx) for proc, idx in items])
    hit = _DESCRIBED.get(key)
    if hit is None:
        from kvdoctor.units import fmt_bytes

        hit = ", ".join(
            f"pid {proc.pid} ({proc.name or '?'}) {fmt_bytes(proc.used_bytes)} on GPU {idx}"
            for proc, idx in items
        )
        if len(_DESCRIBED) > 256:
            _DESCRIBED.clear()
        _DESCRIBED[key] = hit
    return hit


def stats_engine(e: LogEvent) -> int:
    """The data-parallel engine index of a stats line ("Engine 001:"), 0 when absent."""
    try:
        return int(e.values.get("engine") or 0)
    except (TypeError, ValueError):
        return 0


def engine_stats(log: LogView, dp_label: str | None) -> list[LogEvent]:
    """The stats lines of one data-parallel engine (all of them without DP)."""
    stats = log.of("stats")
    if dp_label is not None and str(dp_label).isdigit():
        return [e for e in stats if stats_engine(e) == int(dp_label)]
    return stats


def num(s: str | None) -> float | None:
    """A ``vllm:cache_config_info`` label value as a number; None for "None"/""/text."""
    return number_in_range(s)  # "inf", "1e309": corrupt, unknown
