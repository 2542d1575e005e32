"""invalid-kv-cache-dtype: a value the fix drops is not advised in the words."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.invalid_kv_cache_dtype import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """The seed tutorial's --kv-cache-dtype int8, rejected by vLLM 0.33.0."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        invalid_kv_dtype=True,
        invalid_kv_dtype_value="int8",
        invalid_kv_dtype_line=55,
        suggested_kv_dtype="int8_per_token_head",
        vllm_version="0.33.0",
        kv_cache_dtype="int8",
        engine_gpus=[0, 1],
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_the_nearest_valid_value_is_the_fix_and_the_advice() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--kv-cache-dtype": "int8_per_token_head"}]
    assert f.summary == (
        "vLLM 0.33.0 does not accept --kv-cache-dtype int8. Use --kv-cache-dtype int8_per_token_head,"
        " which halves KV bytes per token like int8 would."
    )
    assert f.gpus == [0, 1]


def test_a_suggestion_the_version_rejects_is_not_advised() -> None:
    # int8_per_token_head arrived in 0.20: on 0.14 the fix drops it, and the words must not
    # say "Use --kv-cache-dtype int8_per_token_head" (nor "Use --kv-cache-dtype N/A" without one)
    for version, suggested in (("0.14.0", "int8_per_token_head"), ("0.33.0", None)):
        ev = _evaluate(vllm_version=version, suggested_kv_dtype=suggested)
        assert not ev.errors
        (f,) = ev.findings
        assert f.fixes == []
        assert "--kv-cache-dtype" not in f.summary and "Use " not in f.summary
        assert f.summary.startswith(f"vLLM {version} does not accept kv_cache_dtype int8;")


def test_near_miss_a_valid_dtype_does_not_fire() -> None:
    ev = _evaluate(invalid_kv_dtype=False)
    assert ev.findings == [] and not ev.errors
