"""mixed-gpus-in-parallel-group: only flags that change something, and only a partition vLLM takes."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.mixed_gpus_in_parallel_group import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.facts import ModelArch
from kvdoctor.units import GiB

LLAMA_8B = ModelArch(
    model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128
)


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """Llama-3.1-8B at TP 2 over an 80 GB and a 48 GB card."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        arch=LLAMA_8B,
        tp=2,
        pp=1,
        tp_pp=2,
        gpu_count=2,
        gmu=0.92,
        engine_gpus=[0, 1],
        gpu_total_map={0: 80 * GiB, 1: 48 * GiB},
        engine_gpu_total_min_bytes=48 * GiB,
        engine_gpu_total_max_bytes=80 * GiB,
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"gpus"})])


def test_tp_to_pp_with_a_proportional_partition() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    (fix,) = f.fixes
    assert fix.flags == {"--tensor-parallel-size": "1", "--pipeline-parallel-size": "2"}
    assert fix.env == {"VLLM_PP_LAYER_PARTITION": "20,12"}
    assert (
        "--tensor-parallel-size 1 --pipeline-parallel-size 2 with VLLM_PP_LAYER_PARTITION=20,12" in f.summary
    )


def test_pipeline_already_in_effect_leaves_only_the_partition() -> None:
    # TP 1 × PP 2 already: YAML still said "--tensor-parallel-size 1 --pipeline-parallel-size 2"
    # after the fix dropped both as in effect
    (f,) = _evaluate(tp=1, pp=2).findings
    (fix,) = f.fixes
    assert fix.flags == {} and fix.env == {"VLLM_PP_LAYER_PARTITION": "20,12"}
    assert "--" not in f.summary
    assert "proportional to card sizes: VLLM_PP_LAYER_PARTITION=20,12 (one stage per GPU 0, 1" in f.summary


def test_no_partition_whose_stage_count_is_not_the_pipeline_size() -> None:
    # three GPUs listed for a TP 2 engine: a 3-stage partition with --pipeline-parallel-size 2
    # is a startup error in vLLM
    ev = _evaluate(engine_gpus=[0, 1, 2], gpu_total_map={0: 80 * GiB, 1: 48 * GiB, 2: 48 * GiB}, gpu_count=3)
    assert not ev.errors
    (f,) = ev.findings
    assert f.fixes == []
    assert f.summary.endswith("proportional to card sizes.")


def test_near_miss_matched_cards() -> None:
    ev = _evaluate(engine_gpu_total_min_bytes=80 * GiB, gpu_total_map={0: 80 * GiB, 1: 80 * GiB})
    assert ev.findings == [] and not ev.errors
