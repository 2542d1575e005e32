"""Root cause first: ``explains:`` in rule files (validated), ``caused_by`` on findings, reports
that lead with the root and nest its consequences; and the ``for:`` / ``clear_for:`` keys."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.facts import Snapshot, SourceStatus
from kvdoctor.findings import Finding, causal_order
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import build_report, make_console, render_json, render_markdown, render_text
from kvdoctor.rulekit import Hit, Rule, RuleContext, RuleFileError, evaluate, load_rules
from kvdoctor.sources.bundle import load_bundle

DATA = Path(__file__).parent / "data"
DOC = "## What\nx\n## Why\nx\n## How to confirm\nx\n## Fix\nx\n## Sources\nx\n"


@dataclass(frozen=True)
class _T:
    pass


def _rule(rid: str, name: str, severity: str = "warning", **kw: Any) -> Rule[Any]:
    def check(f: Any, t: Any) -> Hit | None:
        return Hit(summary=f"{rid} fired") if f.get(name) else None

    return Rule(id=rid, family="K", severity=severity, title=rid, doc=DOC, thresholds=_T(), check=check, **kw)  # type: ignore[arg-type]


def test_consequences_carry_caused_by_for_the_same_engine_only() -> None:
    rules = [_rule("root-cause", "root", explains=("symptom",)), _rule("symptom", "sym", severity="critical")]
    res = evaluate(
        rules,
        [
            RuleContext("e1", {"root": True, "sym": True}),
            RuleContext("e2", {"root": False, "sym": True}),
        ],
    )
    got = {(f.rule, f.engine): f.caused_by for f in res.findings}
    assert got == {("root-cause", "e1"): None, ("symptom", "e1"): "root-cause", ("symptom", "e2"): None}


def test_explains_must_name_loaded_rules(tmp_path: Path) -> None:
    (tmp_path / "root_cause.py").write_text(
        "from dataclasses import dataclass\nfrom kvdoctor.rulekit import Rule\n"
        "@dataclass(frozen=True)\nclass T:\n    pass\n"
        f"RULE = Rule(id='root-cause', family='K', severity='info', title='t', doc={DOC!r}, thresholds=T(),"
        " check=lambda f, t: None, explains=('symptm-b',))\n"
    )
    with pytest.raises(RuleFileError, match="symptm-b"):
        load_rules([tmp_path], plugins=False)


def test_reports_lead_with_the_root_and_nest_consequences() -> None:
    # A real case: the preemption storm comes from --max-num-seqs admitting more than the KV holds.
    tl = load_bundle(DATA / "cases" / "real-cpu-preemptions").timeline
    rep = Pipeline.load().evaluate(tl, now=0)
    doc = json.loads(render_json(rep))
    pairs = [(f["rule"], f["caused_by"]) for f in doc["findings"]]
    assert pairs == [("max-num-seqs-exceeds-kv", None), ("preemption-storm", "max-num-seqs-exceeds-kv")]
    assert doc["schema"] == "kvdoctor.report/2"
    md = render_markdown(rep)
    assert md.index("### WARNING: --max-num-seqs") < md.index("#### ↳ WARNING:")
    assert "A consequence of `max-num-seqs-exceeds-kv`" in md
    out = io.StringIO()
    render_text(rep, make_console(out))
    text = out.getvalue()
    assert "↳ WARNING" in text and "A consequence of max-num-seqs-exceeds-kv" in text
    # The consequence's panel is indented under its root's.
    nested = [line for line in text.splitlines() if "↳ WARNING" in line][0]
    assert nested.startswith("    ╭")


def test_causal_order_puts_a_warning_root_before_its_critical_consequence() -> None:
    root = Finding("root", "warning", "K", "t", "s")
    sym = Finding("sym", "critical", "K", "t", "s", caused_by="root")
    other = Finding("other", "critical", "W", "t", "s")
    assert [f.rule for f in causal_order([sym, other, root])] == ["other", "root", "sym"]
    # A cause that did not fire (or was deduplicated away) leaves its consequence a root.
    lone = Finding("sym", "critical", "K", "t", "s", caused_by="absent")
    assert [f.rule for f in causal_order([lone])] == ["sym"]
    # (a source was read: with none, health is "unknown" whatever the findings say)
    rep = build_report(Snapshot(sources=[SourceStatus("log", "vllm.log", "ok")]), [sym, root], [])
    assert [f.rule for f in rep.findings] == ["root", "sym"] and rep.health == "critical"


def test_for_and_clear_for_are_seconds_and_never_negative() -> None:
    from kvdoctor.rulekit import check_rule

    ok = check_rule(_rule("a-rule", "x", for_s=30.0, clear_for_s=120.0), "test")
    assert (ok.for_s, ok.clear_for_s) == (30.0, 120.0)
    with pytest.raises(RuleFileError, match="seconds"):
        check_rule(_rule("b-rule", "x", for_s=-5.0), "test")


def test_the_shipped_catalogue_declares_explains_that_hold() -> None:
    rules = {r.id: r for r in Pipeline.load().rules}
    assert set(rules["weights-not-sharded"].explains) >= {
        "kv-budget-exhausted",
        "max-model-len-exceeds-kv-capacity",
    }
    assert "kv-budget-exhausted" in rules["orphaned-engine-processes"].explains
    assert all(t in rules for r in rules.values() for t in r.explains)
