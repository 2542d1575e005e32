"""max-model-len-exceeds-kv-capacity: the words advise only the fixes the finding carries."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.max_model_len_exceeds_kv_capacity import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.units import GiB


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """The V1 fit error of a Llama-3.1-8B at 131072 tokens on a card with 3.87 GiB of KV."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        mml_error=True,
        mml_error_line=12,
        mml_error_max_model_len=131072,
        max_model_len=131072,
        mml_error_needed_bytes=16 * GiB,
        mml_error_available_bytes=int(3.87 * GiB),
        mml_error_estimate=31696,
        block_size=16,
        gmu=0.9,
        gpu_total_bytes=80 * GiB,
        kv_cache_dtype="auto",
        vllm_version="0.33.0",
        tp_pp=1,
        engine_gpus=[0],
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_every_alternative_named_is_a_fix_and_the_length_in_effect_is_no_flag() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    # 16 GiB needed, 3.87 available: gmu 0.9 + 12.13 / 80 = 1.06 is out of reach, fp8 not enough
    assert [x.flags for x in f.fixes] == [{"--max-model-len": "31696"}]
    assert f.summary.startswith("One request of max_model_len 131,072 tokens")
    assert "Cap --max-model-len at 31696" in f.summary


def test_a_length_not_below_the_one_in_effect_is_not_advised() -> None:
    # vLLM's estimate is not below the max_model_len in effect: the fix is dropped, and the
    # words no longer say "Cap --max-model-len at 131072" (nor "at N/A" without an estimate).
    for estimate in (131072, None):
        ev = _evaluate(mml_error_estimate=estimate, mml_error_kv_tokens=None, kv_capacity_tokens=None)
        assert not ev.errors
        (f,) = ev.findings
        assert all("--max-model-len" not in x.flags for x in f.fixes)
        assert "--max-model-len" not in f.summary
        assert "N/A." not in f.summary


def test_a_gmu_the_fix_would_drop_is_not_advised() -> None:
    # the gmu that keeps the full length is the gmu in effect (the error's shortfall is
    # tiny): no "raise --gpu-memory-utilization to 0.9", and no dangling "or".
    ev = _evaluate(mml_error_needed_bytes=4 * GiB, mml_error_available_bytes=4 * GiB, kv_cache_dtype="fp8")
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--max-model-len": "31696"}]
    assert "--gpu-memory-utilization" not in f.summary
    assert f.summary.endswith("Cap --max-model-len at 31696.")


def test_the_alternatives_are_joined_by_or_each_a_fix_of_its_own() -> None:
    # halving the KV makes it fit (8 / 2 <= 4.5 GiB); the gmu for the full length is 0.95
    ev = _evaluate(mml_error_needed_bytes=8 * GiB, mml_error_available_bytes=int(4.5 * GiB), gmu=0.9)
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [
        {"--max-model-len": "31696"},
        {"--gpu-memory-utilization": "0.95"},
        {"--kv-cache-dtype": "fp8"},
    ]
    assert f.summary.endswith(
        "Cap --max-model-len at 31696, or raise --gpu-memory-utilization to 0.95 to keep the full length,"
        " or halve the KV per token with --kv-cache-dtype fp8."
    )
    # where the model's GPU has no fp8, only the length is advised
    ev = _evaluate(
        mml_error_needed_bytes=8 * GiB,
        mml_error_available_bytes=int(4.5 * GiB),
        gmu=0.95,
        fp8_supported=False,
    )
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--max-model-len": "31696"}]


def test_per_gpu_rank_only_with_parallelism_and_never_na() -> None:
    (f,) = _evaluate(tp_pp=2).findings
    assert "31,696 tokens per GPU rank." in f.summary
    (f,) = _evaluate(tp_pp=None).findings
    assert "31,696 tokens." in f.summary and "N/A" not in f.summary


def test_near_miss_capacity_above_the_length_does_not_fire() -> None:
    ev = _evaluate(mml_error=False, mml_error_estimate=None, kv_capacity_tokens=200_000)
    assert ev.findings == [] and not ev.errors


# vLLM 0.34 (spec/vllm-0.34.md §2, max-model-len-exceeds-kv-capacity row)


