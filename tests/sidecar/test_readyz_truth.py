"""/readyz tells the truth (issue 27 item 4): ready while an engine source was read
successfully within a stated age; one failed read does not flip it, a dead endpoint, a deleted
log or a stopped cycle loop does."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvdoctor.facts import Snapshot, SourceStatus, Timeline
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import Report
from kvdoctor.sampler import Cycle, LogSource
from kvdoctor.sidecar.server import READY_MIN_AGE_S, Sidecar, ready_max_age_s
from tests.sidecar.conftest import FakeVllm, get, live_feed, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _cycle(i: int, *statuses: SourceStatus) -> Cycle:
    snap = Snapshot(timestamp=float(i), sources=list(statuses))
    timeline = Timeline()
    timeline.append(snap)
    return Cycle(i, snap, timeline, Report(generated_at="x", health="ok", sources=list(statuses)), 0.01)


OK = SourceStatus("metrics", "http://127.0.0.1:8000/metrics", "ok", "1 engine(s)")
DOWN = SourceStatus("metrics", "http://127.0.0.1:8000/metrics", "error", "connection refused")
NVML = SourceStatus("nvml", "NVML", "ok", "1 GPU(s)")


def test_ready_age_is_stated() -> None:
    assert ready_max_age_s(1.0) == READY_MIN_AGE_S == 10.0
    assert ready_max_age_s(5.0) == 15.0


def test_one_failed_read_does_not_flip_ready_a_dead_endpoint_does() -> None:
    clock = Clock()
    sc = Sidecar(live_feed("http://127.0.0.1:1/metrics"), Pipeline.load(), interval_s=1.0, clock=clock)
    assert not sc.ready and "no cycle yet" in sc.ready_reason
    sc.on_cycle(_cycle(0, OK, NVML))
    assert sc.ready and "engine source read 0.0s ago" in sc.ready_reason
    clock.t += 1
    sc.on_cycle(_cycle(1, DOWN, NVML))  # one slow or failed read: still ready, and says why
    assert sc.ready and "connection refused" in sc.ready_reason
    clock.t += 1
    sc.on_cycle(_cycle(2, OK, NVML))
    assert sc.ready
    for i in range(3, 15):  # the endpoint stays down past the age
        clock.t += 1
        sc.on_cycle(_cycle(i, DOWN, NVML))
    assert not sc.ready and "no engine source read for 12s" in sc.ready_reason


def test_a_stopped_cycle_loop_is_not_ready() -> None:
    # a cycle that never comes back (a bug in a stage, a hung loop): ready lapses by itself
    clock = Clock()
    sc = Sidecar(live_feed("http://127.0.0.1:1/metrics"), Pipeline.load(), interval_s=1.0, clock=clock)
    sc.on_cycle(_cycle(0, OK))
    clock.t += 11
    assert not sc.ready


def test_nvml_alone_is_not_ready() -> None:
    clock = Clock()
    sc = Sidecar(live_feed("http://127.0.0.1:1/metrics"), Pipeline.load(), interval_s=1.0, clock=clock)
    sc.on_cycle(_cycle(0, NVML, DOWN))
    assert not sc.ready and "connection refused" in sc.ready_reason


def test_a_deleted_log_is_not_read(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.33.0\n")
    src = LogSource(log)
    assert src.read().status == "ok"
    log.unlink()
    r = src.read()
    assert r.status == "missing" and "gone" in r.detail and src.last_log is not None
    log.write_text("INFO 01-01 00:00:01 [api_server.py:1] vLLM API server version 0.33.0\n")
    assert src.read().status == "ok"  # a new file at the path is followed again


def test_live_sidecar_recovers_and_lapses(
    fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar], monkeypatch: object
) -> None:
    import kvdoctor.sidecar.server as server

    monkeypatch.setattr(server, "READY_MIN_AGE_S", 1.0)  # type: ignore[attr-defined]
    sc = start_sidecar(live_feed(fake_vllm.url, timeout_s=0.5), interval_s=0.1)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: get(base + "/readyz").status_code == 200, 20)
    fake_vllm.mode = "500"
    t0 = time.monotonic()
    wait_for(lambda: get(base + "/readyz").status_code == 503, 20)
    assert time.monotonic() - t0 >= 0.5  # not on the first failed read
    assert "HTTP 500" in get(base + "/readyz").text
    fake_vllm.mode = "ok"
    wait_for(lambda: get(base + "/readyz").status_code == 200, 30)


def test_an_oversized_metrics_body_is_released_at_once(fake_vllm: FakeVllm) -> None:
    # each gzip bomb once held its 16 MiB body (in the error's traceback) until a rare
    # collection: 35 -> 383 MiB after five; now nothing of a failed read stays
    import gc
    import tracemalloc

    from kvdoctor.sampler import LiveFeed, LiveOptions

    fake_vllm.mode = "gzipbomb"
    fake_vllm.bomb()
    feed = LiveFeed(
        LiveOptions(metrics_urls=[fake_vllm.url], use_nvml=False, use_processes=False, timeout_s=5.0)
    )
    old = gc.get_threshold()
    gc.set_threshold(50_000, *old[1:])  # the CLI's threshold: collections are rare
    tracemalloc.start()
    try:
        for _ in range(3):
            snap = feed.next()
            assert "larger than 16 MiB" in snap.sources[0].detail
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        gc.set_threshold(*old)
        feed.close()
    assert held < 8 * 1024 * 1024, held
