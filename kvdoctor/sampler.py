"""The one live loop every face runs: feeds of Snapshots, a bounded Timeline, the pipeline.

A *feed* is where Snapshots come from (:class:`SnapshotFeed`): the live machine
(:class:`LiveFeed`: NVML, psutil, /metrics, the log), a bundle or single artifacts
(:class:`TimelineFeed`, finite), or a recording (``kvdoctor.sources.recording``, finite, seekable).
:class:`LiveLoop` reads a feed at an interval into a bounded :class:`~kvdoctor.facts.Timeline`
and evaluates the :class:`~kvdoctor.pipeline.Pipeline` after each read; ``diagnose`` collects a
short window (:meth:`LiveLoop.collect`), ``watch`` and ``sidecar`` keep :meth:`LiveLoop.run`
going on a thread of their own, ``record`` writes what it reads. No face writes its own loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvdoctor.facts import Snapshot, SourceStatus, Timeline

if TYPE_CHECKING:
    from kvdoctor.collect import LiveOptions
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.report import Report


class SnapshotFeed(Protocol):
    """A source of Snapshots, oldest first.

    ``live``: True when :meth:`next` reads the machine now (then it never returns None);
    False for a finite feed (bundle, artifacts, recording), whose :meth:`next` returns None once
    exhausted. :meth:`next` never raises for a source failure: that becomes a
    :class:`~kvdoctor.facts.SourceStatus` in the Snapshot. ``label`` names the input for headers
    ("live", "bundle b.tar.gz", "recording r.jsonl.gz").
    """

    live: bool
    label: str

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None when a finite feed is exhausted."""
        ...

    def close(self) -> None:
        """Release what the feed holds (NVML handle, open files); never raises."""
        ...


class TimelineFeed:
    """A finite feed over Snapshots already read (a bundle, single artifacts, a Timeline)."""

    live = False

    def __init__(self, snapshots: list[Snapshot], label: str = "") -> None:
        self._snapshots = list(snapshots)
        self._pos = 0
        self.label = label

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def position(self) -> int:
        """Index of the Snapshot :meth:`next` returns next (0-based)."""
        return self._pos

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None at the end."""
        if self._pos >= len(self._snapshots):
            return None
        snap = self._snapshots[self._pos]
        self._pos += 1
        return snap

    def close(self) -> None:
        """Nothing to release."""


class LiveFeed:
    """The live machine: each :meth:`next` reads every live source once (``kvdoctor.collect``
    Sampler: NVML, psutil process table, /metrics over HTTP, the log followed as it grows) and
    attaches the engine configs parsed from the API servers' command lines (redacted)."""

    live = True

    def __init__(self, opts: LiveOptions) -> None:
        from kvdoctor.collect import Sampler

        self.opts = opts
        self._sampler = Sampler(opts)
        self.label = "live"

    def next(self) -> Snapshot:
        """Read every live source once; never raises for a source failure."""
        snap = self._sampler.sample()
        snap.configs = self._sampler.configs(snap)
        return snap

    def close(self) -> None:
        """Release NVML; never raises."""
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
    ) -> None:
        """Loop until ``stop`` is set, ``max_cycles`` or ``duration_s`` is reached, or a finite
        feed ends; call ``on_cycle`` after each read. A finite feed is read as fast as it goes
        unless ``pace_finite`` (replay at ``interval_s``). Exceptions from ``on_cycle``
        propagate (they are the face's bugs, not a source's)."""
        start = self._clock()
        n = 0
        while not stop.is_set():
            if self.paused.is_set():
                stop.wait(0.05)
                continue
            t0 = self._clock()
            cycle = self.step()
            if cycle is None:
                return
            on_cycle(cycle)
            n += 1
            if max_cycles is not None and n >= max_cycles:
                return
            if duration_s is not None and self._clock() - start >= duration_s:
                return
            if self.feed.live or pace_finite:
                stop.wait(max(0.0, self.interval_s - (self._clock() - t0)))

    def collect(self, window_s: float, *, sleep: Callable[[float], None] = time.sleep) -> Timeline:
        """Read without evaluating: a live feed for ``window_s`` seconds at ``interval_s`` (one
        read only when no /metrics answered, since rates need two scrapes), a finite feed to
        its end. Returns the Timeline (``diagnose`` then evaluates once)."""
        start = self._clock()
        while True:
            cycle = self.step(evaluate=False)
            if cycle is None or not self.feed.live:
                if cycle is None:
                    break
                continue
            if self._clock() - start >= window_s or not cycle.snapshot.metrics:
                break
            sleep(self.interval_s)
        return self.timeline


def error_status(kind: str, origin: str, err: BaseException) -> SourceStatus:
    """A one-line "error" SourceStatus for a failed source (first line of the message only)."""
    lines = str(err).strip().splitlines()
    return SourceStatus(kind, origin, "error", lines[0] if lines else type(err).__name__)
