"""The live loop's sources: concurrent reads with their own timeout, backoff with jitter,
recovery, re-discovery of engines, per-source health."""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.facts import Gpu, GpuProcess, HostProcess, SourceError, Timeline
from kvdoctor.sampler import (
    LiveFeed,
    LiveLoop,
    LiveOptions,
    LogSource,
    MetricsSource,
    NvmlSource,
    Reading,
    Sampler,
)
from tests.conftest import FakeMetricsServer

CASE = Path(__file__).parent / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"


class FakeGpus:
    kind, origin, timeout_s = "nvml", "NVML", 1.0

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> Reading:
        self.reads += 1
        return Reading({"gpus": [Gpu(index=0, memory_used_bytes=2**30)]}, "1 GPU(s)")

    def close(self) -> None:
        pass


class Flaky:
    """Fails while ``failing`` is set; counts attempts."""

    kind, origin, timeout_s = "log", "flaky.log", 1.0

    def __init__(self) -> None:
        self.failing = True
        self.attempts = 0

    def read(self) -> Reading:
        self.attempts += 1
        if self.failing:
            raise SourceError("flaky.log: cannot read log: Permission denied")
        return Reading({}, "ok now")

    def close(self) -> None:
        pass


def _opts(**kw: object) -> LiveOptions:
    base: dict[str, object] = {"use_nvml": False, "use_processes": False, "interval_s": 0.01}
    base.update(kw)
    return LiveOptions(**base)  # type: ignore[arg-type]


def test_a_slow_metrics_endpoint_never_delays_the_gpu_reading(fake_metrics_server: FakeMetricsServer) -> None:
    fake_metrics_server.delay_s = 3.0
    gpus = FakeGpus()
    sampler = Sampler(_opts(), sources=[gpus, MetricsSource(fake_metrics_server.url, timeout_s=0.3)])
    try:
        t0 = time.monotonic()
        snap = sampler.sample()
        took = time.monotonic() - t0
        assert took < 2.0  # hang guard: bounded by the metrics timeout, not the 3 s stall
        by_kind = {s.kind: s for s in snap.sources}
        assert by_kind["nvml"].status == "ok" and snap.gpus[0].memory_used_bytes == 2**30
        # the sampler's deadline ("0.3s") or the scrape's own ("0.3 s"), whichever fires first
        assert by_kind["metrics"].status == "error"
        assert re.search(r"timed out after 0\.3 ?s", by_kind["metrics"].detail)
        # The hung read is not started again behind itself; the GPU read goes on.
        snap = sampler.sample()
        assert gpus.reads == 2 and {s.kind: s.status for s in snap.sources}["metrics"] == "error"
        health = {h.kind: h for h in sampler.health()}
        assert health["metrics"].up is False and health["metrics"].errors_total == 2
        assert health["nvml"].up is True and health["nvml"].last_success_ts is not None
    finally:
        sampler.close()


def test_a_failing_source_backs_off_with_jitter_and_recovers() -> None:
    flaky = Flaky()
    clock = [0.0]
    sampler = Sampler(
        _opts(interval_s=1.0, backoff_max_s=8.0),
        sources=[flaky],
        rng=random.Random(1),
        clock=lambda: clock[0],
    )
    try:
        attempts_at: list[float] = []
        for t in range(40):
            clock[0] = float(t)
            before = flaky.attempts
            snap = sampler.sample()
            if flaky.attempts > before:
                attempts_at.append(clock[0])
            assert snap.sources[0].status == "error"
        gaps = [b - a for a, b in zip(attempts_at, attempts_at[1:], strict=False)]
        assert gaps[0] == 1.0  # the first failure retries on the next read
        assert max(gaps) <= 8.0 + 1 and gaps[-1] >= 4.0  # doubling, capped at backoff_max_s
        assert len(set(gaps[2:])) > 1 or len(gaps) < 4  # jittered, not a fixed period
        h = sampler.health()[0]
        assert h.consecutive_errors == len(attempts_at) and "Permission denied" in (h.last_error or "")
        flaky.failing = False
        for t in range(40, 60):
            clock[0] = float(t)
            snap = sampler.sample()
            if snap.sources[0].status == "ok":
                break
        assert snap.sources[0].status == "ok" and snap.sources[0].detail == "ok now"
        h = sampler.health()[0]
        assert h.up is True and h.last_error is None and h.consecutive_errors == 0
    finally:
        sampler.close()


