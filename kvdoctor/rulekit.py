"""The rule engine: what a rule declares, the registry, thresholds, evaluation, cause links.

A rule is one Python module (``rules/<rule_id>.py``, shipped as ``kvdoctor.rules``; a third
party's through the ``kvdoctor.rules`` entry-point group or ``--rules-dir``). The module's
docstring is its documentation (``kvdoctor explain``) and its ``RULE`` a :class:`Rule`: the
metadata, typed thresholds (a NamedTuple, one default each, overridable in the user
config) and one ``check(facts, thresholds)`` that returns a :class:`Hit` (the words, the
evidence and the fixes, built from the same values) or None::

    class Thresholds(NamedTuple):
        min_per_min: float = 30.0

    def check(f: Facts, t: Thresholds) -> Hit | None:
        rate = f["preemptions_per_min"]
        if rate is None or rate < t.min_per_min:
            return None
        return Hit(summary=f"{rate:.0f} preemptions/min ...", fixes=[Fix(flags={...}, why="...")])

    RULE = Rule(id="preemption-storm", family="L", severity="warning", title="...",
                doc=__doc__, thresholds=Thresholds(), check=check, needs=("timeline",))

:func:`evaluate` runs every rule over every context (one per engine: derive's variables): a
rule whose inputs are absent is :class:`~kvdoctor.findings.Skipped`; a rule that raises, or
returns a fix vLLM would reject or one already in effect (:func:`kvdoctor.fix_validity.valid_fix`),
becomes an :class:`EvalError` the report shows (never a silent absence).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from kvdoctor.findings import (
    FAMILIES,
    SEVERITIES,
    SEVERITY_ORDER,
    Evidence,
    Finding,
    Fix,
    Severity,
    Skipped,
    sort_findings,
)
from kvdoctor.fix_validity import valid_fix
from kvdoctor.units import na

if TYPE_CHECKING:
    from kvdoctor.derive.facts_typed import Facts
else:
    # The TypedDict of ~400 keys is for mypy only (a rule's ``f: Facts``); at run time a rule's
    # variables are a plain dict, and building the class costs ~6 ms of every start.
    Facts = dict

__all__ = [
    "ENTRY_POINT_GROUP",
    "EvalError",
    "Evaluation",
    "Evidence",
    "Facts",
    "Fix",
    "Hit",
    "Rule",
    "RuleContext",
    "RuleFileError",
    "check_explains",
    "check_rule",
    "evaluate",
    "flag_value",
    "gib_text",
    "is_valid",
    "link_causes",
    "load_rules",
    "na",
]

#: The entry-point group third-party rule packages register modules (or Rule objects) under.
ENTRY_POINT_GROUP = "kvdoctor.rules"

Lifecycle = Literal["stable", "preview", "deprecated"]
T = TypeVar("T")

_SLUG = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_FLAG = re.compile(r"^(--[a-z0-9][a-z0-9-]*|[A-Z_][A-Z0-9_]*)$")
_DOC_SECTIONS = ("## What", "## Why", "## How to confirm", "## Fix", "## Sources")


class RuleFileError(Exception):
    """A rule (module) is invalid. ``str(err)`` is one line: ``path[:line]: reason``."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Hit:
    """What a rule's ``check`` returns when it fires.

    ``summary``: the words (one paragraph; every flag, value and command it names is in
    ``fixes``); ``fixes``: alternatives, the recommended one first; ``gpus``: GPU indices;
    ``severity``/``title``: set only where they differ from the rule's declared ones."""

    summary: str
    evidence: Sequence[Evidence] = ()
    fixes: Sequence[Fix] = ()
    gpus: Sequence[int] = ()
    severity: Severity | None = None
    title: str | None = None


