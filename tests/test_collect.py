"""The live sampler against a real HTTP /metrics endpoint on 127.0.0.1 and a growing log file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.collect import LiveOptions, collect_live
from tests.conftest import FakeMetricsServer

CASE = Path(__file__).parent / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"


@pytest.fixture
def metrics_server(fake_metrics_server: FakeMetricsServer) -> str:
    """Serves the b17 scrapes in order, one per GET (the last one repeats)."""
    return fake_metrics_server.url


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


def test_live_diagnose_with_a_metrics_url(metrics_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # No vLLM process here, whatever else runs on the machine.
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: [])
    r = CliRunner().invoke(
        cli,
        [
            "diagnose",
            "--metrics",
            metrics_server,
            "--window",
            "1.2",  # a rate needs scrapes at least 1 s apart (timeline.MIN_RATE_SPAN_S)
            "--interval",
            "0.1",
            "--no-nvml",
            "--format",
            "json",
        ],
    )
    report = json.loads(r.stdout)
    assert {s["origin"] for s in report["sources"] if s["status"] == "ok"} == {metrics_server}
    assert "preemption-storm" in {f["rule"] for f in report["findings"]}
    assert r.exit_code == 1
