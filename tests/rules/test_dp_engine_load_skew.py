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
