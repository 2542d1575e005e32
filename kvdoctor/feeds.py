"""Finite feeds without the live machinery: :class:`TimelineFeed` and :func:`read_to_end`.

A bundle, single artifacts or a recording is a finite feed (``kvdoctor.sampler.SnapshotFeed``
with ``live`` False). ``diagnose --bundle`` reads one to its end and evaluates once; that path
needs none of :mod:`kvdoctor.sampler`'s threads, back-off and live sources, so these two live
here and a cold start does not import them (issue 8, class 10). ``kvdoctor.sampler`` re-exports
:class:`TimelineFeed`; :class:`~kvdoctor.sampler.LiveLoop` reads a finite feed the same way.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.facts import Snapshot, Timeline

__all__ = ["MAX_LEN", "TimelineFeed", "read_to_end"]

#: Snapshots a Timeline keeps (the oldest dropped): ``LiveLoop``'s default ``max_len``.
MAX_LEN = 3600


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

    def seek(self, index: int) -> None:
        """Move to Snapshot ``index`` (clamped to 0..len)."""
        self._pos = max(0, min(index, len(self._snapshots)))

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None at the end."""
        if self._pos >= len(self._snapshots):
            return None
        snap = self._snapshots[self._pos]
        self._pos += 1
        return snap

    def close(self) -> None:
        """Nothing to release."""


def read_to_end(feed: Any, *, max_len: int = MAX_LEN) -> Timeline:
    """A finite feed (``feed.live`` False: a :class:`TimelineFeed`, a recording) read to its end
    into a Timeline of at most ``max_len`` Snapshots (the newest kept), as
    :meth:`kvdoctor.sampler.LiveLoop.collect` reads one. A recording's ``keep_last(n)`` passes
    over all but the last ``n`` Snapshots without decoding them. Raises ValueError for a live
    feed (it never ends: read it through ``LiveLoop``)."""
    if feed.live:
        raise ValueError("read_to_end reads a finite feed; a live feed goes through LiveLoop")
    timeline = Timeline(max_len=max_len)
    keep_last = getattr(feed, "keep_last", None)
    if callable(keep_last):
        keep_last(max_len)
    while (snap := feed.next()) is not None:
        timeline.append(snap)
    return timeline
