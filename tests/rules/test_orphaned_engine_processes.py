"""orphaned-engine-processes on 0.34 (spec §2): the NVML trigger and `kill PID` fix are kept; an
engine whose API server answers while asleep / KV-released is not called orphaned."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from kvdoctor.units import GiB
from rules.orphaned_engine_processes import RULE
from tests.rules._words import facts


def _eval(**values: Any) -> Any:
    v = facts(
        orphan_pids=[48211],
        orphan_bytes=int(12.5 * GiB),
        orphan_gpus=[0],
        orphan_desc="pid 48211 (VLLM::EngineCore) 12.50 GiB on GPU 0",
        orphan_reason="no vLLM API server is running",
        **values,
    )
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"gpus", "metrics", "log"})])
    assert not ev.errors
    return ev.findings[0] if ev.findings else None


def test_an_orphan_is_killed() -> None:
    f = _eval()
    assert f is not None and f.fixes[0].commands == ("kill 48211",)


def test_a_sleeping_engine_whose_server_answers_metrics_is_not_orphaned() -> None:
    assert _eval(asleep=True, sleep_source="vllm:engine_sleep_state") is None
    # awake=1 during a checkpoint `prepared` / KV loan: the gauge was read, the server answered
    assert _eval(asleep=False, sleep_source="vllm:engine_sleep_state") is None


def test_the_orphan_is_named_as_the_cause_of_shared_gpu_gmu_unset() -> None:
    assert "shared-gpu-gmu-unset" in RULE.explains
