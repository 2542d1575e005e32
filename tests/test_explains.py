"""Root cause first: ``explains:`` in rule files (validated), ``caused_by`` on findings, reports
that lead with the root and nest its consequences; and the ``for:`` / ``clear_for:`` keys."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvdoctor.facts import Snapshot, SourceStatus
from kvdoctor.findings import Finding, causal_order
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import build_report, make_console, render_json, render_markdown, render_text
from kvdoctor.rules_engine import RuleContext, RuleFileError, evaluate, load_rules
from kvdoctor.sources.bundle import load_bundle

DATA = Path(__file__).parent / "data"
DOC = "doc: |\n  ## What\n  x\n  ## Why\n  x\n  ## How to confirm\n  x\n  ## Fix\n  x\n  ## Sources\n  x\n"


def rule_text(rid: str, when: str = "True", extra: str = "", severity: str = "warning") -> str:
    return (
        f'id: {rid}\nfamily: K\nseverity: {severity}\ntitle: {rid}\nwhen: "{when}"\nsummary: {rid} fired\n'
        f"evidence:\n  - {{fact: f, value: v, source: s}}\n{extra}{DOC}"
    )


def write(tmp: Path, rid: str, **kw: str) -> Path:
    p = tmp / f"{rid}.yaml"
    p.write_text(rule_text(rid, **kw))
    return p


def test_explains_names_existing_rules_only(tmp_path: Path) -> None:
    write(tmp_path, "root-cause", extra="explains: [symptom-a, symptm-b]\n")
    write(tmp_path, "symptom-a")
    write(tmp_path, "symptom-b")
    with pytest.raises(RuleFileError) as err:
        load_rules([tmp_path])
    msg = str(err.value)
    assert "root-cause.yaml:" in msg and "explains unknown rule 'symptm-b'" in msg and "symptom-b" in msg
    # The line is the explains line.
    line = int(msg.split("root-cause.yaml:")[1].split(":")[0])
    assert (tmp_path / "root-cause.yaml").read_text().splitlines()[line - 1].startswith("explains:")


def test_explains_cycles_and_self_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "a-rule", extra="explains: [b-rule]\n")
    write(tmp_path, "b-rule", extra="explains: [a-rule]\n")
    with pytest.raises(RuleFileError, match="cycle"):
        load_rules([tmp_path])
    other = tmp_path / "self"
    other.mkdir()
    write(other, "c-rule", extra="explains: [c-rule]\n")
    with pytest.raises(RuleFileError, match="cannot explain itself"):
        load_rules([other])
    bad = tmp_path / "bad"
    bad.mkdir()
    write(bad, "d-rule", extra="explains: d-rule-x\n")
    with pytest.raises(RuleFileError, match="list of rule ids"):
        load_rules([bad])


def test_consequences_carry_caused_by_for_the_same_engine_only(tmp_path: Path) -> None:
    write(tmp_path, "root-cause", when="root", extra="explains: [symptom]\n", severity="warning")
    write(tmp_path, "symptom", when="sym", severity="critical")
    rules = load_rules([tmp_path])
    res = evaluate(
        rules,
        [
            RuleContext("e1", {"root": True, "sym": True}),
            RuleContext("e2", {"root": False, "sym": True}),
        ],
    )
    got = {(f.rule, f.engine): f.caused_by for f in res.findings}
    assert got == {("root-cause", "e1"): None, ("symptom", "e1"): "root-cause", ("symptom", "e2"): None}


def test_reports_lead_with_the_root_and_nest_consequences() -> None:
    # A real case: the preemption storm comes from --max-num-seqs admitting more than the KV holds.
    tl = load_bundle(DATA / "cases" / "real-cpu-preemptions").timeline
    rep = Pipeline.load().evaluate(tl, now=0)
    doc = json.loads(render_json(rep))
    pairs = [(f["rule"], f["caused_by"]) for f in doc["findings"]]
    assert pairs == [("max-num-seqs-exceeds-kv", None), ("preemption-storm", "max-num-seqs-exceeds-kv")]
    assert doc["schema"] == "kvdoctor.report/1"
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


def test_for_and_clear_for_parse_durations(tmp_path: Path) -> None:
    write(tmp_path, "a-rule", extra="for: 30s\n")
    write(tmp_path, "b-rule", extra="for: 2m\nclear_for: 1h\n")
    write(tmp_path, "c-rule", extra="for: 15\n")
    write(tmp_path, "d-rule")
    got = {r.id: (r.for_s, r.clear_for_s) for r in load_rules([tmp_path])}
    assert got == {
        "a-rule": (30.0, 30.0),
        "b-rule": (120.0, 3600.0),
        "c-rule": (15.0, 15.0),
        "d-rule": (0.0, 0.0),
    }
    for bad in ("for: soon\n", "for: -5\n", "clear_for: true\n"):
        d = tmp_path / f"bad{abs(hash(bad))}"
        d.mkdir()
        write(d, "e-rule", extra=bad)
        with pytest.raises(RuleFileError, match="duration"):
            load_rules([d])


def test_the_shipped_catalogue_declares_explains_that_hold() -> None:
    rules = {r.id: r for r in Pipeline.load().rules}
    assert set(rules["weights-not-sharded"].explains) >= {
        "kv-budget-exhausted",
        "max-model-len-exceeds-kv-capacity",
    }
    assert "kv-budget-exhausted" in rules["orphaned-engine-processes"].explains
    assert all(t in rules for r in rules.values() for t in r.explains)
