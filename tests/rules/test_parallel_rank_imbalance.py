"""parallel-rank-imbalance: VLLM_PP_LAYER_PARTITION is named only with the value its fix sets."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from tests.rules._words import bundle_finding

PP2 = "k3-two-nodes-heavy-stage0"  # TP 2 × PP 2, stage 0 holds 5.47 GiB more


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.parallel_rank_imbalance import RULE

    return bundle_finding(RULE, bundle, **changes)


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


def _v034(blocks: list[int], **changes: Any) -> list[Any]:
    from kvdoctor.units import GiB
    from rules.parallel_rank_imbalance import RULE
    from tests.rules._words import facts

    v = facts(
        **{
            "tp_pp": 2,
            "tp": 2,
            "pp": 1,
            "gpu_total_bytes": int(79.19 * GiB),
            "vllm_sizing_mode": "extensible",
            "warmup_blocks_per_rank": blocks,
            "kv_block_bytes": 4 * 2**20,
            "warmup_line": 40,
            **changes,
        }
    )
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"log"})])
    assert not ev.errors
    return ev.findings


def test_on_034_the_per_rank_blocks_after_warmup_name_the_limiting_rank() -> None:
    # (7576 − 6400) × 4 MiB = 4.59 GiB > max(1 GiB, 5 % of 79.19 GiB)
    (f,) = _v034([7576, 6400])
    assert "rank 1 (in the order of the 'Memory after warmup' lines)" in f.summary
    assert "7,576, 6,400 KV blocks; the pool is the minimum, 6,400 (rank 1)" in f.summary
    assert "leave 4.59 GiB of KV memory unused" in f.summary
    assert [e.fact for e in f.evidence] == [
        "KV blocks per rank after warm-up",
        "KV memory the limiting rank leaves unused",
    ]


def test_on_034_near_misses_small_spread_or_not_extensible() -> None:
    assert _v034([7576, 7300]) == []  # 1.08 GiB
    assert (
        _v034([7576, 6400], vllm_sizing_mode="estimate") == []
    )  # 'Available KV cache memory' is no evidence
    assert _v034([7576]) == []
