"""The sidecar's /metrics text is prometheus-client's ``generate_latest`` of its registry, made
once per cycle's view, and a cycle's view is worked out only when a scrape reads it."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.pipeline import Pipeline
from kvdoctor.sampler import Cycle
from kvdoctor.sidecar import server as server_mod
from kvdoctor.sidecar.exposition import SidecarCollector, SourceHealth, View
from kvdoctor.sidecar.server import Sidecar
from tests.sidecar.conftest import DATA, FakeVllm, live_feed

B05 = DATA / "cases" / "b05-foreign-process-blocks-startup"


@contextmanager
def _stepped(cycles: int = 1) -> Iterator[tuple[Sidecar, Cycle]]:
    """A sidecar over B05 that read one cycle and handled it ``cycles`` times (no scrape yet)."""
    sc = Sidecar(open_feed(InputOptions(bundle=B05)), Pipeline.load(), interval_s=1.0, out=io.StringIO())
    try:
        cycle = sc.loop.step()
        assert cycle is not None
        for _ in range(cycles):
            sc.on_cycle(cycle)
        yield sc, cycle
    finally:
        sc.feed.close()


def _strip_process(text: str) -> str:
    # the process collector's values move between two reads (CPU seconds, open fds)
    return re.sub(r"^(process_\S+) .*$", r"\1", text, flags=re.M)


def test_the_metrics_page_is_the_registry_s() -> None:
    with _stepped() as (sc, _cycle):
        page = sc.metrics_page().decode()
        assert _strip_process(page) == _strip_process(generate_latest(sc.registry).decode())
        assert "kvdoctor_gpu_memory_bytes{" in page and "process_cpu_seconds_total" in page


def test_a_cycle_s_view_is_made_by_the_first_scrape_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = server_mod.gpu_breakdown
    monkeypatch.setattr(server_mod, "gpu_breakdown", lambda s, r: calls.append(1) or real(s, r))
    with _stepped(3) as (sc, cycle):
        assert calls == []  # three cycles, no scrape
        first = sc.metrics_page()
        assert calls == [1]
        assert sc.collector.text() is sc.collector.text()  # kept for the view
        assert _strip_process(sc.metrics_page().decode()) == _strip_process(first.decode()) and calls == [1]
        sc.on_cycle(cycle)
        sc.metrics_page()
        assert calls == [1, 1]


def test_a_view_keeps_the_source_health_of_its_cycle() -> None:
    with _stepped() as (sc, _cycle):
        errors_then = {k: h.errors for k, h in sc.health.sources.items()}
        for h in sc.health.sources.values():  # the tracker updates in place next cycle
            h.errors += 5
            h.up = not h.up
        view = sc.collector.view()
        assert {k: h.errors for k, h in view.sources.items()} == errors_then


def test_a_published_function_is_called_once() -> None:
    made: list[int] = []
    collector = SidecarCollector("1.0")

    def view() -> View:
        made.append(1)
        return View(sources={("metrics", "http://x/metrics"): SourceHealth(up=True, errors=2)}, evaluations=3)

    collector.publish(view)
    assert made == []
    text = collector.text()
    assert (
        made == [1] and 'kvdoctor_source_errors_total{origin="http://x/metrics",source="metrics"} 2.0' in text
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert generate_latest(registry).decode() == text and made == [1]


def test_the_text_over_a_live_storm_is_generate_latest_s(fake_vllm: FakeVllm) -> None:
    feed = live_feed(fake_vllm.url)
    sc = Sidecar(feed, Pipeline.load(), interval_s=1.0, out=io.StringIO(), max_len=50)
    only = CollectorRegistry(auto_describe=False)
    only.register(sc.collector)
    try:
        for _ in range(12):
            cycle = sc.loop.step()
            assert cycle is not None
            sc.on_cycle(cycle)
            assert sc.collector.text() == generate_latest(only).decode()
            time.sleep(0.1)  # a rate needs scrapes over 1 s (timeline.MIN_RATE_SPAN_S)
        assert "kvdoctor_engine_preemptions_per_second{" in sc.collector.text()
    finally:
        feed.close()


def test_a_source_no_cycle_reports_is_dropped_after_forget_s() -> None:
    """The /metrics URL of an engine that ended stops being a series (vanished process); a
    source read now and then (within forget_s) stays."""
    from kvdoctor.facts import SourceStatus
    from kvdoctor.sidecar.exposition import SourceHealthTracker

    t = SourceHealthTracker(forget_s=600.0)
    gone = SourceStatus("metrics", "http://127.0.0.1:8001/metrics", "ok", "")
    steady = SourceStatus("nvml", "NVML", "ok", "")
    t.update([gone, steady], now=0.0)
    t.update([steady], now=300.0)
    assert ("metrics", "http://127.0.0.1:8001/metrics") in t.sources  # near miss: 300 s < 600 s
    t.update([steady], now=601.0)
    assert list(t.sources) == [("nvml", "NVML")]
