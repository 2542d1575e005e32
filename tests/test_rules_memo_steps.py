"""The rule memo's finer grain: a rule evaluated again re-evaluates only the steps (lets, when,
templates, fixes, gpus) whose variables changed, and a memo's causes and order of findings
are reused while the findings' keys hold; the report's order and time stamp are reused the
same way. Each is checked against evaluating afresh."""

from __future__ import annotations

import copy
import random
from datetime import datetime, timezone
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest

from kvdoctor import report as RP
from kvdoctor import rules_engine as RE
from kvdoctor.facts import EngineMetrics, Gpu, GpuProcess, Snapshot, Timeline
from kvdoctor.findings import Finding, causal_order
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import render_json
from kvdoctor.rules_engine import RuleContext, RuleMemo, evaluate, load_rules
from kvdoctor.units import GiB
from tests.conftest import evaluation_outcome as _outcome

DOC = "doc: |\n  ## What\n  x\n  ## Why\n  x\n  ## How to confirm\n  x\n  ## Fix\n  x\n  ## Sources\n  x\n"

#: a rule with a step of every kind: lets reading lets, severity_if, evidence with and without
#: when, a fix the fix check reads the context for, gpus; it errs (d == 0), reads a name some
#: contexts lack (opt) and fires or not with x
RICH = """id: rich-rule
family: K
severity: warning
title: "rich {t}"
thresholds: {t: 2}
let:
  a: "x * 2"
  b: "a + y"
  r: "y / d"
  c: "[v * 2 for v in vs]"
when: "a > t"
severity_if: [{when: "b > 40", severity: critical}]
summary: "a={a} b={b} r={r} c={c} opt={opt if x > 20 else 0} z={z:.1f}"
evidence:
  - {fact: "fixed", value: "literal", source: "nowhere"}
  - {fact: "y", value: "{y}", source: "s {len(vs)}", when: "y > 3"}
  - {fact: "z", value: "{z:.2f}", source: "s"}
fix:
  --max-num-seqs: "x"
  --kv-cache-dtype: "'fp8' if y % 2 else None"
gpus: "[g for g in vs if g < 4]"
explains: [plain-rule]
"""
PLAIN = """id: plain-rule
family: L
severity: info
title: plain
let: {q: "y + 1"}
when: "gate and q > 2"
summary: "q={q}"
evidence:
  - {fact: q, value: "{q}", source: s}
"""


def _load(tmp_path: Path) -> list[RE.Rule]:
    (tmp_path / "rich-rule.yaml").write_text(RICH + DOC)
    (tmp_path / "plain-rule.yaml").write_text(PLAIN + DOC)
    return load_rules([tmp_path])


def _variables(rng: random.Random) -> dict[str, Any]:
    return {
        "x": rng.choice([0, 1, 3, 8, 8, 25]),
        "y": rng.choice([1, 4, 4, 5, 40]),
        "d": rng.choice([0, 1, 1, 2]),
        "vs": rng.choice([[1, 2], [1, 2], [5, 1], []]),
        "z": rng.choice([0.5, 0.5, -0.0, 0.0, 2.25]),
        "opt": rng.choice([1, 1, "s"]),
        "max_num_seqs": rng.choice([8, 16, None]),
        "kv_cache_dtype": rng.choice(["auto", "fp8"]),
        "gate": rng.choice([True, True, False, 0, 1]),
    }


def test_a_memo_over_random_changes_gives_what_evaluating_afresh_gives(tmp_path: Path) -> None:
    rules = _load(tmp_path)
    rng = random.Random(3)
    memo = RuleMemo()
    engines: dict[str, dict[str, Any]] = {"e0": _variables(rng), "e1": _variables(rng)}
    fired = 0
    for _ in range(400):
        for v in engines.values():  # a few names change per cycle, as in a live face
            fresh = _variables(rng)
            for name in rng.sample(sorted(fresh), rng.choice([0, 1, 1, 2, 3])):
                v[name] = fresh[name]
            if rng.random() < 0.1:
                v.pop("opt", None)  # a name the context lacks now
        ctxs = [RuleContext(e, dict(v), {"config"}) for e, v in engines.items()]
        want = _outcome(evaluate(rules, ctxs))
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == want
        fired += bool(want[0])
    assert fired > 100
    assert memo.replayed > 0 and memo.evaluated > 0


