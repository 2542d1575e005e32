"""`kvdoctor rules` and `kvdoctor explain` through click's CliRunner, on fixture rule dirs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor import rules_cli
from kvdoctor.cli import cli

RULES = Path(__file__).parent / "data" / "rules_engine" / "rules"
MML = "max-model-len-exceeds-kv-capacity"


@pytest.fixture(autouse=True)
def no_catalogue(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fixture rules use their own variable names, not derive's catalogue.
    monkeypatch.setattr(rules_cli, "variable_catalogue", lambda: None)
    monkeypatch.delenv("KVDOCTOR_RULES_DIR", raising=False)


def run(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), env=env)


def test_rules_table() -> None:
    res = run("rules", "--rules-dir", str(RULES))
    assert res.exit_code == 0, res.output
    out = res.output
    assert "kvdoctor rules (3)" in out
    # sorted by family W K L U P, then id
    assert out.index(MML) < out.index("preemption-storm") < out.index("idle-preallocation")
    assert "critical" not in out.split(MML)[1].splitlines()[0]  # fixture default is warning
    assert "\x1b[" not in out


def test_rules_json_via_env_var() -> None:
    res = run("rules", "--format", "json", env={"KVDOCTOR_RULES_DIR": str(RULES)})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [r["id"] for r in doc] == ["idle-preallocation", MML, "preemption-storm"]
    storm = doc[2]
    assert storm == {
        "id": "preemption-storm",
        "family": "L",
        "severity": "warning",
        "title": "{preemptions_per_min:.0f} preemptions per minute",
        "needs": ["metrics"],
        "needs_any": [],
        "thresholds": {"per_min": 10, "kv_full": 0.9},
        "explains": [],
        "for_s": 0.0,
        "clear_for_s": 0.0,
        "docs": "kvdoctor explain preemption-storm",
    }


def test_rules_empty_dir(tmp_path: Path) -> None:
    res = run("rules", "--rules-dir", str(tmp_path))
    assert res.exit_code == 0 and "No rules found." in res.output


def test_explain_shows_doc_and_metadata() -> None:
    res = run("explain", "preemption-storm", "--rules-dir", str(RULES))
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.startswith("preemption-storm — {preemptions_per_min:.0f} preemptions per minute")
    assert "L (long-request spikes at run time)" in out
    assert "per_min=10, kv_full=0.9" in out and "needs" in out and "metrics" in out
    for section in ("What", "Why", "How to confirm", "Fix", "Sources"):
        assert section in out
    assert "Lower --max-num-seqs." in out


def test_explain_unknown_id_suggests_close_matches() -> None:
    res = run("explain", "preemption-strom", "--rules-dir", str(RULES))
    assert res.exit_code == 3
    assert res.output.strip() == "kvdoctor: unknown rule 'preemption-strom' (did you mean: preemption-storm?)"


def test_bad_rule_file_is_one_line_exit_3(tmp_path: Path) -> None:
    shutil.copy(RULES / "preemption-storm.yaml", tmp_path)
    bad = tmp_path / "broken-rule.yaml"
    text = (RULES / "preemption-storm.yaml").read_text()
    bad.write_text(
        text.replace("id: preemption-storm", "id: broken-rule").replace(
            "severity: warning", "severity: fatal"
        )
    )
    for args in (("rules",), ("explain", "preemption-storm")):
        res = run(*args, "--rules-dir", str(tmp_path))
        assert res.exit_code == 3
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.output
        assert lines[0].startswith("kvdoctor: invalid rule file: ") and lines[0].endswith(
            "broken-rule.yaml:3: severity 'fatal' is not one of critical|warning|info"
        )


def test_missing_rules_dir_exit_3(tmp_path: Path) -> None:
    res = run("rules", "--rules-dir", str(tmp_path / "nope"))
    assert res.exit_code == 3 and "rules directory does not exist" in res.output


def test_catalogue_check_applies_when_derive_provides_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules_cli, "variable_catalogue", lambda: {"kv_usage"})
    res = run("rules", "--rules-dir", str(RULES))
    assert res.exit_code == 3 and "unknown name" in res.output


def test_resolve_rules_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rules_cli.resolve_rules_dirs(()) is None
    monkeypatch.setenv("KVDOCTOR_RULES_DIR", "/a:/b")
    assert rules_cli.resolve_rules_dirs(()) == [Path("/a"), Path("/b")]
    assert rules_cli.resolve_rules_dirs((Path("/c"),)) == [Path("/c")]


_REAL_CATALOGUE = rules_cli.variable_catalogue


def test_shipped_catalogue_is_valid_against_derive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules_cli, "variable_catalogue", _REAL_CATALOGUE)
    res = run("rules", "--format", "json")
    assert res.exit_code == 0, res.output
    for rule in json.loads(res.output):
        assert rule["severity"] in ("critical", "warning", "info") and rule["family"] in "WKLUP"
