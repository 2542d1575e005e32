"""low-util-host-bound (issue 24 kind 7): a sleeping engine is idle by design, not host-bound."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from rules.low_util_host_bound import RULE
from tests.rules._words import facts


def _eval(**values: Any) -> Any:
    v = facts(traffic=True, gpu_util=0.05, kv_usage_max=0.1, waiting_max=0, running=1, **values)
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"gpus", "metrics", "log"})])
    assert not ev.errors
    return ev.findings[0] if ev.findings else None


def test_idle_gpu_with_traffic_and_no_queue_is_host_bound() -> None:
    assert _eval() is not None


def test_a_sleeping_engine_is_not_host_bound() -> None:
    assert _eval(asleep=True, sleep_source="log") is None
    assert _eval(asleep=True, sleep_source="vllm:engine_sleep_state") is None
