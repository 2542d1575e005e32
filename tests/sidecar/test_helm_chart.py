"""deploy/helm/kvdoctor: rendered by Helm's own Go SDK (helm-python-sdk), every object validated
against the Kubernetes 1.29 schemas (kubernetes-validate, strict: no unknown field) and the
Prometheus Operator CRDs (cloudcoil's models of monitoring.coreos.com/v1); the PrometheusRule's
rules pass promtool; no probe of the sidecar can gate vLLM.

The renderer and schemas come with the ``[deploy]`` extra, which .ci/run installs: under CI a
missing one fails these tests, elsewhere it skips them.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvdoctor.sidecar.alerts import RUNBOOK_BASE_URL
from tests.sidecar.k8s import assert_safe_vllm_pod

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvdoctor"
ALERTS = ROOT / "deploy" / "prometheus" / "kvdoctor-alerts.yaml"
#: the oldest Kubernetes with native sidecars on by default, and a recent one.
K8S_VERSIONS = ("1.29.0", "1.33.0")
ALL_ON = {
    "podMonitor": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "dashboard": {"enabled": True},
}


def need(module: str) -> ModuleType:
    """Import ``module`` (of the [deploy] extra); skip without it, fail under CI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{module} not installed (pip install -e '.[deploy]'; .ci/run does)")


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``helm template demo deploy/helm/kvdoctor -n prod`` with ``values``: the objects."""
    helm = need("helm_python")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="demo", namespace="prod")
    return [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {o["kind"]: o for o in objs}
    assert len(out) == len(objs), "one object per kind"
    return out


def validate(objs: list[dict[str, Any]]) -> None:
    """Every object against its schema: built-in kinds with kubernetes-validate (strict) for each
    of K8S_VERSIONS, monitoring.coreos.com/v1 kinds with cloudcoil's CRD models (and no field the
    CRD does not know: the model's dump gives back the whole object)."""
    kv = need("kubernetes_validate")
    po = need("cloudcoil.models.prometheus_operator.v1")
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            model = getattr(po, obj["kind"]).model_validate(obj)
            back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
            assert back == obj, f"{obj['kind']}: fields the CRD does not have"
            continue
        for version in K8S_VERSIONS:
            kv.validate(obj, version, strict=True)  # raises ValidationError


def test_default_render_is_a_valid_safe_vllm_pod() -> None:
    objs = render()
    kinds = by_kind(objs)
    assert set(kinds) == {"Deployment", "Service"}  # the Operator objects are opt-in (CRDs)
    validate(objs)
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    assert_safe_vllm_pod(pod)
    (vllm,) = pod["containers"]
    assert vllm["image"] == "vllm/vllm-openai:v0.34.0"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_chart_and_manifest_run_the_same_pod() -> None:
    """deploy/kubernetes/vllm-with-kvdoctor.yaml is the chart's default pod (names aside)."""
    (dep,) = list(
        yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "vllm-with-kvdoctor.yaml").read_text())
    )
    manifest = dep["spec"]["template"]["spec"]
    chart = by_kind(render())["Deployment"]["spec"]["template"]["spec"]
    side_m, side_c = manifest["initContainers"][0], chart["initContainers"][0]
    assert side_m["args"] == side_c["args"] and side_m["env"] == side_c["env"]
    assert side_m["resources"] == side_c["resources"]
    vllm_m, vllm_c = manifest["containers"][0], chart["containers"][0]
    assert vllm_m["env"] == vllm_c["env"] and vllm_m["image"] == vllm_c["image"]
    strip = str.maketrans("", "", "'")
    assert vllm_m["args"][0].translate(strip) == vllm_c["args"][0].translate(strip)


def test_every_toggle_renders_valid_objects() -> None:
    values = {
        **ALL_ON,
        "workloadKind": "StatefulSet",
        "kvdoctor": {
            "port": 9479,
            "interval": 2,
            "history": 300,
            "nvml": False,
            "livenessProbe": {"enabled": True},
        },
        "vllm": {"args": ["--max-num-seqs", 64], "resources": {"limits": {"memory": "64Gi"}}},
    }
    objs = render(values)
    kinds = by_kind(objs)
    assert set(kinds) == {
        "StatefulSet",
        "Service",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    }
    validate(objs)
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    assert_safe_vllm_pod(pod)
    side = pod["initContainers"][0]
    assert {"--listen=0.0.0.0:9479", "--interval=2", "--history=300", "--no-nvml"} <= set(side["args"])
    assert [e["name"] for e in side["env"]] == ["POD_NAMESPACE", "POD_NAME"]  # no NVIDIA_* without NVML
    assert side["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvdoctor"}
    vllm = pod["containers"][0]
    assert vllm["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    assert "'--max-num-seqs' '64'" in vllm["args"][0]
    assert [e["port"] for e in kinds["PodMonitor"]["spec"]["podMetricsEndpoints"]] == ["kvdoctor", "http"]
    assert {"name": "kvdoctor", "port": 9479, "targetPort": "kvdoctor"} in kinds["Service"]["spec"]["ports"]
    cm = kinds["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kvdoctor.json"])
    assert dash == json.loads((CHART / "files" / "kvdoctor-dashboard.json").read_text())


def test_a_bad_workload_kind_is_one_clear_error() -> None:
    helm = need("helm_python")
    with pytest.raises(helm.HelmError, match="workloadKind must be Deployment or StatefulSet"):
        render({"workloadKind": "DaemonSet"})
    with pytest.raises(helm.HelmError, match="holds a single quote"):
        render({"vllm": {"args": ["--served-model-name", "it's"]}})


def test_prometheus_rule_holds_the_generated_alerts(tmp_path: Path) -> None:
    spec = by_kind(render(ALL_ON))["PrometheusRule"]["spec"]
    assert spec["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    urls = [
        r["annotations"]["runbook_url"]
        for g in spec["groups"]
        for r in g["rules"]
        if "alert" in r and "runbook_url" in r.get("annotations", {})
    ]
    assert len(urls) >= 30 and all(u.startswith(RUNBOOK_BASE_URL + "/") for u in urls)
    for u in urls:  # each points at a generated page
        assert (ROOT / "docs" / "runbooks" / u.rsplit("/", 1)[1]).is_file(), u
    other = by_kind(
        render({**ALL_ON, "prometheusRule": {"enabled": True, "runbookBaseURL": "https://wiki.example/rb/"}})
    )
    text = yaml.safe_dump(other["PrometheusRule"]["spec"])
    assert RUNBOOK_BASE_URL not in text and "https://wiki.example/rb/preemption-storm.md" in text
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing under CI")
        pytest.skip("promtool not installed")
    # promtool checks and unit-tests the PrometheusRule's own groups, as rendered
    (tmp_path / "kvdoctor-alerts.yaml").write_text(yaml.safe_dump({"groups": spec["groups"]}))
    shutil.copy(ALERTS.with_name("kvdoctor-alerts.test.yaml"), tmp_path)
    r = subprocess.run(
        ["promtool", "check", "rules", "kvdoctor-alerts.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        ["promtool", "test", "rules", "kvdoctor-alerts.test.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_helm_lint_is_clean() -> None:
    helm = need("helm_python")
    result = helm.lint(str(CHART))
    assert result["total_charts_linted"] == 1 and not result["errors"], result
    # Helm's severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error
    assert all(m["severity"] < 2 for m in result["messages"]), result["messages"]
