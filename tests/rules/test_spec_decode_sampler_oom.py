"""spec-decode-sampler-oom: every alternative the words offer is a fix of its own."""

from __future__ import annotations

import json
from typing import Any

from kvdoctor.rules.spec_decode_sampler_oom import RULE

from kvdoctor.units import GiB, MiB
from tests.rules._words import assert_words_match_fixes, facts, finding

_CONFIG = '{"method":"eagle3","model":"AngelSlim/Qwen3-4B_eagle3","num_speculative_tokens":4}'


def _oom(**over: Any) -> dict[str, Any]:
    """A rejection-sampler OOM at k = 4 (eagle3), 256 sequences, 1 GiB free at idle."""
    base = dict(
        spec_on=True,
        spec_k=4,
        spec_method="eagle3",
        spec_config_json=_CONFIG,
        runtime_oom=True,
        runtime_oom_line=15,
        oom_frames_rejection_sampler=True,
        vocab_size=151936,
        max_num_seqs_effective=256,
        max_num_batched_tokens=8192,
        logits_dtype_bytes=2,
        idle_headroom_bytes=1 * GiB,
        engine_budget_bytes=int(0.92 * 80 * GiB),
        device_total_bytes=80 * GiB,
        gmu=0.92,
        engine_gpus=[0],
    )
    return facts(**{**base, **over})


def test_each_alternative_is_a_fix() -> None:
    f = finding(RULE, _oom())
    assert f is not None
    flags = [x.flags for x in f.fixes]
    assert flags[0] == {"--max-num-seqs": "80"}
    assert flags[1] == {"--gpu-memory-utilization": "0.9"}
    assert json.loads(flags[2]["--speculative-config"])["num_speculative_tokens"] == 1
    assert f.summary.endswith(
        "--max-num-seqs 80 brings it under the headroom; or --gpu-memory-utilization 0.90; or"
        f" num_speculative_tokens 1 (--speculative-config '{flags[2]['--speculative-config']}')."
    )
    assert_words_match_fixes(f)


def test_without_a_gmu_in_effect_no_gmu_is_named() -> None:
    # the YAML form rendered "N/A" for the whole advice here
    f = finding(RULE, _oom(gmu=None))
    assert f is not None
    assert "--gpu-memory-utilization" not in f.summary and "N/A" not in f.summary
    assert_words_match_fixes(f)


def test_one_alternative_alone_has_no_leading_or() -> None:
    # 8 sequences: no smaller multiple of 8; without the config JSON no k can be written
    f = finding(RULE, _oom(max_num_seqs_effective=8, spec_config_json=None, idle_headroom_bytes=256 * MiB))
    assert f is not None
    assert [x.flags for x in f.fixes] == [{"--gpu-memory-utilization": "0.91"}]
    assert " or " not in f.summary.split("free at idle.")[1]
    assert_words_match_fixes(f)


def test_one_draft_token_is_what_warm_up_measured() -> None:
    assert finding(RULE, _oom(spec_k=1)) is None


def test_on_034_the_v2_bound_and_the_torch_headroom() -> None:
    """spec/vllm-0.34.md spec-decode-sampler-oom row: the legacy runner is gone (the V2 lower bound
    U = V × N_run × k × b, with no 'Using V2 Model Runner' line), and on the extensible cache case
    (b) compares U with H_torch, not H_idle."""
    from kvdoctor.rule_functions import spec_sampler_bytes

    v2 = spec_sampler_bytes(151936, 256, 8192, 4, 2, False, True)
    legacy = spec_sampler_bytes(151936, 256, 8192, 4, 2, False, False)
    assert v2 is not None and legacy is not None and v2 != legacy
    ext = dict(vllm_v34=True, vllm_sizing_mode="extensible", gmu=1.0, engine_budget_bytes=80 * GiB)
    # by frames: the V2 shape is used on 0.34 although no 'Using V2 Model Runner' line exists
    f34 = finding(RULE, _oom(**ext, torch_headroom_bytes=1 * GiB))
    f33 = finding(RULE, _oom())
    assert f34 is not None and f33 is not None and f34.evidence != f33.evidence
    # by size (no frames): 20 GiB idle looks roomy, but torch may only grow 1 GiB before its cap
    by_size = dict(
        oom_frames_rejection_sampler=False, idle_headroom_bytes=20 * GiB, max_num_seqs_effective=1024
    )
    assert finding(RULE, _oom(**by_size)) is None
    f = finding(RULE, _oom(**ext, **by_size, torch_headroom_bytes=1 * GiB))
    assert f is not None
    gmu = [x.flags["--gpu-memory-utilization"] for x in f.fixes if "--gpu-memory-utilization" in x.flags]
    assert gmu and float(gmu[0]) < 1.0  # valid on ext: a lower gmu raises torch's cap
    assert_words_match_fixes(f)
