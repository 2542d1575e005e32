"""The rule memo (``RuleMemo``): a rule whose variables did not change is not evaluated again,
and its result is the one evaluating it would give, errors included."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvdoctor import rules_engine as RE
from kvdoctor.derive import build_contexts
from kvdoctor.feeds import read_to_end
from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import render_json
from kvdoctor.rules_engine import RuleContext, RuleMemo, evaluate, load_rules
from tests.conftest import evaluation_outcome as _outcome

DATA = Path(__file__).parent / "data"
DOC = "doc: |\n  ## What\n  x\n  ## Why\n  x\n  ## How to confirm\n  x\n  ## Fix\n  x\n  ## Sources\n  x\n"


def _rules(tmp_path: Path, body: str, rid: str = "memo-rule") -> list[RE.Rule]:
    (tmp_path / f"{rid}.yaml").write_text(
        f"id: {rid}\nfamily: K\nseverity: warning\ntitle: t\n{body}"
        f"evidence:\n  - {{fact: f, value: '{{x}}', source: s}}\n{DOC}"
    )
    return load_rules([tmp_path])


def _twice(rules: list[RE.Rule], memo: RuleMemo, variables: dict[str, Any]) -> tuple[Any, ...]:
    """The memo's outcome for ``variables``, checked against a plain evaluation."""
    ctxs = [RuleContext("e", variables, {"config"})]
    got = _outcome(evaluate(rules, ctxs, memo=memo))
    assert got == _outcome(evaluate(rules, ctxs))
    return got


def _summary(out: tuple[Any, ...]) -> str | None:
    findings = out[0]
    return findings[0]["summary"] if findings else None


def test_an_unchanged_rule_is_replayed_and_a_changed_one_evaluated(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "x > 1"\nsummary: "x is {x}, y is {y}"\n')
    memo = RuleMemo()
    assert _summary(_twice(rules, memo, {"x": 2, "y": "a"})) == "x is 2, y is a"
    assert (memo.evaluated, memo.replayed) == (1, 0)
    assert _summary(_twice(rules, memo, {"x": 2, "y": "a"})) == "x is 2, y is a"
    assert (memo.evaluated, memo.replayed) == (1, 1)
    # a name only the summary reads counts once the rule fires
    assert _summary(_twice(rules, memo, {"x": 2, "y": "b"})) == "x is 2, y is b"
    assert memo.evaluated == 2
    # a name the rule does not read changes nothing
    assert _summary(_twice(rules, memo, {"x": 2, "y": "b", "z": 1})) == "x is 2, y is b"
    assert memo.evaluated == 2
    assert _summary(_twice(rules, memo, {"x": 0, "y": "b"})) is None
    # a rule that did not fire read only its when: its summary's names do not matter
    before = memo.evaluated
    assert _summary(_twice(rules, memo, {"x": 0, "y": "c"})) is None
    assert memo.evaluated == before


@pytest.mark.parametrize(
    ("first", "then", "shown"),
    [
        (3, 3.0, "3.0"),  # 3 == 3.0 in Python, not in a template
        (1, True, "True"),
        (0.0, -0.0, "-0.0"),
        ([1, 2], [1.0, 2], "[1.0, 2]"),
        ([1, 2], [2, 1], "[2, 1]"),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "{'b': 2, 'a': 1}"),
        ((1, "a"), [1, "a"], "[1, 'a']"),
        ([[0.0]], [[-0.0]], "[[-0.0]]"),
    ],
)
def test_values_python_calls_equal_but_that_read_differently_are_changes(
    tmp_path: Path, first: Any, then: Any, shown: str
) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{v}"\n')
    memo = RuleMemo()
    _twice(rules, memo, {"v": first})
    assert _summary(_twice(rules, memo, {"v": then})) == shown
    assert memo.evaluated == 2


