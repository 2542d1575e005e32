"""The watch controller: the LiveLoop on a worker thread, replay seek/speed, resolved findings,
source errors kept after recovery, recording."""

from __future__ import annotations

import threading
import time

from kvdoctor.facts import Snapshot, SourceStatus
from kvdoctor.findings import Finding
from kvdoctor.sampler import TimelineFeed
from kvdoctor.sources.recording import open_recording
from kvdoctor.watch.controller import RESOLVED_HOLD_S, Controller, View


def _collect() -> tuple[list[View], threading.Event, object]:
    views: list[View] = []
    got = threading.Event()

    def post(v: View) -> None:
        views.append(v)
        got.set()

    return views, got, post


def _wait(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "hang guard"
        time.sleep(0.02)


def test_replay_seek_rebuilds_history_and_shows_that_snapshot(demo_feed, pipeline):
    views, _, post = _collect()
    c = Controller(demo_feed, pipeline, post)
    c.loop.paused.set()
    c.seek(150)
    assert views[-1].position == 150 and views[-1].length == 240
    assert len(c.loop.timeline.snapshots) == 151  # 150 before it + itself
    rules = {r.finding.rule for r in views[-1].findings}
    assert "preemption-storm" in rules and "gpu-shared-with-foreign-process" in rules
    c.seek(10)
    assert views[-1].position == 10
    assert "preemption-storm" not in {r.finding.rule for r in views[-1].findings}
    c.seek(10_000)  # clamped
    assert views[-1].position == 239
    c.stop()


def test_replay_plays_at_speed_and_pauses(demo_feed, pipeline):
    views, _, post = _collect()
    c = Controller(demo_feed, pipeline, post)
    assert c.base_interval_s == 1.0  # recorded at 1 Hz
    for _ in range(6):
        c.change_speed(1)
    assert c.speed == 16.0 and abs(c.interval_s - 1 / 16) < 1e-9
    c.start()
    _wait(lambda: len(views) >= 4)
    c.toggle_pause()
    assert c.paused
    n = len(views)
    time.sleep(0.3)
    assert len(views) <= n + 1  # at most the cycle in flight
    assert [v.position for v in views[:4]] == [0, 1, 2, 3]
    c.change_speed(-10)
    assert c.speed == 0.25
    c.stop()


def test_live_interval_bounds(pipeline):
    class Live:
        live = True
        label = "live"

        def next(self):
            return Snapshot(timestamp=time.time())

        def close(self):
            pass

    c = Controller(Live(), pipeline, lambda v: None, interval_s=1.0)
    assert c.change_interval(2) == 2.0
    for _ in range(10):
        c.change_interval(2)
    assert c.interval_s == 60.0
    for _ in range(20):
        c.change_interval(0.5)
    assert c.interval_s == 0.25


def _finding(rule: str) -> Finding:
    return Finding(rule=rule, severity="warning", family="L", title=rule, summary="s")


def test_findings_resolve_then_drop_after_hold(pipeline):
    c = Controller(TimelineFeed([]), pipeline, lambda v: None)
    rows = c._track_findings([_finding("a"), _finding("b")], now=100.0)
    assert [r.finding.rule for r in rows] == ["a", "b"] and all(r.resolved_at is None for r in rows)
    rows = c._track_findings([_finding("b")], now=110.0)
    assert [(r.finding.rule, r.resolved_at) for r in rows] == [("b", None), ("a", 110.0)]
    rows = c._track_findings([_finding("b")], now=110.0 + RESOLVED_HOLD_S - 1)
    assert [r.finding.rule for r in rows] == ["b", "a"]
    rows = c._track_findings([_finding("b")], now=110.0 + RESOLVED_HOLD_S + 1)
    assert [r.finding.rule for r in rows] == ["b"]
    # fires again: active again, first seen kept while it was still listed
    c._track_findings([_finding("b")], now=300.0)
    rows = c._track_findings([_finding("b"), _finding("a")], now=301.0)
    assert all(r.resolved_at is None for r in rows)


def test_demo_preemption_storm_resolves_as_load_drops(demo_feed, pipeline):
    views, _, post = _collect()
    c = Controller(demo_feed, pipeline, post)
    c.loop.paused.set()
    c.seek(160)
    storm = [r for r in views[-1].findings if r.finding.rule == "preemption-storm"]
    assert storm and storm[0].resolved_at is None
    c.loop.paused.clear()
    for _ in range(6):
        c.change_speed(1)
    c._launch()
    _wait(lambda: views[-1].position is not None and views[-1].position >= 239, timeout=60)
    storm = [r for r in views[-1].findings if r.finding.rule == "preemption-storm"]
    assert storm and storm[0].resolved_at is not None  # shown as resolved, not dropped
    _wait(lambda: c.ended)
    c.stop()


def test_source_error_kept_after_recovery(pipeline):
    c = Controller(TimelineFeed([]), pipeline, lambda v: None)
    bad = SourceStatus("metrics", "http://x:1/metrics", "error", "connection refused")
    ok = SourceStatus("metrics", "http://x:1/metrics", "ok", "engine 0")
    [row] = c._track_sources([bad], now=5.0)
    assert row.last_error == "connection refused"
    [row] = c._track_sources([ok], now=9.0)
    assert row.status.status == "ok" and row.last_error == "connection refused" and row.last_error_at == 5.0


def test_recording_writes_what_is_read(demo_feed, pipeline, tmp_path):
    views, _, post = _collect()
    c = Controller(demo_feed, pipeline, post)
    path = tmp_path / "rec.jsonl.gz"
    c.start_recording(path)
    assert c.recording
    for _ in range(5):
        c.change_speed(1)
    c.start()
    _wait(lambda: len(views) >= 5)
    c.stop()
    assert not c.recording  # stop() closed the recording
    got = open_recording(path)
    assert len(got) >= 5
    assert got.next().timestamp == views[0].snapshot.timestamp


def test_a_bundle_read_for_watch_has_its_latencies(pipeline):
    """watch parses the latency histograms of a bundle's scrapes (diagnose does not need them):
    TTFT and inter-token latency p50/p99 per engine; the bundle is one state, shown at its end."""
    from pathlib import Path

    from kvdoctor.inputs import InputOptions, open_feed

    bundle = Path(__file__).parents[1] / "data" / "bundles" / "healthy-idle-gmu092"
    got = {}
    for flag in (False, True):
        views, _, post = _collect()
        c = Controller(open_feed(InputOptions(bundle=bundle, display_histograms=flag)), pipeline, post)
        c.start()
        assert c.static and c.ended and len(views) == 1
        e = views[-1].engines[0]
        got[flag] = (e.ttft_p50, e.ttft_p99, e.itl_p50, e.itl_p99)
    assert got[False] == (None, None, None, None)
    ttft50, ttft99, itl50, itl99 = got[True]
    assert 0 < ttft50 <= ttft99 and 0 < itl50 <= itl99
