"""long-context-prefill-oom: the alternatives named are the fixes held, joined without a
dangling "or"."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.long_context_prefill_oom import RULE

from kvdoctor.units import GiB, MiB
from tests.rules._words import assert_words_match_fixes, facts, finding


def _oom(**over: Any) -> dict[str, Any]:
    """E = 4 GiB over a 90 GiB budget of a 100 GiB card at a 131,072-token context; prompts reach
    200,000 tokens with 4,096-token chunks."""
    base = dict(
        runtime_oom=True,
        oom_at_runtime=True,
        chunked_prefill_on=True,
        oom_line=16,
        oom_overrun_bytes=4 * GiB,
        oom_process_bytes=int(93.5 * GiB),
        oom_requested_bytes=512 * MiB,
        oom_process_source="torch OOM message",
        engine_budget_bytes=90 * GiB,
        device_total_bytes=100 * GiB,
        gmu=0.9,
        longest_context_tokens=200000,
        longest_context_source="prompt-length histogram",
        max_num_batched_tokens=4096,
        context_at_oom_tokens=131072,
        max_model_len=262144,
        oom_gpu=0,
    )
    return facts(**{**base, **over})


def test_the_chunk_or_the_gmu() -> None:
    f = finding(RULE, _oom())
    assert f is not None
    assert [x.flags for x in f.fixes] == [
        {"--max-num-batched-tokens": "2048"},
        {"--gpu-memory-utilization": "0.81"},
    ]
    assert f.summary.endswith(
        "--max-num-batched-tokens 2048 halves the per-chunk intermediate; or --gpu-memory-utilization 0.81"
        " leaves that room."
    )
    assert_words_match_fixes(f)


def test_with_too_little_kv_left_the_chunk_leads_and_no_or_dangles() -> None:
    # the lowered gmu would leave 1 GiB of KV, less than one 5 GiB max_model_len request
    f = finding(RULE, _oom(log_available_kv_bytes=10 * GiB, offload_kv_one_request_bytes=5 * GiB))
    assert f is not None
    assert [x.flags for x in f.fixes] == [{"--max-num-batched-tokens": "2048"}]
    assert f.summary.endswith(
        "lead with the chunk change. --max-num-batched-tokens 2048 halves the per-chunk intermediate."
    )
    assert_words_match_fixes(f)


def test_a_gmu_below_zero_is_not_named() -> None:
    # E_max = 120 GiB: no gmu leaves that room
    f = finding(
        RULE, _oom(oom_overrun_bytes=60 * GiB, max_num_batched_tokens=2048, longest_context_tokens=9000)
    )
    assert f is not None
    assert f.fixes == [] and "--gpu-memory-utilization" not in f.summary


def test_fragmentation_is_not_this_rule() -> None:
    assert finding(RULE, _oom(oom_reserved_unallocated_bytes=2 * GiB)) is None