@dataclass(frozen=True)
class Rule(Generic[T]):
    """One rule: metadata, ``thresholds`` (the effective values) and ``check``. ``needs``: inputs all required; ``needs_any``: at least one of them
    (``kvdoctor.derive.INPUTS``). ``explains``: rule ids this rule is the root cause of.
    ``flags``: the flags and environment variables its fixes may set. ``for_s`` / ``clear_for_s``:
    seconds a long-running face holds the condition before it fires / clears it (hysteresis).
    ``source``: the module it came from (shown in errors)."""

    id: str
    family: str
    severity: Severity
    title: str
    doc: str | None
    thresholds: T
    check: Callable[[Facts, T], Hit | None]
    needs: tuple[str, ...] = ()
    needs_any: tuple[str, ...] = ()
    explains: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    lifecycle: Lifecycle = "stable"
    for_s: float = 0.0
    clear_for_s: float = 0.0
    source: str = ""

    def threshold_values(self) -> dict[str, Any]:
        """The effective thresholds, name → value."""
        return dict(self.thresholds._asdict())  # type: ignore[attr-defined]

    def with_thresholds(self, overrides: Mapping[str, Any]) -> Rule[T]:
        """A copy with some thresholds replaced. Raises KeyError for a name the rule lacks and
        TypeError for a value of another kind (number/text/bool) than the default."""
        current = self.threshold_values()
        for name, value in overrides.items():
            if name not in current:
                raise KeyError(name)
            want, got = _kind(current[name]), _kind(value)
            if want != got:
                raise TypeError(f"threshold {name!r} of rule {self.id!r} must be a {want}, got {value!r}")
        new = self.thresholds._replace(**overrides)  # type: ignore[attr-defined]
        return dataclasses.replace(self, thresholds=new)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "text" if isinstance(value, str) else type(value).__name__


def check_rule(rule: Any, where: str) -> Rule[Any]:
    """``rule`` as a valid :class:`Rule` (its ``source`` set to ``where`` when empty), else
    :class:`RuleFileError` naming ``where``."""
    if not isinstance(rule, Rule):
        raise RuleFileError(where, None, "no RULE = kvdoctor.rulekit.Rule(...) in the module")

    def bad(reason: str) -> RuleFileError:
        return RuleFileError(where, None, f"rule {rule.id!r}: {reason}")

    if not isinstance(rule.id, str) or not _SLUG.match(rule.id):
        raise bad("id must be lowercase words joined by '-'")
    if rule.family not in FAMILIES:
        raise bad(f"family must be one of {', '.join(FAMILIES)}")
    if rule.severity not in SEVERITIES:
        raise bad(f"severity must be one of {', '.join(SEVERITIES)}")
    if not (isinstance(rule.thresholds, tuple) and hasattr(rule.thresholds, "_asdict")):
        raise bad("thresholds must be a NamedTuple instance")
    if not callable(rule.check):
        raise bad("check is not callable")
    doc = rule.doc or ""
    missing = [s for s in _DOC_SECTIONS if s not in doc]
    if missing:
        raise bad(f"its docstring lacks {', '.join(missing)}")
    for flag in rule.flags:
        if not _FLAG.match(flag):
            raise bad(f"{flag!r} is neither a --flag nor an ENV_VAR")
    if rule.lifecycle not in ("stable", "preview", "deprecated"):
        raise bad("lifecycle must be stable, preview or deprecated")
    if not (rule.for_s >= 0 and rule.clear_for_s >= 0):
        raise bad("for_s and clear_for_s are seconds, not negative")
    return rule if rule.source else dataclasses.replace(rule, source=where)


# --------------------------------------------------------------------------- the registry


def _builtin_rules() -> list[Rule[Any]]:
    import kvdoctor.rules as package

    out = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        out.append(check_rule(getattr(module, "RULE", None), module.__name__))
    return out


def _entry_point_rules() -> list[Rule[Any]]:
    from importlib.metadata import entry_points

    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name} = {ep.value}"
        try:
            obj = ep.load()
        except Exception as err:  # noqa: BLE001 - a broken plugin is a one-line error
            raise RuleFileError(where, None, f"cannot load: {type(err).__name__}: {err}") from None
        out.append(check_rule(getattr(obj, "RULE", obj), where))
    return out


