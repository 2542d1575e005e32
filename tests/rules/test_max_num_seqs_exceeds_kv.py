"""max-num-seqs-exceeds-kv: the limit in effect is not written as a flag to set."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.max_num_seqs_exceeds_kv import RULE

from tests.rules._words import assert_words_match_fixes, facts, finding


def _engine(**over: Any) -> dict[str, Any]:
    """vLLM's default 1,024 sequences × ~16,637 tokens against a 442,192-token cache, preempting."""
    base = dict(
        max_num_seqs_effective=1024,
        max_num_seqs_explicit=False,
        typical_request_tokens=16637,
        prompt_p50=16000.0,
        kv_capacity_tokens=442192,
        kv_preempted=True,
        preemptions_in_window=16.0,
        max_model_len=131072,
        engine_gpus=[1, 0, 1],
    )
    return facts(**{**base, **over})


def test_under_pressure_it_sets_the_concurrency_the_cache_holds() -> None:
    f = finding(RULE, _engine())
    assert f is not None and f.severity == "warning"
    assert f.summary.startswith("max_num_seqs 1,024 (vLLM's default for this GPU) × ~16,637 tokens")
    assert "set --max-num-seqs 26 " in f.summary
    assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "26"}]
    assert f.gpus == [0, 1]
    assert_words_match_fixes(f)


def test_a_fix_already_in_effect_is_neither_set_nor_advised() -> None:
    # the command line says 26 while the effective limit read 1,024 (facts that disagree)
    f = finding(RULE, _engine(max_num_seqs=26))
    assert f is not None
    assert f.fixes == [] and "--max-num-seqs" not in f.summary
    assert f.summary.endswith("Pressure is visible: requests were preempted.")


def test_without_pressure_and_with_the_worst_case_size_nothing_is_advised() -> None:
    f = finding(
        RULE,
        _engine(
            kv_preempted=False,
            preemptions_in_window=0.0,
            max_num_seqs_explicit=True,
            prompt_p50=None,
            typical_request_tokens=131072,
        ),
    )
    assert f is None  # the worst case alone (every request max_model_len long) is no finding


def test_without_pressure_an_explicit_limit_is_an_info_line() -> None:
    f = finding(RULE, _engine(kv_preempted=False, preemptions_in_window=0.0, max_num_seqs_explicit=True))
    assert f is not None and f.severity == "info"
    assert "--max-num-seqs 26 states the real concurrency" in f.summary
    assert_words_match_fixes(f)


def test_a_limit_the_cache_holds_does_not_fire() -> None:
    assert finding(RULE, _engine(max_num_seqs_effective=16)) is None
