"""``Facts``, the typed variables rules read: generated from derive's declarations and current,
and every value derive gives on every bundle is of its declared type (else mypy's checks of the
rules would rest on a wrong type)."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from tests.rule_contexts import all_contexts

ROOT = Path(__file__).resolve().parent.parent


def test_facts_typed_is_current_with_derives_declarations() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_rule_facts.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_facts_has_one_key_per_derive_variable() -> None:
    from kvdoctor.derive import VARIABLES
    from kvdoctor.derive.facts_typed import Facts

    assert set(typing.get_type_hints(Facts)) == set(VARIABLES)


def _matches(value: Any, hint: Any) -> bool:
    if value is None:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()
        )
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_matches, value, args))
    return isinstance(value, hint)


def test_every_value_derive_gives_is_of_its_declared_type() -> None:
    from kvdoctor.derive.facts_typed import Facts

    hints = typing.get_type_hints(Facts)
    wrong = set()
    for bundle, _engine, v, _inputs in all_contexts():
        for name, value in v.items():
            if name in hints and not _matches(value, hints[name]):
                wrong.add(
                    f"{name}: {type(value).__name__} {value!r:.60} (declared {hints[name]}) in {bundle}"
                )
    assert not wrong, "\n".join(sorted(wrong))