def test_nvml_that_fails_is_initialised_afresh_and_comes_back() -> None:
    calls = {"n": 0}

    class Reader:
        def read(self) -> list[Gpu]:
            return [Gpu(index=0)]

        def close(self) -> None:
            pass

    def factory() -> Reader:
        calls["n"] += 1
        if calls["n"] == 1:
            raise SourceError("NVML unavailable: Driver Not Loaded")
        return Reader()

    src = NvmlSource(factory=factory)
    with pytest.raises(SourceError):
        src.read()
    got = src.read()
    assert got.values["gpus"][0].timestamp is not None and calls["n"] == 2


def test_nvml_without_a_driver_is_said_once_and_not_retried() -> None:
    """No libnvidia-ml on the host (SourceUnavailable): "missing" with why, and NVML is not
    initialised again on later reads; a driver that fails (Driver Not Loaded) is retried."""
    from kvdoctor.facts import SourceUnavailable

    calls = {"n": 0}

    def factory() -> Any:
        calls["n"] += 1
        raise SourceUnavailable("NVML unavailable: NVML Shared Library Not Found")

    sampler = Sampler(LiveOptions(interval_s=0.01), sources=[NvmlSource(factory=factory)])
    try:
        for _ in range(5):
            snap = sampler.sample()
            [st] = snap.sources
            assert st.status == "missing" and st.detail.startswith("NVML unavailable: NVML Shared Library")
        assert calls["n"] == 1
    finally:
        sampler.close()


def test_unchanged_gpu_processes_and_reasons_are_shared_between_readings() -> None:
    used = {"b": 70 * 2**30}

    class Reader:
        def read(self) -> list[Gpu]:
            return [
                Gpu(
                    index=i,
                    uuid=f"GPU-{i}",
                    utilization_gpu=0.5,
                    clock_event_reasons=["sw_power_cap"] if i else [],
                    processes=[GpuProcess(pid=100 + i, name="VLLM::Worker", used_bytes=used["b"])],
                )
                for i in range(2)
            ]

        def close(self) -> None:
            pass

    src = NvmlSource(factory=Reader)
    a, b = src.read().values["gpus"], src.read().values["gpus"]
    for ga, gb in zip(a, b, strict=True):
        assert ga is not gb and gb.timestamp is not None
        assert gb.processes is ga.processes and gb.clock_event_reasons is ga.clock_event_reasons
    used["b"] += 2**30  # a process grew: the new reading carries the new value
    c = src.read().values["gpus"]
    assert all(gc.processes is not gb.processes for gc, gb in zip(c, b, strict=True))
    assert [g.processes[0].used_bytes for g in c] == [71 * 2**30] * 2
    assert [g.processes[0].used_bytes for g in b] == [70 * 2**30] * 2  # earlier facts unchanged
    assert c[1].clock_event_reasons is b[1].clock_event_reasons


def test_engines_are_discovered_as_they_start_and_stop(
    fake_metrics_server: FakeMetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(fake_metrics_server.url.rsplit(":", 1)[1].split("/")[0])
    procs: list[HostProcess] = []
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: list(procs))
    sampler = Sampler(_opts(use_processes=True))
    try:
        snap = sampler.sample()
        assert {s.kind: s.status for s in snap.sources}["metrics"] == "missing"
        procs.append(
            HostProcess(
                pid=4242,
                name="vllm",
                cmdline=["vllm", "serve", "m", "--port", str(port)],
                listen_ports=[port],
                vllm_role="api_server",
            )
        )
        snap = sampler.sample()
        ok = [s for s in snap.sources if s.kind == "metrics" and s.status == "ok"]
        assert [s.origin for s in ok] == [fake_metrics_server.url] and snap.metrics
        assert sampler.configs(snap)[0].model == "m"
        (src,) = [st.source for st in sampler._states.values() if st.source.kind == "metrics"]
        assert src._client is not None  # type: ignore[attr-defined]  # its kept-alive connection
        procs.clear()
        snap = sampler.sample()
        assert {s.kind: s.status for s in snap.sources}["metrics"] == "missing" and not snap.metrics
        assert all(h.kind != "metrics" for h in sampler.health())
        assert src._client is None  # type: ignore[attr-defined]  # closed with its engine
    finally:
        sampler.close()


