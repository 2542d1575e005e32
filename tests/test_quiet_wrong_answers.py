"""Quiet wrong answers a new user hit (issue: right on incidents it has never seen, item 8): an
empty input is not "OK", JSON ``health`` is "unknown" whenever the exit code is 3, and a reader
that goes away (``| head``) does not change the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.diagnose import diagnose_command

CASES = Path(__file__).parent / "data" / "cases"


def _json(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(diagnose_command, [*args, "--format", "json"])
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.parametrize("content", ["", "hello\nnot a vllm log at all\n"])
def test_empty_or_foreign_log_alone_is_unknown(tmp_path: Path, content: str) -> None:
    (tmp_path / "vllm.log").write_text(content)
    code, report = _json("--bundle", str(tmp_path))
    assert code == 3
    assert report["health"] == "unknown" and report["exit_code"] == 3
    log = next(s for s in report["sources"] if s["kind"] == "log")
    assert log["status"] == "error"


def test_health_unknown_iff_exit_3(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, report = _json("--bundle", str(empty))
    assert (code, report["health"]) == (3, "unknown")
    code, report = _json("--bundle", str(CASES / "b01-tp1-70b-on-8x-a100-40g"))
    assert code == 2 and report["health"] == "critical"


@pytest.mark.parametrize("fmt", ["text", "json", "markdown"])
def test_closed_pipe_keeps_the_exit_code(fmt: str) -> None:
    # b01 is CRITICAL (exit 2); a reader that closes at once must not turn it into 1 or 0.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvdoctor",
            "diagnose",
            "--bundle",
            str(CASES / "b01-tp1-70b-on-8x-a100-40g"),
            "--format",
            fmt,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 2
    assert b"Traceback" not in err