def _ext(**values: Any) -> rulekit.Evaluation:
    """The handed 0.34 case: Qwen3-8B at 40,960 on an RTX 4090, after-warm-up error, gmu unset."""
    base: dict[str, Any] = dict(
        vllm_version="0.34.0",
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        max_model_len=40960,
        mml_error_max_model_len=40960,
        mml_error_needed_bytes=int(5.62 * GiB),
        mml_error_available_bytes=int(5.33 * GiB),
        mml_error_estimate=38848,
        block_size=64,
        gmu=1.0,
        gmu_resolved=1.0,
        gmu_explicit=False,
        gpu_total_bytes=int(23.64 * GiB),
        fp8_supported=True,
    )
    base.update(values)
    return _evaluate(**base)


def test_034_ext_gmu_unset_has_no_gmu_fix() -> None:
    (f,) = _ext().findings
    assert [x.flags for x in f.fixes] == [{"--max-model-len": "38848"}, {"--kv-cache-dtype": "fp8"}]


def test_034_ext_explicit_gmu_below_one_gets_one_unless_another_process_is_there() -> None:
    (f,) = _ext(gmu=0.9, gmu_resolved=0.9, gmu_explicit=True).findings
    assert {"--gpu-memory-utilization": "1"} in [x.flags for x in f.fixes]
    (g,) = _ext(gmu=0.9, gmu_resolved=0.9, gmu_explicit=True, foreign_bytes=3 * GiB).findings
    assert all("--gpu-memory-utilization" not in x.flags for x in g.fixes)


def test_034_length_is_a_multiple_of_the_block_size_in_effect() -> None:
    # no estimate logged: the committed pool's longest length, rounded down to a multiple of 64
    (f,) = _ext(mml_error_estimate=None, max_model_len_fit_pool=38850).findings
    assert f.fixes[0].flags == {"--max-model-len": "38848"}
    # never from the reservation A: without the pool nothing is sized from mml_error_available_bytes
    (g,) = _ext(mml_error_estimate=None, max_model_len_fit_pool=None, kv_capacity_tokens=None).findings
    assert all("--max-model-len" not in x.flags for x in g.fixes)


def test_033_keeps_its_gmu_fix() -> None:
    # 0.33 behaviour: the gmu whose budget holds the missing KV, ≤ 0.95
    (f,) = _evaluate(mml_error_needed_bytes=4 * GiB, mml_error_available_bytes=int(3.87 * GiB)).findings
    assert any("--gpu-memory-utilization" in x.flags for x in f.fixes)


# issue 24 kind 9: hybrid models on vLLM 0.9–0.20 log a KV cache size as low as a quarter


def test_kind9_capacity_from_concurrency_is_named_in_the_evidence() -> None:
    ev = _evaluate(
        mml_error=None,
        mml_error_max_model_len=None,
        mml_error_needed_bytes=None,
        mml_error_available_bytes=None,
        mml_error_estimate=None,
        vllm_version="0.15.1",
        max_model_len=131072,
        kv_capacity_tokens=100597,
        kv_capacity_from_concurrency=True,
    )
    (f,) = ev.findings
    (cap,) = [e for e in f.evidence if e.fact == "KV cache capacity"]
    assert "Maximum concurrency" in cap.source and "100,597" in cap.value


def test_kind9_hybrid_bundle_is_not_short() -> None:
    from pathlib import Path

    from tests.rule_contexts import all_contexts
    from tests.test_cases import diagnose_json

    name = "k1-hybrid-v015-kv-size-quarter-not-short"
    bundle = Path(__file__).resolve().parent.parent / "data" / "bundles" / name
    _code, report = diagnose_json(bundle)
    assert all(x["rule"] != "max-model-len-exceeds-kv-capacity" for x in report["findings"])
    (v,) = [v for b, _e, v, _i in all_contexts() if b == name]
    assert v["kv_capacity_tokens"] == int(3.07 * 32768) and v["kv_capacity_from_concurrency"] is True
    # a single-group model on the same versions keeps the logged size (they agree within 10 %)
    others = [v for b, _e, v, _i in all_contexts() if b == "r19-v092-dual-kv-gauges-host-bound"]
    assert others and all(v["log_kv_concurrency"] and not v["kv_capacity_from_concurrency"] for v in others)
