"""Faults the sidecar meets in a pod: vLLM's /metrics dead, 500, hanging, garbage, a 50 MB body, a
gzip bomb; NVML absent, fields NotSupported, the GPU lost mid-run. The process stays up, /readyz
tells the truth (and recovers with the endpoint), memory stays bounded."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdoctor.sidecar.server import Sidecar
from tests.sidecar.conftest import FakeVllm, get, live_feed, wait_for
from tests.sources.test_nvml import H100, NVMLError, NVMLError_LibraryNotFound, make_fake

MiB = 2**20


def values(base: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = get(base + "/metrics").text
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def source_up(base: str, kind: str) -> float | None:
    got = [v for labels, v in values(base, "kvdoctor_source_up").items() if ("source", kind) in labels]
    return got[0] if got else None


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("500", "HTTP 500"),
        ("hang", "timed out"),
        ("garbage", "metrics"),
        ("huge", "larger than 16 MiB"),
        ("gzipbomb", "larger than 16 MiB"),
    ],
)
def test_endpoint_fault_keeps_serving_readyz_truthful_and_recovers(
    mode: str, why: str, fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar]
) -> None:
    fake_vllm.mode = mode
    fake_vllm.bomb()  # built before the clock runs
    rss0 = psutil.Process().memory_info().rss
    # A hang must end at the source's timeout; a big body must end at the size cap, which a
    # loaded 2-core machine may need more than half a second to reach.
    timeout_s = 0.5 if mode == "hang" else 5.0
    sc = start_sidecar(live_feed(fake_vllm.url, timeout_s=timeout_s), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: sc.cycles >= 3, 30)
    assert get(base + "/healthz").status_code == 200
    r = get(base + "/readyz")
    assert r.status_code == 503 and why in r.text, r.text
    assert source_up(base, "metrics") == 0.0
    # 1 GiB of zeros or 50 MB of text never sit in memory at once (the read stops at 16 MiB).
    assert psutil.Process().memory_info().rss - rss0 < 200 * MiB
    fake_vllm.release.set()  # let a hung answer go
    fake_vllm.mode = "ok"
    wait_for(lambda: get(base + "/readyz").status_code == 200, 20)
    assert source_up(base, "metrics") == 1.0
    assert sc.loop.timeline.max_len == 720 and len(sc.loop.timeline.snapshots) <= 720


def test_dead_endpoint_from_the_start(start_sidecar: Callable[..., Sidecar]) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    s.close()
    sc = start_sidecar(live_feed(url, timeout_s=0.5), interval_s=0.1)
    wait_for(lambda: sc.cycles >= 5, 20)
    base = sc.base  # type: ignore[attr-defined]
    assert get(base + "/readyz").status_code == 503
    errors = [
        v
        for labels, v in values(base, "kvdoctor_source_errors_total").items()
        if ("source", "metrics") in labels
    ]
    assert errors and errors[0] >= 5


def _nvml(monkeypatch: pytest.MonkeyPatch, devices: list[dict[str, Any]], **kw: Any) -> Any:
    fake = make_fake(devices, **kw)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvml_absent(
    monkeypatch: pytest.MonkeyPatch, fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar]
) -> None:
    _nvml(monkeypatch, [], init_error=NVMLError_LibraryNotFound())
    sc = start_sidecar(live_feed(fake_vllm.url, nvml=True, timeout_s=0.5), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: sc.cycles >= 3, 20)
    assert source_up(base, "nvml") == 0.0
    assert get(base + "/readyz").status_code == 200  # vLLM's /metrics was read
    assert values(base, "kvdoctor_gpu_memory_bytes") == {}


def test_nvml_fields_not_supported(
    monkeypatch: pytest.MonkeyPatch, fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar]
) -> None:
    # Only the memory info answers; every other NVML call says NotSupported.
    dev = {"nvmlDeviceGetMemoryInfo": H100["nvmlDeviceGetMemoryInfo"]}
    _nvml(monkeypatch, [dev])
    sc = start_sidecar(live_feed(fake_vllm.url, nvml=True, timeout_s=0.5), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: sc.cycles >= 3, 20)
    assert source_up(base, "nvml") == 1.0
    total = values(base, "kvdoctor_gpu_memory_total_bytes")
    assert list(total.values()) == [81559 * MiB]
    assert values(base, "kvdoctor_gpu_utilization_ratio") == {}  # unknown, not 0
    free = {k: v for k, v in values(base, "kvdoctor_gpu_memory_bytes").items() if ("part", "free") in k}
    assert list(free.values()) == [(81559 - 75657) * MiB]


def test_gpu_lost_mid_run(
    monkeypatch: pytest.MonkeyPatch, fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar]
) -> None:
    fake = _nvml(monkeypatch, [dict(H100)])
    sc = start_sidecar(live_feed(fake_vllm.url, nvml=True, timeout_s=0.5), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: source_up(base, "nvml") == 1.0, 20)

    def lost() -> int:
        raise NVMLError("GPU is lost")

    fake.nvmlDeviceGetCount = lost
    n = sc.cycles
    wait_for(lambda: sc.cycles >= n + 3, 20)
    assert source_up(base, "nvml") == 0.0
    assert get(base + "/healthz").status_code == 200
    assert get(base + "/readyz").status_code == 200  # the engine is still read
    assert sc.loop is not None and all(t.is_alive() for t in sc._threads)
