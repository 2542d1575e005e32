"""prefill-burst-oom: the step cap only ever lowers --max-num-batched-tokens."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.prefill_burst_oom import RULE

from tests.rules._words import assert_words_match_fixes, facts, finding


def _oom(**over: Any) -> dict[str, Any]:
    """A run-time OOM whose traceback runs through the prefill path, chunked prefill off."""
    base = dict(
        runtime_oom=True,
        runtime_oom_hints=["prefill"],
        runtime_oom_line=27,
        oom_requested_bytes=1879048192,
        oom_free_bytes=1202590842,
        max_num_batched_tokens=8192,
        chunked_prefill_on=False,
        engine_gpus=[0],
    )
    return facts(**{**base, **over})


def test_it_halves_the_step_and_turns_chunking_on() -> None:
    f = finding(RULE, _oom())
    assert f is not None and f.severity == "critical"
    assert [x.flags for x in f.fixes] == [
        {"--max-num-batched-tokens": "4096", "--enable-chunked-prefill": ""}
    ]
    assert "--max-num-batched-tokens 4096 (now 8,192)" in f.summary
    assert_words_match_fixes(f)


def test_a_step_of_256_or_fewer_tokens_is_never_raised() -> None:
    # the YAML form set (and advised) 256 here: more tokens per step, not fewer
    f = finding(RULE, _oom(max_num_batched_tokens=200))
    assert f is not None
    assert [x.flags for x in f.fixes] == [{"--enable-chunked-prefill": ""}]
    assert "--max-num-batched-tokens" not in f.summary
    assert "chunks of 200 tokens" in f.summary
    assert_words_match_fixes(f)


def test_with_chunking_on_and_small_steps_no_fix_is_named() -> None:
    f = finding(RULE, _oom(max_num_batched_tokens=256, chunked_prefill_on=True))
    assert f is not None
    assert f.fixes == [] and "--" not in f.summary


def test_a_logprobs_oom_is_not_this_rule() -> None:
    assert finding(RULE, _oom(runtime_oom_hints=["prefill", "logprobs"])) is None


def test_on_034_extensible_the_torch_cap_is_evidence_and_a_small_step_is_torch_cap_ooms() -> None:
    """spec/vllm-0.34.md prefill-burst-oom row: trigger and the --max-num-batched-tokens fix
    unchanged; the failed allocation is bounded by the torch cap (the OOM's allowed part); when
    the step size is not the cause, torch-cap-oom (N4)."""
    from kvdoctor.rules.prefill_burst_oom import RULE as BURST

    from kvdoctor.units import GiB
    from tests.rules._words import facts, finding

    base = dict(
        runtime_oom=True,
        runtime_oom_hints=["prefill"],
        runtime_oom_line=20,
        vllm_sizing_mode="extensible",
        vllm_defaults_version="0.34.0",
        oom_allowed_bytes=int(18.34 * GiB),
        gpu_total_bytes=80 * GiB,
        gpu_name="NVIDIA H100 80GB HBM3",
        chunked_prefill_on=True,
    )
    f = finding(BURST, facts(**base))
    assert f is not None and f.suggested_flags == {
        "--max-num-batched-tokens": "4096"
    }  # 0.34 H100 default 8192
    assert any(e.fact == "torch cap at the OOM" for e in f.evidence)
    assert finding(BURST, facts(**{**base, "max_num_batched_tokens": 256})) is None
    # 0.33 behaviour kept: the same small step on an estimate-mode engine still fires (chunk advice)
    assert (
        finding(BURST, facts(**{**base, "max_num_batched_tokens": 256, "vllm_sizing_mode": "estimate"}))
        is not None
    )
