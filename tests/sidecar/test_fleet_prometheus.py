"""A fleet in a real Prometheus: bench/fleet.py's test fleet (vLLM series from a real vLLM 0.33.0
page, DCGM exporter 4.x series, kvdoctor sidecar series; healthy pods and one pod of each kind
in trouble) written as OpenMetrics, backfilled with ``promtool tsdb create-blocks-from
openmetrics`` into a real Prometheus (Debian's), and diagnosed with ``kvdoctor diagnose
--prometheus`` as a user runs it: exactly the pods in trouble are reported, each with its
finding, root cause first; the healthy pods beside them (the near miss) have none.

25 pods (a few seconds); ``bench/fleet.py`` runs the same over 500 and prints time and memory."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from tests.sidecar.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None or shutil.which("prometheus") is None,
    reason="promtool/prometheus not installed (.ci/run installs the Debian package)",
)
#: the finding each kind of pod must get (bench/fleet.py's kinds)
EXPECTED = {
    "storm": "preemption-storm",
    "idle": "idle-preallocation",
    "kvsat": "low-util-kv-saturated",
    "growth": "gpu-memory-growth",
}


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvdoctor_bench_fleet", ROOT / "bench" / "fleet.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fleet_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ModuleType]]:
    bench = _bench()
    work = tmp_path_factory.mktemp("fleet")
    assert bench.write_fleet(work / "fleet.om", pods=25) > 100_000
    bench.backfill(work / "fleet.om", work / "tsdb")
    proc = bench.start_prometheus(work / "tsdb", free_port(), work)
    port = proc.args[3].rsplit(":", 1)[1]
    try:
        yield f"http://127.0.0.1:{port}", bench
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_diagnose_prometheus_reports_the_pods_in_trouble_root_cause_first(
    fleet_prometheus: tuple[str, ModuleType],
) -> None:
    url, bench = fleet_prometheus
    r = CliRunner().invoke(cli, ["diagnose", "--prometheus", url, "--since", "15m", "--format", "json"])
    assert "Traceback" not in r.output and r.exit_code in (1, 2), r.output[-2000:]
    report = json.loads(r.stdout)
    trouble = bench.pods_in_trouble(report)
    kinds = {f"ml-{i % 5}/vllm-{i:04d}": bench.pod_kind(i) for i in range(25)}
    assert set(trouble) == {pod for pod, kind in kinds.items() if kind != "healthy"}, trouble
    for pod, rules in trouble.items():
        assert EXPECTED[kinds[pod]] in rules, (pod, rules)
    # root cause first: a finding's cause (caused_by) comes before it, in the same pod
    seen: set[tuple[str, str]] = set()
    for f in report["findings"]:
        pod = f["engine"].split(":", 1)[0]
        if f.get("caused_by"):
            assert (pod, f["caused_by"]) in seen, f
        seen.add((pod, f["rule"]))
    # every pod with vLLM series was read, its GPU from DCGM (exported_pod, not the exporter's)
    assert len({g["pod"] for g in report["gpus"]}) == 25
    # the text report names the pods in trouble, and no healthy pod
    text = CliRunner().invoke(cli, ["diagnose", "--prometheus", url, "--since", "15m"]).output
    assert all(pod in text for pod in trouble)
    assert not any(pod in text for pod, kind in kinds.items() if kind == "healthy")