def test_a_log_that_appears_later_is_followed_and_kept_while_unreadable(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    src = LogSource(log)
    early = src.read()
    assert early.status == "missing" and "not created yet" in early.detail and early.values == {}
    log.write_text((CASE / "vllm.log").read_text())
    first = src.read().values["log"]
    assert first.vllm_version == "0.10.0"
    again = src.read().values["log"]
    assert again is first  # unchanged: the same fact, not a copy
    with log.open("a") as fh:
        fh.write("INFO 07-29 10:20:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s\n")
    grown = src.read().values["log"]
    assert grown is not first and grown.line_count == first.line_count + 1
    assert first.line_count == len((CASE / "vllm.log").read_text().splitlines())  # never changed


def test_sampler_waits_for_a_log_without_backoff_then_follows_it_across_rotation(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "vllm.log"
    sampler = Sampler(_opts(log_path=log, use_nvml=False, use_processes=False))
    try:
        for _ in range(3):  # not yet: "missing" every read, never an error or a backoff
            snap = sampler.sample()
            (st,) = [s for s in snap.sources if s.kind == "log"]
            assert st.status == "missing" and "not created yet" in st.detail and snap.log is None
        (h,) = [h for h in sampler.health() if h.kind == "log"]
        assert h.errors_total == 0 and h.next_attempt_ts is None
        log.parent.mkdir()
        log.write_text((CASE / "vllm.log").read_text())
        snap = sampler.sample()  # the next read after it appears
        assert snap.log is not None and snap.log.vllm_version == "0.10.0"
        first_lines = snap.log.line_count
        log.rename(log.with_suffix(".log.1"))  # rotated away: the last log read stays
        snap = sampler.sample()
        assert snap.log is not None and snap.log.line_count == first_lines
        log.write_text("INFO 07-29 11:00:00 [api_server.py:1] vLLM API server version 0.11.0\n")
        snap = sampler.sample()  # the new file, from its top
        assert snap.log is not None and snap.log.line_count == 1 and snap.log.vllm_version == "0.11.0"
    finally:
        sampler.close()


def test_live_loop_stops_on_the_stop_signal(fake_metrics_server: FakeMetricsServer) -> None:
    feed = LiveFeed(_opts(metrics_urls=[fake_metrics_server.url], interval_s=0.05))
    loop = LiveLoop(feed, None, interval_s=0.05)
    stop = threading.Event()
    seen: list[int] = []

    def on_cycle(c: object) -> None:
        seen.append(1)
        if len(seen) == 3:
            stop.set()

    t = threading.Thread(target=loop.run, args=(on_cycle, stop))
    t.start()
    t.join(10)
    feed.close()
    assert not t.is_alive() and len(seen) == 3
    assert [h.kind for h in loop.health()] == ["metrics"] and loop.health()[0].up


def test_gpu_readings_over_time_have_one_shape() -> None:
    live = Timeline()
    from kvdoctor.facts import Snapshot

    for t in (10.0, 11.0, 12.0):
        live.append(Snapshot(timestamp=t, gpus=[Gpu(index=0, memory_used_bytes=int(t))]))
    moments = live.gpu_moments()
    assert [[(g.index, g.timestamp) for g in m] for m in moments] == [[(0, 10.0)], [(0, 11.0)], [(0, 12.0)]]
    offline = Timeline()
    offline.append(Snapshot(gpu_series=[[g for g in m] for m in moments], gpus=moments[-1]))
    assert offline.gpu_moments() == moments
    assert live.snapshots[0].gpus[0].timestamp is None  # the facts were not changed


class _SlowFirstRead:
    """A live feed whose first read (process discovery, a loaded server's first scrape) takes
    ``first_s`` seconds of a fake clock, and every later one ``each_s``."""

    live, label = True, "live"

    def __init__(self, clock: list[float], first_s: float, each_s: float = 0.1) -> None:
        from kvdoctor.facts import EngineMetrics, Snapshot

        self._clock, self._first, self._each = clock, first_s, each_s
        self._snapshot, self._metrics = Snapshot, EngineMetrics
        self.reads: list[float] = []

    def next(self) -> object:
        self._clock[0] += self._first if not self.reads else self._each
        self.reads.append(self._clock[0])
        return self._snapshot(timestamp=self._clock[0], metrics=[self._metrics(timestamp=self._clock[0])])

    def close(self) -> None:
        pass


@pytest.mark.parametrize("face", ["collect", "run"])
def test_a_slow_first_read_does_not_eat_the_window(face: str) -> None:
    # A loaded CI box: discovery plus the first scrape took 40 s of a 30 s window. The window
    # (diagnose/bundle) and the duration (record) count from the end of that first read, so
    # the reads still span the window instead of ending with two back-to-back scrapes.
    clock = [0.0]
    feed = _SlowFirstRead(clock, first_s=40.0)
    _faked(feed, clock, face, 30.0)
    span = feed.reads[-1] - feed.reads[0]
    assert 30.0 <= span < 30.0 + 2.0 + 0.2, feed.reads
    assert len(feed.reads) >= 15


class _StallingFeed:
    """A live feed on a fake clock whose reads take ``durations`` seconds in turn (then 0.1 s):
    the first read's page comes at its end (discovery first), every later one 17 ms after its
    start (the scrape answers; another source of the read hangs on). The server preempts 200
    requests a minute, a whole request at a time, with the KV cache full and a queue.
    ``pages_after`` reads: no page (the endpoint fails) past that many."""

    live, label = True, "live"

    def __init__(self, clock: list[float], durations: list[float], pages_after: int | None = None) -> None:
        self._clock, self._durations, self._pages_after = clock, list(durations), pages_after
        self.reads = 0

    def next(self) -> object:
        import math

        from kvdoctor.facts import EngineMetrics, Snapshot, SourceStatus

        start = self._clock[0]
        took = self._durations[self.reads] if self.reads < len(self._durations) else 0.1
        self._clock[0] += took
        t = self._clock[0] if self.reads == 0 else start + 0.017
        self.reads += 1
        if self._pages_after is not None and self.reads > self._pages_after:
            return Snapshot(
                timestamp=t, sources=[SourceStatus("metrics", "m", "error", "timed out after 30s")]
            )
        page = EngineMetrics(
            timestamp=t,
            model_name="m",
            kv_cache_usage=1.0,
            num_requests_running=2,
            num_requests_waiting=20,
            num_preemptions_total=float(math.floor(t * 200 / 60)),
        )
        return Snapshot(
            timestamp=t, metrics=[page], sources=[SourceStatus("metrics", "m", "ok", "1 engine(s)")]
        )

    def close(self) -> None:
        pass


def _faked(feed: object, clock: list[float], face: str, window_s: float) -> Timeline:
    """``feed`` read by a LiveLoop on the fake ``clock``, as diagnose/bundle (collect) or record
    (run with a duration) read it."""
    loop = LiveLoop(feed, None, interval_s=2.0, clock=lambda: clock[0])  # type: ignore[arg-type]

    def sleep(s: float) -> None:
        clock[0] += s

    class _Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            sleep(timeout or 0.0)
            return self.is_set()

    if face == "collect":
        return loop.collect(window_s, sleep=sleep)
    loop.run(lambda c: None, _Stop(), duration_s=window_s)
    return loop.timeline


@pytest.mark.parametrize("face", ["collect", "run"])
def test_a_read_that_stalls_for_the_window_does_not_leave_one_instant(face: str) -> None:
    # Integration tier on a loaded 2-core box: the first read took 5 s, the second's scrape
    # answered at once but its process-table walk hung to the 30 s timeout, which ended a 30 s
    # window with two pages 17 ms apart: "0 preemptions/min" in a storm of 200/min. The second
    # read now waits a whole interval, and the window goes on until its pages span half of it.
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.timeline import counter_rate

    clock = [0.0]
    feed = _StallingFeed(clock, [5.0, 30.0])
    timeline = _faked(feed, clock, face, 30.0)
    times = [s.metrics[0].timestamp or 0.0 for s in timeline.snapshots]
    assert times[1] - times[0] >= 2.0 and times[-1] - times[0] >= 15.0, times
    assert times[-1] - times[0] < 2 * 30.0 + 0.2
    series = [s.metrics[0] for s in timeline.snapshots]
    rate = counter_rate(series, "num_preemptions_total", 120.0)
    assert rate is not None and 180 <= rate * 60 <= 220
    report = Pipeline.load().evaluate(timeline)
    assert "preemption-storm" in {f.rule for f in report.findings}


@pytest.mark.parametrize(("gap", "storm"), [(0.017, None), (2.0, True)])
def test_two_pages_of_one_instant_are_no_timeline(gap: float, storm: bool | None) -> None:
    # Such a window (a bundle of an older kvdoctor, a recording of a stalled host) says so:
    # preemption-storm is skipped for want of "two /metrics scrapes 1 s apart", not passed.
    from kvdoctor.facts import Snapshot
    from kvdoctor.pipeline import Pipeline

    clock = [1000.0]
    feed = _StallingFeed(clock, [])
    timeline = Timeline()
    for t in (1000.0, 1000.0 + gap):
        clock[0] = t - 0.017
        snap = feed.next()
        assert isinstance(snap, Snapshot)
        timeline.append(snap)
    report = Pipeline.load().evaluate(timeline)
    skipped = {s.rule: s.missing for s in report.skipped}
    fired = "preemption-storm" in {f.rule for f in report.findings}
    if storm is None:
        assert skipped.get("preemption-storm") == ["timeline"] and not fired
    else:
        assert "preemption-storm" not in skipped and fired


@pytest.mark.parametrize(
    ("pages_after", "ends"),
    [
        (None, (30.0, 32.2)),  # pages all along: on time (the near miss: nothing is made up for)
        (1, (60.0, 62.2)),  # one page, then the endpoint fails: retried up to twice the window
        (0, (30.0, 32.2)),  # no page at all: on time, the report says the source failed
    ],
)
def test_a_window_is_made_up_for_only_while_its_pages_do_not_span_it(
    pages_after: int | None, ends: tuple[float, float]
) -> None:
    for face in ("collect", "run"):
        clock = [0.0]
        feed = _StallingFeed(clock, [5.0], pages_after=pages_after)
        _faked(feed, clock, face, 30.0)
        elapsed = clock[0] - 5.0  # counted from the end of the first read
        assert ends[0] <= elapsed < ends[1], (face, elapsed, feed.reads)


class _DiscoveryFeed:
    """A live feed whose first ``failed`` reads of the process table fail (no endpoint found
    then), and whose later reads scrape the server the table names."""

    live, label = True, "live"

    def __init__(self, clock: list[float], failed: int, server: bool = True) -> None:
        self._clock, self._failed, self._server = clock, failed, server
        self.reads = 0

    def next(self) -> object:
        from kvdoctor.facts import EngineMetrics, Snapshot, SourceStatus

        self.reads += 1
        self._clock[0] += 0.1
        t = self._clock[0]
        if self.reads <= self._failed or not self._server:
            procs = (
                SourceStatus("processes", "psutil", "error", "timed out after 30s")
                if self.reads <= self._failed
                else SourceStatus(
                    "processes", "psutil", "missing", "no vLLM server or engine process running"
                )
            )
            missing = SourceStatus("metrics", "/metrics", "missing", "no vLLM server found to scrape")
            return Snapshot(timestamp=t, sources=[procs, missing])
        ok = SourceStatus("metrics", "http://127.0.0.1:8000/metrics", "ok", "")
        return Snapshot(timestamp=t, metrics=[EngineMetrics(timestamp=t)], sources=[ok])

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("failed", "server", "reads"), [(1, True, "window"), (0, False, 1), (2, False, 3)])
def test_no_endpoint_ends_a_collection_only_once_the_process_table_was_read(
    failed: int, server: bool, reads: int | str
) -> None:
    """One read tells all when the process table was read and names no vLLM server; a
    process-table read that failed (a loaded host) found nothing, so the window goes on."""
    clock = [0.0]
    feed = _DiscoveryFeed(clock, failed, server)
    loop = LiveLoop(feed, None, interval_s=2.0, clock=lambda: clock[0])  # type: ignore[arg-type]

    def sleep(s: float) -> None:
        clock[0] += s

    timeline = loop.collect(10.0, sleep=sleep)
    if reads == "window":
        assert feed.reads >= 6 and sum(bool(s.metrics) for s in timeline.snapshots) >= 2
    else:
        assert feed.reads == reads


def test_unchanged_histograms_are_shared_between_scrapes(fake_metrics_server: FakeMetricsServer) -> None:
    from tests.conftest import B17_PAGES

    page = B17_PAGES[0].read_bytes()
    fake_metrics_server.reset([page, page, B17_PAGES[-1].read_bytes()])
    src = MetricsSource(fake_metrics_server.url)
    src.warm()
    try:
        (a,) = src.read().values["metrics"]
        (b,) = src.read().values["metrics"]
        (c,) = src.read().values["metrics"]
    finally:
        src.close()
    assert a.histograms and a is not b
    assert all(b.histograms[k] is a.histograms[k] for k in a.histograms)  # one copy in the Timeline
    assert b.cache_config is a.cache_config
    changed = [k for k in c.histograms if c.histograms[k] != b.histograms.get(k)]
    assert changed and all(c.histograms[k] is not b.histograms[k] for k in changed)  # new values kept


def test_the_sampler_copy_of_a_fact_is_dataclasses_replace() -> None:
    """``_with`` (the sampler's cheap copy of every GPU reading) gives what ``replace`` gives,
    leaves the original as it was, and defers to ``replace`` where ``__init__`` does more."""
    import dataclasses

    from kvdoctor.sampler import _with

    g = Gpu(index=3, name="H100", processes=[GpuProcess(pid=7)], clock_event_reasons=["hw_slowdown"])
    got = _with(g, timestamp=12.5, name="NVIDIA H100")
    assert got == dataclasses.replace(g, timestamp=12.5, name="NVIDIA H100") and got is not g
    assert (g.timestamp, g.name) == (None, "H100") and got.processes is g.processes

    @dataclasses.dataclass
    class Checked:
        x: int
        doubled: int = 0

        def __post_init__(self) -> None:
            self.doubled = 2 * self.x

    assert _with(Checked(1), x=5).doubled == 10


def test_each_source_reads_on_its_own_thread_and_close_ends_them() -> None:
    """One reader thread per source, reused read after read; close() ends the idle ones and
    does not wait for one whose read hangs (a daemon: it never holds the process at exit)."""
    release = threading.Event()

    class Hung:
        kind, origin, timeout_s = "log", "hung.log", 0.2

        def read(self) -> Reading:
            release.wait(10)
            return Reading({}, "late")

        def close(self) -> None:
            pass

    gpus = FakeGpus()
    before = set(threading.enumerate())  # other tests' hung readers may still be running
    sampler = Sampler(_opts(), sources=[gpus, Hung()])
    try:
        started = []
        for _ in range(3):
            snap = sampler.sample()
            started.append(set(threading.enumerate()) - before)
        assert {s.kind: s.status for s in snap.sources} == {"nvml": "ok", "log": "error"}
        assert started[0] == started[2] and len(started[0]) == 2
        readers = {t.name: t for t in started[0]}
        assert set(readers) == {"kvdoctor-source-nvml", "kvdoctor-source-log"}
        assert all(t.daemon for t in readers.values())
    finally:
        t0 = time.monotonic()
        sampler.close()
        assert time.monotonic() - t0 < 1.0
    readers["kvdoctor-source-nvml"].join(5)
    assert not readers["kvdoctor-source-nvml"].is_alive()
    assert readers["kvdoctor-source-log"].is_alive()  # still in its hung read
    release.set()
    readers["kvdoctor-source-log"].join(5)
    assert not readers["kvdoctor-source-log"].is_alive()  # and gone once it returned
    assert gpus.reads == 3
