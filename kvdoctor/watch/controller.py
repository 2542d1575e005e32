"""The loop behind ``kvdoctor watch``, without any UI: a worker thread running
:meth:`~kvdoctor.sampler.LiveLoop.run`, replay control (seek, speed), recording, and the
:class:`View` each cycle becomes.

Everything a View holds is computed on the worker thread (the pipeline's Report, the memory
breakdown, engine figures, sparkline series), so the UI thread only draws: a slow or dead source
delays the next View, never the screen. Findings that stop firing stay in the View as resolved
for :data:`RESOLVED_HOLD_S` seconds (snapshot time) instead of vanishing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdoctor.breakdown import EngineStats, GpuBreakdown, engine_stats, gpu_breakdown
from kvdoctor.facts import Snapshot, SourceStatus, Timeline
from kvdoctor.findings import Finding
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import Report, printable
from kvdoctor.sampler import Cycle, LiveLoop

#: seconds (snapshot clock) a finding that stopped firing stays listed as resolved.
RESOLVED_HOLD_S = 120.0
#: samples kept for sparklines (at 1 Hz: the last two minutes).
HISTORY_SAMPLES = 120
#: replay speeds offered by ``[`` / ``]``.
SPEEDS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
#: bounds of the live interval set with ``+`` / ``-``, seconds.
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.25, 60.0
#: snapshots replayed into the Timeline before a seek target, so windows have history.
SEEK_HISTORY = 300
#: live /metrics page texts kept for the ``b`` bundle (the newest; at 1 Hz two minutes)
RAW_PAGES_KEPT = 120


def finding_key(f: Finding) -> tuple[str, str, tuple[int, ...]]:
    """Identity of a finding across cycles: rule, engine and GPUs (its numbers may change)."""
    return (f.rule, f.engine or "", tuple(f.gpus))


@dataclass
class FindingRow:
    """One line of the findings panel: the finding as last seen; ``resolved_at`` is the
    snapshot time it stopped firing (None while it fires)."""

    finding: Finding
    first_seen: float
    resolved_at: float | None = None

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        """:func:`finding_key` of the finding."""
        return finding_key(self.finding)


@dataclass
class SourceRow:
    """A source in the header: its current status, and its last error (one line) with the
    snapshot time it was seen, kept after the source recovers."""

    status: SourceStatus
    last_error: str | None = None
    last_error_at: float | None = None


@dataclass
class View:
    """Everything the screen shows for one cycle (read-only once posted).

    ``now``: snapshot time (unix seconds). ``gpu_util``/``gpu_mem``: per GPU index, fractions
    0..1 oldest first over the last :data:`HISTORY_SAMPLES` snapshots. ``position``/``length``:
    replay position (0-based index of the shown snapshot) and recording length, None live."""

    index: int
    now: float
    snapshot: Snapshot
    report: Report | None
    gpus: list[GpuBreakdown] = field(default_factory=list)
    engines: list[EngineStats] = field(default_factory=list)
    findings: list[FindingRow] = field(default_factory=list)
    sources: list[SourceRow] = field(default_factory=list)
    gpu_util: dict[int, list[float]] = field(default_factory=dict)
    gpu_mem: dict[int, list[float]] = field(default_factory=dict)
    position: int | None = None
    length: int | None = None
    duration_s: float = 0.0


class Controller:
    """Runs ``LiveLoop(feed, pipeline)`` on a worker thread and posts a :class:`View` per cycle.

    ``post`` is called on the worker thread (the Textual app passes a function that hands the
    View to the UI thread with ``call_from_thread``). Control methods (pause, interval, speed,
    seek, recording) may be called from any thread.
    """

    def __init__(
        self,
        feed: Any,
        pipeline: Pipeline,
        post: Callable[[View], None],
        *,
        interval_s: float = 1.0,
        max_len: int = 3600,
        start_at: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.feed = feed
        self.pipeline = pipeline
        self.post = post
        self.clock = clock
        #: a static input (a bundle, single artifacts): one state, shown at its end, no play/seek
        self.static = is_static(feed)
        self.replay = hasattr(feed, "seek") and not feed.live and not self.static
        #: called (worker thread) when a finite input has ended, so the screen says so
        self.on_end: Callable[[], None] | None = None
        #: recorded seconds between snapshots (replay speed 1× plays at this interval)
        rec = getattr(feed, "interval_s", None) if self.replay else None
        self.base_interval_s = float(rec) if rec else interval_s
        self.speed = 1.0
        self.loop = LiveLoop(feed, pipeline, interval_s=self.base_interval_s, max_len=max_len)
        self.ended = False
        self.error: str | None = None
        self._start_at = start_at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctl = threading.Lock()
        self._wlock = threading.Lock()
        self._writer: Any = None
        self.recording_path: Path | None = None
        self._rows: dict[tuple[str, str, tuple[int, ...]], FindingRow] = {}
        self._sources: dict[tuple[str, str], SourceRow] = {}
        #: live: (unix seconds, URL, page text) of the newest scrapes, for the ``b`` bundle
        self._raw: deque[tuple[float, str, str]] = deque(maxlen=RAW_PAGES_KEPT)
        self._raw_last: dict[str, float] = {}

    # ------------------------------------------------------------------ state

    @property
    def live(self) -> bool:
        """True when the feed reads the machine now."""
        return bool(self.feed.live)

    @property
    def paused(self) -> bool:
        """True while the loop is paused (``p``, or space in replay)."""
        return self.loop.paused.is_set()

    @property
    def interval_s(self) -> float:
        """Seconds between reads now (replay: recorded interval / speed)."""
        return self.loop.interval_s

    @property
    def recording(self) -> bool:
        """True while ``r`` records what is read."""
        return self._writer is not None

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        """Start reading (a replay with ``start_at`` first seeks there; a static input is read
        to its end at once and evaluated there, as ``diagnose`` evaluates it)."""
        if self.static:
            self._show_end()
            return
        if self.replay and self._start_at:
            self.seek(self._start_at)
            return
        self._launch()

    def _launch(self) -> None:
        self._stop = threading.Event()
        self.ended = False
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name="kvdoctor-watch", daemon=True
        )
        self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        try:
            self.loop.run(self._on_cycle, stop, pace_finite=self.replay)
        except Exception as e:  # a bug in a View computation must not kill the screen silently
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not stop.is_set():
            self.ended = not self.live
            if self.ended and self.on_end is not None:
                self.on_end()

    def _halt(self, wait: bool = True) -> None:
        self._stop.set()
        t = self._thread
        if wait and t is not None and t is not threading.current_thread():
            t.join(timeout=10)
        self._thread = None

    def stop(self, *, wait: bool = True) -> None:
        """Stop the worker thread, close a recording and the feed; never raises. The UI thread
        passes ``wait=False``: the worker may be waiting on it to take a View."""
        with self._ctl:
            self._halt(wait)
        self.stop_recording()
        try:
            self.feed.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ control

    def toggle_pause(self) -> bool:
        """Pause or resume; returns True when now paused. A replay at its end starts over."""
        if self.replay and self.ended:
            self.loop.paused.clear()
            self.seek(0)
            return False
        if self.paused:
            self.loop.paused.clear()
            with self._ctl:
                # After a seek while paused no thread runs: start one.
                if self._thread is None or not self._thread.is_alive():
                    self._launch()
        else:
            self.loop.paused.set()
        return self.paused

    def change_interval(self, factor: float) -> float:
        """Multiply the interval (live) or divide the speed (replay) by ``factor``."""
        if self.replay:
            return self.change_speed(-1 if factor > 1 else 1)
        self.loop.interval_s = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, self.loop.interval_s * factor))
        return self.loop.interval_s

    def change_speed(self, step: int) -> float:
        """Next replay speed up (``step`` > 0) or down; returns the interval now."""
        i = min(range(len(SPEEDS)), key=lambda k: abs(SPEEDS[k] - self.speed))
        self.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + step))]
        self.loop.interval_s = self.base_interval_s / self.speed
        return self.loop.interval_s

    @property
    def position(self) -> int | None:
        """Replay: index of the snapshot shown last (0-based); None live."""
        if not self.replay:
            return None
        return max(0, int(self.feed.position) - 1)

    def _show_end(self) -> None:
        """Static input: evaluate at its last snapshot with every snapshot before it in the
        Timeline (what ``diagnose --bundle`` evaluates), then mark the input ended."""
        n = len(self.feed) if hasattr(self.feed, "__len__") else 0
        if n == 0 or not hasattr(self.feed, "seek"):
            self._launch()  # nothing to seek in: read it as it comes (it ends by itself)
            return
        self._seek(n - 1, history=n)

    def seek(self, index: int) -> None:
        """Replay: show snapshot ``index`` (clamped) with the Timeline rebuilt from the
        snapshots before it, then go on playing unless paused (a static input: shown there, not
        played). Blocks until done (call it off the UI thread)."""
        if self.replay:
            self._seek(index, history=SEEK_HISTORY)
        elif self.static:  # one state: shown at ``index`` with everything before it, not played
            self._seek(index, history=len(self.feed))

    def _seek(self, index: int, history: int) -> None:
        with self._ctl:
            self._halt()
            n = len(self.feed)
            if n == 0:
                return
            index = max(0, min(n - 1, index))
            # the View posted below must not say "ended" for the position it shows
            self.ended = False
            start = max(0, index - history)
            tl = Timeline(max_len=self.loop.timeline.max_len)
            self.feed.seek(start)
            for _ in range(index - start):
                snap = self.feed.next()
                if snap is not None:
                    tl.append(snap)
            self.loop.timeline = tl
            # Resolved/fired history belongs to the old position.
            self._rows.clear()
            cycle = self.loop.step()
            if cycle is not None:
                self._on_cycle(cycle)
            self.ended = self.feed.position >= n
            if not self.paused and not self.ended and not self.static:
                self._launch()
        if self.ended and self.on_end is not None:
            self.on_end()

    def seek_by(self, delta: int) -> None:
        """Replay: seek ``delta`` snapshots from the one shown."""
        pos = self.position
        if pos is not None:
            self.seek(pos + delta)

    def start_recording(self, path: Path) -> Path:
        """Write every snapshot read from now on to ``path`` (``kvdoctor.recording/1``)."""
        from kvdoctor.sources.recording import RecordingWriter

        with self._wlock:
            if self._writer is None:
                self._writer = RecordingWriter(path)
                self.recording_path = path
        return path

    def stop_recording(self) -> int:
        """Close the recording; returns the number of snapshots written (0 when none)."""
        with self._wlock:
            w, self._writer = self._writer, None
        if w is None:
            return 0
        try:
            w.close()
        except OSError:
            pass
        return int(w.count)

    # ------------------------------------------------------------------ per cycle

    def raw_metrics(self) -> list[tuple[float, str, str]]:
        """Live: the newest /metrics pages as scraped, (unix seconds, URL, text), oldest first
        (what ``kvdoctor bundle`` writes as ``metrics/<ts>.txt``); [] for files."""
        with self._wlock:
            return list(self._raw)

    def _keep_raw(self) -> None:
        for url, (ts, text) in list(getattr(self.feed, "last_raw", {}).items()):
            if self._raw_last.get(url) != ts:
                self._raw_last[url] = ts
                self._raw.append((ts, url, text))

    def _on_cycle(self, cycle: Cycle) -> None:
        with self._wlock:
            if self.live:
                self._keep_raw()
            if self._writer is not None:
                try:
                    self._writer.write(cycle.snapshot)
                except OSError as e:
                    self._writer = None
                    self.error = f"recording stopped: {e.strerror or type(e).__name__}"
        self.post(self.build_view(cycle))

    def build_view(self, cycle: Cycle) -> View:
        """The :class:`View` of one cycle (worker thread). Updates resolved-finding and
        source-error tracking."""
        snap = cycle.snapshot
        now = snap.timestamp if snap.timestamp is not None else self.clock()
        report = cycle.report
        view = View(index=cycle.index, now=now, snapshot=snap, report=report, duration_s=cycle.duration_s)
        if report is not None:
            view.gpus = gpu_breakdown(snap, report)
            view.engines = engine_stats(cycle.timeline, report, self.pipeline.window_s)
            view.findings = self._track_findings(report.findings, now)
        view.sources = self._track_sources(report.sources if report is not None else snap.sources, now)
        # what the screen shows, with control characters escaped (a metrics label or a
        # directory name holding ESC would otherwise drive the terminal)
        view.gpus, view.engines = printable(view.gpus), printable(view.engines)
        view.findings, view.sources = printable(view.findings), printable(view.sources)
        for s in cycle.timeline.snapshots[-HISTORY_SAMPLES:]:
            for g in s.gpus:
                if g.utilization_gpu is not None:
                    view.gpu_util.setdefault(g.index, []).append(g.utilization_gpu)
                if g.memory_total_bytes and g.memory_used_bytes is not None:
                    view.gpu_mem.setdefault(g.index, []).append(g.memory_used_bytes / g.memory_total_bytes)
        if self.replay:
            view.position = max(0, int(self.feed.position) - 1)
            view.length = len(self.feed)
        return view

    def _track_findings(self, findings: list[Finding], now: float) -> list[FindingRow]:
        active: list[FindingRow] = []
        seen = set()
        for f in findings:
            key = finding_key(f)
            seen.add(key)
            row = self._rows.get(key)
            if row is None or row.resolved_at is not None:
                row = FindingRow(f, first_seen=now if row is None else row.first_seen)
                self._rows[key] = row
            row.finding = f
            active.append(row)
        resolved = []
        for key, row in list(self._rows.items()):
            if key in seen:
                continue
            if row.resolved_at is None:
                row.resolved_at = now
            if now - row.resolved_at > RESOLVED_HOLD_S or now < row.resolved_at:
                del self._rows[key]
                continue
            resolved.append(row)
        resolved.sort(key=lambda r: -(r.resolved_at or 0))
        return active + resolved

    def _track_sources(self, sources: list[SourceStatus], now: float) -> list[SourceRow]:
        rows = []
        for s in sources:
            key = (s.kind, s.origin)
            row = self._sources.get(key)
            if row is None:
                row = self._sources[key] = SourceRow(s)
            row.status = s
            if s.status == "error":
                row.last_error, row.last_error_at = s.detail or "error", now
            rows.append(SourceRow(row.status, row.last_error, row.last_error_at))
        return rows


def is_static(feed: Any) -> bool:
    """True for a finite input that is one state rather than a recording to play: a bundle or
    single artifacts (``kvdoctor.feeds.TimelineFeed``)."""
    from kvdoctor.feeds import TimelineFeed

    return isinstance(feed, TimelineFeed)


def write_support_bundle(
    timeline: Timeline,
    dest_dir: Path,
    source: str = "watch",
    *,
    opts: Any = None,
    raw_metrics: list[tuple[float, str, str]] | None = None,
    live: bool = False,
) -> tuple[Path | None, str]:
    """Write a support bundle of what watch has read into ``dest_dir`` as
    ``kvdoctor-bundle-<time>.tar.gz``, as ``kvdoctor bundle`` writes it from the same inputs
    (``kvdoctor.bundle_writer.write_bundle``): ``opts``' files copied (the log bounded and
    redacted, not re-rendered), ``raw_metrics`` pages as scraped, the Timeline's facts for the
    rest, on a ``live`` host the tools' output; spec/bundle.md layout, manifest.json.
    Returns (path, one-line message); (None, why) on failure."""
    from kvdoctor import bundle_writer

    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = dest_dir / f"kvdoctor-bundle-{stamp}.tar.gz"
    try:
        manifest = bundle_writer.write_bundle(
            timeline, path, source=source, opts=opts, raw_metrics=raw_metrics, live=live
        )
    except OSError as e:
        return None, f"bundle not written: {e.strerror or type(e).__name__}"
    n = sum(1 for e in manifest.entries if e.status == "ok")
    return path, f"bundle written: {path} ({n} files)"
