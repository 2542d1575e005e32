"""idle-preallocation: the lower gmu that shares the card is named only when it is the fix."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from kvdoctor.units import GiB
from tests.rules._words import bundle_finding


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.idle_preallocation import RULE

    return bundle_finding(RULE, bundle, **changes)


def test_an_idle_80_gb_card_gets_the_gmu_that_leaves_16_gib_free() -> None:
    f = _finding("healthy-idle-gmu092")
    assert "To share the card, --gpu-memory-utilization 0.79 would leave about 16 GiB free." in f.summary
    assert [fix.flags for fix in f.fixes] == [{"--gpu-memory-utilization": "0.79"}]


def test_a_card_smaller_than_the_share_gets_no_gmu_advice() -> None:
    # A 10 GiB MIG slice, idle at gmu 0.92: leaving 16 GiB free would need gmu 0, which vLLM
    # rejects (the YAML form still said "--gpu-memory-utilization 0.0 would leave about 16 GiB
    # free" with an empty fix).
    f = _finding(
        "healthy-idle-gmu092",
        gpu_total_bytes=10 * GiB,
        gpu_used_bytes=int(9.2 * GiB),
        gpu_used_fraction=0.92,
    )
    assert f.summary.endswith("This is not a leak.")
    assert "--gpu-memory-utilization" not in f.summary
    assert f.fixes == []


def _eval(v: dict[str, Any]) -> Any:
    from rules.idle_preallocation import RULE

    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"gpus", "metrics", "log"})])
    assert not ev.errors, [str(e) for e in ev.errors]
    return ev.findings[0] if ev.findings else None


def _v34(**changes: Any) -> dict[str, Any]:
    from tests.rules._words import facts

    base = dict(
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        gmu=1.0,
        gmu_explicit=False,
        gmu_assumption="unset: 1.0 with the extensible KV cache (vLLM ≥ 0.34)",
        gpu_total_bytes=int(79.19 * GiB),
        gpu_used_bytes=int(76.1 * GiB),
        gpu_used_fraction=0.96,
        gpu_util=0.0,
        kv_usage=0.0,
        kv_usage_max=0.0,
        traffic=False,
        engine_gpus=[0],
        idle_headroom_design_bytes=int(3.1 * GiB),
    )
    return facts(**{**base, **changes})


def test_on_034_extensible_it_says_normal_after_warmup_and_leaves_a_margin() -> None:
    f = _eval(_v34())
    assert f is not None and f.severity == "info"
    assert (
        "normal: vLLM 0.34 measures after warm-up and commits all but μ + kept (3.10 GiB here)" in f.summary
    )
    # floor_0.01((79.19 − 16 − 0.5)/79.19) = 0.79
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.79"}


def test_on_034_a_released_or_sleeping_engine_is_not_reported() -> None:
    # KV released (sleep, /release_kv_cache_memory, checkpoint prepared): far below the threshold
    assert _eval(_v34(gpu_used_bytes=int(17.5 * GiB), gpu_used_fraction=0.22)) is None
    assert _eval(_v34(asleep=True)) is None


def test_a_sleeping_neighbour_is_counted_in_the_words_and_the_share() -> None:
    v = _v34(
        gmu=0.9,
        gmu_explicit=True,
        gmu_assumption="explicit --gpu-memory-utilization 0.9",
        gpu_used_bytes=int(74.2 * GiB),
        colocated_names=["llama", "qwen"],
        colocated_self=0,
        colocated_sleeping=[False, True],
        colocated_bytes=[int(71.3 * GiB), int(2.9 * GiB)],
    )
    f = _eval(v)
    assert f is not None
    assert "2.90 GiB of it is held by sleeping engine(s) beside it (qwen 2.90 GiB)" in f.summary
    # leaving 16 GiB free beside the sleeping 2.9 GiB: floor_0.01((79.19 − 2.9 − 16 − 0.5)/79.19) = 0.75
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.75"}