def test_a_container_changed_in_place_is_a_change(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{len(v)} {v}"\n')
    memo = RuleMemo()
    v = [1, 2]
    _twice(rules, memo, {"v": v})
    v.append(3)  # the kept snapshot is a copy: the same list object, new content, is seen
    assert _summary(_twice(rules, memo, {"v": v})) == "3 [1, 2, 3]"


def test_a_name_that_appears_or_goes_is_a_change(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{v}"\n')
    memo = RuleMemo()
    gone = _twice(rules, memo, {"x": 1})
    assert _summary(gone) == "N/A" and any("read as None: v" in e for e in gone[2])
    assert _summary(_twice(rules, memo, {"x": 1, "v": None})) == "N/A"
    assert _twice(rules, memo, {"x": 1, "v": None})[2] == []  # provided (None): no error now
    assert _summary(_twice(rules, memo, {"x": 1})) == "N/A"
    assert memo.evaluated == 3 and memo.replayed == 1


def test_errors_are_replayed_with_the_result(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'let: {r: "x / d"}\nwhen: "True"\nsummary: "{r} {missing_name}"\n')
    memo = RuleMemo()
    first = _twice(rules, memo, {"x": 1, "d": 0})
    assert any("ZeroDivisionError" in e for e in first[2]) and any("missing_name" in e for e in first[2])
    assert _twice(rules, memo, {"x": 1, "d": 0}) == first
    assert memo.replayed == 1


def test_the_fix_check_s_names_count(tmp_path: Path) -> None:
    # the fix reads only x; whether it is dropped ("already in effect") depends on max_num_seqs,
    # which only fix_validity reads
    rules = _rules(tmp_path, 'when: "True"\nsummary: s\nfix: {--max-num-seqs: "x"}\n')
    memo = RuleMemo()
    flags = _twice(rules, memo, {"x": 8, "max_num_seqs": 16})[0][0]["suggested_flags"]
    assert flags == {"--max-num-seqs": "8"}
    out = _twice(rules, memo, {"x": 8, "max_num_seqs": 8})
    assert out[0][0]["suggested_flags"] == {}
    assert any("already in effect" in e for e in out[2])
    assert memo.evaluated == 2


def test_a_threshold_and_a_defined_let_hide_the_variable_of_that_name(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'thresholds: {t: 5}\nlet: {y: "x + 1"}\nwhen: "x + y > t"\nsummary: "{y} {t}"\n')
    memo = RuleMemo()
    assert _summary(_twice(rules, memo, {"x": 3, "t": 100, "y": 0})) == "4 5"
    # t and y of the context are never read: not a change
    assert _summary(_twice(rules, memo, {"x": 3, "t": 1, "y": 9})) == "4 5"
    assert memo.replayed == 1


def test_a_let_read_before_its_definition_reads_the_variable(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'let: {y: "y * 2"}\nwhen: "True"\nsummary: "{y}"\n')
    memo = RuleMemo()
    assert _summary(_twice(rules, memo, {"y": 2})) == "4"
    assert _summary(_twice(rules, memo, {"y": 3})) == "6"


def test_a_rule_calling_a_registered_function_is_never_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted(v: int) -> int:
        calls.append(v)
        return len(calls)

    monkeypatch.setitem(RE.FUNCTIONS, "counted_for_test", counted)
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{counted_for_test(x)}"\n')
    memo = RuleMemo()
    ctxs = [RuleContext("e", {"x": 1}, set())]
    assert [evaluate(rules, ctxs, memo=memo).findings[0].summary for _ in range(3)] == ["1", "2", "3"]
    assert memo.replayed == 0


def test_a_replaced_function_is_a_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{join(xs)}"\n')
    memo = RuleMemo()
    ctxs = [RuleContext("e", {"xs": [1, 2]}, set())]
    assert evaluate(rules, ctxs, memo=memo).findings[0].summary == "1 2"
    monkeypatch.setitem(RE.FUNCTIONS, "join", lambda items: "+".join(map(str, items)))
    assert evaluate(rules, ctxs, memo=memo).findings[0].summary == "1+2"


def test_replayed_findings_are_new_objects(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{x}"\nfix: {--max-num-seqs: "x"}\ngpus: "[0]"\n')
    memo = RuleMemo()
    ctxs = [RuleContext("e", {"x": 4}, set())]
    first = evaluate(rules, ctxs, memo=memo).findings[0]
    first.summary = "changed"
    first.evidence[0].value = "changed"
    first.suggested_flags["--max-num-seqs"] = "1"
    first.gpus.append(7)
    first.caused_by = "other"
    again = evaluate(rules, ctxs, memo=memo).findings[0]
    assert memo.replayed == 1
    assert (again.summary, again.evidence[0].value, again.suggested_flags, again.gpus, again.caused_by) == (
        "4",
        "4",
        {"--max-num-seqs": "4"},
        [0],
        None,
    )


def test_inputs_and_rules_that_change_between_calls(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _rules(tmp_path / "a", 'needs: [log]\nwhen: "True"\nsummary: "{x}"\n', rid="rule-a")
    b = _rules(tmp_path / "b", 'when: "x > 1"\nsummary: "{x}"\n', rid="rule-b")
    memo = RuleMemo()
    variables = {"x": 2}
    for rules, inputs in [
        (a, {"log"}),
        (a, set()),
        (a, {"log"}),
        (a + b, {"log"}),
        (b, set()),
        (a + b, set()),
    ]:
        ctxs = [RuleContext("e", variables, inputs)]
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == _outcome(evaluate(rules, ctxs))


def test_a_memo_in_use_by_another_thread_is_left_alone(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{x}"\n')
    memo = RuleMemo()
    with memo.lock:
        out = evaluate(rules, [RuleContext("e", {"x": 1}, set())], memo=memo)
    assert out.findings[0].summary == "1"
    assert (memo.evaluated, memo.replayed, memo.engines) == (0, 0, {})


def test_the_memo_is_bounded_by_engines(tmp_path: Path) -> None:
    rules = _rules(tmp_path, 'when: "True"\nsummary: "{x}"\n')
    memo = RuleMemo(max_engines=3)
    for i in range(10):
        evaluate(rules, [RuleContext(f"e{i}", {"x": i}, set())], memo=memo)
    assert list(memo.engines) == ["e7", "e8", "e9"]
    memo.clear()
    assert memo.engines == {}


def _bundle_contexts() -> list[tuple[str, list[RuleContext]]]:
    out = []
    for root in (DATA / "bundles", DATA / "cases"):
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            try:
                feed = open_feed(InputOptions(bundle=d))
            except Exception:  # noqa: BLE001 - a bundle the suite keeps as unreadable
                continue
            tl = read_to_end(feed) if hasattr(feed, "next") else feed
            latest = tl.latest
            _, contexts, _ = build_contexts(tl, list(latest.configs) if latest else [], window_s=60.0)
            out.append((d.name, [RuleContext(e, v, i) for e, v, i in contexts]))
    return out


def test_the_catalogue_over_every_bundle_in_any_order_gives_what_evaluating_gives() -> None:
    rules = Pipeline.load().rules
    bundles = _bundle_contexts()
    assert len(bundles) > 10
    memo = RuleMemo()
    order = bundles * 2
    random.Random(7).shuffle(order)
    for name, ctxs in order:
        want = _outcome(evaluate(rules, ctxs))
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == want, name
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == want, name  # replayed
    assert memo.replayed > memo.evaluated


def test_a_pipeline_keeps_its_memo_and_its_reports_are_the_same() -> None:
    pipe = Pipeline.load()
    bundle = DATA / "bundles" / sorted(p.name for p in (DATA / "bundles").iterdir() if p.is_dir())[0]
    feed = open_feed(InputOptions(bundle=bundle))
    tl = read_to_end(feed) if hasattr(feed, "next") else feed
    first = render_json(pipe.evaluate(tl, now=0.0))
    assert pipe.memo is pipe.memo
    assert render_json(pipe.evaluate(tl, now=0.0)) == first
    assert render_json(Pipeline(rules=pipe.rules).evaluate(tl, now=0.0)) == first
    assert pipe.memo.replayed > 0
