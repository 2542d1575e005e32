"""deploy/: the generated alerting rules stay in sync with rules/*.yaml and pass promtool (check and
unit tests); the Kubernetes example has what the sidecar needs."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvdoctor.sidecar.alerts import RUNBOOK_BASE_URL, alert_name, catalogue, shipped_rules_text
from tests.sidecar.k8s import assert_safe_vllm_pod, parse_quantity

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "kvdoctor-alerts.yaml"
MANIFEST = DEPLOY / "kubernetes" / "vllm-with-kvdoctor.yaml"
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
    rules = catalogue()
    assert len(rules) >= 30
    doc = yaml.safe_load(ALERTS.read_text())
    alerts = {a["alert"]: a for g in doc["groups"] for a in g["rules"] if "alert" in a}
    for r in rules:
        a = alerts[alert_name(r.id)]
        assert f'rule="{r.id}"' in a["expr"] and a["for"]
        assert a["annotations"]["runbook"] == f"kvdoctor explain {r.id}"
        assert a["annotations"]["runbook_url"] == f"{RUNBOOK_BASE_URL}/{r.id}.md"
        page = (ROOT / "docs" / "runbooks" / f"{r.id}.md").read_text()
        assert page.startswith(f"# {r.id} — ") and "## Fix" in page and alert_name(r.id) in page
        assert "kvdoctor_suggested_flag_info" in a["annotations"]["description"]
        assert "{" not in a["annotations"]["summary"].replace("{{ $labels.model_name }}", "")
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
    (dep,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert_safe_vllm_pod(dep["spec"]["template"]["spec"])
    vllm = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    assert vllm["image"] == "vllm/vllm-openai:v0.34.0"


def test_no_sidecar_probe_can_gate_vllm_and_the_check_catches_one() -> None:
    """The check itself: the old manifest's readinessProbe on the native sidecar fails it, and so
    does a startupProbe (it holds vLLM's start)."""
    (dep,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    pod = dep["spec"]["template"]["spec"]
    assert_safe_vllm_pod(pod)
    for probe in ("readinessProbe", "startupProbe"):
        bad = copy.deepcopy(pod)
        bad["initContainers"][0][probe] = {"httpGet": {"path": "/readyz", "port": "kvdoctor"}}
        with pytest.raises(AssertionError, match="gate"):
            assert_safe_vllm_pod(bad)


def test_dockerignore_keeps_venv_and_git_out_of_the_image() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*", "an allowlist: everything is ignored unless named"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert not allowed & {".git", ".venv", "tests", "bench"}
    # every path the Dockerfile copies is in the context
    copied = [
        src
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
    ]
    assert copied and all(src.rstrip("/") in allowed for src in copied), copied
    assert "COPY . " not in (DEPLOY / "Dockerfile").read_text()


def _log_script(pod: dict, log_dir: Path, max_bytes: int, lines: int) -> str:
    """The vLLM container's shell script with the log in ``log_dir``, ``max_bytes`` per file and
    vllm replaced by a Python loop that prints ``lines`` lines to stdout and to stderr."""
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    script = vllm["args"][0]
    assert vllm["command"] == ["/bin/bash", "-c"] and "exec vllm serve" in script
    old_dir = next(m["mountPath"] for m in vllm["volumeMounts"] if m["name"] == "vllm-log")
    script = re.sub(r"max=\d+", f"max={max_bytes}", script.replace(old_dir, str(log_dir)))
    fake = (
        f"exec {sys.executable} -c 'import sys\n"
        f'for i in range({lines}): print("out", i); print("err", i, file=sys.stderr, flush=True)\''
    )
    return re.sub(r"exec vllm serve .*", lambda _m: fake, script)


def _run_bounded_log(pod: dict, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    script = _log_script(pod, log_dir, max_bytes=2000, lines=400)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 800  # kubectl logs still gets everything, stderr too
    log, old = log_dir / "vllm.log", log_dir / "vllm.log.1"
    deadline = time.monotonic() + 10  # the writer loop ends just after vllm does
    while time.monotonic() < deadline and not (log.is_file() and log.read_text().endswith("err 399\n")):
        time.sleep(0.05)
    assert sorted(p.name for p in log_dir.iterdir()) == ["vllm.log", "vllm.log.1"]
    assert old.stat().st_size == 2000 and 0 < log.stat().st_size <= 2000
    # no byte lost between the two files, the last lines are the newest
    assert (old.read_text() + log.read_text()).endswith("out 398\nerr 398\nout 399\nerr 399\n")


def test_manifest_log_is_bounded_and_complete(tmp_path: Path) -> None:
    (dep,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    pod = dep["spec"]["template"]["spec"]
    _run_bounded_log(pod, tmp_path)
    # the log volume holds two full files with room to spare: exceeding it would evict the pod
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    max_bytes = int(re.search(r"max=(\d+)", vllm["args"][0]).group(1))  # type: ignore[union-attr]
    vol = next(v for v in pod["volumes"] if v["name"] == "vllm-log")
    assert parse_quantity(vol["emptyDir"]["sizeLimit"]) > 2 * max_bytes
