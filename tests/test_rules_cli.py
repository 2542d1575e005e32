"""`kvdoctor rules` (text, JSON, markdown) and `kvdoctor explain` through click's CliRunner, on
the shipped catalogue and on rule directories of Python modules; docs/rules.md is current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor import rules_cli
from kvdoctor.cli import cli

ROOT = Path(__file__).resolve().parent.parent
MML = "max-model-len-exceeds-kv-capacity"

RULE_SOURCE = '''"""## What
w

## Why
w

## How to confirm
w

## Fix
w

## Sources
w
"""
from dataclasses import dataclass

from kvdoctor.rulekit import Facts, Hit, Rule


@dataclass(frozen=True)
class Thresholds:
    per_min: float = 10.0


def check(f: Facts, t: Thresholds) -> Hit | None:
    return None


RULE = Rule(id="RULE_ID", family="L", severity="SEVERITY", title="A title", doc=__doc__,
            thresholds=Thresholds(), check=check, needs=("metrics",))
'''


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDOCTOR_RULES_DIR", raising=False)


def run(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), env=env)


def _rule_dir(tmp_path: Path, rule_id: str = "my-rule", severity: str = "warning") -> Path:
    (tmp_path / f"{rule_id.replace('-', '_')}.py").write_text(
        RULE_SOURCE.replace("RULE_ID", rule_id).replace("SEVERITY", severity)
    )
    return tmp_path


def test_rules_table_lists_the_shipped_catalogue() -> None:
    res = run("rules")
    assert res.exit_code == 0, res.output
    assert "preemption-storm" in res.output and MML in res.output and "kvdoctor explain ID" in res.output


def test_rules_json_via_env_var(tmp_path: Path) -> None:
    res = run("rules", "--format", "json", env={"KVDOCTOR_RULES_DIR": str(_rule_dir(tmp_path))})
    assert res.exit_code == 0, res.output
    (rule,) = json.loads(res.output)
    assert (
        rule["id"] == "my-rule" and rule["thresholds"] == {"per_min": 10.0} and rule["needs"] == ["metrics"]
    )
    assert rule["lifecycle"] == "stable" and rule["docs"] == "kvdoctor explain my-rule"


def test_rules_empty_dir(tmp_path: Path) -> None:
    res = run("rules", "--rules-dir", str(tmp_path))
    assert res.exit_code == 0 and "No rules found." in res.output


def test_explain_shows_doc_and_metadata() -> None:
    res = run("explain", "preemption-storm")
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.startswith("preemption-storm — ")
    assert "L (long-request spikes at run time)" in out and "thresholds" in out and "may suggest" in out
    for section in ("What", "Why", "How to confirm", "Fix", "Sources"):
        assert section in out
    assert "kvdoctor.rules.preemption_storm" in out


def test_explain_unknown_id_suggests_close_matches() -> None:
    res = run("explain", "preemption-strom")
    assert res.exit_code == 3
    assert res.output.strip().startswith(
        "kvdoctor: unknown rule 'preemption-strom' (did you mean: preemption-storm"
    )


def test_bad_rule_module_is_one_line_exit_3(tmp_path: Path) -> None:
    _rule_dir(tmp_path, "broken-rule", severity="fatal")
    for args in (("rules",), ("explain", "broken-rule"), ("diagnose", "--demo")):
        res = run(*args, "--rules-dir", str(tmp_path))
        assert res.exit_code == 3, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.output
        assert lines[0].startswith("kvdoctor: invalid rule file: ") and "broken_rule.py" in lines[0]
        assert "severity must be one of" in lines[0]


def test_missing_rules_dir_exit_3(tmp_path: Path) -> None:
    res = run("rules", "--rules-dir", str(tmp_path / "nope"))
    assert res.exit_code == 3 and "rules directory does not exist" in res.output


def test_resolve_rules_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rules_cli.resolve_rules_dirs(()) is None
    monkeypatch.setenv("KVDOCTOR_RULES_DIR", "/a:/b")
    assert rules_cli.resolve_rules_dirs(()) == [Path("/a"), Path("/b")]
    assert rules_cli.resolve_rules_dirs((Path("/c"),)) == [Path("/c")]


def test_shipped_catalogue_json() -> None:
    res = run("rules", "--format", "json")
    assert res.exit_code == 0, res.output
    rules = json.loads(res.output)
    assert len(rules) >= 35
    for rule in rules:
        assert rule["severity"] in ("critical", "warning", "info") and rule["family"] in "WKLUP"
        assert "## What" in rule["doc"]


def test_docs_rules_md_is_the_catalogue_as_generated() -> None:
    """docs/rules.md is `kvdoctor rules --format markdown` (regenerate it when a rule changes)."""
    res = run("rules", "--format", "markdown")
    assert res.exit_code == 0, res.output
    page = (ROOT / "docs" / "rules.md").read_text()
    assert page == res.output, "docs/rules.md is stale: kvdoctor rules --format markdown > docs/rules.md"
    assert res.output.count("\n## ") == len(json.loads(run("rules", "--format", "json").output))
