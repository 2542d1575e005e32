"""The fuzz contract in CI (issue 8, class 11): every parser, mutated seeds from tests/data, a
fixed seed, a per-input time limit and a memory limit; zero unhandled exceptions and zero slow
inputs. ``python -m tests.fuzz_harness 2000`` runs the same harness longer, locally.

Also one hypothesis property per parser: arbitrary text gives a result or a one-line
SourceError, never anything else.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdoctor.facts import SourceError
from tests import fuzz_harness

# Small under CI (2 cores, a few minutes at most for the whole suite); deterministic either way.
ITERATIONS = int(os.environ.get("KVDOCTOR_FUZZ_ITERATIONS", "40" if os.environ.get("CI") else "60"))
TARGETS = fuzz_harness._targets()


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_fuzz_contract(target: fuzz_harness.Target) -> None:
    assert target.seeds, f"{target.name}: no seed inputs found in tests/data"
    count, failures = fuzz_harness.run(
        ITERATIONS, seed=8, time_limit=2.0, memory_limit=256 * 1024 * 1024, targets=[target]
    )
    assert count == ITERATIONS
    assert not failures, [(f.kind, f.detail) for f in failures[:5]]


def test_mutations_are_deterministic() -> None:
    import random

    seed = b"INFO 01-01 00:00:00 [a.py:1] Using max model len 4096\n"
    a = [fuzz_harness.mutate(random.Random(3), seed, [b"x"]) for _ in range(5)]
    b = [fuzz_harness.mutate(random.Random(3), seed, [b"x"]) for _ in range(5)]
    assert a == b and any(m != seed for m in a)


def test_harness_catches_a_contract_breach() -> None:
    # A parser that raises something else, or is slow, is reported (the harness can fail).
    def bad(text: str) -> None:
        if len(text) % 2:
            raise KeyError("x")

    target = fuzz_harness.Target("bad", bad, [b"ab", b"abc"], [b"z"])
    _, failures = fuzz_harness.run(20, targets=[target])
    assert failures and failures[0].kind == "exception" and "KeyError" in failures[0].detail


_PROPS = {t.name: t.call for t in TARGETS if t.name not in ("vllm_log.parse_log_file", "bundle.load_bundle")}


@pytest.mark.parametrize("name", sorted(_PROPS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=3000))
def test_property_text_gives_result_or_source_error(name: str, text: str) -> None:
    try:
        _PROPS[name](text)
    except SourceError as e:
        assert "\n" not in str(e)