def _dir_rules(directory: Path) -> list[Rule[Any]]:
    """Every ``*.py`` in ``directory`` (not ``_*``), imported as Python code."""
    if not directory.is_dir():
        raise RuleFileError(directory, None, "rules directory does not exist")
    out = []
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        name = f"kvdoctor_user_rules.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise RuleFileError(path, None, "not an importable Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - a broken rule file is a one-line error
            line = err.lineno if isinstance(err, SyntaxError) else None
            raise RuleFileError(path, line, f"{type(err).__name__}: {err}") from None
        out.append(check_rule(getattr(module, "RULE", None), str(path)))
    return out


def load_rules(dirs: Iterable[str | Path] | None = None, *, plugins: bool = True) -> list[Rule[Any]]:
    """The catalogue: the built-in rules (or, with ``dirs``, the rules of those directories:
    Python modules, each with a ``RULE``), then the ``kvdoctor.rules`` entry-point group's.
    Raises :class:`RuleFileError` for an invalid rule, a duplicate id or a broken ``explains``."""
    rules = [r for d in dirs for r in _dir_rules(Path(d))] if dirs else _builtin_rules()
    if plugins:
        rules += _entry_point_rules()
    seen: dict[str, str] = {}
    for r in rules:
        if r.id in seen:
            raise RuleFileError(r.source or r.id, None, f"duplicate rule id {r.id!r} (also in {seen[r.id]})")
        seen[r.id] = r.source or r.id
    check_explains(rules)
    return rules


def check_explains(rules: Iterable[Rule[Any]]) -> None:
    """Every ``explains`` names a known rule other than itself, and the links have no cycle;
    else :class:`RuleFileError`."""
    by_id = {r.id: r for r in rules}
    for r in by_id.values():
        for target in r.explains:
            if target == r.id or target not in by_id:
                raise RuleFileError(r.source or r.id, None, f"explains: unknown or own rule id {target!r}")

    def visit(rid: str, trail: tuple[str, ...]) -> None:
        if rid in trail:
            raise RuleFileError(
                by_id[rid].source or rid, None, f"explains: cycle {' → '.join((*trail, rid))}"
            )
        for target in by_id[rid].explains:
            visit(target, (*trail, rid))

    for rid in by_id:
        visit(rid, ())


# --------------------------------------------------------------------------- helpers for rules


def flag_value(value: object) -> str | None:
    """A computed value as a flag's text: ints "23648", floats with up to 2 decimals trimmed
    ("0.63", "0.9", "2"), text as is, lists comma-joined ("2,3" for CUDA_VISIBLE_DEVICES),
    True → "" (a flag without argument, ``--enforce-eager``); None, False, NaN → None."""
    if value is None or value is False:
        return None
    if value is True:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        text = f"{value:.2f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    if isinstance(value, (list, tuple)):
        return ",".join(flag_value(v) or "" for v in value)
    return str(value)


def gib_text(nbytes: float | None, spec: str = ".2f") -> str:
    """Bytes as GiB formatted with ``spec`` ("3.25"), "N/A" for None (the number only: the
    rule writes the unit)."""
    return "N/A" if nbytes is None else format(nbytes / 2**30, spec)


def is_valid(f: Facts, flag: str, value: object) -> bool:
    """Whether ``flag value`` is a fix vLLM accepts and that changes something here
    (:func:`kvdoctor.fix_validity.valid_fix` over the context's variables)."""
    text = flag_value(value)
    return text is not None and valid_fix(flag, text, f) is None


# --------------------------------------------------------------------------- evaluation


@dataclass
class RuleContext:
    """The variables rules read for one engine (or the host, ``engine=None``): ``variables``
    (derive's names, :class:`~kvdoctor.derive.facts_typed.Facts`) and the ``inputs`` present
    ("log", "metrics", …) that ``needs``/``needs_any`` refer to."""

    engine: str | None
    variables: dict[str, Any]
    inputs: set[str] = field(default_factory=set)


@dataclass
class EvalError:
    """A rule that failed on one context: it raised, or returned an invalid fix (``where``:
    "check" or "fix --flag"). Listed in the report's ``errors``."""

    rule: str
    engine: str | None
    where: str
    message: str

    def __str__(self) -> str:
        eng = f" [{self.engine}]" if self.engine else ""
        return f"{self.rule}{eng} {self.where}: {self.message}"


