"""A real Prometheus (Debian's prometheus, started here on a loopback port with a temp config and
data dir) scrapes a fake vLLM serving recorded real /metrics (a preemption storm) and a running
sidecar fed by it: the shipped alert for the firing rule reaches "firing", and
``diagnose --prometheus`` against that Prometheus reports the findings ``diagnose`` reports
reading the endpoint directly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.sidecar.server import Sidecar
from tests.sidecar.conftest import FakeVllm, free_port, live_feed, wait_for

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "kvdoctor-alerts.yaml"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus not installed (.ci/run installs the Debian package)",
)


def _alert_state(base: str, name: str) -> str | None:
    alerts = httpx.get(base + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    states = [a["state"] for a in alerts if a["labels"].get("alertname") == name]
    return "firing" if "firing" in states else (states[0] if states else None)


def _rules(out: str) -> set[str]:
    return {f["rule"] for f in json.loads(out)["findings"]}


def test_alert_fires_and_fleet_mode_agrees_with_diagnose(
    fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar], prometheus: Callable[..., str], tmp_path: Path
) -> None:
    fake_vllm.record_dir = tmp_path / "metrics"
    fake_vllm.record_dir.mkdir()
    sc = start_sidecar(live_feed(fake_vllm.url), interval_s=0.5)
    host, port = sc.address
    vllm_target = fake_vllm.url.split("//", 1)[1].split("/", 1)[0]
    base = prometheus([("vllm", vllm_target), ("kvdoctor", f"{host}:{port}")])

    # The sidecar's finding reaches Prometheus, and its alert goes pending → firing.
    assert wait_for(lambda: _alert_state(base, "KvdoctorPreemptionStorm") == "firing", 60, 0.5)
    alerts = httpx.get(base + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    storm = next(a for a in alerts if a["labels"]["alertname"] == "KvdoctorPreemptionStorm")
    assert storm["labels"]["severity"] == "warning" and storm["labels"]["pod"] == "vllm-0"
    assert storm["annotations"]["runbook"] == "kvdoctor explain preemption-storm"

    # Rates need a span of scrapes: let Prometheus hold 15 s of vLLM's series first.
    def span() -> bool:
        q = 'count_over_time(vllm:num_preemptions_total{pod="vllm-0"}[1m])'
        got = httpx.get(base + "/api/v1/query", params={"query": q}, timeout=5).json()["data"]["result"]
        return bool(got) and float(got[0]["value"][1]) >= 15

    wait_for(span, 60, 0.5)
    # diagnose directly on the pages the fake served (a metrics/ directory of scrapes).
    runner = CliRunner()
    direct = runner.invoke(cli, ["diagnose", "--metrics", str(tmp_path / "metrics"), "--format", "json"])
    fleet = runner.invoke(cli, ["diagnose", "--prometheus", base, "--since", "2m", "--format", "json"])
    assert "Traceback" not in direct.output + fleet.output
    assert "preemption-storm" in _rules(direct.stdout)
    assert _rules(fleet.stdout) == _rules(direct.stdout), fleet.stdout[:3000]
    report = json.loads(fleet.stdout)
    assert all(f["engine"].startswith("ml/vllm-0") for f in report["findings"])  # grouped by pod
    assert fleet.exit_code == direct.exit_code == 1


def test_fleet_mode_errors_are_one_line() -> None:
    port = free_port()
    r = CliRunner().invoke(cli, ["diagnose", "--prometheus", f"http://127.0.0.1:{port}", "--since", "5m"])
    assert r.exit_code == 3 and "connection refused" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["diagnose", "--prometheus", "http://127.0.0.1:1", "--since", "five"])
    assert r.exit_code == 3 and "--since" in r.stderr
    r = CliRunner().invoke(
        cli, ["diagnose", "--prometheus", "http://127.0.0.1:1", "--selector", "namespace=ml"]
    )
    assert r.exit_code == 3 and "--selector" in r.stderr
