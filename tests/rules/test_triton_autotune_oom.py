"""triton-autotune-oom: the words advise the gmu only when the fix carries it."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.triton_autotune_oom import RULE

from kvdoctor.findings import Finding
from kvdoctor.units import GiB
from tests.rules._words import facts, finding
from tests.test_words_and_fixes import _problems


def _findings(**values: Any) -> list[Finding]:
    variables = facts(
        triton_oom=True,
        triton_oom_line=21,
        triton_oom_phase="runtime",
        triton_oom_hints=["fla_ops", "triton_autotune"],
        gdn_model=True,
        model_name="Qwen/Qwen3-Next-80B-A3B-Instruct",
        vllm_release=17,
        vllm_version="0.17.0",
        gpu_compute_capability="8.0",
        gmu=0.9,
        engine_budget_bytes=72 * GiB,
        device_total_bytes=80 * GiB,
        idle_headroom_bytes=4 * GiB,
        engine_gpus=[0, 1],
    )
    found = finding(RULE, {**variables, **values})
    assert found is None or _problems(found) == []
    return [found] if found is not None else []


def test_the_budget_less_the_scratch_is_the_fix_and_the_upgrade_is_advised() -> None:
    (f,) = _findings()
    # (72 GiB − 0.5 GiB) / 80 GiB = 0.89375 → 0.89
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.89"}
    assert "Upgrade to vLLM ≥ 0.18" in f.summary
    assert "Also leave room for scratch outside the allocator: --gpu-memory-utilization 0.89" in f.summary


def test_a_gmu_fix_within_half_a_percent_of_the_one_in_effect_is_not_advised() -> None:
    # budget 72.4 GiB less 0.5 GiB over 80 GiB: 0.8988 → 0.89, within 0.005 of gmu 0.894
    (f,) = _findings(gmu=0.894, engine_budget_bytes=int(72.4 * GiB))
    assert f.fixes == []
    assert "--gpu-memory-utilization" not in f.summary
    assert f.summary.endswith("Also leave 512.00 MiB of room for scratch outside the allocator.")


def test_a_budget_that_cannot_spare_the_scratch_advises_no_gmu() -> None:
    (f,) = _findings(engine_budget_bytes=GiB // 4, vllm_release=18, vllm_version="0.18.0")
    assert f.fixes == []
    assert "Upgrade" not in f.summary and "--gpu-memory-utilization" not in f.summary


def test_near_miss_a_budget_that_already_leaves_the_room_does_not_fire() -> None:
    # (72 GiB − 0.5 GiB) / 80 GiB floors to 0.89: not below a gmu of 0.89
    assert _findings(gmu=0.89) == []


def test_v034_ext_startup_triton_oom_gets_no_gmu() -> None:
    """triton-autotune-oom on vLLM 0.34's extensible KV cache: a startup autotune OOM comes
    before the KV commit, where a lower gmu frees nothing; a run-time one keeps the formula."""
    from pathlib import Path

    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    bundles = Path(__file__).parent.parent / "data" / "bundles"

    def fixes(name: str) -> list[dict[str, str]]:
        report = Pipeline.load().evaluate(load_bundle(bundles / name).timeline, now=0)
        (f,) = [f for f in report.findings if f.rule == "triton-autotune-oom"]
        return [dict(x.flags) for x in f.fixes]

    assert fixes("d2-v34-triton-autotune-oom-before-commit") == []
    assert fixes("d2-v34-triton-autotune-oom-runtime-ext") == [{"--gpu-memory-utilization": "0.98"}]
    assert fixes("c2-triton-autotune-oom-qwen3next-v017-a100") == [{"--gpu-memory-utilization": "0.89"}]
