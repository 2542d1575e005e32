"""low-util-kv-saturated: every flag the advice names is a fix; fixes are alternatives."""

from __future__ import annotations

from typing import Any

from tests.rules._words import bundle_finding

V0 = "r05-v0-063-pending-kv-saturated"  # vLLM 0.6.3, no fp8 on its GPU: 35,632 KV tokens, ~1,079 per request


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.low_util_kv_saturated import RULE

    return bundle_finding(RULE, bundle, **changes)


def test_fp8_kv_is_the_first_alternative_where_the_gpu_has_fp8() -> None:
    f = _finding("b20-low-util-kv-saturated-qwen2-0.5b")
    assert "Double the tokens per GB with --kv-cache-dtype fp8" in f.summary
    assert f.fixes[0].flags == {"--kv-cache-dtype": "fp8"}


def test_the_batch_the_pool_holds_is_advised_and_is_the_fix() -> None:
    f = _finding(V0, log_running_first=None)
    assert "Cap the batch at what the pool holds with --max-num-seqs 33" in f.summary
    assert [fix.flags for fix in f.fixes] == [{"--max-num-seqs": "33"}]


def test_a_max_num_seqs_already_in_effect_is_not_advised() -> None:
    # The YAML form said "Cap the batch … with --max-num-seqs 33" beside an empty fix, and its
    # next clause started in lower case.
    f = _finding(V0, max_num_seqs=33, log_running_first=None)
    assert "--max-num-seqs" not in f.summary
    assert "throughput. Add tensor parallelism for more KV per rank, or add replicas." in f.summary
    assert f.fixes == []


def test_a_max_num_seqs_below_the_requests_running_before_the_trouble_is_not_advised() -> None:
    # 41 requests ran before the KV cache filled: a cap of 33 would throttle the traffic.
    f = _finding(V0, running_before_trouble=41)
    assert "--max-num-seqs" not in f.summary
    assert f.fixes == []


def test_fp8_is_not_offered_for_a_kv_cache_already_fp8() -> None:
    f = _finding(V0, kv_cache_dtype="fp8", fp8_supported=True, running_before_trouble=None)
    assert "fp8" not in f.summary
    assert [fix.flags for fix in f.fixes] == [{"--max-num-seqs": "33"}]


def test_fp8_is_mentioned_for_a_kv_cache_of_unknown_dtype() -> None:
    f = _finding(V0, kv_cache_dtype=None, fp8_supported=True)
    assert f.summary.endswith("or add replicas; fp8 KV would double the tokens.")
