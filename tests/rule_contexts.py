"""Every engine context (derive's variables) of every bundle the tests have: the repository's
``tests/data/bundles`` and ``tests/data/cases``, and ``../shared/cases`` where it exists. Shared
by the rule tests that check a property over every bundle."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
SHARED_CASES = Path(__file__).resolve().parent.parent.parent / "shared" / "cases"


def bundle_dirs() -> list[Path]:
    """Every bundle directory, sorted by name within each root."""
    roots = [DATA / "bundles", DATA / "cases", DATA / "cases-034", DATA / "bundles-034", SHARED_CASES]
    return [d for root in roots if root.is_dir() for d in sorted(root.iterdir()) if d.is_dir()]


@lru_cache(maxsize=1)
def all_contexts() -> tuple[tuple[str, str | None, dict[str, Any], frozenset[str]], ...]:
    """(bundle name, engine id, variables, inputs) of every engine context of every bundle
    (read once per test session; do not modify the variables)."""
    import kvdoctor.derive as derive
    from kvdoctor.sources.bundle import load_bundle

    out = []
    for d in bundle_dirs():
        timeline = load_bundle(d).timeline
        latest = timeline.latest
        configs = list(latest.configs) if latest is not None else []
        _engines, contexts, _kv = derive.build_contexts(timeline, configs)
        for eid, variables, inputs in contexts:
            variables.pop(derive.FAILED_KEY, None)
            out.append((d.name, eid, variables, frozenset(inputs)))
    return tuple(out)


def iter_contexts() -> Iterator[tuple[str, str | None, dict[str, Any], frozenset[str]]]:
    """:func:`all_contexts`, one at a time."""
    yield from all_contexts()