@dataclass
class Evaluation:
    """Result of :func:`evaluate`: the findings (worst first, causes linked), the rules skipped
    for missing inputs, and the rules that failed."""

    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    errors: list[EvalError] = field(default_factory=list)


def _missing(rule: Rule[Any], inputs: set[str]) -> list[str]:
    missing = [n for n in rule.needs if n not in inputs]
    if rule.needs_any and not any(n in inputs for n in rule.needs_any):
        missing.append("|".join(rule.needs_any))
    return missing


def _invalid(fix: Fix, f: Facts) -> str | None:
    for name, value in (*fix.flags.items(), *fix.env.items()):
        why = valid_fix(name, value, f)
        if why is not None:
            return f"{name} {value}: {why}"
    return None


def _run(rule: Rule[Any], ctx: RuleContext, errors: list[EvalError]) -> Finding | None:
    facts: Facts = ctx.variables  # type: ignore[assignment]
    try:
        hit = rule.check(facts, rule.thresholds)
    except Exception as err:  # noqa: BLE001 - one rule's failure is a visible error, not the run's
        errors.append(EvalError(rule.id, ctx.engine, "check", f"{type(err).__name__}: {err}"))
        return None
    if hit is None:
        return None
    for fix in hit.fixes:
        why = _invalid(fix, facts)
        if why is not None:
            errors.append(EvalError(rule.id, ctx.engine, "fix", f"would suggest an invalid fix: {why}"))
    first = hit.fixes[0] if hit.fixes else None
    return Finding(
        rule=rule.id,
        severity=hit.severity or rule.severity,
        family=rule.family,  # type: ignore[arg-type]
        title=hit.title or rule.title,
        summary=hit.summary,
        evidence=list(hit.evidence),
        suggested_flags={**first.flags, **first.env} if first else {},
        fixes=list(hit.fixes),
        gpus=sorted(set(hit.gpus)),
        engine=ctx.engine,
    )


def evaluate(rules: Iterable[Rule[Any]], contexts: Iterable[RuleContext]) -> Evaluation:
    """Every rule over every context. Findings are deduplicated by (rule, engine) keeping the
    worst severity, linked to their causes (:func:`link_causes`) and sorted worst first.
    Never raises for a rule's failure: it is an :class:`EvalError` in ``errors``."""
    rules = list(rules)
    out = Evaluation()
    best: dict[tuple[str, str | None], Finding] = {}
    for ctx in contexts:
        for rule in rules:
            missing = _missing(rule, ctx.inputs)
            if missing:
                out.skipped.append(Skipped(rule=rule.id, missing=missing, engine=ctx.engine))
                continue
            finding = _run(rule, ctx, out.errors)
            if finding is None:
                continue
            key = (finding.rule, finding.engine)
            kept = best.get(key)
            if kept is None or SEVERITY_ORDER[finding.severity] > SEVERITY_ORDER[kept.severity]:
                best[key] = finding
    findings = list(best.values())
    link_causes(rules, findings)
    out.findings = sort_findings(findings)
    return out


def link_causes(rules: Iterable[Rule[Any]], findings: list[Finding]) -> None:
    """Set ``caused_by`` on each finding another fired finding explains (``explains``), for
    the same engine or where either is about the host (engine None). The worst such root wins
    (then rule id); a link that would close a cycle is dropped."""
    explains = {r.id: set(r.explains) for r in rules if r.explains}
    for f in findings:
        causes = [
            g
            for g in findings
            if g is not f
            and f.rule in explains.get(g.rule, ())
            and (g.engine == f.engine or g.engine is None or f.engine is None)
        ]
        if causes:
            causes.sort(key=lambda g: (-SEVERITY_ORDER.get(g.severity, 0), g.rule))
            f.caused_by = causes[0].rule
    by_rule = {f.rule: f for f in findings}
    for f in findings:
        seen, cur = {f.rule}, by_rule.get(f.caused_by) if f.caused_by else None
        while cur is not None and cur.caused_by:
            if cur.caused_by in seen:
                f.caused_by = None
                break
            seen.add(cur.rule)
            cur = by_rule.get(cur.caused_by)
