"""parallel-rank-imbalance: VLLM_PP_LAYER_PARTITION is named only with the value its fix sets."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from tests.rule_contexts import all_contexts

PP2 = "k3-two-nodes-heavy-stage0"  # TP 2 × PP 2, stage 0 holds 5.47 GiB more


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.parallel_rank_imbalance import RULE

    (eid, v, inputs) = next((e, v, i) for b, e, v, i in all_contexts() if b == bundle)
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext(eid, {**v, **changes}, set(inputs))])
    assert not ev.errors
    (finding,) = ev.findings
    return finding


def test_a_heavy_pipeline_stage_gets_the_layer_partition_that_is_its_fix() -> None:
    f = _finding(PP2)
    assert f.summary.endswith("with VLLM_PP_LAYER_PARTITION = 10,22.")
    assert [fix.env for fix in f.fixes] == [{"VLLM_PP_LAYER_PARTITION": "10,22"}]


def test_without_a_partition_the_variable_is_not_named() -> None:
    # The weights' size unknown: no partition can be computed. The YAML form still said
    # "… with VLLM_PP_LAYER_PARTITION." beside an empty fix.
    f = _finding(PP2, weights_bytes=None)
    assert "VLLM_PP_LAYER_PARTITION" not in f.summary
    assert f.summary.endswith("move layers off the heavy stage (the last one holds lm_head and the sampler).")
    assert f.fixes == []


def test_a_tensor_parallel_group_gets_no_pipeline_advice() -> None:
    f = _finding("k3-node-logs-heavy-rank")
    assert "pipeline" not in f.summary
    assert f.fixes == []
