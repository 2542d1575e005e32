"""Compiled rule expressions (issue 10) evaluate exactly as simpleeval does.

Differential: every expression of every shipped rule, over the variables derive builds from
every bundle (tests/data/bundles, tests/data/cases, /work/shared/cases when present), gives the
same value or the same error compiled and under simpleeval (``evaluate(reference=True)``), and
so does the whole evaluation. Hostile: what a rule file may write (a user's own ``--rules``
directory included) is as safe compiled as under simpleeval: the same guards (huge powers,
strings, sequences, comprehensions), no builtins, no attribute, forbidden functions refused,
constructs refused at load still refused; constructs native code would not evaluate exactly
like simpleeval are left to simpleeval.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
import simpleeval

from kvdoctor import rules_engine as RE
from kvdoctor.derive import build_contexts
from kvdoctor.pipeline import variable_catalogue
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.userconfig import UserConfig, apply_user_config

DATA = Path(__file__).parent / "data"
SHARED_CASES = Path("/work/shared/cases")
RULES = RE.load_rules(known_names=variable_catalogue())


def _bundles() -> list[Path]:
    seen: dict[str, Path] = {}
    for root in (DATA / "bundles", DATA / "cases", SHARED_CASES):
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if d.is_dir():
                    seen.setdefault(f"{root.name}/{d.name}", d)
    return [seen[k] for k in sorted(seen)]


BUNDLES = _bundles()


def _contexts(bundle: Path) -> list[RE.RuleContext]:
    tl = load_bundle(bundle).timeline
    latest = tl.latest
    _, contexts, _ = build_contexts(tl, list(latest.configs) if latest else [], window_s=60.0)
    return [RE.RuleContext(engine=e, variables=v, inputs=i) for e, v, i in contexts]


def _outcome(run: RE._Runner, expr: RE.Expr) -> tuple[Any, ...]:
    """What evaluating ``expr`` gave: the value (type and repr: 1 == 1.0 == True would hide a
    difference) and the errors it added."""
    n = len(run.errors)
    v = run.value(expr)
    return (type(v).__name__, repr(v), [e.message for e in run.errors[n:]])


def _runners(rule: RE.Rule, ctx: RE.RuleContext) -> tuple[RE._Runner, RE._Runner]:
    """A compiled and a simpleeval runner for ``rule`` over ``ctx``, names as evaluate makes them."""
    out = []
    for cls in (RE._Runner, RE._ReferenceRunner):
        names = RE._Names(RE.CONSTANTS)
        names.update(ctx.variables)
        names = RE._Names(names)
        names.missing = set()
        names.update(rule.thresholds)
        run = cls(names, RE._functions(), rule, ctx.engine, [])
        if isinstance(run, RE._ReferenceRunner):
            run.evaluator = simpleeval.EvalWithCompoundTypes(functions=dict(run.functions), names={})
            run.evaluator.nodes.pop(ast.Attribute, None)
        out.append(run)
    return out[0], out[1]


def _compare_rule(rule: RE.Rule, ctx: RE.RuleContext) -> int:
    """Every expression of ``rule`` over ``ctx`` both ways (``let`` values feed the later ones,
    each side its own); returns how many were compared."""
    compiled, reference = _runners(rule, ctx)
    count = 0
    for name, expr in rule.let:
        got, want = _outcome(compiled, expr), _outcome(reference, expr)
        assert got == want, (rule.id, ctx.engine, expr.where, expr.source)
        compiled.names[name] = compiled.value(expr)
        reference.names[name] = reference.value(expr)
        count += 1
    for expr in RE._all_exprs(rule):
        if expr.where.startswith("let "):
            continue
        got, want = _outcome(compiled, expr), _outcome(reference, expr)
        assert got == want, (rule.id, ctx.engine, expr.where, expr.source)
        count += 1
    assert compiled.names.missing == reference.names.missing, rule.id
    return count


def _zeroed(rules: list[RE.Rule]) -> list[RE.Rule]:
    """The rules with every numeric threshold 0 (user-config overrides: other branches run)."""
    cfg = UserConfig(
        thresholds={
            r.id: {k: 0 for k, v in r.thresholds.items() if RE._threshold_kind(v) == "number"}
            for r in rules
            if any(RE._threshold_kind(v) == "number" for v in r.thresholds.values())
        }
    )
    return apply_user_config(rules, cfg)


def _report(ev: RE.Evaluation) -> tuple[Any, ...]:
    return (
        [f.to_dict() for f in ev.findings],
        [(s.rule, s.engine, s.missing) for s in ev.skipped],
        [str(e) for e in ev.errors],
    )


def test_every_shipped_expression_is_compiled() -> None:
    # none left to simpleeval: the cycle's cost is the compiled form's
    exprs = [e for r in RULES for e in RE._all_exprs(r)]
    assert len(exprs) > 500
    assert [e.source for e in exprs if e.code is None] == []


def test_there_are_bundles_to_compare_over() -> None:
    assert len(BUNDLES) >= 100


@pytest.mark.parametrize("bundle", BUNDLES, ids=[f"{b.parent.name}/{b.name}" for b in BUNDLES])
def test_compiled_equals_simpleeval_on_every_bundle(bundle: Path) -> None:
    contexts = _contexts(bundle)
    assert contexts
    compared = 0
    for rules in (RULES, _zeroed(RULES)):
        for ctx in contexts:
            for rule in rules:
                compared += _compare_rule(rule, ctx)
        assert _report(RE.evaluate(rules, contexts)) == _report(RE.evaluate(rules, contexts, reference=True))
    assert compared >= 2 * len(contexts) * 500


# --------------------------------------------------------------------------- hostile expressions

BIG = list(range(20000))
NAMES: dict[str, Any] = {
    "n": 5,
    "x": 2.5,
    "s": "abc",
    "xs": [1, 2, 3],
    "big": BIG,
    "thirty": list(range(30)),
    "pairs": [(1, 2), (3, 4)],
    "ragged": [(1, 2, 3), (4,)],
    "d": {"a": 1, "b": None},
    "none": None,
    "nan": math.nan,
    "hints": ["logprobs"],
}


def _rule(expr: RE.Expr) -> RE.Rule:
    text = RE.compile_template("t", path="t", line=1, where="title")
    return RE.Rule(
        id="t", family="K", severity="info", title=text, summary=text, evidence=(), when=expr, doc=""
    )


def _both(src: str, names: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...], RE.Expr]:
    expr = RE.compile_expr(src, path="t.yaml", line=1, where="when")
    rule = _rule(expr)
    ctx = RE.RuleContext(engine=None, variables=dict(NAMES if names is None else names))
    compiled, reference = _runners(rule, ctx)
    got, want = _outcome(compiled, expr), _outcome(reference, expr)
    assert compiled.names.missing == reference.names.missing
    return got, want, expr


GUARDED = [
    ("'a' * 200000", "IterableTooLong"),
    ("[1] * 100001", "IterableTooLong"),
    ("100001 * [1]", "IterableTooLong"),
    ("'x' * 60000 + 'y' * 60000", "IterableTooLong"),
    ("xs * 50000", "IterableTooLong"),
    ("2 ** 5000000", "NumberTooHigh"),
    ("4000001 ** 2", "NumberTooHigh"),
    ("1 << 100000", "NumberTooHigh"),
    ("1 >> 100000", "NumberTooHigh"),
    ("1e309 << 1", "NumberTooHigh"),
    ("[i for i in thirty for j in thirty for k in thirty]", "IterableTooLong"),
    ("sum([1 for a in big])", "IterableTooLong"),
    ("len([a for a in thirty]) + len([b for b in big])", "IterableTooLong"),
    ("'" + "a" * 100001 + "'", "IterableTooLong"),
]


@pytest.mark.parametrize(("src", "error"), GUARDED, ids=[s[:40] for s, _ in GUARDED])
def test_simpleeval_guards_hold_compiled(src: str, error: str) -> None:
    got, want, _ = _both(src)
    assert got == want
    assert got[0] == "NoneType" and got[2] and got[2][0].startswith(f"{error}: ")


SAME = [
    # values
    "n + x * 2 - 1 / 4 // 1 % 3",
    "'a' * 100000 == 'a' * 100000",  # at the limit: allowed
    "2 ** 20 + (-2) ** 3 + 2 ** -1",
    "1 < n < 10",
    "1 < n > 10 < undefined_name",
    "not n or none",
    "none and 1/0",
    "n if s else x",
    "s in hints or 'logprobs' in hints",
    "'a' not in s and n is not None and none is None",
    "xs[0:2] + [xs[-1]] + list(xs[::2])",
    "d['a']",
    "(1, n, s)",
    "[n, x, [s]]",
    "min(xs) + max(xs, default=0) + round(x)",
    "sorted(xs, reverse=True)",
    "tuple(xs) + tuple(s)",  # simpleeval's EvalWithCompoundTypes adds tuple/dict/set/list
    "dict(a=1)",
    "set(xs) == set(xs)",
    "[h for h in hints if h in ('logprobs', 'x')]",
    "any(h in hints for h in ('logprobs', 'multimodal'))",
    "[[a * b for a in xs] for b in xs]",
    "[a for a in xs for b in xs if a < b]",
    "[a for a in [a for a in xs]]",
    "[n for n in xs]",  # a target shadows a variable
    "[i for i in s]",
    "[x for x in x]",  # the first iterable reads the name around: 2.5 is not iterable
    "nan == nan",
    "-s if False else ~n",
    "__debug__",  # a name like any other: not provided, None
    "__builtins__",
    "min",  # a function's name read bare is a name, not the function
    "undefined_name",
    "True and False or None",
    # errors, the same message
    "none + 1",
    "1 / 0",
    "'a' < 1",
    "-s",
    "'ab' * 'c'",  # simpleeval's guard fails first, with its own TypeError
    "d['zz']",
    "xs[10]",
    "len(n)",
    "min()",
    "undefined_fn(1)",
    "__import__('os')",
    "eval('1')",
    "open('/tmp/kvdoctor-pwned', 'w')",
    "any(v > 1 for v in [5, none])",  # eager as simpleeval: the None is compared too
    "[v for v in none]",
    "int('x')",
    "float('inf') ** 2",
    "10 ** 400 * 1.0",
    # left to simpleeval: same semantics by construction
    "{'a': 1, 'b': n}['b']",
    "{1, 2} == {2, 1}",
    "{k: 1 for k in xs}",
    "{**d}",
    "f'{n} and {x:.1f} {s!r}'",
    "[a for a, b in pairs]",
    "[b for a, b in ragged]",  # simpleeval zips: no unpacking error
    "[v for w in xs for v in (v, w)]",  # a target read before it is bound
    "[__n for __n in xs]",  # a target named like the compiled code's own
    "max(xs, **{'default': 0})",
    "max(xs, key=None, key=None)",  # Python's compiler refuses it, simpleeval takes the last
]


@pytest.mark.parametrize("src", SAME)
def test_compiled_equals_simpleeval(src: str) -> None:
    got, want, _ = _both(src)
    assert got == want


def test_constructs_with_other_python_semantics_are_left_to_simpleeval() -> None:
    for src in ("{'a': 1}", "{1}", "{k: 1 for k in xs}", "f'{n}'", "[a for a, b in pairs]", "max(**d)"):
        assert RE.compile_expr(src, path="t", line=1, where="when").code is None, src
    for src in ("n + 1", "[h for h in hints]", "any(h for h in hints)", "f(a=1)"):
        assert RE.compile_expr(src, path="t", line=1, where="when").code is not None, src


@pytest.mark.parametrize(
    "src",
    [
        "x.__class__",
        "(lambda: 1)()",
        "(y := 1)",
        "{v for v in xs}",
        "[*xs]",
        "f()()",
        "xs[0]()",
        "n @ n",
        "(yield)",
        "await n",
    ],
)
def test_what_load_refuses_stays_refused(src: str) -> None:
    with pytest.raises(RE.RuleFileError) as err:
        RE.compile_expr(src, path="t.yaml", line=3, where="when")
    assert str(err.value).startswith("t.yaml:3: ")


def test_a_deeply_nested_expression_is_a_rule_file_error_or_evaluates_alike() -> None:
    for src in ("(" * 300 + "1" + ")" * 300, "-" * 3000 + "1", "1" + " + 1" * 3000, "not " * 3000 + "n"):
        try:
            got, want, _ = _both(src)
        except RE.RuleFileError as err:
            assert str(err).startswith("t.yaml:1: ")
        else:
            assert got == want


def test_the_compiled_code_reaches_no_builtin_and_no_global() -> None:
    expr = RE.compile_expr("min(xs) + n", path="t", line=1, where="when")
    assert expr.code is not None
    assert set(expr.code.co_names) <= set(RE._EXPR_GLOBALS) - {"__builtins__"}
    assert expr.fn(RE._Names(xs=[4], n=1), RE._functions()) == 5  # the first call makes the function
    assert expr.fn.__globals__["__builtins__"] == {}
    assert RE._code_ok(expr.code)


def test_a_forbidden_function_cannot_be_registered_or_called(monkeypatch: pytest.MonkeyPatch) -> None:
    for fn in (eval, exec, open, getattr, type, __import__("os").system):
        with pytest.raises(ValueError):
            RE.register_function("evil", fn)
    assert "evil" not in RE.FUNCTIONS
    monkeypatch.setitem(RE.FUNCTIONS, "evil", eval)  # put there behind register_function's back
    expr = RE.compile_expr("evil('1 + 1')", path="t", line=1, where="when")
    run = RE._Runner(RE._Names(), RE._functions(), _rule(expr), None, [])
    assert _outcome(run, expr) == ("NoneType", "None", ["FeatureNotAvailable: This function is forbidden"])


def test_a_registered_function_is_called_at_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    expr = RE.compile_expr("triple(n)", path="t", line=1, where="when")  # unknown when compiled
    monkeypatch.setitem(RE.FUNCTIONS, "triple", lambda v: 3 * v)
    got, want, _ = _both("triple(n)")
    assert got == want == ("int", "15", [])
    assert expr.fn(RE._Names(n=2), RE._functions()) == 6


def test_the_limits_and_operators_are_simpleevals() -> None:
    assert RE.MAX_STRING_LENGTH == simpleeval.MAX_STRING_LENGTH
    assert RE.MAX_COMPREHENSION_LENGTH == simpleeval.MAX_COMPREHENSION_LENGTH
    assert RE.MAX_POWER == simpleeval.MAX_POWER
    assert RE.MAX_SHIFT == simpleeval.MAX_SHIFT
    assert RE.MAX_SHIFT_BASE == simpleeval.MAX_SHIFT_BASE
    assert RE._ALLOWED_OPERATORS == set(simpleeval.DEFAULT_OPERATORS)
    assert not [name for name, fn in RE.FUNCTIONS.items() if RE._is_forbidden(fn)]


def test_user_config_values_are_data_never_evaluated() -> None:
    # a user config overrides thresholds with values of the default's kind; a text where a
    # number is expected is refused, and no value is ever parsed as an expression
    rule = next(r for r in RULES if any(RE._threshold_kind(v) == "number" for v in r.thresholds.values()))
    name = next(k for k, v in rule.thresholds.items() if RE._threshold_kind(v) == "number")
    from kvdoctor.userconfig import UserConfigError

    with pytest.raises(UserConfigError):
        apply_user_config([rule], UserConfig(thresholds={rule.id: {name: "__import__('os').system('x')"}}))


def test_compiling_prints_no_warning() -> None:
    # Python's compiler warns about "is" with a literal; simpleeval evaluates it quietly
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want, expr = _both("n is 5 or s is 'abc' or xs is ()")
    assert expr.code is not None and got == want
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("src", ["x.__class__", "n @ n", "(lambda: 1)()", "(y := 1)"])
def test_an_expr_made_by_hand_is_no_more_able_than_under_simpleeval(src: str) -> None:
    # compile_expr refuses these; an Expr made without it is compiled lazily, and never natively
    names = frozenset({"x", "n", "xs"})
    expr = RE.Expr(src, "when", 1, names, frozenset())
    assert expr.code is None
    compiled, reference = _runners(_rule(expr), RE.RuleContext(engine=None, variables=dict(NAMES)))
    got, want = _outcome(compiled, expr), _outcome(reference, expr)
    assert got == want and got[2], (got, want)


def test_without_a_cache_only_what_is_evaluated_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RE.ENV_CACHE_DIR, "")
    monkeypatch.setattr(RE, "_COMPILED", {})
    RE._RULES_CACHE.clear()
    rules = RE.load_rules(known_names=variable_catalogue())
    RE._RULES_CACHE.clear()
    exprs = [e for r in rules for e in RE._all_exprs(r)]
    assert all(e.compiled is RE.LAZY for e in exprs)
    ctx = RE.RuleContext(engine="e", variables={}, inputs={"log", "metrics", "config", "gpus", "timeline"})
    RE.evaluate(rules, [ctx])
    done = [e for e in exprs if e.compiled is not RE.LAZY]
    assert done and len(done) < len(exprs)
    assert all(isinstance(e.compiled, CodeType) for e in done)
