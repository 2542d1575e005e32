"""logprobs-oom: the step cap only ever lowers --max-num-batched-tokens."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.logprobs_oom import RULE

from tests.rules._words import assert_words_match_fixes, facts, finding


def _oom(**over: Any) -> dict[str, Any]:
    """A run-time OOM in logprobs code, 8,192 tokens per step, chunked prefill on."""
    base = dict(
        runtime_oom=True,
        runtime_oom_hints=["logprobs", "sampler"],
        runtime_oom_line=22,
        max_num_batched_tokens=8192,
        vocab_size=128256,
        chunked_prefill_on=True,
        engine_gpus=[0],
    )
    return facts(**{**base, **over})


def test_it_halves_the_step() -> None:
    f = finding(RULE, _oom())
    assert f is not None
    assert "(8,192 tokens × 128,256 vocabulary × 4 bytes = 3.91 GiB)" in f.summary
    assert [x.flags for x in f.fixes] == [{"--max-num-batched-tokens": "4096"}]
    assert_words_match_fixes(f)


def test_a_step_of_256_or_fewer_tokens_is_never_raised() -> None:
    # the YAML form advised "Lower --max-num-batched-tokens to 256" with 128 in effect
    f = finding(RULE, _oom(max_num_batched_tokens=128))
    assert f is not None
    assert f.fixes == [] and "--max-num-batched-tokens" not in f.summary
    assert "Steps are already at most 128 tokens: cap prompt_logprobs" in f.summary


def test_with_chunking_off_small_steps_still_turn_it_on() -> None:
    f = finding(RULE, _oom(max_num_batched_tokens=256, chunked_prefill_on=None))
    assert f is not None
    assert [x.flags for x in f.fixes] == [{"--enable-chunked-prefill": ""}]
    assert_words_match_fixes(f)


def test_a_rejection_sampler_oom_with_k_drafts_is_the_spec_decode_rule() -> None:
    assert finding(RULE, _oom(oom_frames_rejection_sampler=True, spec_on=True, spec_k=4)) is None


def test_on_034_trigger_and_fix_unchanged_and_the_warmup_measured_one_request() -> None:
    """spec/vllm-0.34.md logprobs-oom row: trigger and fix unchanged; on the extensible cache the
    sizing warm-up measured one prompt-logprobs request, concurrent ones are not."""
    f = finding(RULE, _oom(vllm_sizing_mode="extensible", vllm_v34=True))
    g = finding(RULE, _oom())
    assert f is not None and g is not None
    assert [x.flags for x in f.fixes] == [x.flags for x in g.fixes] == [{"--max-num-batched-tokens": "4096"}]
    assert "measured prompt logprobs for one request" in f.summary
    assert "measured prompt logprobs" not in g.summary
