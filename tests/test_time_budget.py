"""``--time-budget``: one deadline for reading a bundle or files (issue 27 item 2).

Past the deadline a vLLM log is still read, cut to its latest run (``parse_log_file``), and a
file not yet started is reported as not read; every face says what was cut. These tests assert
what is read and shown, never how long it took: a budget already spent is a tiny
``--time-budget`` or a patched :func:`kvdoctor.sources.bundle.budget_spent`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.sources import bundle as bundle_src
from kvdoctor.sources.bundle import NOT_READ_OUT_OF_TIME, load_bundle

#: logs cut at a test's scale (tests/conftest.py): chunks of 4 KiB, 16 KiB kept at the end
pytestmark = pytest.mark.usefixtures("small_cut")

BUNDLES = Path(__file__).parent / "data" / "bundles"
#: a run-time OOM deep into a long context (its latest run in vllm.log, six files in all)
CASE = BUNDLES / "c2-long-context-prefill-oom-gh200"
#: tp 4 over two nodes, one log per node (nodes/*/vllm.log)
NODE_CASE = BUNDLES / "k3-node-logs-heavy-rank"
#: a budget spent before anything starts (open_feed's deadline is already past at the first file)
SPENT = "1e-9"

_STATS = (
    "(APIServer pid=41) INFO 11-30 08:{m:02d}:{s:02d} [loggers.py:335] Engine 000: Avg prompt "
    "throughput: 0.0 tokens/s, Avg generation throughput: 12.0 tokens/s, Running: 1 reqs, "
    "Waiting: 0 reqs, GPU KV cache usage: 1.0%, Prefix cache hit rate: 0.0%\n"
)


def long_log_bundle(dest: Path, case: Path = CASE, earlier_kib: int = 64) -> Path:
    """A copy of ``case`` whose vllm.log starts with an earlier run of the same server (its
    startup lines, then ``earlier_kib`` KiB of stats lines) before the case's own log: with
    ``small_cut``'s sizes a spent budget cuts the earlier run and parses the latest whole."""
    shutil.copytree(case, dest)
    (dest / "expected.json").unlink(missing_ok=True)
    log = dest / "vllm.log"
    latest = log.read_text()
    start = [
        line.replace("pid=51", "pid=41").replace("12-01", "11-30") for line in latest.splitlines(True)[:2]
    ]
    lines, size, i = list(start), sum(map(len, start)), 0
    while size < earlier_kib << 10:
        lines.append(_STATS.format(m=(i // 60) % 60, s=i % 60))
        size += len(lines[-1])
        i += 1
    log.write_text("".join(lines) + latest)
    return dest


def _diagnose(bundle: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["diagnose", "--bundle", str(bundle), *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout


def _json(bundle: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code, out = _diagnose(bundle, "--format", "json", *args)
    return code, json.loads(out)


def _fired(report: dict[str, Any]) -> list[str]:
    return sorted(f["rule"] for f in report["findings"])


def _usual_code(report: dict[str, Any]) -> int:
    return {"ok": 0, "info": 0, "warning": 1, "critical": 2, "unknown": 3}[report["health"]]


def test_a_spent_budget_cuts_the_log_and_every_face_says_so(tmp_path: Path) -> None:
    b = long_log_bundle(tmp_path / "b")
    code, report = _json(b, "--time-budget", SPENT)
    by_file = {Path(s["origin"]).name: s for s in report["sources"]}
    log = by_file["vllm.log"]
    # the log is read even past the budget, its latest run whole; the earlier run counted
    assert log["status"] == "ok"
    assert log["cut"].startswith("time budget ran out: lines ") and "(earlier runs)" in log["cut"]
    assert log["cut"] in log["detail"]
    # every other file is reported, as not read and why: none silently dropped
    others = {name: s for name, s in by_file.items() if name != "vllm.log"}
    assert set(others) == {"nvidia-smi.txt", "metrics.txt", "cmdline.txt", "config.json", "env.txt"}
    for s in others.values():
        assert (s["status"], s["detail"], s["cut"]) == ("error", NOT_READ_OUT_OF_TIME, NOT_READ_OUT_OF_TIME)
    # the log's latest run still gives its run-time OOM
    assert "long-context-prefill-oom" in _fired(report)
    # the usual exit codes: the findings' health, never UNKNOWN while the log was read
    assert code == report["exit_code"] == _usual_code(report) == 2

    code, text = _diagnose(b, "--format", "text", "--time-budget", SPENT)
    assert code == 2
    flat = " ".join(text.split())
    assert "⚠ Partial evidence: the time budget for reading the inputs ran out" in flat
    assert "read in part, 5 sources not read" in flat
    assert "◐ log" in flat and "ok (in part)" in flat and "counted, not parsed" in flat
    assert "✗ cmdline" in flat and "not read: the time budget" in flat

    code, md = _diagnose(b, "--format", "markdown", "--time-budget", SPENT)
    assert code == 2
    assert "> ⚠ **Partial evidence: the time budget for reading the inputs ran out" in md
    assert "| ok (in part) |" in md and "counted, not parsed" in md
    assert f"| error | {NOT_READ_OUT_OF_TIME} |" in md


def test_a_budget_spent_in_the_log_cuts_only_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small files are read before the log: a budget that runs out while the log is parsed
    leaves none of them unread, and the diagnosis from the cut log is the full read's."""
    b = long_log_bundle(tmp_path / "b")
    _, full = _json(b, "--time-budget", "0")
    assert not any(s["cut"] for s in full["sources"])
    monkeypatch.setattr(bundle_src, "budget_spent", lambda deadline: False)  # the files beat the clock
    code, cut = _json(b, "--time-budget", SPENT)  # … the log does not
    log = next(s for s in cut["sources"] if s["origin"].endswith("vllm.log"))
    assert log["status"] == "ok" and "(earlier runs) counted, not parsed" in log["cut"]
    assert [s for s in cut["sources"] if s["cut"]] == [log]
    assert all(s["status"] == "ok" for s in cut["sources"])
    assert _fired(cut) == _fired(full) and "long-context-prefill-oom" in _fired(cut)
    assert code == _usual_code(cut) == _usual_code(full)


@pytest.mark.parametrize("shape", ["one host", "nodes"])
def test_every_small_file_is_read_before_the_logs(
    shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget runs out in the first log parsed: every other file (the bundle's, each
    node's) was read already, and every log is still read (past the budget, its latest run)."""
    b = tmp_path / "b"
    if shape == "nodes":
        shutil.copytree(NODE_CASE, b)
        (b / "nodes" / "gpu-node-b" / "env.txt").write_text(
            "CUDA_VISIBLE_DEVICES=0,1\n"
        )  # after node a's log
    else:
        shutil.copytree(CASE, b)  # vllm.log sorts before metrics, cmdline, config and env
    baseline = load_bundle(b).snapshot
    spent = {"now": False}
    real_parse = bundle_src._parse_log

    def parse_spending_the_budget(path: Path, deadline: float | None = None) -> Any:
        spent["now"] = True
        return real_parse(path, deadline)

    monkeypatch.setattr(bundle_src, "budget_spent", lambda deadline: deadline is not None and spent["now"])
    monkeypatch.setattr(bundle_src, "_parse_log", parse_spending_the_budget)
    snap = load_bundle(b, deadline=float("inf")).snapshot
    assert spent["now"]
    assert not [s for s in snap.sources if s.cut], [(s.origin, s.detail) for s in snap.sources]
    assert sorted((s.kind, s.origin, s.status) for s in snap.sources) == sorted(
        (s.kind, s.origin, s.status) for s in baseline.sources
    )
    assert [(g.node, g.index) for g in snap.gpus] == [(g.node, g.index) for g in baseline.gpus]
    assert len(snap.configs) == len(baseline.configs) and snap.model is not None
    assert snap.log is not None and baseline.log is not None
    assert len(snap.log.events) == len(baseline.log.events)  # with nodes: node b's figures joined


def test_a_file_not_started_is_reported_never_dropped(tmp_path: Path) -> None:
    """A deadline passed before loading: the same sources as a read without one, each small
    file "error" with why (the log read in part); a multi-node bundle's node files too."""
    for case in (CASE, NODE_CASE, BUNDLES / "k3-two-nodes-heavy-stage0"):
        whole = load_bundle(case).snapshot.sources
        cut = load_bundle(case, deadline=0.0).snapshot.sources
        assert sorted((s.kind, s.origin) for s in cut) == sorted((s.kind, s.origin) for s in whole), case.name
        for s in cut:
            if s.status == "missing":
                assert not s.cut  # a file the bundle has not is still only missing
            elif s.origin.endswith("vllm.log"):
                assert s.status == "ok", (case.name, s.detail)  # small logs: one chunk, nothing cut
            else:
                assert (s.status, s.detail, s.cut) == ("error", NOT_READ_OUT_OF_TIME, NOT_READ_OUT_OF_TIME)


def test_an_archive_bundle_is_budgeted_too(tmp_path: Path) -> None:
    import tarfile

    b = long_log_bundle(tmp_path / "b")
    arc = tmp_path / "b.tar.gz"
    with tarfile.open(arc, "w:gz") as tar:
        tar.add(b, arcname="b")
    code, report = _json(arc, "--time-budget", SPENT)
    log = next(s for s in report["sources"] if s["origin"].endswith("vllm.log"))
    assert log["origin"].startswith(str(arc)) and "(earlier runs) counted, not parsed" in log["cut"]
    assert code == _usual_code(report) == 2


def test_no_budget_and_the_default_read_everything(tmp_path: Path) -> None:
    b = long_log_bundle(tmp_path / "b")
    for args in (["--time-budget", "0"], []):
        code, report = _json(b, *args)
        assert all(s["status"] == "ok" and s["cut"] == "" for s in report["sources"]), args
        assert code == 2


def test_a_url_beside_files_is_not_scraped_past_the_budget(tmp_path: Path, fake_metrics_server: Any) -> None:
    smi = CASE / "nvidia-smi.txt"
    result = CliRunner().invoke(
        cli,
        [
            "diagnose",
            "--nvidia-smi",
            str(smi),
            "--metrics",
            fake_metrics_server.url,
            "--format",
            "json",
            "--time-budget",
            SPENT,
        ],
    )
    report = json.loads(result.stdout)
    url = next(s for s in report["sources"] if s["origin"] == fake_metrics_server.url)
    assert (url["status"], url["cut"]) == ("error", NOT_READ_OUT_OF_TIME)
    assert fake_metrics_server.hits == 0
    # nothing was read: UNKNOWN (3), and the text says why
    assert result.exit_code == 3 == report["exit_code"]
    args = [
        "diagnose",
        "--nvidia-smi",
        str(smi),
        "--metrics",
        fake_metrics_server.url,
        "--time-budget",
        SPENT,
    ]
    result = CliRunner().invoke(cli, [*args, "--format", "text"])
    flat = " ".join(result.stdout.split())
    assert result.exit_code == 3 and "UNKNOWN" in flat and "2 sources not read" in flat
    assert "Nothing was read before the time budget ran out" in flat
    assert fake_metrics_server.hits == 0


def test_bundle_o_copies_every_file_whole_past_the_budget(tmp_path: Path) -> None:
    """``kvdoctor bundle --bundle X -o``: a budget cuts only the reading, never what is copied;
    the manifest lists no failure for a file that was copied."""
    b = long_log_bundle(tmp_path / "b")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["bundle", "--bundle", str(b), "-o", str(out), "--time-budget", SPENT])
    assert result.exit_code == 0, result.output
    assert (out / "vllm.log").read_bytes() == (b / "vllm.log").read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert not [e for e in manifest["files"] if e["status"] == "error"]
