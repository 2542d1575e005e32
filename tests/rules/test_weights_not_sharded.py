"""weights-not-sharded: no tensor-parallel size advised that the fix drops."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.weights_not_sharded import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.facts import ModelArch
from kvdoctor.units import GiB

LLAMA_8B = ModelArch(
    model_type="llama",
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=4096,
    max_position_embeddings=131072,
)


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """An 8B model (15 GiB) at TP 1 on the first of two 80 GiB GPUs; the load OOMed while GPU 1
    stayed empty."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        arch=LLAMA_8B,
        num_attention_heads=32,
        num_kv_heads=8,
        weights_bytes=15 * GiB,
        gmu=0.9,
        gpu_total_bytes=80 * GiB,
        gpu_total_map={0: 80 * GiB, 1: 80 * GiB},
        gpu_used_map={0: 79 * GiB, 1: 0},
        gpus_without_processes=[1],
        gpu_count=2,
        tp=1,
        pp=1,
        tp_pp=1,
        max_model_len=8192,
        kv_cache_dtype="auto",
        weight_loading_oom=True,
        oom_line=40,
        engine_gpus=[0],
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"gpus", "log"})])


def test_a_tp_of_1_already_in_effect_is_not_advised() -> None:
    # the weights fit one GPU by the estimate: the smallest TP is 1, the TP in effect. YAML said
    # "Shard the model with --tensor-parallel-size 1" while the fix dropped it.
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert f.fixes == []
    assert "--tensor-parallel-size" not in f.summary
    assert "while 1 of the 2 visible GPUs hold nothing." in f.summary
    assert "(1) is not one this engine can take" in f.summary


def test_weights_too_big_for_one_gpu_get_the_smallest_tp_that_fits() -> None:
    ev = _evaluate(weights_bytes=100 * GiB, weight_loading_oom=False)
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--tensor-parallel-size": "2"}]
    assert f.summary.startswith("Shard the model with --tensor-parallel-size 2. ")


def test_near_miss_weights_fit_and_no_oom() -> None:
    ev = _evaluate(weight_loading_oom=False)
    assert ev.findings == [] and not ev.errors