def test_only_the_steps_whose_variables_changed_are_evaluated_again(tmp_path: Path) -> None:
    rules = _load(tmp_path)
    rich = next(r for r in rules if r.id == "rich-rule")
    counts: dict[str, int] = {}

    def counted(expr: RE.Expr) -> None:
        code = expr.code  # compiled now: its first call would replace fn
        inner = RE._fallback_fn(expr.source) if code is None else FunctionType(code, RE._EXPR_GLOBALS)

        def fn(names: Any, functions: Any) -> Any:
            counts[expr.source] = counts.get(expr.source, 0) + 1
            return inner(names, functions)

        object.__setattr__(expr, "fn", fn)

    for expr in RE._all_exprs(rich):
        counted(expr)
    memo = RuleMemo()
    base = {"x": 8, "y": 4, "d": 1, "vs": [1, 2], "z": 0.5, "opt": 1, "max_num_seqs": 16}
    ctxs = [RuleContext("e", base, {"config"})]
    first = _outcome(evaluate(rules, ctxs, memo=memo))
    assert counts["x * 2"] == 1 and first[0][0]["summary"].startswith("a=16 b=20")
    # only z changed: the lets and the when are not evaluated again, the z fields are
    ctxs = [RuleContext("e", {**base, "z": 2.25}, {"config"})]
    second = _outcome(evaluate(rules, ctxs, memo=memo))
    assert second == _outcome(evaluate(rules, ctxs))
    assert counts["x * 2"] == 2  # the plain evaluation's, not the memo's
    assert counts["z"] == 6  # "{z:.1f}" and "{z:.2f}": by the memo twice, then afresh
    assert "z=2.2" in second[0][0]["summary"] and memo.evaluated >= 2
    # y changed: b, r, the severity, the y evidence and the dtype fix follow; a does not
    counts.clear()
    ctxs = [RuleContext("e", {**base, "z": 2.25, "y": 41}, {"config"})]
    third = _outcome(evaluate(rules, ctxs, memo=memo))
    assert "x * 2" not in counts and counts["a + y"] == 1 and counts["y / d"] == 1
    counts.clear()
    assert third == _outcome(evaluate(rules, ctxs))
    assert third[0][0]["severity"] == "critical"
    assert third[0][0]["suggested_flags"] == {"--max-num-seqs": "8", "--kv-cache-dtype": "fp8"}


def test_a_rule_that_did_not_fire_reads_only_what_decided_it(tmp_path: Path) -> None:
    rules = [r for r in _load(tmp_path) if r.id == "plain-rule"]
    memo = RuleMemo()

    def run(**variables: Any) -> tuple[Any, ...]:
        ctxs = [RuleContext("e", variables, set())]
        got = _outcome(evaluate(rules, ctxs, memo=memo))
        assert got == _outcome(evaluate(rules, ctxs))
        return got

    run(gate=False, y=1)
    assert memo.evaluated == 1
    # the let reads y: a change of y is evaluated; the when stopped at gate
    run(gate=False, y=5)
    assert memo.evaluated == 2
    run(gate=False, y=5, other=1)
    assert (memo.evaluated, memo.replayed) == (2, 1)
    (tmp_path / "gated").mkdir()
    (tmp_path / "gated" / "gated-rule.yaml").write_text(
        'id: gated-rule\nfamily: U\nseverity: info\ntitle: t\nwhen: "gate and w > 1"\nsummary: "{w}"\n'
        "evidence:\n  - {fact: f, value: v, source: s}\n" + DOC
    )
    gated = load_rules([tmp_path / "gated"])
    gmemo = RuleMemo()
    for w in (1, 2, 3, 4):  # the when stops at gate: w is not read, so not watched
        ctxs = [RuleContext("e", {"gate": False, "w": w}, set())]
        assert _outcome(evaluate(gated, ctxs, memo=gmemo)) == _outcome(evaluate(gated, ctxs))
    assert (gmemo.evaluated, gmemo.replayed) == (1, 3)
    ctxs = [RuleContext("e", {"gate": True, "w": 4}, set())]
    assert _outcome(evaluate(gated, ctxs, memo=gmemo))[0][0]["summary"] == "4"
    assert run(gate=True, y=5)[0][0]["summary"] == "q=6"
    assert memo.evaluated == 3
    # a when that reads q now: y counts, and a gate that goes back to False
    assert run(gate=True, y=0)[0] == []
    assert run(gate=0, y=0)[0] == [] and memo.evaluated == 5


