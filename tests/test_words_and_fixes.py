"""One computation for the advice: on every bundle, a finding's words and its fixes agree.

- every flag (``--max-model-len``) and environment variable its fixes set is named in the
  summary with the same value, and every command (``kill 48211 48212``) is quoted whole;
- every ``--flag`` the summary names is set by one of its fixes (the words name the settings
  in effect by their field names — max_model_len, gmu — and keep ``--flag`` for the advice);
- no fix is empty or without a reason, and no rule failed (``errors``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import pytest

from tests.rule_contexts import bundle_dirs

_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


@lru_cache(maxsize=1)
def _reports() -> tuple[tuple[str, Any], ...]:
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    pipeline = Pipeline.load()
    return tuple((d.name, pipeline.evaluate(load_bundle(d).timeline, now=0)) for d in bundle_dirs())


def _problems(f: Any) -> list[str]:
    out = []
    words = f.summary
    fixed = {k for x in f.fixes for k in (*x.flags, *x.env)}
    for x in f.fixes:
        if not (x.flags or x.env or x.commands):
            out.append("an empty fix")
        if not x.why.strip():
            out.append(f"a fix without a why: {x.line()}")
        for name, value in (*x.flags.items(), *x.env.items()):
            if name not in words:
                out.append(f"fix {name} {value} not named in the words")
            elif value and value not in words:
                out.append(f"fix {name} {value}: the words do not give the value {value!r}")
        for cmd in x.commands:
            if cmd not in words:
                out.append(f"command {cmd!r} not in the words")
    for flag in set(_FLAG.findall(words)):
        if flag not in fixed:
            out.append(f"the words name {flag} but no fix sets it")
    return out


def _cases() -> list[str]:
    return [d.name for d in bundle_dirs()]


@pytest.mark.parametrize("bundle", _cases())
def test_words_and_fixes_agree(bundle: str) -> None:
    report = dict(_reports())[bundle]
    assert not report.errors, report.errors
    problems = [f"{f.rule} [{f.engine}]: {p}" for f in report.findings for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_words_that_name_a_dropped_fix() -> None:
    from kvdoctor.findings import Finding, Fix

    f = Finding(
        rule="x",
        severity="warning",
        family="L",
        title="t",
        summary="Cap --max-model-len at 10320 or lower --max-num-batched-tokens to 4096.",
        fixes=[Fix(flags={"--max-num-batched-tokens": "4096"}, why="a smaller step")],
    )
    assert _problems(f) == ["the words name --max-model-len but no fix sets it"]
    f.fixes = [Fix(flags={"--max-num-batched-tokens": "2048"}, why="a smaller step")]
    assert any("value '2048'" in p for p in _problems(f))
    f.fixes = [Fix(commands=("kill 1 2",), why="")]
    assert {"a fix without a why: kill 1 2", "command 'kill 1 2' not in the words"} <= set(_problems(f))
