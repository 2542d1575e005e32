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


def _diagnose(path: str) -> list[dict]:
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from kvdoctor.cli import cli

    data = Path(__file__).parent.parent / "data"
    out = CliRunner().invoke(cli, ["diagnose", "--bundle", str(data / path), "--format", "json"])
    return [f for f in json.loads(out.stdout)["findings"] if f["rule"] == "gpu-shared-with-foreign-process"]


def test_without_a_visible_process_the_memory_is_held_outside_vllm() -> None:
    # issue 24 kind 3: "another process" only when one is visible
    (f,) = _diagnose("bundles/p2-free-below-util-no-process-visible")
    assert f["title"] == "Memory on the engine's GPU is held outside vLLM"
    assert "other process" not in f["summary"] and "another process" not in f["summary"].lower()
    assert "stop whatever holds the memory outside vLLM first" in f["summary"]
    (g,) = _diagnose("cases/b05-foreign-process-blocks-startup")
    assert g["title"] == "Another process holds memory on the engine's GPU"
    assert "kill 48213" in g["summary"]


def test_on_034_non_extensible_the_033_refusal_is_kept() -> None:
    # 0.34 after 'Disabling the extensible KV cache: …': the startup refusal comes back (spec §2)
    (f,) = _diagnose("bundles-034/v34-fallback-disabled-free-below-util")
    assert f["severity"] == "critical" and "vLLM refused to start" in f["summary"]
    assert f["suggested_flags"] == {"--gpu-memory-utilization": "0.81"}


def test_on_034_extensible_with_an_explicit_gmu_the_words_say_cap_not_fit() -> None:
    (f,) = _diagnose("bundles/p2-v34-n1-near-miss-explicit-gmu")
    assert "caps this engine" in f["summary"] and "caps this instance at" in f["summary"]
    assert "shared-gpu-gmu-unset" not in [
        x["rule"] for x in _diagnose("bundles/p2-v34-n1-near-miss-explicit-gmu")
    ]
