"""cpu-offload-not-applied: the words name the setting in effect by its field name."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.cpu_offload_not_applied import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.units import GiB


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """DeepSeek-V2-Lite on 0.25.1 with --cpu-offload-gb 12: the V2 runner was chosen on its own."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        offload_not_applied=True,
        cpu_offload_bytes=12 * GiB,
        offload_evidence=["v2_runner"],
        v2_runner_line=5,
        vllm_version="0.25.1",
        vllm_release=25,
        offload_needed_gib=2,
        offload_other_assumed=True,
        engine_gpus=[0],
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_the_env_fix_is_advised_and_the_flag_in_effect_is_no_flag() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.env for x in f.fixes] == [{"VLLM_USE_V2_MODEL_RUNNER": "0"}]
    assert f.summary.startswith("cpu_offload_gb 12 was given, but vLLM 0.25.1 did not offload any weights.")
    assert "--cpu-offload-gb" not in f.summary
    assert "Set VLLM_USE_V2_MODEL_RUNNER=0 (the V2 runner was chosen automatically" in f.summary
    assert f.severity == "warning"


def test_dspark_on_025_needs_an_upgrade_not_the_env() -> None:
    (f,) = _evaluate(dspark_speculative=True).findings
    assert f.fixes == [] and "VLLM_USE_V2_MODEL_RUNNER=0" not in f.summary
    assert "Upgrade to vLLM ≥ 0.28" in f.summary


def test_unknown_evidence_and_g_leave_no_na_sentences() -> None:
    # YAML rendered "N/AN/AN/A" for offload_evidence None and "N/A" for the G comparison
    ev = _evaluate(offload_evidence=None, cpu_offload_bytes=None, vllm_release=30)
    assert not ev.errors
    (f,) = ev.findings
    assert f.summary == "cpu_offload_gb N/A was given, but vLLM 0.25.1 did not offload any weights."


def test_a_failed_start_is_critical() -> None:
    (f,) = _evaluate(weight_loading_oom=True).findings
    assert f.severity == "critical"


def test_near_miss_the_offload_was_applied() -> None:
    ev = _evaluate(offload_not_applied=False)
    assert ev.findings == [] and not ev.errors