def test_a_step_that_erred_is_never_reused(tmp_path: Path) -> None:
    rules = _load(tmp_path)
    memo = RuleMemo()
    variables = {"x": 8, "y": 4, "d": 0, "vs": [1], "z": 0.5, "opt": 1, "max_num_seqs": 8}
    outs = []
    for z in (0.5, 1.5, 2.5):  # d == 0 errs every time; the fix is dropped (already in effect)
        ctxs = [RuleContext("e", {**variables, "z": z}, {"config"})]
        outs.append(_outcome(evaluate(rules, ctxs, memo=memo)))
        assert outs[-1] == _outcome(evaluate(rules, ctxs))
    assert all(any("ZeroDivisionError" in e for e in o[2]) for o in outs)
    assert all(any("dropped 8: already in effect" in e for e in o[2]) for o in outs)


def test_causes_and_order_follow_severities_that_change(tmp_path: Path) -> None:
    rules = _load(tmp_path)
    memo = RuleMemo()
    for y in (4, 41, 41, 4, 1, 4, 41):
        ctxs = [
            RuleContext("e", {"x": 8, "y": y, "d": 1, "vs": [1], "z": 0.5, "opt": 1, "gate": True}, set())
        ]
        got = evaluate(rules, ctxs, memo=memo)
        want = evaluate(rules, ctxs)
        assert [(f.rule, f.severity, f.caused_by) for f in got.findings] == [
            (f.rule, f.severity, f.caused_by) for f in want.findings
        ]
    assert [(f.rule, f.caused_by) for f in got.findings] == [("rich-rule", None), ("plain-rule", "rich-rule")]


def _rolling_timeline_cycles() -> list[Timeline]:
    """Copies of a rolling Timeline (history 40: old snapshots evicted) of a busy engine:
    preemptions, KV near full, a counter reset at 120, metrics without their own timestamp
    now and then, GPU memory that moves."""
    tl = Timeline(max_len=40)
    out = []
    preempted = 0.0
    for i in range(160):
        preempted = 0.0 if i == 120 else preempted + (i % 4)  # vLLM restarted: counters reset
        gpus = [
            Gpu(index=j, memory_total_bytes=80 * GiB, memory_used_bytes=70 * GiB + (i % 5 << 20),
                utilization_gpu=(i % 9) / 10,
                processes=[GpuProcess(pid=10, name="VLLM::EngineCore", used_bytes=60 * GiB)])
            for j in range(2)
        ]  # fmt: skip
        m = EngineMetrics(timestamp=None if i % 11 == 0 else float(i), engine="0",
                          kv_cache_usage=0.97 if i % 30 < 25 else 0.5, num_requests_running=20 + i % 3,
                          num_requests_waiting=i % 4, num_preemptions_total=preempted,
                          generation_tokens_total=float(50 * i), prompt_tokens_total=float(400 * i))  # fmt: skip
        tl.append(Snapshot(timestamp=float(i), gpus=gpus, metrics=[m]))
        out.append(Timeline(snapshots=copy.deepcopy(tl.snapshots), max_len=40))
    return out


def test_a_live_pipeline_s_reports_equal_fresh_evaluations_cycle_after_cycle() -> None:
    pipe = Pipeline.load()
    fired = 0
    for tl in _rolling_timeline_cycles():
        got = render_json(pipe.evaluate(tl, now=1_800_000_000.0))
        want = render_json(Pipeline(rules=pipe.rules).evaluate(tl, now=1_800_000_000.0))
        assert got == want
        fired += '"rule":"preemption-storm"' in got
    assert fired > 20
    assert pipe.memo.replayed > 0 and pipe.memo.evaluated > 0


# --------------------------------------------------------------------------- the report's


def _iso_fresh(now: datetime | float) -> str:
    dt = datetime.fromtimestamp(now, timezone.utc) if isinstance(now, (int, float)) else now
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("start", [1_800_000_000.0, 59.0, -3.0, 0.0])
def test_the_time_stamp_is_the_second_s_text_whatever_came_before(start: float) -> None:
    rng = random.Random(int(start))
    stamps: list[datetime | float] = []
    for _ in range(200):
        step = rng.choice([0.0, 1e-7, 0.4999995, 0.5, 0.9999994, 0.9999996, 1.0, -1.0, 3600.25])
        stamps.append(start + step * rng.choice([1, 1, 2]))
        start = float(stamps[-1])
    stamps.append(datetime(2030, 1, 1, 12, 0, 0, 999999))  # naive: read as UTC
    stamps.append(datetime(2030, 1, 1, 12, 0, 1, tzinfo=timezone.utc))
    for now in stamps:
        assert RP._iso_utc(now) == _iso_fresh(now), now


