"""Helpers for the focused rule tests: a context from keyword facts, one rule's finding, and
the "--flag value" pairs a finding's words name (to hold them against its fixes)."""

from __future__ import annotations

import re
from typing import Any

from kvdoctor import rulekit
from kvdoctor.derive import VARIABLES
from kvdoctor.findings import Finding

_FLAG_VALUE = re.compile(r"(--[a-z][a-z0-9-]*)(?: (?!--)('[^']*'|[^\s;:()]+))?")


def facts(**values: Any) -> dict[str, Any]:
    """Every derive variable None, except ``values``."""
    unknown = set(values) - set(VARIABLES)
    assert not unknown, f"not derive variables: {sorted(unknown)}"
    return {**dict.fromkeys(VARIABLES), **values}


def finding(rule: rulekit.Rule[Any], variables: dict[str, Any]) -> Finding | None:
    """The rule's finding on one context with every input present; a rule error fails the test."""
    ev = rulekit.evaluate(
        [rule], [rulekit.RuleContext("e", variables, {"log", "metrics", "timeline", "config"})]
    )
    assert not ev.errors, [str(e) for e in ev.errors]
    return ev.findings[0] if ev.findings else None


_NOT_VALUES = {"and", "or", "so", "the", "with", "to", "in", "at", "is", "lowered"}


def named(summary: str) -> list[tuple[str, str | None]]:
    """Each ``--flag`` the words name and the value written after it (None when a word that is
    no value, or nothing, follows)."""
    out: list[tuple[str, str | None]] = []
    for flag, value in _FLAG_VALUE.findall(summary):
        value = value.strip("'") if value.startswith("'") else value.rstrip(".,")
        out.append((flag, value if value and value not in _NOT_VALUES else None))
    return out


def _same(a: str, b: str) -> bool:
    try:
        return float(a.replace(",", "")) == float(b)
    except ValueError:
        return a == b


def assert_words_match_fixes(f: Finding) -> None:
    """Every flag the words name is in some fix, with the value they give; every fix's flag is
    named."""
    fixed: dict[str, list[str]] = {}
    for fix in f.fixes:
        for flag, value in fix.flags.items():
            fixed.setdefault(flag, []).append(value)
    words = named(f.summary)
    for flag, said in words:
        assert flag in fixed, f"{flag} named but in no fix: {f.summary}"
        if said is not None:
            assert any(_same(said, v) for v in fixed[flag]), f"{flag} {said} named, fixes hold {fixed[flag]}"
    for flag in fixed:
        assert flag in dict(words), f"{flag} fixed but not named: {f.summary}"


def bundle_finding(rule: rulekit.Rule[Any], bundle: str, **changes: Any) -> Finding:
    """The rule's one finding on the first engine context of ``bundle`` (tests.rule_contexts),
    with some variables changed; a rule error, or no finding, fails the test."""
    from tests.rule_contexts import all_contexts

    eid, v, inputs = next((e, v, i) for b, e, v, i in all_contexts() if b == bundle)
    ev = rulekit.evaluate([rule], [rulekit.RuleContext(eid, {**v, **changes}, set(inputs))])
    assert not ev.errors, [str(e) for e in ev.errors]
    (found,) = ev.findings
    return found
