"""idle-preallocation: the lower gmu that shares the card is named only when it is the fix."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from kvdoctor.units import GiB
from tests.rule_contexts import all_contexts


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.idle_preallocation import RULE

    (eid, v, inputs) = next((e, v, i) for b, e, v, i in all_contexts() if b == bundle)
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext(eid, {**v, **changes}, set(inputs))])
    assert not ev.errors
    (finding,) = ev.findings
    return finding


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