def test_the_report_s_order_is_causal_order_for_any_findings() -> None:
    rng = random.Random(5)
    rules = ["r-a", "r-b", "r-c", "r-d"]
    for _ in range(300):
        findings = [
            Finding(rule=rng.choice(rules), severity=rng.choice(["critical", "warning", "info"]),
                    family=rng.choice("WKLUP"), title="t", summary=str(i), engine=rng.choice([None, "0", "1"]),
                    caused_by=rng.choice([None, None, *rules]))  # type: ignore[arg-type]
            for i in range(rng.randint(0, 6))
        ]  # fmt: skip
        got = RP._causal_order(findings)
        assert [id(f) for f in got] == [id(f) for f in causal_order(findings)]
    assert len(RP._ORDER) <= RP._ORDER_MAX


class _NoTruth:
    """A value whose truth raises (what numpy arrays do)."""

    def __bool__(self) -> bool:
        raise ValueError("ambiguous")


def test_a_when_whose_truth_raises_counts_as_not_firing_with_the_memo_too(tmp_path: Path) -> None:
    (tmp_path / "truth-rule.yaml").write_text(
        'id: truth-rule\nfamily: U\nseverity: info\ntitle: t\nwhen: "v"\nsummary: "{v}"\n'
        "evidence:\n  - {fact: f, value: v, source: s}\n" + DOC
    )
    rules = load_rules([tmp_path])
    memo = RuleMemo()
    for v in (_NoTruth(), 1, _NoTruth(), None):
        ctxs = [RuleContext("e", {"v": v}, set())]
        got = _outcome(evaluate(rules, ctxs, memo=memo))
        assert got == _outcome(evaluate(rules, ctxs))
        assert bool(got[0]) == (v == 1)
        assert any("ValueError: ambiguous" in e for e in got[2]) == isinstance(v, _NoTruth)


# --------------------------------------------------------------------------- session 8: lets by value

#: lets that short-circuit over names a later let reads again (``x``: fetched by ``a`` or by
#: ``b``), lets many values map to one (``big``), a let named like the variable it reads
#: (``w``), and a when that stops early or late
SHORT = """id: short-rule
family: U
severity: info
title: "short {big}"
thresholds: {lim: 5}
let:
  a: "c and x > 0"
  b: "x + 1"
  big: "b > lim"
  w: "w or 0"
  label: "'big' if big else 'small'"
when: "(gate or a) and (big or w > 2)"
summary: "b={b} {label} w={w}"
evidence:
  - {fact: "x", value: "{x}", source: "s {label}", when: "c"}
"""


def _counted(rules: list[RE.Rule], counts: dict[str, int]) -> None:
    """Count each expression's evaluations (by its source) in ``counts``."""
    for rule in rules:
        for expr in RE._all_exprs(rule):
            code = expr.code  # compiled now: its first call would replace fn
            inner = RE._fallback_fn(expr.source) if code is None else FunctionType(code, RE._EXPR_GLOBALS)

            def fn(names: Any, functions: Any, inner: Any = inner, src: str = expr.source) -> Any:
                counts[src] = counts.get(src, 0) + 1
                return inner(names, functions)

            object.__setattr__(expr, "fn", fn)


def test_a_step_reused_after_the_let_that_fetched_its_name_stopped_reading_it(tmp_path: Path) -> None:
    # a fetched x (c true) and b read it again; then c turns false: a no longer reads x, b is
    # reused; a later change of x alone must still be seen (b read x)
    (tmp_path / "short-rule.yaml").write_text(SHORT + DOC)
    rules = load_rules([tmp_path])
    memo = RuleMemo()
    steps = [
        {"c": True, "x": 3, "gate": False, "w": 0},
        {"c": False, "x": 3, "gate": False, "w": 0},
        {"c": False, "x": 9, "gate": False, "w": 0},
        {"c": False, "x": 9, "gate": True, "w": 0},
        {"c": False, "x": 2, "gate": True, "w": 0},
    ]
    for variables in steps:
        ctxs = [RuleContext("e", variables, set())]
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == _outcome(evaluate(rules, ctxs)), variables
    assert _outcome(evaluate(rules, [RuleContext("e", steps[-1], set())], memo=memo))[0] == []


