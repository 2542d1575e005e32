"""The one live loop every face runs: feeds of Snapshots, a bounded Timeline, the pipeline.

A *feed* is where Snapshots come from (:class:`SnapshotFeed`): the live machine
(:class:`LiveFeed`: NVML, psutil, /metrics, the log), a bundle or single artifacts
(:class:`TimelineFeed`, finite), or a recording (``kvdoctor.sources.recording``, finite, seekable).
:class:`LiveLoop` reads a feed at an interval into a bounded :class:`~kvdoctor.facts.Timeline`
and evaluates the :class:`~kvdoctor.pipeline.Pipeline` after each read; ``diagnose`` collects a
short window (:meth:`LiveLoop.collect`), ``watch`` and ``sidecar`` keep :meth:`LiveLoop.run`
going on a thread of their own, ``record`` writes what it reads. No face writes its own loop.

Live reads go through :class:`Sampler`: every source (:class:`LiveSource`: NVML, psutil,
each /metrics endpoint, the log) is read concurrently with its own timeout, a failing one backs
off exponentially with jitter and recovers by itself, and :class:`SourceHealth` says how each is
doing (the sidecar exports it, the watch header shows it).

GPU readings over time have one shape: a moment is a list of :class:`~kvdoctor.facts.Gpu` with
``timestamp`` set. Live, each Snapshot's ``gpus`` is one moment (NVML readings are stamped);
offline, an ``nvidia-smi -l`` loop is the bundle Snapshot's ``gpu_series``.
:meth:`~kvdoctor.facts.Timeline.gpu_moments` reads either.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvdoctor.facts import (
    EngineConfig,
    Gpu,
    Snapshot,
    SourceError,
    SourceStatus,
    SourceStatusValue,
    SourceUnavailable,
    Timeline,
    VllmLog,
)
from kvdoctor.feeds import TimelineFeed as TimelineFeed  # re-exported; lives apart for the cold start

if TYPE_CHECKING:
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.report import Report


_D = TypeVar("_D")

# --------------------------------------------------------------------------- live sources


@dataclass
class LiveOptions:
    """What to read live. ``metrics_urls`` empty → discovered from the vLLM API server processes'
    ports (psutil) on every read, so engines that start or stop are picked up.

    Seconds everywhere: ``interval_s`` between reads, ``timeout_s`` per source and read,
    ``backoff_max_s`` the longest wait before a failing source is tried again (8 s: a /metrics
    that comes back is read again, and the sidecar ready, within 8 s; one GET every few seconds
    to a dead local endpoint costs nothing). ``window_s`` is :func:`kvdoctor.collect.collect_live`'s window."""

    metrics_urls: list[str] = field(default_factory=list)
    log_path: Path | None = None
    window_s: float = 5.0
    interval_s: float = 1.0
    timeout_s: float = 2.0
    use_nvml: bool = True
    use_processes: bool = True
    backoff_max_s: float = 8.0
    #: one diagnosis, not a watch: a source waiting out its backoff is reported by its last
    #: error, without "retrying in …" (nothing will retry it)
    one_shot: bool = False
    #: /metrics histogram families parsed (None: ``sources.metrics.READ_HISTOGRAMS``; a screen
    #: that shows latencies passes ``DISPLAY_HISTOGRAMS``)
    histograms: tuple[str, ...] | None = None


@dataclass
class Reading:
    """What one live source read once: Snapshot fields by name (``{"gpus": [...]}``), the
    status ("ok" or "missing") and its one-line ``detail``; ``raw`` is the page text of a
    /metrics scrape (kept for ``kvdoctor bundle``), else None."""

    values: dict[str, Any]
    detail: str = ""
    status: SourceStatusValue = "ok"
    raw: str | None = None


class LiveSource(Protocol):
    """One live input behind one small interface (node_exporter's collector).

    ``kind`` is spec/report.md's ``sources[].kind`` ("nvml", "processes", "metrics", "log");
    ``origin`` names it ("NVML", "psutil", the URL, the log path) and is unique within a feed;
    ``timeout_s`` bounds one :meth:`read` (the loop stops waiting for it then). :meth:`read`
    raises any exception for a failure (SourceError with one line preferred): the loop turns it
    into an "error" SourceStatus and backs off. Reads run on a worker thread, one at a time per
    source.
    """

    kind: str
    origin: str
    timeout_s: float

    def read(self) -> Reading:
        """Read the input once; raise on failure."""
        ...

    def close(self) -> None:
        """Release what the source holds; never raises."""
        ...


@dataclass
class SourceHealth:
    """How one live source is doing, for the sidecar's ``kvdoctor_source_up`` family and the
    watch header. Times are unix seconds, durations seconds.

    ``up``: the last attempt succeeded (None before the first); ``errors_total`` counts failed
    attempts (timeouts included) since the feed started; ``consecutive_errors`` resets on a
    success; ``next_attempt_ts`` is when a backing-off source is tried again (None: next read).
    """

    kind: str
    origin: str
    up: bool | None = None
    last_success_ts: float | None = None
    last_attempt_ts: float | None = None
    last_duration_s: float | None = None
    last_error: str | None = None
    errors_total: int = 0
    consecutive_errors: int = 0
    next_attempt_ts: float | None = None


