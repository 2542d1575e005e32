"""Finding transitions: for: before firing, clear_for: hysteresis, the JSON-lines events."""

from __future__ import annotations

import json
import types

from kvdoctor.findings import Finding
from kvdoctor.sidecar.transitions import RuleTiming, Transitions, event_line, rule_timings


def storm(severity: str = "warning", engine: str | None = "m") -> Finding:
    return Finding(
        rule="preemption-storm",
        severity=severity,  # type: ignore[arg-type]
        family="L",
        title="Requests are preempted",
        summary="23 preemptions per minute",
        suggested_flags={"--max-num-seqs": "2"},
        gpus=[0],
        engine=engine,
    )


def run(t: Transitions, seq: list[bool], step: float = 5.0) -> list[tuple[float, str]]:
    """Feed a present/absent sequence one cycle every ``step`` s; returns (time, event) pairs."""
    out = []
    for i, present in enumerate(seq):
        now = 1000.0 + i * step
        for e in t.update([storm()] if present else [], now):
            out.append((now, e["event"]))
    return out


def test_fires_only_after_holding_for_its_for_time() -> None:
    t = Transitions({"preemption-storm": RuleTiming(for_s=30, clear_for_s=30)})
    events = run(t, [True] * 8)
    assert events == [(1030.0, "fired")]  # present at 1000 … 1030: held 30 s
    assert [f.rule for f in t.active()] == ["preemption-storm"]


def test_a_flapping_value_never_fires() -> None:
    t = Transitions({"preemption-storm": RuleTiming(for_s=30, clear_for_s=30)})
    assert run(t, [True, True, False] * 10) == []
    assert t.active() == [] and t.tracked == {}


def test_resolves_only_after_clear_for_and_a_blip_does_not_resolve() -> None:
    t = Transitions({"preemption-storm": RuleTiming(for_s=0, clear_for_s=20)})
    # fires at once; absent for 10 s (2 cycles), back, then absent for good
    seq = [True, False, False, True, True, False, False, False, False, False]
    assert run(t, seq) == [(1000.0, "fired"), (1045.0, "resolved")]
    assert t.tracked == {}


def test_without_timings_fires_and_resolves_at_once() -> None:
    t = Transitions()
    assert run(t, [True, False]) == [(1000.0, "fired"), (1005.0, "resolved")]


def test_event_carries_first_seen_duration_and_no_more_than_the_finding() -> None:
    t = Transitions({"preemption-storm": RuleTiming(for_s=10, clear_for_s=0)})
    t.update([storm()], 1000.0)
    (fired,) = t.update([storm("critical")], 1012.5)
    assert fired["event"] == "fired" and fired["severity"] == "critical"  # the latest finding
    assert fired["first_seen"] == "1970-01-01T00:16:40.000Z" and fired["duration_s"] == 12.5
    (resolved,) = t.update([], 1020.0)
    assert resolved["event"] == "resolved" and resolved["duration_s"] == 20.0
    line = event_line(resolved)
    assert "\n" not in line and json.loads(line)["suggested_flags"] == {"--max-num-seqs": "2"}


def test_engines_are_tracked_apart() -> None:
    t = Transitions()
    t.update([storm(engine="a"), storm(engine="b")], 1.0)
    assert {f.engine for f in t.active()} == {"a", "b"}
    (ev,) = t.update([storm(engine="a")], 2.0)
    assert ev["event"] == "resolved" and ev["engine"] == "b"


def test_rule_timings_read_for_and_clear_for_when_the_schema_has_them() -> None:
    rules = [
        types.SimpleNamespace(id="a", for_s=60.0, clear_for_s=None),
        types.SimpleNamespace(id="b", for_s=30.0, clear_for_s=120.0),
        types.SimpleNamespace(id="c"),  # a rule loaded before `for:` existed
    ]
    got = rule_timings(rules)
    assert got["a"] == RuleTiming(60.0, 60.0)  # clear_for defaults to for
    assert got["b"] == RuleTiming(30.0, 120.0)
    assert got["c"] == RuleTiming(0.0, 0.0)
