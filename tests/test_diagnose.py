"""`kvdoctor diagnose` end to end: formats, exit codes, bad input for every source, redaction."""

from __future__ import annotations

import json
import socket
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from tests.check_cases import check

DATA = Path(__file__).parent / "data"
HEALTHY = DATA / "bundles" / "healthy-idle-gmu092"
CASES = DATA / "cases"
SECRET = "sk-secret-do-not-leak-1234"


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in r.output
    return r.exit_code, r.stdout, r.stderr


def test_healthy_idle_server_at_gmu_092_gives_no_warning() -> None:
    code, out, _ = run("diagnose", "--bundle", str(HEALTHY), "--format", "json")
    report = json.loads(out)
    assert check(report, json.loads((HEALTHY / "expected.json").read_text())) == []
    assert report["health"] == "info" and code == 0
    idle = next(f for f in report["findings"] if f["rule"] == "idle-preallocation")
    # 16 GiB free on an 81559 MiB card: (79.65 - 16) / 79.65 → 0.79
    assert idle["suggested_flags"] == {"--gpu-memory-utilization": "0.79"}


@pytest.mark.parametrize("fmt", ["json", "markdown", "text"])
def test_api_key_never_reaches_any_output(fmt: str) -> None:
    assert SECRET in (HEALTHY / "cmdline.txt").read_text()  # the input does hold it
    _, out, err = run("diagnose", "--bundle", str(HEALTHY), "--format", fmt)
    assert SECRET not in out and SECRET not in err


def test_report_json_shape() -> None:
    _, out, _ = run(
        "diagnose", "--bundle", str(CASES / "b05-foreign-process-blocks-startup"), "--format", "json"
    )
    assert "\n" not in out.strip()  # one document, never wrapped
    r = json.loads(out)
    assert r["schema"] == "kvdoctor.report/2" and r["generated_at"].endswith("Z")
    assert {s["kind"] for s in r["sources"]} >= {"nvidia-smi", "log", "cmdline"}
    assert r["gpus"][0]["processes"][0] == {
        "pid": 48213,
        "name": "/opt/conda/bin/python3.10",
        "used_bytes": 15790 * 2**20,
    }
    f = r["findings"][0]
    assert (
        f["rule"] == "gpu-shared-with-foreign-process" and f["severity"] == "critical" and f["family"] == "K"
    )
    assert f["suggested_flags"] == {"--gpu-memory-utilization": "0.65"}
    assert any("line 36" in e["source"] for e in f["evidence"])
    assert f["gpus"] == [0]


def test_markdown_has_the_fix_and_a_collapsed_evidence_table() -> None:
    code, out, _ = run(
        "diagnose", "--bundle", str(CASES / "b08-v1-fp8-estimated-max-len-122080"), "--format", "markdown"
    )
    assert code == 2
    assert "--max-model-len 122080" in out and "<details>" in out


def test_text_leads_with_the_fix() -> None:
    _, out, _ = run("diagnose", "--bundle", str(CASES / "b06-v0-max-seq-len-3664"))
    assert out.index("Fix: --max-model-len 3664") < out.index("One request of max_model_len")


def test_demo_runs_on_the_bundled_incident() -> None:
    code, out, _ = run("diagnose", "--demo", "--format", "json")
    r = json.loads(out)
    assert code == 2
    orphan = next(f for f in r["findings"] if f["rule"] == "orphaned-engine-processes")
    assert "kill 48211 48212" in orphan["summary"]
    assert all(s["origin"].startswith("demo:") for s in r["sources"])


def test_tar_gz_bundle(tmp_path: Path) -> None:
    case = CASES / "b06-v0-max-seq-len-3664"
    archive = tmp_path / "bundle.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(case, arcname="bundle")
    code, out, _ = run("diagnose", "--bundle", str(archive), "--format", "json")
    r = json.loads(out)
    assert code == 2 and r["findings"][0]["suggested_flags"] == {"--max-model-len": "3664"}
    assert all(str(tmp_path) in s["origin"] for s in r["sources"] if s["status"] == "ok")


def _broken_bundle(root: Path) -> Path:
    b = root / "broken"
    b.mkdir()
    (b / "nvidia-smi.xml").write_text(
        '<?xml version="1.0" ?>\n<nvidia_smi_log>\n<gpu id="00000000:07:00.0">\n<product_name>NVIDIA A10'
    )
    (b / "vllm.log").write_bytes(bytes(range(256)) * 64)
    (b / "metrics.txt").write_text("")
    (b / "config.json").write_text("{not json")
    (b / "cmdline.txt").write_text("vllm serve 'unbalanced --max-model-len 4096\n")
    return b


def test_every_broken_source_is_one_clear_line_and_exit_3_when_nothing_reads(tmp_path: Path) -> None:
    code, out, _ = run("diagnose", "--bundle", str(_broken_bundle(tmp_path)), "--format", "json")
    r = json.loads(out)
    assert code == 3
    errors = {s["origin"].rsplit("/", 1)[-1]: s["detail"] for s in r["sources"] if s["status"] == "error"}
    assert set(errors) == {"nvidia-smi.xml", "vllm.log", "metrics.txt", "config.json", "cmdline.txt"}
    for name, detail in errors.items():
        assert "\n" not in detail and name in detail, detail


