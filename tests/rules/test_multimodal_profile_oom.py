"""multimodal-profile-oom: the words advise only the fixes the finding carries, with their values."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.multimodal_profile_oom import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """Qwen2-VL-7B's profile run OOMed in the vision tower with 4 images per prompt."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        mm_profile_oom=True,
        mm_profile_line=20,
        oom_hints=["multimodal"],
        startup_failed=True,
        limit_mm_per_prompt='{"image":4}',
        max_num_seqs_effective=256,
        enforce_eager=False,
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_every_flag_named_is_a_fix_with_the_value_named() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [
        {"--limit-mm-per-prompt": '{"image":1}'},
        {"--mm-processor-kwargs": '{"max_pixels":802816}'},
        {"--max-num-seqs": "8"},
        {"--enforce-eager": ""},
    ]
    for fix in f.fixes:
        for flag, value in fix.flags.items():
            assert f"{flag} '{value}'" in f.summary or f"{flag} {value}".strip() in f.summary


def test_a_max_num_seqs_already_small_is_not_advised() -> None:
    # max_num_seqs 8 set on the command line: YAML still said "a small --max-num-seqs (8)"
    (f,) = _evaluate(max_num_seqs=8, max_num_seqs_effective=8, max_num_seqs_explicit=True).findings
    assert all("--max-num-seqs" not in x.flags for x in f.fixes)
    assert "--max-num-seqs" not in f.summary
    assert f.summary.endswith("; or --enforce-eager to drop the CUDA graph memory.")


def test_a_limit_already_in_effect_is_not_advised() -> None:
    (f,) = _evaluate(limit_mm_per_prompt='{"image": 1}').findings
    assert all("--limit-mm-per-prompt" not in x.flags for x in f.fixes)
    assert "--limit-mm-per-prompt" not in f.summary
    assert "Shrink the worst case: --mm-processor-kwargs" in f.summary


def test_the_too_short_warning_alone_is_a_warning() -> None:
    (f,) = _evaluate(mm_profile_oom=False, mm_profile_too_short=True, startup_failed=False).findings
    assert f.severity == "warning"
    assert [e.fact for e in f.evidence][0] == "profiling sequence too short for the multimodal worst case"


def test_near_miss_a_text_model_oom_is_not_this_rule() -> None:
    ev = _evaluate(mm_profile_oom=False)
    assert ev.findings == [] and not ev.errors
