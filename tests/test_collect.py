"""The live sampler against a real HTTP /metrics endpoint on 127.0.0.1 and a growing log file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.collect import LiveOptions, collect_live

CASE = Path(__file__).parent / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"
SCRAPES = sorted((CASE / "metrics").glob("*.txt"))


@pytest.fixture
def metrics_server() -> Iterator[str]:
    """Serves the b17 scrapes in order, one per GET (the last one repeats)."""
    pages = [p.read_bytes() for p in SCRAPES]
    state = {"i": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = pages[min(state["i"], len(pages) - 1)]
            state["i"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_sampler_reads_metrics_and_log_over_a_window(metrics_server: str, tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text((CASE / "vllm.log").read_text())
    opts = LiveOptions(
        metrics_urls=[metrics_server],
        log_path=log,
        window_s=0.3,
        interval_s=0.1,
        use_nvml=False,
        use_processes=False,
    )
    timeline, configs = collect_live(opts, sleep=lambda s: None)
    assert len(timeline.snapshots) >= 2
    latest = timeline.latest
    assert latest is not None and latest.log is not None and latest.log.vllm_version == "0.10.0"
    assert [s.status for s in latest.sources] == ["ok", "ok"]
    counters = [s.metrics[0].num_preemptions_total for s in timeline.snapshots]
    assert counters == sorted(counters) and counters[-1] > counters[0]
    assert configs == []  # no process table read


def test_live_diagnose_with_a_metrics_url(metrics_server: str) -> None:
    r = CliRunner().invoke(
        cli,
        [
            "diagnose",
            "--metrics",
            metrics_server,
            "--window",
            "0.5",
            "--interval",
            "0.05",
            "--no-nvml",
            "--format",
            "json",
        ],
    )
    report = json.loads(r.stdout)
    assert {s["origin"] for s in report["sources"] if s["status"] == "ok"} == {metrics_server}
    assert "preemption-storm" in {f["rule"] for f in report["findings"]}
    assert r.exit_code == 1
