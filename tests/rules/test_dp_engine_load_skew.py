"""dp-engine-load-skew: no fix, so the words name no flag; each point is said once."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from tests.rule_contexts import all_contexts

SKEW = "r22-dp2-storm-on-engine1-only"  # vLLM ≥ 0.27: engine 1 queues while engine 0 idles


def _finding(bundle: str, **changes: Any) -> Any:
    from rules.dp_engine_load_skew import RULE

    ev = rulekit.evaluate(
        [RULE],
        [rulekit.RuleContext(e, {**v, **changes}, set(i)) for b, e, v, i in all_contexts() if b == bundle],
    )
    assert not ev.errors
    (finding,) = ev.findings
    return finding


def test_a_skew_on_a_recent_balancer_points_at_pinned_requests_once() -> None:
    f = _finding(SKEW)
    assert "hot engine 1 (waiting 13, running 29, KV 1.00); cold engine 0" in f.summary
    assert f.summary.count("X-data-parallel-rank") == 1
    assert f.fixes == []


def test_an_outside_router_is_named_without_a_flag_no_fix_sets() -> None:
    f = _finding(SKEW, dp_external_lb=True)
    assert "placed by an outside router" in f.summary
    assert "--" not in f.summary
    assert f.summary.count("Requests sent with X-data-parallel-rank skip the balancer.") == 1


def test_an_old_balancer_is_named_by_its_version() -> None:
    f = _finding("c2-dp-engine-load-skew-dp8-v014")
    assert "vLLM 0.14.0’s balancer ranks engines by 4 × waiting + running" in f.summary
    assert f.summary.count("Requests sent with X-data-parallel-rank skip the balancer.") == 1


def _running_samples(rows: list[list[int]], waiting: int = 0) -> list[dict]:
    return [
        {
            "t": 15.0 * i,
            "engines": {
                str(e): {"waiting": waiting if e == 0 else 0, "running": r, "kv": 0.3 if r else 0.0}
                for e, r in enumerate(row)
            },
        }
        for i, row in enumerate(rows)
    ]


def test_running_concentrated_with_nothing_waiting_fires_vllm_48808() -> None:
    from kvdoctor import rulekit
    from rules.dp_engine_load_skew import RULE
    from tests.rules._words import facts

    rows = [[52, 49, 0, 0], [55, 47, 1, 0], [50, 51, 0, 0]]
    v = facts(dp_samples=_running_samples(rows), dp_window_s=30.0, dp_source="metrics", model_name="m")
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"metrics"})])
    assert not ev.errors
    (f,) = ev.findings
    assert "nothing waiting anywhere (vllm#48808)" in f.summary
    assert "busy engine 0 (waiting 0, running 50" in f.summary and "idle engine 2" in f.summary
    assert f.title.startswith("Data-parallel engines run requests unevenly")
    assert f.fixes == []


def test_running_skew_near_misses_even_trickle_or_a_queue() -> None:
    from kvdoctor import rulekit
    from rules.dp_engine_load_skew import RULE
    from tests.rules._words import facts

    def fires(samples: list[dict]) -> bool:
        v = facts(dp_samples=samples, dp_window_s=30.0, dp_source="metrics")
        return bool(rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"metrics"})]).findings)

    assert not fires(_running_samples([[13, 12, 14, 12]] * 3))  # even
    assert not fires(_running_samples([[2, 1, 0, 0]] * 3))  # a trickle
    assert not fires(_running_samples([[52, 49, 0, 0]] * 3, waiting=3))  # a queue: the waiting form decides
    assert not fires(
        _running_samples([[52, 49, 0, 0], [52, 49, 0, 0], [13, 12, 14, 12]])
    )  # not in every sample
