"""The Grafana dashboard (deploy/helm/kvdoctor/files/kvdoctor-dashboard.json, built by
deploy/dashboard.py with grafana-foundation-sdk): its datasource is the DS_PROMETHEUS input, and
every panel's query returns data from a real Prometheus (Debian's) scraping a real sidecar (GPUs
from a stub NVML, vLLM from a fake serving recorded real /metrics of a preemption storm) and
that vLLM: a query no series answers would be an empty panel on every fleet."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvdoctor.collect import LiveOptions
from kvdoctor.sampler import LiveFeed, MetricsSource
from kvdoctor.sidecar.server import Sidecar
from tests.sidecar.conftest import FakeVllm, wait_for
from tests.sidecar.test_container import StubNvml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "helm" / "kvdoctor" / "files" / "kvdoctor-dashboard.json"


def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(b: dict) -> list[tuple[str, str]]:
    return [
        (p.get("title", ""), t["expr"]) for p in b["panels"] for t in p.get("targets", []) if t.get("expr")
    ]


def test_datasource_is_the_ds_prometheus_input_and_a_variable() -> None:
    b = board()
    assert [i["name"] for i in b["__inputs"]] == ["DS_PROMETHEUS"] and b["__inputs"][0][
        "pluginId"
    ] == "prometheus"
    variables = {v["name"]: v for v in b["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"  # provisioning from the ConfigMap
    refs = [t["datasource"] for p in b["panels"] for t in p.get("targets", [])]
    refs += [v["datasource"] for v in variables.values() if v["type"] == "query"]
    assert refs and all(r == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for r in refs)
    ids = [p["id"] for p in b["panels"]]
    assert len(set(ids)) == len(ids)
    titles = " ".join(t for t, _ in queries(b))
    for what in ("findings", "Suggested flags", "memory by part", "KV cache", "Preemptions", "sources up"):
        assert what.lower() in titles.lower(), what


def _expand(expr: str, pod: str) -> str:
    """The query as Grafana sends it with every variable at "All" and one pod chosen."""
    expr = expr.replace('pod=~"$pod"', f'pod=~"{pod}"').replace("$__rate_interval", "1m")
    return re.sub(r"\$(namespace|uuid)\b", ".*", expr)


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus not installed (.ci/run installs it)"
)
def test_every_panel_query_returns_data_from_a_real_prometheus(
    fake_vllm: FakeVllm, start_sidecar: Callable[..., Sidecar], prometheus: Callable[..., str]
) -> None:
    feed = LiveFeed(
        LiveOptions(use_nvml=False, use_processes=False),
        sources=[StubNvml(), MetricsSource(fake_vllm.url, 1.0)],
    )
    sc = start_sidecar(feed, interval_s=0.5)
    host, port = sc.address
    vllm_target = fake_vllm.url.split("//", 1)[1].split("/", 1)[0]
    base = prometheus([("vllm", vllm_target), ("kvdoctor", f"{host}:{port}")])

    def answer(expr: str) -> list:
        r = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=5).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    # the variables' own queries: label_values(metric{…}, label) as Grafana asks them
    for v in board()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
            assert m, v["query"]
            wait_for(
                lambda m=m: answer(f"count by ({m.group(2)}) ({_expand(m.group(1), 'vllm-0')})"), 30, 0.5
            )
    # every panel, once the storm's finding is active and a minute of rates is there
    wait_for(lambda: answer('kvdoctor_finding{rule="preemption-storm"}'), 30, 0.5)
    wait_for(lambda: answer("rate(vllm:num_preemptions_total[1m]) > 0"), 30, 0.5)
    for title, expr in queries(board()):
        got = wait_for(lambda expr=expr: answer(_expand(expr, "vllm-0")), 15, 0.5)
        assert got, f"panel {title!r} is empty: {expr}"
    parts = {r["metric"]["part"] for r in answer(_expand(queries(board())[3][1], "vllm-0"))}
    assert {"free"} < parts  # the stack has the parts, not only the total
