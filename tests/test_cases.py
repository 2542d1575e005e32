"""Every real-world case (support bundles with expected.json, copied from ../shared/cases) is a test.

Each bundle runs through ``kvdoctor diagnose --bundle CASE --format json`` in-process and its report
is checked with the same oracle as ../shared/tools/check_cases.py (a copy: tests/check_cases.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from tests.check_cases import check

DATA = Path(__file__).parent / "data"
# The handed real-world cases (../shared/cases, and the handed vLLM 0.34 cases of
# ../shared/cases-034), then bundles written by the team for situations they miss.
CASE_DIRS = [
    p
    for root in (DATA / "cases", DATA / "cases-034", DATA / "bundles")
    for p in sorted(root.iterdir())
    if (p / "expected.json").is_file()
]


def diagnose_json(bundle: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["diagnose", "--bundle", str(bundle), "--format", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("case", CASE_DIRS, ids=[p.name for p in CASE_DIRS])
def test_case(case: Path) -> None:
    code, report = diagnose_json(case)
    expected = json.loads((case / "expected.json").read_text())
    problems = check(report, expected)
    assert not problems, f"{case.name}: " + "; ".join(problems)
    # The default --time-budget cuts nothing of any case: the findings above are a full read's.
    assert not [s for s in report["sources"] if s["cut"]], case.name
    assert code in (0, 1, 2)
    # Exit code follows the worst finding (spec/report.md).
    worst = {"ok": 0, "info": 0, "warning": 1, "critical": 2}[report["health"]]
    assert code == worst


def test_there_are_cases() -> None:
    assert len(CASE_DIRS) >= 17
