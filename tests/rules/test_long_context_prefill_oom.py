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


def test_it_explains_long_request_spike_on_the_gh200_bundle() -> None:
    """Issue 24 kind 4: capping max_model_len at a quarter of the KV does not stop a long prompt
    that OOMs in chunked prefill's attention: long-context-prefill-oom is the root cause and
    long-request-spike nests under it."""
    from pathlib import Path

    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    bundle = Path(__file__).parents[1] / "data" / "bundles" / "c2-long-context-prefill-oom-gh200"
    report = Pipeline.load().evaluate(load_bundle(bundle).timeline, now=0)
    by_rule = {f.rule: f for f in report.findings}
    assert "long-request-spike" in RULE.explains
    assert by_rule["long-request-spike"].caused_by == "long-context-prefill-oom"
    assert by_rule["long-context-prefill-oom"].caused_by is None


def test_on_034_extensible_the_overrun_is_measured_against_the_torch_cap() -> None:
    """spec/vllm-0.34.md long-context-prefill-oom row: with gmu unset B = T, so P + A − B never
    exceeds 0; E = allocated + reserved-unallocated + A − L. Attention frames make it this rule's,
    and it explains torch-cap-oom; MLP frames at the cap are torch-cap-oom's alone."""
    from pathlib import Path

    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    bundles = Path(__file__).parents[1] / "data" / "bundles"
    pipeline = Pipeline.load()

    def by_rule(name: str) -> dict[str, Any]:
        report = pipeline.evaluate(load_bundle(bundles / name).timeline, now=0)
        return {f.rule: f for f in report.findings}

    got = by_rule("v34-long-context-prefill-oom-at-cap")
    f = got["long-context-prefill-oom"]
    assert "more than its torch cap" in f.summary and "L = 18.34 GiB" in f.summary
    assert [x.flags for x in f.fixes] == [
        {"--max-num-batched-tokens": "4096"},
        {"--gpu-memory-utilization": "0.96"},
    ]
    assert got["torch-cap-oom"].caused_by == "long-context-prefill-oom"
    assert_words_match_fixes(f)
    assert "long-context-prefill-oom" not in by_rule("v34-torch-cap-oom-prefill")
    # the same OOM at the cap on a 0.33-style engine: E = P + A − B, unchanged (0.33 behaviour)
    assert finding(RULE, _oom(torch_cap_overrun_bytes=GiB)) is not None
    assert finding(RULE, _oom(torch_cap_overrun_bytes=GiB, vllm_sizing_mode="estimate")).summary.startswith(
        "The engine ran out of memory at run time (vllm.log line 16) with 4.00 GiB more than its own budget"
    )
