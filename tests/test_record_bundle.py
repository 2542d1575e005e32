"""`kvdoctor record`, `diagnose --recording` and `kvdoctor bundle` end to end, against a real
HTTP /metrics on 127.0.0.1 serving recorded real pages (tests/conftest.py)."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from tests.conftest import B17_PAGES, FakeMetricsServer

CASE = Path(__file__).parent / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"
SECRET = "sk-secret-do-not-leak-1234"


@pytest.fixture(autouse=True)
def _no_vllm_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # No vLLM process here, whatever else runs on the machine.
    monkeypatch.setattr("kvdoctor.sources.processes.list_processes", lambda *a, **k: [])


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout, r.stderr


def verdict(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """What a user acts on: each finding's rule, severity and suggested flags."""
    return sorted(
        (f["rule"], f["severity"], json.dumps(f.get("suggested_flags", {}), sort_keys=True))
        for f in report["findings"]
    )


def twice_with_the_same_pages(
    server: FakeMetricsServer, first: Callable[[], Any], second: Callable[[], Any]
) -> tuple[Any, Any]:
    """Run two live reads of ``server`` from its first page; on a loaded machine they may read
    a different number of pages (rates then differ), so try up to three times for the same.
    The tests' windows are not a multiple of the interval: a read ending right at the window's
    end would make the count a coin toss between the two runs."""
    for _ in range(3):
        server.reset()
        a = first()
        hits = server.hits
        server.reset()
        b = second()
        if server.hits == hits:
            return a, b
    raise AssertionError(f"the two runs read {hits} and {server.hits} pages")


