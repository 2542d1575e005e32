"""Shared test factories."""

from __future__ import annotations

# --------------------------------------------------------------------------- fake vLLM /metrics
# (io helper: a real HTTP endpoint on 127.0.0.1 serving recorded real pages; reused by the
# sampler, record, bundle and sidecar tests.)
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).parent / "data"
#: real /metrics scrapes of a preempting vLLM 0.10.0 (cases/b17), oldest first
B17_PAGES = sorted((DATA / "cases" / "b17-v1-preemption-thrash-long-prompts" / "metrics").glob("*.txt"))
#: a real vLLM 0.33.0 /metrics page
V033_PAGE = DATA / "bench" / "vllm-0.33.0-metrics-sample.txt"


class FakeMetricsServer:
    """Serves ``pages`` in order, one per GET (the last repeats), like a vLLM whose counters
    move between scrapes. ``delay_s`` stalls each answer (a slow endpoint); ``status`` other
    than 200 answers with an error; :meth:`reset` starts the sequence again; ``hits`` counts
    GETs. ``url`` is ``http://127.0.0.1:PORT/metrics``."""

    def __init__(self, pages: list[bytes]) -> None:
        self.pages = list(pages)
        self.delay_s = 0.0
        self.status = 200
        self.hits = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                with server._lock:
                    i = server.hits
                    server.hits += 1
                    delay, status = server.delay_s, server.status
                if delay:
                    threading.Event().wait(delay)
                body = server.pages[min(i, len(server.pages) - 1)] if status == 200 else b"oops\n"
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def reset(self, pages: list[bytes] | None = None) -> None:
        """Serve from the first page again (or a new sequence)."""
        with self._lock:
            self.hits = 0
            if pages is not None:
                self.pages = list(pages)

    def close(self) -> None:
        """Stop serving."""
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def fake_metrics_server() -> Iterator[FakeMetricsServer]:
    """A fake vLLM ``/metrics`` on 127.0.0.1 serving the real b17 scrapes in order."""
    srv = FakeMetricsServer([p.read_bytes() for p in B17_PAGES])
    try:
        yield srv
    finally:
        srv.close()


# --------------------------------------------------------------------------- findings' fixes


def all_flags(finding: Any) -> dict[str, str]:
    """The flags and environment of every alternative fix of a finding, merged (the first
    alternative's value wins), for tests that ask "which flags may it suggest"."""
    out: dict[str, str] = {}
    for fix in reversed(finding.fixes):
        out.update(fix.flags)
        out.update(fix.env)
    return out


def alternatives(finding: Any) -> list[dict[str, str]]:
    """Each alternative fix's flags and environment, the recommended first."""
    return [{**fix.flags, **fix.env} for fix in finding.fixes]


# --------------------------------------------------------------------------- a log cut small
@pytest.fixture
def small_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """``parse_log_file`` past its deadline at a test's scale: 4 KiB chunks, the last run's
    first 8 KiB and the last 16 KiB kept (32 MiB in use), so a log of tens of KiB is cut."""
    from kvdoctor.sources import vllm_log

    monkeypatch.setattr(vllm_log, "_CHUNK_BYTES", 4096)
    monkeypatch.setattr(vllm_log, "_CUT_HEAD_CHARS", 8192)
    monkeypatch.setattr(vllm_log, "_CUT_TAIL_CHARS", 16384)
