"""Fixtures for the sidecar tests: a fake vLLM serving recorded real /metrics pages (and faults),
an in-process sidecar on a free loopback port, and small HTTP helpers.

Kept local to tests/sidecar (the shared ``fake_metrics_server`` of tests/conftest.py may replace
``fake_vllm`` once both exist).
"""

from __future__ import annotations

import functools
import gzip
import io
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvdoctor.pipeline import Pipeline
from kvdoctor.sampler import SnapshotFeed
from kvdoctor.sidecar.server import Sidecar

DATA = Path(__file__).resolve().parents[1] / "data"
#: the shipped alert rules (a real Prometheus loads them: the ``prometheus`` fixture)
ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "kvdoctor-alerts.yaml"
#: a V1 0.10.0 preemption storm (case b17): 8 real scrapes 10 s apart.
STORM_DIR = DATA / "metrics" / "b17"
#: a real 0.33.0 page (55 KB).
SAMPLE_PAGE = DATA / "metrics" / "vllm-0.33.0-sample.txt"
_PREEMPT = re.compile(r"^(vllm:num_preemptions_total\{[^}]*\}) ([0-9.e+]+)$", re.M)


@functools.lru_cache(maxsize=1)
def gzip_bomb() -> bytes:
    """1 GiB of zeros, gzip-compressed (about 1 MB); built once per test session."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6) as gz:
        chunk = b"\0" * (1 << 20)
        for _ in range(1024):
            gz.write(chunk)
    return buf.getvalue()


def storm_pages() -> list[str]:
    """The b17 scrapes, oldest first."""
    return [p.read_text() for p in sorted(STORM_DIR.glob("*.txt"))]


class FakeVllm:
    """A vLLM /metrics endpoint on 127.0.0.1 serving ``pages`` one per scrape; past the last page
    it keeps serving the last one with ``vllm:num_preemptions_total`` still rising by
    ``preempt_step`` per scrape (the storm goes on). ``mode`` picks a fault: "ok", "500",
    "hang" (answers after ``hang_s``), "garbage", "huge" (a 50 MB body), "gzipbomb" (1 GiB of
    zeros gzip-compressed to ~1 MB)."""

    def __init__(self, pages: list[str], preempt_step: float = 4.0) -> None:
        self.pages = pages
        self.preempt_step = preempt_step
        self.mode = "ok"
        self.hang_s = 30.0
        self.scrapes = 0
        self.release = threading.Event()
        #: when set, every page served is also written there as <unix-seconds>.txt (the last
        #: one of each second), a metrics/ directory ``diagnose --metrics DIR`` reads.
        self.record_dir: Path | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802
                fake.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def page(self) -> str:
        i = self.scrapes
        self.scrapes += 1
        if i < len(self.pages):
            return self.pages[i]
        extra = (i - len(self.pages) + 1) * self.preempt_step
        return _PREEMPT.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + extra}", self.pages[-1])

    def bomb(self) -> bytes:
        return gzip_bomb()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        mode = self.mode
        headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        if mode == "500":
            body, code = b"internal error\n", 500
        elif mode == "hang":
            self.release.wait(self.hang_s)
            body, code = self.page().encode(), 200
        elif mode == "garbage":
            body, code = bytes(range(256)) * 64 + b"\nvllm:kv_cache_usage_perc{{{ nope\n", 200
        elif mode == "huge":
            body, code = b"# padding\n" * (5 * 1024 * 1024), 200
        elif mode == "gzipbomb":
            body, code = self.bomb(), 200
            headers["Content-Encoding"] = "gzip"
        else:
            text = self.page()
            if self.record_dir is not None:
                (self.record_dir / f"{int(time.time())}.txt").write_text(text)
            body, code = text.encode(), 200
        try:
            h.send_response(code)
            for k, v in headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        except OSError:
            pass  # the client gave up (timeout): fine

    def start(self) -> FakeVllm:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_vllm() -> Iterator[FakeVllm]:
    """A running :class:`FakeVllm` over the b17 storm pages."""
    fake = FakeVllm(storm_pages()).start()
    yield fake
    fake.stop()


class Lines:
    """A thread-safe text sink collecting the sidecar's stdout lines."""

    def __init__(self) -> None:
        self._buf: list[str] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        with self._lock:
            return "".join(self._buf).splitlines()


@pytest.fixture
def start_sidecar() -> Iterator[Callable[..., Sidecar]]:
    """Factory: ``start_sidecar(feed, interval_s=…, pipeline=…)`` → a started in-process
    :class:`Sidecar` on a free loopback port (``sidecar.base`` its URL, ``sidecar.out`` a
    :class:`Lines`); stopped at teardown."""
    started: list[Sidecar] = []

    def make(
        feed: SnapshotFeed, *, interval_s: float = 0.2, pipeline: Pipeline | None = None, **kw: Any
    ) -> Sidecar:
        sc = Sidecar(
            feed, pipeline or Pipeline.load(), interval_s=interval_s, listen="127.0.0.1:0", out=Lines(), **kw
        )
        sc.start()
        host, port = sc.address
        sc.base = f"http://{host}:{port}"  # type: ignore[attr-defined]
        started.append(sc)
        return sc

    yield make
    for sc in started:
        sc.stop()


def live_feed(url: str, *, nvml: bool = False, timeout_s: float = 1.0) -> SnapshotFeed:
    """The live feed the sidecar runs, reading ``url`` (and NVML when ``nvml``), without the host's
    process table: other vLLM servers on a shared test machine must not join the diagnosis."""
    from kvdoctor.collect import LiveOptions
    from kvdoctor.sampler import LiveFeed

    return LiveFeed(LiveOptions(metrics_urls=[url], use_nvml=nvml, use_processes=False, timeout_s=timeout_s))


def get(url: str, timeout: float = 5.0) -> httpx.Response:
    """GET with a timeout (the sidecar must always answer)."""
    return httpx.get(url, timeout=timeout)


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, step: float = 0.05) -> Any:
    """Poll ``pred`` until truthy; returns its value or fails the test after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[tuple[str, str]]], str]]:
    """A real Prometheus (Debian's prometheus, on a loopback port with a temp config and data dir).

    Factory: ``start([(job, "127.0.0.1:PORT"), …])`` → the base URL of a Prometheus scraping
    those targets every second (labels namespace=ml, pod=vllm-0: both containers of one pod)
    with the shipped alert rules, their ``for:`` shortened to 2 s so the test need not wait 1 m."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(targets: list[tuple[str, str]]) -> str:
        rules = ALERTS.read_text().replace("for: 1m", "for: 2s")
        (tmp_path / "alerts.yaml").write_text(rules)
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": ["alerts.yaml"],
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [{"targets": [t], "labels": {"namespace": "ml", "pod": "vllm-0"}}],
                }
                for job, t in targets
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                return httpx.get(base + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 30, 0.2)
        return base

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