def test_a_let_that_kept_its_value_does_not_make_its_readers_evaluate_again(tmp_path: Path) -> None:
    (tmp_path / "short-rule.yaml").write_text(SHORT + DOC)
    rules = load_rules([tmp_path])
    counts: dict[str, int] = {}
    _counted(rules, counts)
    memo = RuleMemo()
    for x in (10, 11, 12, 13):  # b changes each time, big (b > 5) and label do not
        ctxs = [RuleContext("e", {"c": True, "x": x, "gate": True, "w": 0}, set())]
        got = _outcome(evaluate(rules, ctxs, memo=memo))
        assert got[0][0]["summary"] == f"b={x + 1} big w=0"
    assert counts["x + 1"] == 4 and counts["b > lim"] == 4
    assert counts["'big' if big else 'small'"] == 1  # big held True: its reader is reused
    # the summary reads b: rendered each time, but its label field only once (field by
    # field), as the evidence source, which reads only label
    assert counts["label"] == 1 + 1 and counts["w"] == 1
    assert counts["b"] == 4 and counts["x"] == 4  # the summary's b, the evidence value's x
    # big turns False: label is evaluated again, and the when, which reads big
    ctxs = [RuleContext("e", {"c": True, "x": 1, "gate": True, "w": 0}, set())]
    assert _outcome(evaluate(rules, ctxs, memo=memo)) == _outcome(evaluate(rules, ctxs))


def test_a_rule_that_did_not_fire_reuses_its_steps_too(tmp_path: Path) -> None:
    (tmp_path / "short-rule.yaml").write_text(SHORT + DOC)
    rules = load_rules([tmp_path])
    counts: dict[str, int] = {}
    _counted(rules, counts)
    memo = RuleMemo()
    for w in (0, 1, 2, 0, 1):  # never fires (big false, w <= 2); only w's steps run again
        ctxs = [RuleContext("e", {"c": True, "x": 1, "gate": True, "w": w}, set())]
        assert _outcome(evaluate(rules, ctxs, memo=memo))[0] == []
    assert counts["x + 1"] == 1 and counts["c and x > 0"] == 1 and counts["b > lim"] == 1
    assert counts["w or 0"] == 5 and memo.evaluated == 5


#: a rule whose templates' fields change apart: some fail to format ("s" with ".1f"), some are
#: None (N/A), one reads a let that keeps its value across many inputs
FIELDS = """id: fields-rule
family: U
severity: info
title: "fields {'x' if pos else 'no x'}"
let:
  pos: "(x or 0) > 0"
when: "gate or pos"
summary: "w={w:.1f} x={x} pos={pos} c={c} both={(x, w)}"
evidence:
  - {fact: "w", value: "{w} / {x:,}", source: "s {c}"}
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lets_by_value_over_random_changes_give_what_evaluating_afresh_gives(
    tmp_path: Path, seed: int
) -> None:
    (tmp_path / "short-rule.yaml").write_text(SHORT + DOC)
    (tmp_path / "rich-rule.yaml").write_text(RICH + DOC)
    (tmp_path / "plain-rule.yaml").write_text(PLAIN + DOC)
    (tmp_path / "fields-rule.yaml").write_text(FIELDS + DOC)
    rules = load_rules([tmp_path])
    rng = random.Random(seed)
    memo = RuleMemo()

    def pick() -> dict[str, Any]:
        return {
            **_variables(rng),
            "c": rng.choice([True, False, 0, 1]),
            "x": rng.choice([0, 1, 3, 3, 9, 9.0, -0.0, 0.0]),
            "w": rng.choice([0, 0, 3, 3.0, None, "", "s"]),
        }

    variables = pick()
    seen = set()
    for _ in range(300):
        fresh = pick()
        for name in rng.sample(sorted(fresh), rng.choice([0, 1, 1, 2])):
            variables[name] = fresh[name]
        if rng.random() < 0.05:
            variables.pop("x", None)  # a name the context lacks now
        ctxs = [RuleContext("e", dict(variables), {"config"})]
        want = _outcome(evaluate(rules, ctxs))
        assert _outcome(evaluate(rules, ctxs, memo=memo)) == want
        seen.update(f["rule"] for f in want[0])
    assert seen >= {"short-rule", "rich-rule", "fields-rule"}