class NvmlSource:
    """GPUs through NVML (``kvdoctor.sources.nvml.NvmlReader``: ``nvmlDeviceGetMemoryInfo``,
    ``…GetUtilizationRates``, ``…GetComputeRunningProcesses``, …). A failure shuts NVML down
    so the next attempt initialises it afresh: a driver that comes back is picked up."""

    kind = "nvml"
    origin = "NVML"

    def __init__(self, timeout_s: float = 2.0, factory: Callable[[], Any] | None = None) -> None:
        self.timeout_s = timeout_s
        self._factory = factory
        self._reader: Any = None
        #: the last reading's Gpu by NVML index (unchanged parts are shared)
        self._prev: dict[int, Gpu] = {}

    def warm(self) -> None:
        """Import what :meth:`read` needs (on the caller's thread, outside the timeout)."""
        import kvdoctor.sources.nvml  # noqa: F401

    def read(self) -> Reading:
        """Every GPU, each stamped with the reading's unix time (one shape with a CSV loop). A
        GPU's process list or clock event reasons equal to the previous reading's are that same
        object (as :meth:`MetricsSource.read` shares unchanged histograms)."""
        try:
            if self._reader is None:
                if self._factory is not None:
                    self._reader = self._factory()
                else:
                    from kvdoctor.sources.nvml import NvmlReader

                    self._reader = NvmlReader()
            gpus = self._reader.read()
        except SourceError:
            self.close()
            raise
        except Exception as e:  # pynvml raises its own error types
            self.close()
            raise SourceError(f"NVML: {type(e).__name__}: {_one_line(e)}") from None
        now = time.time()
        prev, self._prev = self._prev, {}
        # An NvmlReader makes every Gpu, list and GpuProcess of a read afresh and hands them to
        # no one else: they are stamped in place, before any Snapshot holds them; another
        # reader's objects are copied.
        fresh = getattr(type(self._reader), "fresh_objects", False) is True

        def put(obj: _D, **changes: Any) -> _D:
            if not fresh:
                return _with(obj, **changes)
            for k, v in changes.items():
                setattr(obj, k, v)
            return obj

        stamped = []
        for g in gpus:
            before = prev.get(g.index)
            # What did not change since the last reading is that same object (facts are never
            # modified): a Timeline of --history readings keeps one copy of it. Compared before
            # interning (equal either way): an unchanged list costs no copies.
            procs = g.processes
            if before is not None and procs == before.processes:
                procs = before.processes
            else:
                procs = [
                    put(
                        p,
                        name=_intern(p.name) or "",
                        gpu_uuid=_intern(p.gpu_uuid),
                        gpu_bus_id=_intern(p.gpu_bus_id),
                    )
                    for p in procs
                ]
            reasons = g.clock_event_reasons
            if before is not None and reasons == before.clock_event_reasons:
                reasons = before.clock_event_reasons
            gpu = put(
                g,
                timestamp=g.timestamp if g.timestamp is not None else now,
                name=_intern(g.name),  # interned: one copy of each string
                uuid=_intern(g.uuid),
                bus_id=_intern(g.bus_id),
                processes=procs,
                clock_event_reasons=reasons,
            )
            self._prev[g.index] = gpu
            stamped.append(gpu)
        return Reading({"gpus": stamped}, f"{len(stamped)} GPU(s)")

    def close(self) -> None:
        """``nvmlShutdown`` (through the reader); never raises."""
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except Exception:
                pass


