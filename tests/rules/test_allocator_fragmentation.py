"""allocator-fragmentation: the fix keeps the operator's other allocator options."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.allocator_fragmentation import RULE, alloc_conf_with_expandable

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.units import GiB


def _evaluate(**values: Any) -> rulekit.Evaluation:
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        oom_requested_bytes=2 * GiB,
        oom_free_bytes=1 * GiB,
        oom_reserved_unallocated_bytes=3 * GiB // 2,
        oom_line=812,
        oom_gpu=0,
        oom_phase="runtime",
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_the_fix_adds_expandable_segments_to_the_options_already_set() -> None:
    ev = _evaluate(
        engine_env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, garbage_collection_threshold:0.8"}
    )
    assert not ev.errors
    (finding,) = ev.findings
    (fix,) = finding.fixes
    want = "max_split_size_mb:512,garbage_collection_threshold:0.8,expandable_segments:True"
    assert fix.env == {"PYTORCH_CUDA_ALLOC_CONF": want}
    assert f"PYTORCH_CUDA_ALLOC_CONF={want}." in finding.summary
    assert finding.gpus == [0]


def test_without_an_alloc_conf_the_fix_is_expandable_segments_alone() -> None:
    (finding,) = _evaluate().findings
    assert finding.suggested_flags == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_an_expandable_segments_option_already_there_is_replaced_not_repeated() -> None:
    assert alloc_conf_with_expandable("expandable_segments:False,max_split_size_mb:128") == (
        "max_split_size_mb:128,expandable_segments:True"
    )


def test_near_miss_expandable_segments_already_on_is_not_fragmentation() -> None:
    ev = _evaluate(
        alloc_conf_expandable=True, engine_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    assert ev.findings == [] and not ev.errors


def test_near_miss_the_request_exceeds_free_plus_reserved() -> None:
    assert _evaluate(oom_requested_bytes=3 * GiB).findings == []
