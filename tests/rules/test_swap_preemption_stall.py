"""swap-preemption-stall: --swap-space 0 is advised only when it changes something."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.swap_preemption_stall import RULE

from tests.rules._words import assert_words_match_fixes, facts, finding


def _stall(**over: Any) -> dict[str, Any]:
    """A V0 stats line with 6 requests swapped, generation at 0.0 tokens/s, 4 GiB swap space."""
    base = dict(
        swap_stall=True,
        swap_preemptions=4,
        swap_stall_line=20,
        log_swapped_max=6.0,
        swap_space_gib=4.0,
        engine_gpus=[0],
    )
    return facts(**{**base, **over})


def test_it_sets_the_swap_space_to_zero() -> None:
    f = finding(RULE, _stall())
    assert f is not None and f.severity == "critical"
    assert [x.flags for x in f.fixes] == [{"--swap-space": "0"}]
    assert "Set --swap-space 0 (now 4 GiB)" in f.summary
    assert '(4 "preempted by PreemptionMode.SWAP" warnings)' in f.summary
    assert_words_match_fixes(f)


def test_a_swap_space_already_zero_is_not_set_again() -> None:
    f = finding(RULE, _stall(swap_space_gib=0.0))
    assert f is not None
    assert f.fixes == [] and "--swap-space" not in f.summary
    assert "The swap space is already 0 GiB: cap n / best_of" in f.summary


def test_a_pooling_engine_does_not_fire() -> None:
    assert finding(RULE, _stall(is_pooling=True)) is None


def test_never_fires_on_034() -> None:
    """spec/vllm-0.34.md swap-preemption-stall row: V0 only, never fires on 0.34."""
    assert finding(RULE, _stall(vllm_v34=True)) is None
    assert finding(RULE, _stall(vllm_v34=False)) is not None