class ProcessSource:
    """vLLM processes through psutil (``kvdoctor.sources.processes.list_processes``): command
    lines (redacted), CPU, RSS, listening ports, roles. The host's process table is kept
    between reads (:class:`~kvdoctor.sources.processes.ProcessTable`): rescanned in full every
    ``rescan_s`` seconds or after NVML's GPU pids change (:meth:`note_gpu_pids`, which the
    :class:`Sampler` calls after each NVML read), else only new pids and the vLLM processes are
    read."""

    kind = "processes"
    origin = "psutil"

    def __init__(self, timeout_s: float = 2.0, rescan_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.rescan_s = rescan_s
        self._table: Any = None

    def warm(self) -> None:
        """Import what :meth:`read` needs (on the caller's thread, outside the timeout)."""
        from kvdoctor.sources.processes import ProcessTable

        if self._table is None:
            self._table = ProcessTable(rescan_s=self.rescan_s)

    def note_gpu_pids(self, pids: set[int]) -> None:
        """NVML's GPU process pids of the latest read (a change rescans the table)."""
        if self._table is not None:
            self._table.note_gpu_pids(pids)

    def read(self) -> Reading:
        """The vLLM process table; "missing" when no vLLM process runs."""
        from kvdoctor.sources import processes

        if self._table is None:
            self.warm()
        procs = processes.list_processes(cache=self._table)
        values = {"processes": procs, "process_table_known": True}
        if procs:
            return Reading(values, f"{len(procs)} vLLM process(es)")
        return Reading(values, "no vLLM server or engine process running", status="missing")

    def close(self) -> None:
        """Nothing to release."""


class MetricsSource:
    """One vLLM ``/metrics`` endpoint over HTTP (``kvdoctor.sources.metrics.scrape``: the
    response parsed by httptools, one keep-alive connection kept by a
    :class:`~kvdoctor.sources.metrics.ScrapeClient`)."""

    kind = "metrics"

    def __init__(self, url: str, timeout_s: float = 2.0, histograms: tuple[str, ...] | None = None) -> None:
        self.origin = url
        self.timeout_s = timeout_s
        #: histogram families parsed (None: the default ``READ_HISTOGRAMS``)
        self.histograms = histograms
        # One HTTP client for every scrape of this endpoint: it keeps the connection alive and
        # its TLS context (~40 ms to build, more than the rest of a sidecar cycle).
        self._client: Any = None
        #: the last scrape's EngineMetrics by engine label (unchanged parts are shared)
        self._prev: dict[str | None, Any] = {}

    def warm(self) -> None:
        """Import what :meth:`read` needs and build the HTTP client (http.client for the
        connection, httptools for the response, and for an https URL its SSL context, ~40 ms;
        on the caller's thread, outside the timeout)."""
        import http.client  # noqa: F401

        from kvdoctor.sources.metrics import ScrapeClient

        if self._client is None:
            self._client = ScrapeClient()
            if self.origin.lower().startswith("https:"):
                self._client.ssl_context()

    def read(self) -> Reading:
        """One scrape parsed into EngineMetrics; the page text kept in ``raw``. A histogram or
        the ``cache_config_info`` labels equal to the previous scrape's are that same object
        (facts are never modified, so Snapshots may share them): a Timeline of --history
        scrapes holds one copy of what did not change."""
        from kvdoctor.sources.metrics import parse_metrics, scrape

        text, ts = scrape(self.origin, timeout=self.timeout_s, client=self._client)
        if self.histograms is None:
            ms = parse_metrics(text, origin=self.origin, timestamp=ts)
        else:
            ms = parse_metrics(text, origin=self.origin, timestamp=ts, histograms=self.histograms)
        prev, self._prev = self._prev, {}
        for m in ms:
            before = prev.get(m.engine)
            if before is not None:
                for name, h in list(m.histograms.items()):
                    old = before.histograms.get(name)
                    if old is not None and old == h:
                        m.histograms[name] = old
                if m.cache_config == before.cache_config:
                    m.cache_config = before.cache_config
            self._prev[m.engine] = m
        return Reading({"metrics": ms}, f"{len(ms)} engine(s)", raw=text)

    def close(self) -> None:
        """Close the HTTP client; never raises."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None


#: the detail of a live log path that does not exist yet ("missing" status).
NOT_YET = "log file not created yet"


class LogSource:
    """The vLLM log file followed as it grows (``kvdoctor.sources.vllm_log.LogFollower``: only
    appended lines are parsed). Each change gives a new :class:`~kvdoctor.facts.VllmLog` (the
    follower's own keeps growing), so Snapshots never see a log change under them and a
    recording writes only the appended events.

    A log that does not exist yet (a pod whose vLLM has not started writing it) is "missing",
    not an error: no backoff, it is opened on the first read after it appears. Rotation (a new
    file at the path) and truncation restart the follower at the top of the new file; while the
    path is briefly absent the last log read stays."""

    kind = "log"

    def __init__(self, path: Path, timeout_s: float = 2.0) -> None:
        self.path = path
        self.origin = str(path)
        self.timeout_s = timeout_s
        self._follower: Any = None
        self._view: VllmLog | None = None
        self._seen: tuple[int, int, str | None] | None = None

    def warm(self) -> None:
        """Import what :meth:`read` needs (on the caller's thread, outside the timeout)."""
        import kvdoctor.sources.bundle  # noqa: F401
        import kvdoctor.sources.vllm_log  # noqa: F401

    def read(self) -> Reading:
        """Parse what was appended since the last read."""
        from kvdoctor.sources.bundle import describe_log
        from kvdoctor.sources.vllm_log import LogFollower, check_log_file

        if self._follower is None:
            if not os.path.lexists(self.path):
                return Reading({}, f"{NOT_YET} ({self.path.name}); read once it appears", status="missing")
            check_log_file(self.path)
            self._follower = LogFollower(self.path)
        elif not os.path.lexists(self.path):
            # deleted (or rotated away and not yet recreated): the last log read stays
            # (``last_log``), but nothing is read from it now
            return Reading(
                {},
                f"{self.path.name} is gone (deleted or rotated); the last log read stays",
                status="missing",
            )
        try:
            self._follower.poll()
        except Exception:
            self._follower = None  # start again from the top next time
            raise
        log = self._follower.log
        key = (log.line_count, len(log.events), log.vllm_version)
        if self._view is None or key != self._seen:
            self._view = replace(log, events=list(log.events), args=dict(log.args))
            self._seen = key
        return Reading({"log": self._view}, describe_log(self._view))

    @property
    def last_log(self) -> VllmLog | None:
        """The last log read, kept while the file is unreadable (a log only grows)."""
        return self._view

    def close(self) -> None:
        """Nothing to release."""


class _Call:
    """One read of a source on its reader thread: :meth:`wait` for it, then ``result``
    (Reading, seconds it took) or ``error``. A lock released when the read ends is all the
    hand-off costs (a Future's Condition and the pool's queue cost ~2x, every source every
    second)."""

    __slots__ = ("_done", "result", "error")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.result: tuple[Reading, float] | None = None
        self.error: BaseException | None = None

    def run(self, fn: Callable[[], Reading]) -> None:
        t0 = time.monotonic()
        try:
            self.result = (fn(), time.monotonic() - t0)
        except Exception as e:
            # reported as one line: its traceback (and the exception it was raised from) would
            # keep the failed read's frames alive until a rare collection, an oversized /metrics
            # body (16 MiB) among them; released now
            e.__traceback__, e.__context__, e.__cause__ = None, None, None
            self.error = e
        except BaseException as e:  # noqa: BLE001 - handed to the sampler, which re-raises it
            self.error = e
        finally:
            self._done.release()

    def done(self) -> bool:
        """True once the read has ended (returned or raised)."""
        return self.wait(0.0)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the read to end; True when it has."""
        if self._done.acquire(timeout=max(0.0, timeout)):
            self._done.release()
            return True
        return False


class _Reader:
    """The thread that reads one source, one read at a time (a daemon: a read that hangs,
    an NVML call stuck in the driver, never holds the process at exit)."""

    def __init__(self, name: str) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._job: tuple[Callable[[], Reading], _Call] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Reading]) -> _Call:
        """Start one read (the previous one has ended: the sampler never starts a source's
        read behind one that hangs)."""
        call = _Call()
        self._job = (fn, call)
        self._go.release()
        return call

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if self._closed or job is None:
                return
            job[1].run(job[0])

    def close(self) -> None:
        """End the thread after its current read, if any; never raises."""
        self._closed = True
        try:
            self._go.release()
        except RuntimeError:  # released already: a read was just submitted and is running
            pass


@dataclass
class _State:
    source: LiveSource
    health: SourceHealth
    future: _Call | None = None
    started: float = 0.0
    next_attempt: float = 0.0
    reader: _Reader | None = None
    #: why the source cannot exist on this host (SourceUnavailable): never read again
    unavailable: str | None = None


class Sampler:
    """Reads every live source concurrently once per :meth:`sample` into one Snapshot.

    Each source runs on a worker thread with its own deadline (``timeout_s``): a source still
    running at its deadline is dropped for that read ("error", "timed out after 2s") and the
    others are used; it is not started again while that read hangs. A failing source is retried
    with exponential backoff and jitter (the interval doubling up to ``backoff_max_s``, times a
    random 0.5..1) and recovers by itself: NVML is initialised afresh, the log reopened.
    Without ``--metrics`` URLs the /metrics endpoints are discovered from the API server
    processes on every read (engines that start are scraped, those that stop are dropped).
    ``sources`` replaces the default set (tests inject slow or failing ones).
    """

    def __init__(
        self,
        opts: LiveOptions,
        *,
        sources: list[LiveSource] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.opts = opts
        self._proc_root = proc_root
        #: config.json read through /proc/PID/root: path → ((mtime_ns, size), ModelArch | None)
        self._models: dict[str, tuple[tuple[int, int], Any]] = {}
        self._model_paths: dict[tuple[str, ...], Path | None] = {}
        self._rng = rng or random.Random()
        self._clock = clock
        self._states: dict[str, _State] = {}
        self._fixed_urls = list(opts.metrics_urls)
        #: /metrics page texts of the last read, origin → (unix seconds, text)
        self.last_raw: dict[str, tuple[float, str]] = {}
        self._configs: dict[tuple[str, ...], EngineConfig | None] = {}
        self._log_source: LogSource | None = None
        self._warmed: set[int] = set()
        base: list[LiveSource]
        if sources is not None:
            base = list(sources)
        else:
            base = []
            if opts.use_nvml:
                base.append(NvmlSource(opts.timeout_s))
            if opts.use_processes:
                base.append(ProcessSource(opts.timeout_s))
            for url in self._fixed_urls:
                base.append(MetricsSource(url, opts.timeout_s, opts.histograms))
            if opts.log_path is not None:
                self._log_source = LogSource(opts.log_path, opts.timeout_s)
                base.append(self._log_source)
        for src in base:
            self._add(src)
        self._default_sources = sources is None
        self._discovering = sources is None and not self._fixed_urls and opts.use_processes

    def _add(self, src: LiveSource) -> _State:
        st = _State(src, SourceHealth(src.kind, src.origin))
        # copy-on-write: health() may iterate from another thread (sidecar, watch)
        self._states = {**self._states, f"{src.kind}\0{src.origin}": st}
        return st

    def health(self) -> list[SourceHealth]:
        """Per-source health, in source order (copies; safe to read from another thread)."""
        return [replace(st.health) for st in list(self._states.values())]

    # ------------------------------------------------------------------ one read

    def _start(self, st: _State, now: float, statuses: dict[str, SourceStatus]) -> None:
        key = f"{st.source.kind}\0{st.source.origin}"
        if st.unavailable is not None:
            statuses[key] = SourceStatus(st.source.kind, st.source.origin, "missing", st.unavailable)
            return
        if st.future is not None and not st.future.done():
            # The previous read still hangs: do not pile threads up behind it.
            self._fail(st, f"timed out after {st.source.timeout_s:g}s (still running)", now, None)
            statuses[key] = self._status(st, st.health.last_error or "")
            return
        if st.unavailable is not None:
            statuses[key] = SourceStatus(st.source.kind, st.source.origin, "missing", st.unavailable)
            return
        if st.future is not None:
            st.future = None
        if now < st.next_attempt:
            wait = st.next_attempt - now
            retry = "" if self.opts.one_shot else f" (retrying in {wait:.1f}s)"
            statuses[key] = self._status(st, f"{st.health.last_error}{retry}")
            return
        warm = getattr(st.source, "warm", None)
        if callable(warm) and id(st.source) not in self._warmed:
            # Imports take the import lock and, on a loaded host, seconds: never inside a
            # source's timeout (two threads importing at once would wait on each other).
            self._warmed.add(id(st.source))
            try:
                warm()
            except Exception:
                pass  # read() will say what is missing
            now = self._clock()
        st.started = now
        st.health.last_attempt_ts = time.time()
        if st.reader is None:
            st.reader = _Reader(f"kvdoctor-source-{st.source.kind}")
        st.future = st.reader.submit(st.source.read)

    def _finish(self, st: _State, snap: Snapshot, statuses: dict[str, SourceStatus]) -> None:
        key = f"{st.source.kind}\0{st.source.origin}"
        fut = st.future
        if fut is None or key in statuses:
            return
        remaining = st.started + st.source.timeout_s - self._clock()
        if not fut.wait(remaining):
            self._fail(st, f"timed out after {st.source.timeout_s:g}s", self._clock(), None)
            statuses[key] = self._status(st, st.health.last_error or "")
            return
        st.future = None
        if fut.result is None:
            e = fut.error if fut.error is not None else RuntimeError("no reading")
            if not isinstance(e, Exception):
                raise e  # KeyboardInterrupt, SystemExit in a read: not a source failure
            if isinstance(e, SourceUnavailable):
                st.unavailable = f"{_one_line(e)}: not retried"
                st.health.up, st.health.last_error = False, st.unavailable
                statuses[key] = SourceStatus(st.source.kind, st.source.origin, "missing", st.unavailable)
                return
            self._fail(st, _one_line(e), self._clock(), self._clock() - st.started)
            statuses[key] = self._status(st, st.health.last_error or "")
            return
        reading, duration = fut.result
        h = st.health
        h.up, h.last_success_ts, h.last_duration_s = True, time.time(), duration
        h.consecutive_errors, h.last_error, h.next_attempt_ts = 0, None, None
        st.next_attempt = 0.0
        for name, value in reading.values.items():
            if name == "metrics":
                snap.metrics.extend(value)
            else:
                setattr(snap, name, value)
        if reading.raw is not None and snap.metrics:
            self.last_raw[st.source.origin] = (snap.metrics[-1].timestamp or time.time(), reading.raw)
        statuses[key] = SourceStatus(
            st.source.kind,
            st.source.origin,
            reading.status,
            reading.detail,
            duration_s=duration,
            last_success=h.last_success_ts,
        )

    def _fail(self, st: _State, message: str, now: float, duration: float | None) -> None:
        h = st.health
        h.up = False
        h.last_error = message
        h.errors_total += 1
        h.consecutive_errors += 1
        if duration is not None:
            h.last_duration_s = duration
        n = h.consecutive_errors
        if n >= 2:
            delay = min(self.opts.backoff_max_s, self.opts.interval_s * 2 ** (n - 1))
            delay *= self._rng.uniform(0.5, 1.0)
            st.next_attempt = now + delay
            h.next_attempt_ts = time.time() + delay
        else:
            st.next_attempt = 0.0
            h.next_attempt_ts = None

    def _status(self, st: _State, detail: str) -> SourceStatus:
        h = st.health
        return SourceStatus(
            st.source.kind,
            st.source.origin,
            "error",
            detail,
            duration_s=h.last_duration_s,
            last_success=h.last_success_ts,
        )

    def _rediscover(self, snap: Snapshot, statuses: dict[str, SourceStatus]) -> None:
        """Metrics endpoints from this read's API server processes; new ones start now."""
        if not snap.process_table_known:
            return  # psutil failed this time: keep the endpoints known
        from kvdoctor.sources.processes import metrics_url_for

        urls: list[str] = []
        for p in snap.processes:
            url = metrics_url_for(p) if p.vllm_role == "api_server" else None
            if url and url not in urls:
                urls.append(url)
        gone = [
            k
            for k, st in self._states.items()
            if st.source.kind == "metrics" and st.source.origin not in urls
        ]
        if gone:  # those engines stopped
            for k in gone:
                st = self._states[k]
                if st.reader is not None:
                    st.reader.close()
                try:
                    st.source.close()  # its kept-alive connection to the stopped server
                except Exception:
                    pass
            self._states = {k: st for k, st in self._states.items() if k not in gone}
            for k in gone:
                self.last_raw.pop(k.split("\0", 1)[1], None)
        now = self._clock()
        for url in urls:
            if f"metrics\0{url}" not in self._states:
                self._start(
                    self._add(MetricsSource(url, self.opts.timeout_s, self.opts.histograms)), now, statuses
                )

    def sample(self) -> Snapshot:
        """Read every live source once, concurrently; never raises for a source failure.

        Waits at most the longest source timeout. Statuses come in source order; with no
        /metrics endpoint known a "missing" metrics status says how to give one."""
        snap = Snapshot(timestamp=time.time())
        statuses: dict[str, SourceStatus] = {}
        now = self._clock()
        for st in list(self._states.values()):
            self._start(st, now, statuses)
        proc = self._states.get("processes\0psutil")
        if proc is not None and self._discovering:
            self._finish(proc, snap, statuses)
            self._rediscover(snap, statuses)
        for st in list(self._states.values()):
            self._finish(st, snap, statuses)
        if snap.gpus and proc is not None:
            note = getattr(proc.source, "note_gpu_pids", None)
            if callable(note):  # an engine that starts or stops rescans the process table
                note({p.pid for g in snap.gpus for p in g.processes})
        if self._log_source is not None and snap.log is None:
            snap.log = self._log_source.last_log  # unreadable now: what was read stays true
        ordered = [statuses[k] for k in self._states if k in statuses]
        if self._default_sources and not any(st.source.kind == "metrics" for st in self._states.values()):
            insert = next((i for i, s in enumerate(ordered) if s.kind == "log"), len(ordered))
            ordered.insert(
                insert,
                SourceStatus(
                    "metrics", "/metrics", "missing", "no vLLM server found to scrape (give --metrics URL)"
                ),
            )
        snap.sources = ordered
        return snap

    def configs(self, snap: Snapshot) -> list[EngineConfig]:
        """Engine configs from the live API servers' command lines (``/proc/PID/cmdline`` via
        psutil, redacted; ``kvdoctor.sources.cmdline.parse_argv``). A command line parsed once
        gives the same EngineConfig object on every read.

        Containers (``kvdoctor.sources.container``): the server's ``/proc/PID/environ`` gives the
        GPU UUIDs its container was given (``NVIDIA_VISIBLE_DEVICES``), kept as
        ``args["_gpu_uuids"]`` (derive/container.py matches them to NVML's when NVML's host pids
        are not in this PID namespace), and a local ``--model`` directory's config.json is found
        through ``/proc/PID/root`` (:meth:`model`)."""
        from kvdoctor.sources import container
        from kvdoctor.sources.cmdline import parse_argv

        out = []
        for p in snap.processes:
            if p.vllm_role != "api_server" or not p.cmdline:
                continue
            key = (str(p.pid), *p.cmdline)
            if key not in self._configs:
                if len(self._configs) > 256:
                    self._configs.clear()  # engines came and went: keep the cache bounded
                try:
                    cfg = parse_argv(p.cmdline, origin=f"pid {p.pid}")
                except SourceError:
                    cfg = None
                seen = container.read_process(p.pid, self._proc_root)
                if cfg is not None and seen is not None:
                    uuids = container.gpu_uuids(seen.env)
                    if uuids:
                        cfg.args["_gpu_uuids"] = uuids
                if len(self._model_paths) > 256:
                    self._model_paths.clear()
                self._model_paths[key] = seen.config_path if seen is not None else None
                self._configs[key] = cfg
            cfg = self._configs[key]
            if cfg is not None:
                out.append(cfg)
        return out

    def model(self, snap: Snapshot) -> Any:
        """The model's architecture from the first API server whose ``--model`` is a local
        directory with a config.json (read through ``/proc/PID/root``: the vLLM container's
        filesystem; ``kvdoctor.sources.model_config``), re-read only when the file changes;
        None when there is none or it does not parse."""
        from kvdoctor.sources.model_config import parse_model_config_file

        for p in snap.processes:
            if p.vllm_role != "api_server" or not p.cmdline:
                continue
            path = self._model_paths.get((str(p.pid), *p.cmdline))
            if path is None:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            known = self._models.get(str(path))
            if known is None or known[0] != stamp:
                try:
                    arch = parse_model_config_file(path)
                except (SourceError, OSError, ValueError):
                    arch = None
                if len(self._models) > 16:
                    self._models.clear()
                self._models[str(path)] = known = (stamp, arch)
            if known[1] is not None:
                return known[1]
        return None

    def close(self) -> None:
        """Release every source (nvmlShutdown) and the worker threads; never raises. A read
        that hangs is abandoned, not waited for."""
        for st in list(self._states.values()):
            try:
                st.source.close()
            except Exception:
                pass
            if st.reader is not None:
                st.reader.close()


def _with(obj: _D, **changes: Any) -> _D:
    """``dataclasses.replace(obj, **changes)`` for a plain dataclass (fields set by ``__init__``
    only, no ``__post_init__``: nothing to run again), as a copy of its ``__dict__``: a few
    times cheaper, and the sampler copies every GPU every read. Another object goes through
    ``replace``."""
    cls = type(obj)
    if hasattr(cls, "__post_init__") or not hasattr(obj, "__dict__"):
        return replace(obj, **changes)  # type: ignore[type-var]
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


def _intern(text: str | None) -> str | None:
    return sys.intern(text) if text else text


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# --------------------------------------------------------------------------- feeds and the loop


class SnapshotFeed(Protocol):
    """A source of Snapshots, oldest first.

    ``live``: True when :meth:`next` reads the machine now (then it never returns None);
    False for a finite feed (bundle, artifacts, recording), whose :meth:`next` returns None once
    exhausted. :meth:`next` never raises for a source failure: that becomes a
    :class:`~kvdoctor.facts.SourceStatus` in the Snapshot. ``label`` names the input for headers
    ("live", "bundle b.tar.gz", "recording r.jsonl.gz").

    Optional, looked up with ``getattr`` by :class:`LiveLoop`: ``health()`` → list of
    :class:`SourceHealth` (:class:`LiveFeed`); ``keep_last(n)`` (a recording: pass over all
    but the last ``n`` Snapshots without decoding them); ``seek(i)``, ``position``, ``len()``
    (a recording, a :class:`TimelineFeed`: replay controls).
    """

    live: bool
    label: str

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None when a finite feed is exhausted."""
        ...

    def close(self) -> None:
        """Release what the feed holds (NVML handle, open files); never raises."""
        ...


class LiveFeed:
    """The live machine: each :meth:`next` reads every live source once through
    :class:`Sampler` (NVML, psutil process table, /metrics over HTTP, the log followed as it
    grows) and attaches the engine configs parsed from the API servers' command lines
    (redacted). :meth:`health` says how each source is doing; :attr:`last_raw` holds the
    /metrics page texts of the last read (``kvdoctor bundle`` writes them as they came)."""

    live = True

    def __init__(
        self,
        opts: LiveOptions,
        *,
        sources: list[LiveSource] | None = None,
        rng: random.Random | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.opts = opts
        self._sampler = Sampler(opts, sources=sources, rng=rng, proc_root=proc_root)
        self.label = "live"

    def next(self) -> Snapshot:
        """Read every live source once; never raises for a source failure. Engine configs
        and, from a local model directory seen through /proc, the model's config.json are
        attached (:meth:`Sampler.configs`, :meth:`Sampler.model`)."""
        snap = self._sampler.sample()
        snap.configs = self._sampler.configs(snap)
        if snap.model is None:
            snap.model = self._sampler.model(snap)
        return snap

    def health(self) -> list[SourceHealth]:
        """Per-source health (:class:`SourceHealth`), in source order."""
        return self._sampler.health()

    @property
    def last_raw(self) -> dict[str, tuple[float, str]]:
        """/metrics page texts of the last read: URL → (unix seconds, text)."""
        return self._sampler.last_raw

    def close(self) -> None:
        """Release NVML and the worker threads; never raises."""
        self._sampler.close()


@dataclass
class Cycle:
    """One turn of the loop: the Snapshot read, the Timeline after it, and the Report of the
    pipeline over that Timeline (None when the loop runs without evaluating). ``index`` counts
    cycles from 0; ``duration_s`` is the read + evaluation wall time, seconds."""

    index: int
    snapshot: Snapshot
    timeline: Timeline
    report: Report | None
    duration_s: float


class _Window:
    """When a live window of ``window_s`` seconds (diagnose, bundle) or a duration (record) is
    over: ``window_s`` after the end of the first read, with at least two reads, and with the
    /metrics pages spanning at least half of it. A read that stalls for most of the window (a
    process-table walk or another source hanging to its timeout on a loaded host) would
    otherwise leave two pages of one instant, whose rate says nothing: the window then goes on
    until the pages span half of it, for at most twice its length. Without any page (no
    endpoint answered) it ends on time: the report says which source failed."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.first: float | None = None  # unix seconds of the first and the newest page
        self.last: float | None = None

    def note(self, snap: Snapshot) -> None:
        """Record the page times of one read (``EngineMetrics.timestamp``, else the read's)."""
        if not snap.metrics:
            return
        t = max((m.timestamp for m in snap.metrics if m.timestamp is not None), default=snap.timestamp)
        if t is None:
            return
        self.first = t if self.first is None else min(self.first, t)
        self.last = t if self.last is None else max(self.last, t)

    def over(self, elapsed: float, reads: int) -> bool:
        """Whether the window is over ``elapsed`` seconds after the end of the first read,
        after ``reads`` reads."""
        if reads < 2 or elapsed < self.window_s:
            return False
        if self.first is None or self.last is None or elapsed >= 2 * self.window_s:
            return True
        return self.last - self.first >= self.window_s / 2


class LiveLoop:
    """Reads a feed into a bounded Timeline at ``interval_s`` and evaluates ``pipeline``.

    ``max_len`` bounds the Timeline (oldest snapshots dropped). ``interval_s`` may be changed
    while running (watch's ``+``/``-``); :attr:`paused` stops reading without ending the loop.
    A finite feed ends the loop when exhausted. The loop itself never raises for a source.
    """

    def __init__(
        self,
        feed: SnapshotFeed,
        pipeline: Pipeline | None = None,
        *,
        interval_s: float = 1.0,
        max_len: int = 3600,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feed = feed
        self.pipeline = pipeline
        self.interval_s = interval_s
        self.timeline = Timeline(max_len=max_len)
        self.paused = threading.Event()
        self._clock = clock
        self._index = 0

    def step(self, *, evaluate: bool = True) -> Cycle | None:
        """Read one Snapshot, append it, evaluate; None when a finite feed is exhausted."""
        t0 = self._clock()
        snap = self.feed.next()
        if snap is None:
            return None
        self.timeline.append(snap)
        report = self.pipeline.evaluate(self.timeline) if (evaluate and self.pipeline) else None
        cycle = Cycle(self._index, snap, self.timeline, report, self._clock() - t0)
        self._index += 1
        return cycle

    def run(
        self,
        on_cycle: Callable[[Cycle], None],
        stop: threading.Event,
        *,
        max_cycles: int | None = None,
        duration_s: float | None = None,
        pace_finite: bool = False,
        evaluate_every: int = 1,
    ) -> None:
        """Loop until ``stop`` is set, ``max_cycles`` or ``duration_s`` is reached, or a finite
        feed ends; call ``on_cycle`` after each read. ``duration_s`` counts from the end of the
        first read (process discovery and a first scrape of a loaded server can take longer
        than the whole duration: a recording of one read has no rates) and, like :meth:`collect`'s
        window, goes on past it while the pages span less than half of it (at most twice it).
        A finite feed is read as fast as it goes unless ``pace_finite`` (replay at
        ``interval_s``). ``evaluate_every`` N evaluates the pipeline on every Nth cycle only (a
        fast replay of a long recording; the other cycles carry ``report=None``). Exceptions
        from ``on_cycle`` propagate (they are the face's bugs, not a source's)."""
        start = self._clock()
        n = 0
        every = max(1, evaluate_every)
        window = _Window(duration_s) if duration_s is not None and self.feed.live else None
        while not stop.is_set():
            if self.paused.is_set():
                stop.wait(0.05)
                continue
            t0 = self._clock()
            cycle = self.step(evaluate=(self._index % every == every - 1) or every == 1)
            if cycle is None:
                return
            on_cycle(cycle)
            n += 1
            if max_cycles is not None and n >= max_cycles:
                return
            if window is not None:
                window.note(cycle.snapshot)
            if n == 1:
                start = self._clock()
            elif window is not None:
                if window.over(self._clock() - start, n):
                    return
            elif duration_s is not None and self._clock() - start >= duration_s:
                return
            if self.feed.live or pace_finite:
                stop.wait(self._wait(t0, first=n == 1))

    def collect(
        self,
        window_s: float,
        *,
        sleep: Callable[[float], None] | None = None,
        stop: threading.Event | None = None,
        on_cycle: Callable[[Cycle], None] | None = None,
    ) -> Timeline:
        """Read without evaluating: a live feed for ``window_s`` seconds at ``interval_s``,
        counted from the end of the first read (discovery and a first scrape of a loaded server
        do not eat the window: two back-to-back scrapes after them give no usable rate); one
        read only when there is no /metrics endpoint; at least two reads otherwise, since rates
        need two scrapes, and a slow or failing endpoint is retried within the window; a read
        that stalled for most of the window is made up for, up to twice the window, until the
        pages span half of it (:class:`_Window`); a whole interval after the first read, so the
        second is not a back-to-back scrape of the same instant; a finite feed to its end;
        ``stop`` ends it early (Ctrl-C). ``on_cycle`` is called after each read (``bundle`` keeps
        each scrape's raw page). Returns the Timeline (``diagnose`` then evaluates once)."""
        start = self._clock()
        window, reads = _Window(window_s), 0
        keep_last = getattr(self.feed, "keep_last", None)
        if not self.feed.live and callable(keep_last):
            # The Timeline keeps the last max_len Snapshots: a recording need not decode the rest.
            keep_last(self.timeline.max_len)
        while stop is None or not stop.is_set():
            t0 = self._clock()
            cycle = self.step(evaluate=False)
            if cycle is None:
                break
            if on_cycle is not None:
                on_cycle(cycle)
            if not self.feed.live:
                continue
            sources = cycle.snapshot.sources
            if (
                not cycle.snapshot.metrics
                and not any(st.kind == "metrics" and st.status != "missing" for st in sources)
                # a process-table read that failed (timed out on a loaded host) found no
                # endpoint: that is no proof there is none, read again within the window
                and not any(st.kind == "processes" and st.status == "error" for st in sources)
            ):
                break  # no /metrics endpoint at all: nothing to take a rate of, one read tells all
            window.note(cycle.snapshot)
            reads += 1
            if reads == 1:
                start = self._clock()
            # An endpoint that was slow or failed this time may answer later in the window.
            if window.over(self._clock() - start, reads):
                break  # at least two scrapes apart in time, so counter rates exist
            wait = self._wait(t0, first=reads == 1)
            if sleep is not None:
                sleep(wait)
            elif stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
        return self.timeline

    def _wait(self, t0: float, *, first: bool) -> float:
        """Seconds to the next read of a cycle that started at ``t0``: the rest of the interval;
        a whole interval after the first read, whose scrape came at its end (after discovery),
        so the second is not a back-to-back read of the same instant."""
        if first:
            return self.interval_s
        return max(0.0, self.interval_s - (self._clock() - t0))

    def health(self) -> list[SourceHealth]:
        """Per-source health of a live feed (:class:`SourceHealth`); [] for a finite feed."""
        fn = getattr(self.feed, "health", None)
        return list(fn()) if callable(fn) else []


def error_status(kind: str, origin: str, err: BaseException) -> SourceStatus:
    """A one-line "error" SourceStatus for a failed source (first line of the message only)."""
    lines = str(err).strip().splitlines()
    return SourceStatus(kind, origin, "error", lines[0] if lines else type(err).__name__)
