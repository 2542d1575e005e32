"""preemption-storm: each lever is an alternative fix, named only when it is valid."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.preemption_storm import RULE

from tests.rules._words import assert_words_match_fixes, facts, finding


def _storm(**over: Any) -> dict[str, Any]:
    """16 preemptions/min at 100 % KV, TP 2 of 4 visible GPUs, two of them free."""
    base = dict(
        preemptions_per_min=16.0,
        preemptions_in_window=16.0,
        window_seconds=60.0,
        kv_usage_max=1.0,
        kv_capacity_tokens=442192,
        typical_request_tokens=16637,
        max_num_seqs_effective=1024,
        kv_cache_dtype="auto",
        tp=2,
        pp=1,
        gpu_count=4,
        gpus_without_processes=[2, 3],
        num_attention_heads=32,
        num_kv_heads=8,
        engine_gpus=[0, 1],
    )
    return facts(**{**base, **over})


def test_every_lever_is_an_alternative() -> None:
    f = finding(RULE, _storm())
    assert f is not None
    assert [x.flags for x in f.fixes] == [
        {"--max-num-seqs": "26"},
        {"--kv-cache-dtype": "fp8"},
        {"--tensor-parallel-size": "4"},
    ]
    assert "or more tensor parallelism (--tensor-parallel-size 4)." in f.summary
    assert_words_match_fixes(f)


def test_a_tensor_parallel_size_the_heads_refuse_is_not_named() -> None:
    # 4 ranks do not divide 6 KV heads: vLLM rejects --tensor-parallel-size 4
    f = finding(RULE, _storm(num_attention_heads=30, num_kv_heads=6))
    assert f is not None
    assert "--tensor-parallel-size" not in f.summary
    assert f.summary.endswith("or more tensor parallelism.")
    assert all("--tensor-parallel-size" not in x.flags for x in f.fixes)
    assert_words_match_fixes(f)


def test_a_limit_that_already_fits_is_said_without_a_flag() -> None:
    f = finding(RULE, _storm(max_num_seqs_effective=16, kv_cache_dtype="fp8", gpus_without_processes=[]))
    assert f is not None
    assert "fewer concurrent sequences (the 16 in effect already fits the cache)" in f.summary
    assert f.fixes == []


def test_a_storm_below_a_full_cache_does_not_fire() -> None:
    assert finding(RULE, _storm(kv_usage_max=0.6)) is None
