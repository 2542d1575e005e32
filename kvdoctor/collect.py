"""Compatibility names for the live sampler, which now lives in :mod:`kvdoctor.sampler`.

``LiveOptions`` and ``Sampler`` are the sampler's own; :func:`collect_live` is the short window
``diagnose`` reads, run through :class:`~kvdoctor.sampler.LiveLoop` like every face.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvdoctor.facts import EngineConfig, Snapshot, Timeline
from kvdoctor.sampler import LiveFeed, LiveLoop, LiveOptions, Sampler

__all__ = ["LiveOptions", "Sampler", "collect_live"]


def collect_live(
    opts: LiveOptions, *, sleep: Callable[[float], None] = time.sleep
) -> tuple[Timeline, list[EngineConfig]]:
    """Sample for ``opts.window_s`` seconds at ``opts.interval_s`` (at least one sample; two when a
    /metrics endpoint answers, so counter rates exist). Returns the timeline and the latest
    snapshot's engine configs (``Snapshot.configs``)."""
    feed = LiveFeed(opts)
    try:
        loop = LiveLoop(feed, None, interval_s=opts.interval_s)
        timeline = loop.collect(opts.window_s, sleep=sleep)
    finally:
        feed.close()
    latest = timeline.latest or Snapshot()
    return timeline, list(latest.configs)
