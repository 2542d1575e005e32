"""gpu-memory-growth on vLLM 0.34's extensible KV cache (spec/vllm-0.34.md §2): torch's growth
up to H_torch is a plateau by design (info); growth beyond it is non-torch or KV (warning); a
step the size of the KV commit or a recommit is not growth. 0.33 behaviour kept (r29)."""

from __future__ import annotations

from kvdoctor.rules.gpu_memory_growth import RULE

from kvdoctor import rulekit
from kvdoctor.findings import Finding
from kvdoctor.units import GiB
from tests.rules._words import facts


def finding(rule: rulekit.Rule, variables: dict) -> Finding | None:  # type: ignore[type-arg]
    ev = rulekit.evaluate([rule], [rulekit.RuleContext("e", variables, {"gpus", "log"})])
    assert not ev.errors, [str(e) for e in ev.errors]
    return ev.findings[0] if ev.findings else None


_SERIES = {
    "mem_growth_gpu": 0,
    "mem_growth_points": 13,
    "mem_growth_span_s": 6 * 3600.0,
    "mem_growth_used_bytes": 70 * GiB,
    "mem_growth_headroom_bytes": 9 * GiB,
}


def _f(rise_gib: float, *, ext: bool = True, step_gib: float = 0.1, **more: object):  # type: ignore[no-untyped-def]
    values = dict(
        _SERIES,
        mem_growth_rise_bytes=int(rise_gib * GiB),
        mem_growth_bytes_per_hour=rise_gib * GiB / 6,
        mem_growth_recent_bytes_per_hour=rise_gib * GiB / 6,
        mem_growth_max_step_bytes=int(step_gib * GiB),
        vllm_sizing_mode="extensible" if ext else "estimate",
        torch_headroom_bytes=int(8.75 * GiB) if ext else None,
        torch_cap_bytes=int(24.47 * GiB) if ext else None,
        kv_pool_bytes=int(53.06 * GiB),
    )
    values.update(more)
    return finding(RULE, facts(**values))


def test_growth_within_torch_headroom_is_by_design_on_ext() -> None:
    f = _f(5)
    assert f is not None and f.severity == "info" and "by design" in f.summary


def test_the_same_growth_on_033_is_a_warning() -> None:
    f = _f(5, ext=False)
    assert f is not None and f.severity == "warning" and "by design" not in f.summary


def test_growth_beyond_torch_headroom_is_non_torch() -> None:
    f = _f(12)
    assert f is not None and f.severity == "warning" and "non-torch" in f.summary


def test_a_kv_commit_step_is_not_growth() -> None:
    assert _f(53.3, step_gib=53.0) is None
    # the same step on 0.33 is not recognised (0.33 behaviour kept)
    assert _f(53.3, ext=False, step_gib=53.0) is not None


def test_a_recommit_after_a_wake_is_not_growth_but_more_than_it_is() -> None:
    assert (
        _f(32.8, step_gib=32.5, kv_recommits=1, sleep_pool_bytes=int(32.3 * GiB), kv_pool_bytes=None) is None
    )
    f = _f(53.0 + 12, step_gib=53.0)
    assert f is not None and "not growth" in f.summary and f.severity == "warning"
