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


def test_never_below_the_requests_running_before_the_trouble() -> None:
    # 26 fit at ~16.6k tokens, but 33 ran before the trouble: a limit of 26 serialises traffic
    f = finding(RULE, _engine(running_before_trouble=33.0, kv_cache_dtype="auto"))
    assert f is not None and f.severity == "warning"
    assert [x.flags for x in f.fixes] == [{"--kv-cache-dtype": "fp8"}]
    assert "below the 33 running before the trouble" in f.summary
    assert_words_match_fixes(f)


def test_a_mixed_median_gives_no_limit_but_caps_and_chunks_the_tail() -> None:
    # ~1.7k-token traffic with a tail of 100k prompts: the median would say 114 or, in the storm, 2
    f = finding(
        RULE,
        _engine(
            typical_request_tokens=1700,
            prompt_p50=1500.0,
            prompt_p99=100000.0,
            prompt_p99_body=4900.0,
            kv_capacity_tokens=194384,
            block_size=16,
            max_model_len=131072,
            max_num_batched_tokens=8192,
            running_before_trouble=8.0,
        ),
    )
    assert f is not None
    flags = [x.flags for x in f.fixes]
    assert {"--max-model-len": "48592"} in flags and {"--max-num-batched-tokens": "2048"} in flags
    assert not any("--max-num-seqs" in x for x in flags)
    assert "prompts are mixed" in f.summary
    assert_words_match_fixes(f)


def test_a_queue_in_stats_lines_of_an_earlier_burst_is_history_on_an_idle_engine() -> None:
    # issue 24 kind 2: scrapes cover the window (idle, KV 0 %); the log's stats lines of an
    # earlier burst showed requests waiting at 99 % KV: no present-tense warning
    idle = dict(
        kv_preempted=False,
        preemptions_in_window=0.0,
        metrics_present=True,
        stats_enabled=True,
        queued_kv_usages=[],
        log_queued_kv_usages=[0.99, 0.99, 0.98],
        kv_usage_max=0.0,
        log_running_last=0,
    )
    assert finding(RULE, _engine(**idle)) is None
    # the fire: the same queue seen in the window's scrapes
    f = finding(RULE, _engine(**{**idle, "queued_kv_usages": [0.97, 0.99]}))
    assert f is not None and f.severity == "warning"
    assert "requests wait while the KV cache is 99% full" in f.summary


def test_padding_in_64_token_blocks_is_not_pressure_and_block_size_16_is_offered_where_valid() -> None:
    # 100-token requests in 64-token blocks: 91 % block usage is ~69 % of the tokens
    base = dict(
        kv_preempted=False,
        preemptions_in_window=0.0,
        queued_kv_usages=[0.91, 0.92, 0.91],
        typical_request_tokens=100,
        prompt_p50=80.0,
        kv_capacity_tokens=20000,
        block_size=64,
        kv_padding_tokens_per_request=31.5,
        max_num_seqs_explicit=True,
    )
    f = finding(RULE, _engine(**base))
    assert f is not None and f.severity == "info"  # token occupancy below 0.9: no pressure
    assert "is padding" in f.summary
    # with preemptions (pressure), --block-size 16 is an alternative where the backend takes it
    f = finding(RULE, _engine(**{**base, "kv_preempted": True, "block_size_16_valid": True}))
    assert f is not None and {"--block-size": "16"} in [x.flags for x in f.fixes]
    assert_words_match_fixes(f)
    f = finding(RULE, _engine(**{**base, "kv_preempted": True, "block_size_16_valid": False}))
    assert f is not None and {"--block-size": "16"} not in [x.flags for x in f.fixes]


def test_on_034_the_capacity_in_requests_is_counted_in_64_token_blocks() -> None:
    """spec/vllm-0.34.md max-num-seqs-exceeds-kv row: --max-num-seqs = floor((N − 1) /
    req_blocks(typical)); KV tokens ÷ typical tokens overstates it by up to 31.5 padding tokens a
    request at B = 64. 100-token requests take 2 blocks (128 tokens): a 7,000-block pool holds
    3,499 of them, not 448,000 / 100 = 4,480."""
    f = finding(
        RULE,
        _engine(
            max_num_seqs_effective=8192,
            typical_request_tokens=100,
            prompt_p50=80.0,
            kv_capacity_tokens=448000,
            block_size=64,
            kv_pool_requests_typical=3499,
        ),
    )
    assert f is not None
    assert f.suggested_flags == {"--max-num-seqs": "3328"}  # 3,499 a step down (multiples of 256)
    assert_words_match_fixes(f)


def test_log_only_a_queue_older_than_the_window_before_the_last_stats_line_is_history() -> None:
    # no scrapes: the log says what is now; its queue lines of an hour ago are not pressure
    base = dict(
        kv_preempted=False,
        preemptions_in_window=None,
        metrics_present=False,
        log_running_last=3,
        log_queued_kv_usages=[0.99, 0.99, 0.98],
        log_queued_kv_usages_recent=[],
    )
    assert finding(RULE, _engine(**base)) is None
    f = finding(RULE, _engine(**{**base, "log_queued_kv_usages_recent": [0.99, 0.98]}))
    assert f is not None and f.severity == "warning"