def test_one_good_source_is_enough(tmp_path: Path) -> None:
    b = _broken_bundle(tmp_path)
    (b / "nvidia-smi.txt").write_text(
        (CASES / "b05-foreign-process-blocks-startup" / "nvidia-smi.txt").read_text()
    )
    code, out, _ = run("diagnose", "--bundle", str(b), "--format", "json")
    r = json.loads(out)
    assert code != 3 and r["gpus"][0]["memory_used_bytes"] == 15796 * 2**20
    assert sum(s["status"] == "error" for s in r["sources"]) == 5


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_dead_metrics_url_is_an_error_line_and_the_log_still_counts() -> None:
    url = f"http://127.0.0.1:{_dead_port()}/metrics"
    log = CASES / "b08-v1-fp8-estimated-max-len-122080" / "vllm.log"
    code, out, _ = run(
        "diagnose", "--log", str(log), "--metrics", url, "--cmdline", "vllm serve x", "--format", "json"
    )
    r = json.loads(out)
    dead = next(s for s in r["sources"] if s["origin"] == url)
    assert dead["status"] == "error" and "refused" in dead["detail"].lower()
    assert code == 2 and r["findings"][0]["rule"] == "max-model-len-exceeds-kv-capacity"


def test_live_without_gpu_or_vllm_says_what_it_could_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # No vLLM here, whatever else runs on the machine (other tests spawn fake `vllm serve`s).
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: [])
    code, out, _ = run("diagnose", "--window", "0", "--format", "json")
    r = json.loads(out)
    nvml = next(s for s in r["sources"] if s["kind"] == "nvml")
    # no driver here: reported as missing, once, not retried (issue 27)
    assert nvml["detail"].startswith("NVML unavailable: NVML Shared Library Not Found")
    assert nvml["status"] == "missing" and "retrying" not in nvml["detail"]
    assert code == 3  # nothing at all could be read


def test_missing_bundle_is_a_one_line_error() -> None:
    code, out, err = run("diagnose", "--bundle", "/nonexistent/bundle")
    assert code == 3 and err.count("\n") == 1 and "/nonexistent/bundle" in err


def test_bad_rule_file_exits_3_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "oops.py").write_text(
        "from kvdoctor.rulekit import Rule\n\n\ndef check(f, t):\n    return f[\n"
    )
    code, _, err = run("diagnose", "--bundle", str(HEALTHY), "--rules-dir", str(tmp_path))
    assert code == 3 and "oops.py:5" in err and "SyntaxError" in err


def test_bad_user_config_exits_3(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("thresholds:\n  no-such-rule: {x: 1}\n")
    code, _, err = run("diagnose", "--bundle", str(HEALTHY), "--config", str(cfg))
    assert code == 3 and "no-such-rule" in err


def test_user_threshold_override_changes_the_verdict(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("thresholds:\n  preemption-storm: {min_per_min: 1000}\n")
    case = CASES / "b17-v1-preemption-thrash-long-prompts"
    _, out, _ = run("diagnose", "--bundle", str(case), "--format", "json")
    assert "preemption-storm" in {f["rule"] for f in json.loads(out)["findings"]}
    _, out, _ = run("diagnose", "--bundle", str(case), "--format", "json", "--config", str(cfg))
    assert "preemption-storm" not in {f["rule"] for f in json.loads(out)["findings"]}


def test_text_says_unknown_when_nothing_was_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: [])
    code, out, _ = run("diagnose", "--window", "0")
    assert code == 3
    assert "UNKNOWN" in out.splitlines()[0] and "OK" not in out.splitlines()[0]
    assert "NVML unavailable: NVML Shared Library Not Found" in out and "--demo" in out


def test_the_readme_config_example_is_accepted(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(block)
    code, out, err = run("diagnose", "--bundle", str(HEALTHY), "--config", str(cfg), "--format", "json")
    assert code == 0, err
    assert "idle-preallocation" not in {f["rule"] for f in json.loads(out)["findings"]}


@pytest.mark.parametrize(
    "cmd",
    [
        'vllm serve m --api-key "SECRET123',
        'curl -H "Authorization: Bearer SECRET123" x',
        "vllm serve m --api-key SECRET123",
    ],
)
@pytest.mark.parametrize("fmt", ["json", "markdown", "text"])
def test_unparsable_command_lines_are_redacted_too(
    cmd: str, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: [])
    _, out, err = run("diagnose", "--cmdline", cmd, "--no-nvml", "--window", "0", "--format", fmt)
    assert "SECRET123" not in out + err


def test_usage_errors_exit_3_not_critical() -> None:
    import subprocess
    import sys

    for args in (["diagnose", "--format", "jsn"], ["diagnose", "--bogus"], ["explain"]):
        r = subprocess.run([sys.executable, "-m", "kvdoctor", *args], capture_output=True, text=True)
        assert r.returncode == 3 and "Traceback" not in r.stderr, (args, r.stderr)
