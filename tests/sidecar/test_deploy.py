"""deploy/: the generated alerting rules stay in sync with the rule catalogue and pass promtool (check and
unit tests); the Kubernetes example has what the sidecar needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvdoctor.rulekit import load_rules
from kvdoctor.sidecar.alerts import alert_name, shipped_rules_text

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "kvdoctor-alerts.yaml"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (.ci/run installs Debian's prometheus)"
)


def test_alert_rules_file_is_generated_from_the_catalogue() -> None:
    assert ALERTS.read_text() == shipped_rules_text(), "run: python deploy/generate.py"
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_every_rule_id_has_an_alert_with_severity_for_and_runbook() -> None:
    rules = load_rules(plugins=False)
    doc = yaml.safe_load(ALERTS.read_text())
    alerts = {a["alert"]: a for g in doc["groups"] for a in g["rules"] if "alert" in a}
    for r in rules:
        a = alerts[alert_name(r.id)]
        assert f'rule="{r.id}"' in a["expr"] and a["for"]
        assert a["annotations"]["runbook"] == f"kvdoctor explain {r.id}"
        assert "kvdoctor_suggested_flag_info" in a["annotations"]["description"]
        assert "{" not in a["annotations"]["summary"].replace("{{ $labels.engine }}", "")
    # vLLM's own rules read the counter as a rate and never advise a lower gmu for preemptions
    storm = alerts["VllmPreemptionStorm"]
    text = ALERTS.read_text()
    assert "rate(vllm:num_preemptions_total[" in text and "vllm:num_preemptions " not in text
    assert "Do not lower --gpu-memory-utilization" in storm["annotations"]["description"]


@needs_promtool
def test_promtool_check_rules() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests() -> None:
    r = subprocess.run(
        ["promtool", "test", "rules", "kvdoctor-alerts.test.yaml"],
        capture_output=True,
        text=True,
        cwd=DEPLOY / "prometheus",
    )
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_promtool_check_config_with_the_scrape_jobs(tmp_path: Path) -> None:
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape-config.yaml").read_text())
    shutil.copy(ALERTS, tmp_path / "kvdoctor-alerts.yaml")
    cfg = {"rule_files": ["kvdoctor-alerts.yaml"], **scrape}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    if "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check everything else (the
        # relabelling, the rule file) with the discovery swapped for a static target.
        for job in cfg["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
            job["static_configs"] = [{"targets": ["127.0.0.1:8479"]}]
        path.write_text(yaml.safe_dump(cfg))
        r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_example_has_what_the_sidecar_needs() -> None:
    (dep,) = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "vllm-with-kvdoctor.yaml").read_text()))
    pod = dep["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    (side,) = [c for c in pod["initContainers"] if c["name"] == "kvdoctor"]
    assert side["restartPolicy"] == "Always"  # a native sidecar
    assert side["args"][0] == "sidecar" and "--listen=0.0.0.0:8479" in side["args"]
    sec = side["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False
    assert side["resources"]["limits"]["memory"] and side["resources"]["limits"]["cpu"]
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "nvidia.com/gpu" not in str(side["resources"])  # it must not take a GPU of its own
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert "readinessProbe" in vllm and "8479" not in str(vllm["readinessProbe"])  # never gated by kvdoctor
    # the log vLLM writes is the one the sidecar follows, through a volume both mount
    (log_arg,) = [a for a in side["args"] if a.startswith("--log=")]
    log_path = Path(log_arg.split("=", 1)[1])
    assert str(log_path) in " ".join(vllm["args"])

    def mount(c: dict, path: Path) -> dict:
        return next(m for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"]))

    side_mount, vllm_mount = mount(side, log_path), mount(vllm, log_path)
    assert side_mount["name"] == vllm_mount["name"] and side_mount.get("readOnly") is True
    assert any(v["name"] == side_mount["name"] for v in pod["volumes"])
