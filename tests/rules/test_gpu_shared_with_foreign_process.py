"""gpu-shared-with-foreign-process: the advice names a gmu only when that gmu is the fix."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from kvdoctor.units import GiB
from tests.rule_contexts import all_contexts


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.gpu_shared_with_foreign_process import RULE

    (eid, v, inputs) = next((e, v, i) for b, e, v, i in all_contexts() if b == bundle)
    ctx = rulekit.RuleContext(eid, {**v, **changes}, set(inputs))
    ev = rulekit.evaluate([RULE], [ctx])
    assert not ev.errors
    (finding,) = ev.findings
    return finding


def test_the_gmu_that_fits_beside_the_other_process_is_advised_and_is_the_fix() -> None:
    f = _finding("b05-foreign-process-blocks-startup")
    assert "Lower --gpu-memory-utilization to 0.65" in f.summary
    assert "or stop the other process first (kill 48213)." in f.summary
    # two alternatives: the gmu that fits, or stopping the process (the YAML form named only the first)
    assert [(fix.flags, fix.commands) for fix in f.fixes] == [
        ({"--gpu-memory-utilization": "0.65"}, ()),
        ({}, ("kill 48213",)),
    ]


def test_a_process_listed_on_two_gpus_is_killed_once() -> None:
    f = _finding("k1-preload-near-miss-real-foreign")
    assert "(kill 7)" in f.summary
    assert f.fixes[-1].commands == ("kill 7",)


def test_a_gmu_already_in_effect_is_not_advised_stopping_the_process_is() -> None:
    # An H200 (141 GiB) at gmu 0.924: what is free less the 0.5 GiB margin gives 0.92, which is
    # within 0.005 of the gmu in effect, so it is no fix (the YAML form still said "Lower
    # --gpu-memory-utilization to 0.92" with an empty fix).
    f = _finding(
        "b05-foreign-process-blocks-startup",
        gmu=0.924,
        fbu_gmu=0.924,
        fbu_total_bytes=141 * GiB,
        gpu_total_bytes=141 * GiB,
        fbu_free_bytes=int(130.25 * GiB),
    )
    assert "--gpu-memory-utilization to" not in f.summary
    assert f.summary.endswith("Stop the other process (kill 48213) first.")
    assert [(fix.flags, fix.commands) for fix in f.fixes] == [({}, ("kill 48213",))]


def test_a_raise_already_in_effect_for_preloaded_weights_is_not_advised() -> None:
    # vLLM ≥ 0.32 refused: the preloaded weights exceed the budget; derive's gmu that holds
    # them (0.28) is within 0.005 of the gmu in effect (0.276).
    f = _finding(
        "b05-foreign-process-blocks-startup",
        gmu=0.276,
        fbu_gmu=0.276,
        startup_refusal_variant="external_weights_exceed",
        external_weights_gmu=0.28,
        external_weights_bytes=12 * GiB,
    )
    assert "Raise --gpu-memory-utilization" not in f.summary
    assert "Even --gpu-memory-utilization" not in f.summary
    assert f.summary.endswith("Preload a smaller or quantized model, or shard it over more GPUs.")
    assert f.fixes == []


def test_the_gmu_in_effect_is_not_written_as_a_flag_the_fix_does_not_set() -> None:
    # A foreign process beside a running engine whose gmu still fits: no fix, so no flag named.
    f = _finding("k4-compose-foreign-rank1")
    assert "The current gmu 0.92 still fits beside it" in f.summary
    assert "--gpu-memory-utilization" not in f.summary
    assert f.fixes == []
