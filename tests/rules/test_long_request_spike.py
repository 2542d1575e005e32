"""long-request-spike: the cap and the chunk size are decided once; the words name only them."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.long_request_spike import RULE

from kvdoctor.facts import ModelArch
from tests.rules._words import assert_words_match_fixes, facts, finding


def _tail(**over: Any) -> dict[str, Any]:
    """A heavy prompt tail (median 1,567, p99 76,000) with KV usage at 97 %."""
    base = dict(
        prompt_p50=1567.0,
        prompt_p99=76000.0,
        prompt_max_bucket=200000.0,
        prompt_p99_body=6000.0,
        kv_usage_max=0.97,
        kv_capacity_tokens=582544,
        block_size=16,
        max_model_len=262144,
        max_num_batched_tokens=8192,
        engine_gpus=[0],
    )
    return facts(**{**base, **over})


def test_it_caps_the_max_model_len_and_chunks_prefills() -> None:
    f = finding(RULE, _tail())
    assert f is not None and f.severity == "warning"
    assert f.fixes[0].flags == {"--max-model-len": "145632", "--max-num-batched-tokens": "2048"}
    assert "Cap --max-model-len at 145632" in f.summary
    assert_words_match_fixes(f)


def test_a_cap_above_the_models_maximum_is_not_advised() -> None:
    # KV / 4 = 145,632 tokens, but the model accepts 8,192 at most: vLLM would reject the cap
    f = finding(RULE, _tail(max_model_len=None, arch=ModelArch(max_position_embeddings=8192)))
    assert f is not None
    assert "--max-model-len" not in f.summary
    assert f.fixes[0].flags == {"--max-num-batched-tokens": "2048"}
    assert_words_match_fixes(f)


def test_the_max_model_len_in_effect_is_not_named_as_a_flag() -> None:
    # four full-length requests of 131,072 tokens fit the cache: the cap changes nothing
    f = finding(RULE, _tail(max_model_len=131072))
    assert f is not None
    assert "max model length in effect (131,072 tokens)" in f.summary
    assert "--max-model-len" not in f.summary
    assert_words_match_fixes(f)


def test_with_the_capacity_unknown_it_still_chunks_and_names_no_na() -> None:
    f = finding(RULE, _tail(kv_capacity_tokens=None, max_num_batched_tokens=4096, chunked_prefill_off=True))
    assert f is not None
    assert "N/A" not in f.summary and "4096" not in f.summary
    assert f.fixes[0].flags == {"--max-num-batched-tokens": "2048", "--enable-chunked-prefill": ""}
    assert_words_match_fixes(f)


def test_steps_already_small_get_no_chunk_advice() -> None:
    f = finding(RULE, _tail(max_num_batched_tokens=256))
    assert f is not None
    assert "--max-num-batched-tokens" not in f.summary
    assert f.fixes[0].flags == {"--max-model-len": "145632"}
    assert_words_match_fixes(f)


def test_a_tail_without_kv_pressure_does_not_fire() -> None:
    assert finding(RULE, _tail(kv_usage_max=0.5)) is None


def test_on_034_the_cap_is_a_multiple_of_64_over_the_committed_pool() -> None:
    """spec/vllm-0.34.md long-request-spike row: --max-model-len ≤ capacity / 4 rounded down to a
    multiple of B (64 on 0.34) with the post-commit capacity (484,800 tokens: 7,575 blocks of 64);
    a run-time OOM at torch's cap is named as torch-cap-oom evidence."""
    from kvdoctor.units import GiB

    f = finding(
        RULE,
        _tail(
            kv_capacity_tokens=484800,
            block_size=64,
            max_model_len=131072,
            vllm_sizing_mode="extensible",
            runtime_oom=True,
            oom_allowed_bytes=int(18.34 * GiB),
        ),
    )
    assert f is not None and f.severity == "critical"
    mml = int(f.fixes[0].flags["--max-model-len"])
    assert mml == 121152 and mml % 64 == 0  # floor(121,200 / 64) × 64
    assert any(e.fact == "torch cap at the OOM" for e in f.evidence)
    assert_words_match_fixes(f)


def test_full_blocks_of_short_requests_are_not_kv_pressure() -> None:
    """Issue 28 item 5: 96 % block usage of ~40-token requests in 64-token blocks is ~54 % of the
    tokens (padding): not the KV pressure this rule needs; with 16-token blocks it is."""
    over = dict(
        kv_usage_max=0.96, typical_request_tokens=40, kv_padding_tokens_per_request=31.5, block_size=64
    )
    assert finding(RULE, _tail(**over)) is None
    assert finding(RULE, _tail(**{**over, "kv_padding_tokens_per_request": 0.0})) is not None