def diagnose_json(*args: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = run("diagnose", *args, "--format", "json")
    return code, json.loads(out)


def test_record_then_replay_gives_the_same_findings_as_live(
    fake_metrics_server: FakeMetricsServer, tmp_path: Path
) -> None:
    url = fake_metrics_server.url
    rec = tmp_path / "r.jsonl.gz"
    (code, _, err), (live_code, live) = twice_with_the_same_pages(
        fake_metrics_server,
        lambda: run(
            "record", "-o", str(rec), "--force", "--metrics", url, "--duration", "2.25", "--interval", "0.5"
        ),
        lambda: diagnose_json("--metrics", url, "--window", "2.25", "--interval", "0.5"),
    )
    assert code == 0 and "recorded" in err
    n_recorded = fake_metrics_server.hits
    assert n_recorded >= 2  # rates need two scrapes
    code, replay = diagnose_json("--recording", str(rec))
    assert verdict(replay) == verdict(live) and code == live_code
    assert "preemption-storm" in {f["rule"] for f in replay["findings"]}
    status = next(s for s in replay["sources"] if s["kind"] == "recording")
    assert status["detail"].startswith(f"{n_recorded} snapshot(s)")


def test_bundle_from_a_metrics_url_and_a_log_diagnoses_the_same(
    fake_metrics_server: FakeMetricsServer, tmp_path: Path
) -> None:
    url = fake_metrics_server.url
    log = tmp_path / "vllm.log"
    log.write_text(
        (CASE / "vllm.log").read_text()
        + f"INFO 07-29 10:20:00 [api_server.py:1] args: --api-key {SECRET}\n"
        + "INFO 07-29 10:20:01 [logger.py:41] Received request cmpl-1: prompt: 'my private question', "
        "params: SamplingParams(n=1), prompt_token_ids: [1, 2, 3].\n"
    )
    out = tmp_path / "b.tar.gz"
    live = ("--window", "1.25", "--interval", "0.5")  # a URL and a log: sampled live, log followed
    (code, _, err), (ref_code, ref) = twice_with_the_same_pages(
        fake_metrics_server,
        lambda: run("bundle", "-o", str(out), "--force", "--metrics", url, "--log", str(log), *live),
        lambda: diagnose_json("--metrics", url, "--log", str(log), *live),
    )
    assert code == 0 and "wrote bundle" in err
    code, got = diagnose_json("--bundle", str(out))
    assert verdict(got) == verdict(ref) and code == ref_code
    assert {"max-num-seqs-exceeds-kv", "preemption-storm"} <= {f["rule"] for f in got["findings"]}
    with tarfile.open(out) as tar:
        names = tar.getnames()
        text = tar.extractfile("b/vllm.log").read().decode()  # type: ignore[union-attr]
        manifest = json.loads(tar.extractfile("b/manifest.json").read())  # type: ignore[union-attr]
        page = tar.extractfile(next(n for n in names if n.startswith("b/metrics/"))).read()  # type: ignore[union-attr]
    assert SECRET not in text and "my private question" not in text and "***" in text
    assert page == B17_PAGES[0].read_bytes()  # the scrape as it came
    files = {e["file"]: e for e in manifest["files"]}
    assert manifest["schema"] == "kvdoctor.bundle-manifest/1" and manifest["redacted"] is True
    assert files["vllm.log"]["source"] == str(log) and files["vllm.log"]["status"] == "ok"
    assert any(e["source"] == url for e in manifest["files"])


def test_a_bundle_taken_live_diagnoses_the_same_offline(
    fake_metrics_server: FakeMetricsServer, tmp_path: Path
) -> None:
    url = fake_metrics_server.url
    out = tmp_path / "bundle"
    (code, _, _), (live_code, live) = twice_with_the_same_pages(
        fake_metrics_server,
        lambda: run(
            "bundle", "-o", str(out), "--force", "--metrics", url, "--window", "1.25", "--interval", "0.5"
        ),
        lambda: diagnose_json("--metrics", url, "--window", "1.25", "--interval", "0.5"),
    )
    assert code == 0
    pages = [p.read_bytes() for p in sorted((out / "metrics").glob("*.txt"))]
    served = [p.read_bytes() for p in B17_PAGES]
    # each page as it came, in order (a read that timed out on a loaded machine is not there)
    assert len(pages) >= 2 and all(p in served for p in pages)
    assert [served.index(p) for p in pages] == sorted(served.index(p) for p in pages)
    manifest = json.loads((out / "manifest.json").read_text())
    # what failed and why: no NVML on this machine
    assert any(
        e["kind"] == "nvml" and e["status"] in ("error", "missing") and e["detail"] for e in manifest["files"]
    )
    tools = {e["file"]: e for e in manifest["files"] if e["source"].startswith(("nvidia-smi ", "ps "))}
    assert tools["nvidia-smi.xml"]["status"] in ("missing", "error", "ok")
    code, got = diagnose_json("--bundle", str(out))
    assert verdict(got) == verdict(live) and code == live_code
    assert "preemption-storm" in {f["rule"] for f in got["findings"]}


def test_a_live_bundle_of_a_slow_endpoint_still_holds_two_scrapes(
    fake_metrics_server: FakeMetricsServer, tmp_path: Path
) -> None:
    # A loaded server answers /metrics slower than the bundle's window: like a live diagnose,
    # the bundle keeps reading until it holds two scrapes (one has no rates: it diagnosed
    # nothing at all against a real vLLM under load).
    fake_metrics_server.delay_s = 0.8
    url = fake_metrics_server.url
    out = tmp_path / "bundle"
    slow = ("--metrics", url, "--window", "0.5", "--interval", "0.2", "--no-nvml")
    (code, _, _), (live_code, live) = twice_with_the_same_pages(
        fake_metrics_server,
        lambda: run("bundle", "-o", str(out), "--force", *slow),
        lambda: diagnose_json(*slow),
    )
    assert code == 0
    assert len(list((out / "metrics").glob("*.txt"))) >= 2
    code, got = diagnose_json("--bundle", str(out))
    assert "preemption-storm" in {f["rule"] for f in live["findings"]}
    assert verdict(got) == verdict(live) and code == live_code


def test_repacking_a_bundle_keeps_its_findings_and_redacts(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in CASE.iterdir():
        if f.is_file() and f.name != "expected.json":
            (src / f.name).write_bytes(f.read_bytes())
    (src / "metrics").mkdir()
    for p in B17_PAGES:
        (src / "metrics" / p.name).write_bytes(p.read_bytes())
    (src / "env.txt").write_text(f"HF_TOKEN={SECRET}\nCUDA_VISIBLE_DEVICES=0\n")
    out = tmp_path / "re.tar.gz"
    assert run("bundle", "-o", str(out), "--bundle", str(src))[0] == 0
    _, ref = diagnose_json("--bundle", str(src))
    _, got = diagnose_json("--bundle", str(out))
    assert verdict(got) == verdict(ref)
    with tarfile.open(out) as tar:
        env = tar.extractfile("re/env.txt").read().decode()  # type: ignore[union-attr]
    assert SECRET not in env and "HF_TOKEN=***" in env and "CUDA_VISIBLE_DEVICES=0" in env


def test_a_bundle_from_a_recording_diagnoses_the_same(tmp_path: Path) -> None:
    rec = tmp_path / "r.jsonl"
    assert run("record", "-o", str(rec), "--bundle", str(CASE))[0] == 0
    out = tmp_path / "fromrec"
    assert run("bundle", "-o", str(out), "--recording", str(rec))[0] == 0
    _, ref = diagnose_json("--recording", str(rec))
    _, got = diagnose_json("--bundle", str(out))
    assert verdict(got) == verdict(ref) and ref["findings"]
    manifest = json.loads((out / "manifest.json").read_text())
    log = next(e for e in manifest["files"] if e["file"] == "vllm.log")
    assert log["status"] == "ok" and "rendered from" in log["detail"]


@pytest.mark.parametrize(
    "case",
    [
        "b23-sampler-warmup-oom-qwen3-32b",
        "b26-orphaned-enginecore-workers",
        "b08-v1-fp8-estimated-max-len-122080",
    ],
)
def test_a_bundle_from_a_recording_keeps_the_log_findings(tmp_path: Path, case: str) -> None:
    src = CASE.parent / case
    rec = tmp_path / "r.jsonl.gz"
    assert run("record", "-o", str(rec), "--bundle", str(src))[0] == 0
    out = tmp_path / "b"
    assert run("bundle", "-o", str(out), "--recording", str(rec))[0] == 0
    _, ref = diagnose_json("--bundle", str(src))
    _, got = diagnose_json("--bundle", str(out))
    assert verdict(got) == verdict(ref) and ref["findings"]


CASES = sorted(p for p in CASE.parent.iterdir() if p.is_dir())


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_every_real_case_replays_from_a_recording_with_the_same_report(tmp_path: Path, case: Path) -> None:
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.report import render_json
    from kvdoctor.sampler import LiveLoop
    from kvdoctor.sources.bundle import load_bundle
    from kvdoctor.sources.recording import RecordingWriter, open_recording

    pipeline = Pipeline.load()
    timeline = load_bundle(case).timeline
    path = tmp_path / "r.jsonl.gz"
    with RecordingWriter(path) as w:
        for snap in timeline.snapshots:
            w.write(snap)
    feed = open_recording(path)
    replayed = LiveLoop(feed, pipeline).collect(0.0)
    feed.close()
    want = json.loads(render_json(pipeline.evaluate(timeline, now=0.0)))
    got = json.loads(render_json(pipeline.evaluate(replayed, now=0.0)))
    assert got["findings"] == want["findings"] and got["health"] == want["health"]
    # the replay names itself as a source; the rest is what the bundle said
    assert [s for s in got["sources"] if s["kind"] != "recording"] == want["sources"]


def test_existing_output_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    out.write_text("keep me\n")
    code, _, err = run("record", "-o", str(out), "--bundle", str(CASE))
    assert code == 3 and "--force" in err and out.read_text() == "keep me\n"


def test_recording_with_other_artifacts_is_refused_not_ignored(tmp_path: Path) -> None:
    rec = tmp_path / "r.jsonl"
    assert run("record", "-o", str(rec), "--bundle", str(CASE))[0] == 0
    code, _, err = run("diagnose", "--recording", str(rec), "--log", str(CASE / "vllm.log"))
    assert code == 3 and "--recording" in err and err.count("\n") == 1


def test_artifacts_beside_a_bundle_are_merged(tmp_path: Path) -> None:
    other_log = CASE.parent / "b08-v1-fp8-estimated-max-len-122080" / "vllm.log"
    _, alone = diagnose_json("--bundle", str(CASE))
    _, merged = diagnose_json("--bundle", str(CASE), "--log", str(other_log))
    rules = {f["rule"] for f in merged["findings"]}
    # b17's scrapes still count, and b08's log (KV too small for max-model-len) is read
    assert "preemption-storm" in rules and "max-model-len-exceeds-kv-capacity" in rules
    assert "max-model-len-exceeds-kv-capacity" not in {f["rule"] for f in alone["findings"]}
    origins = {s["origin"]: s for s in merged["sources"]}
    assert origins[str(other_log)]["status"] == "ok"
    assert "not used" in origins[str(CASE / "vllm.log")]["detail"]


def test_a_live_recording_ends_cleanly_on_sigterm(
    fake_metrics_server: FakeMetricsServer, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys
    import time

    from kvdoctor.sources.recording import open_recording

    rec = tmp_path / "r.jsonl.gz"
    cmd = [sys.executable, "-m", "kvdoctor", "record", "-o", str(rec), "--metrics", fake_metrics_server.url]
    proc = subprocess.Popen([*cmd, "--interval", "0.2", "--no-nvml"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while fake_metrics_server.hits < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "recorded" in err
    feed = open_recording(rec)
    n = 0
    while feed.next() is not None:
        n += 1
    assert n >= 2 and feed.skipped == 0  # the gzip stream was finished, nothing cut
