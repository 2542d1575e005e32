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


def test_a_storm_that_ended_is_reported_as_history_with_when() -> None:
    """Issue 24 kind 2: the forensic question scans the whole series; a storm that ended before
    the bundle was taken is an info finding saying when, with no sequence limit sized from the
    traffic after it."""
    from kvdoctor.rules.preemption_storm import RULE as STORM

    from tests.rules._words import facts, finding

    past = facts(
        preemptions_per_min=0.0,
        kv_usage_max=0.3,
        preemption_episode_count=40.0,
        preemption_episode_per_min=28.9,
        preemption_episode_kv_max=1.0,
        preemption_episode_start=1773142800.0,
        preemption_episode_end=1773142883.0,
        preemption_episode_in_window=False,
        kv_capacity_tokens=194384,
        typical_request_tokens=1700,
        max_num_seqs_effective=256,
        kv_cache_dtype="auto",
        window_seconds=300.0,
        series_saved=True,
    )
    f = finding(STORM, past)
    assert f is not None and f.severity == "info"
    assert "A preemption storm happened from 2026-03-10 11:40:00 to 11:41:23 UTC" in f.summary
    assert [x.flags for x in f.fixes] == [{"--kv-cache-dtype": "fp8"}]
    # live scrapes or a replay: the finding clears once the storm has left the window
    assert finding(STORM, {**past, "series_saved": False}) is None
    # near miss: a few preemptions over the series is no storm
    assert (
        finding(STORM, {**past, "preemption_episode_count": 3.0, "preemption_episode_per_min": 3.0}) is None
    )


def test_on_034_padding_in_64_token_blocks_offers_block_size_16_where_the_backend_takes_it() -> None:
    """spec/vllm-0.34.md preemption-storm row (trigger unchanged: preemptions are block
    exhaustion) and issue 28 item 5: with ~40-token requests in 64-token blocks 44 % of each
    request's blocks is padding; --block-size 16 only where block_size_16_valid."""
    from kvdoctor.rules.preemption_storm import RULE as STORM

    from tests.rules._words import facts, finding

    ctx = facts(
        preemptions_per_min=20.0,
        kv_usage_max=0.97,
        kv_capacity_tokens=20000,
        typical_request_tokens=40,
        kv_padding_tokens_per_request=31.5,
        block_size=64,
        block_size_16_valid=True,
        kv_cache_dtype="auto",
        window_seconds=60.0,
    )
    f = finding(STORM, ctx)
    assert f is not None and {"--block-size": "16"} in [x.flags for x in f.fixes]
    assert any(e.fact == "token occupancy behind the KV usage" for e in f.evidence)
    assert_words_match_fixes(f)
    f = finding(STORM, {**ctx, "block_size_16_valid": False})  # FLASHMLA, CUTLASS_MLA, hybrid
    assert f is not None and {"--block-size": "16"} not in [x.flags for x in f.fixes]
