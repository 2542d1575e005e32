"""Finding transitions: a finding fires only after it held for its rule's ``for:`` and resolves
only after it stayed away for ``clear_for:`` (hysteresis), so a flapping value does not page.

The state machine per finding key (rule id, engine), Prometheus alerting semantics:

- absent → **pending** when a cycle's report has it (``first_seen`` = that instant);
- pending → **firing** once it held ``for_s`` seconds (every cycle since ``first_seen`` had it);
  a pending finding missing from one cycle is forgotten (it never fired, nothing is logged);
- firing → **clearing** when a cycle lacks it; clearing → firing again when it comes back;
- clearing → **resolved** once it stayed away ``clear_for_s`` seconds (the rule's
  ``clear_for:``, default its ``for:``).

:meth:`Transitions.update` returns the events (``fired`` / ``resolved``) as dicts ready for
the JSON-lines log: no prompt text, summaries are the report's (already redacted).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvdoctor.findings import Finding

Key = tuple[str, str]


def iso(ts: float) -> str:
    """Unix seconds → ISO-8601 UTC with milliseconds and a Z."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


@dataclass
class Tracked:
    """One finding's state: ``state`` pending|firing|clearing, ``first_seen`` (unix s the
    condition was first seen in this episode), ``fired_at`` (unix s it fired, None while
    pending), ``absent_since`` (unix s it went missing while firing), ``finding`` the latest."""

    finding: Finding
    first_seen: float
    state: str = "pending"
    fired_at: float | None = None
    absent_since: float | None = None


@dataclass
class RuleTiming:
    """A rule's hold times in seconds: ``for_s`` before firing, ``clear_for_s`` before resolving."""

    for_s: float = 0.0
    clear_for_s: float = 0.0


def rule_timings(rules: Iterable[Any]) -> dict[str, RuleTiming]:
    """``{rule id: RuleTiming}`` from loaded rules (``Rule.for_s`` / ``Rule.clear_for_s`` when
    the rule schema has them; 0 and "same as for" otherwise)."""
    out: dict[str, RuleTiming] = {}
    for r in rules:
        for_s = float(getattr(r, "for_s", 0.0) or 0.0)
        clear = getattr(r, "clear_for_s", None)
        out[r.id] = RuleTiming(for_s, for_s if clear is None else float(clear))
    return out


def finding_key(f: Finding) -> Key:
    """The identity of a finding across cycles: (rule id, engine id or "")."""
    return (f.rule, f.engine or "")


class Transitions:
    """Tracks findings across cycles (see the module doc). ``timings`` per rule id; a rule not
    in it fires at once and resolves at once (``default``). Memory: one entry per distinct
    active finding key, dropped when it resolves."""

    def __init__(
        self, timings: dict[str, RuleTiming] | None = None, default: RuleTiming | None = None
    ) -> None:
        self.timings = timings or {}
        self.default = default or RuleTiming()
        self.tracked: dict[Key, Tracked] = {}

    def _timing(self, rule: str) -> RuleTiming:
        return self.timings.get(rule, self.default)

    def update(self, findings: Iterable[Finding], now: float) -> list[dict[str, Any]]:
        """Feed one cycle's findings seen at ``now`` (unix seconds); returns the events of this
        cycle, oldest transition first, each ``{"event": "fired"|"resolved", "time", "rule",
        "severity", "family", "engine", "gpus", "title", "summary", "suggested_flags",
        "first_seen", "duration_s"}`` (``duration_s``: seconds since first seen)."""
        events: list[dict[str, Any]] = []
        seen: set[Key] = set()
        for f in findings:
            key = finding_key(f)
            if key in seen:
                continue
            seen.add(key)
            t = self.tracked.get(key)
            if t is None:
                t = self.tracked[key] = Tracked(f, first_seen=now)
            t.finding = f
            if t.state == "clearing":
                t.state, t.absent_since = "firing", None
            if t.state == "pending" and now - t.first_seen >= self._timing(f.rule).for_s:
                t.state, t.fired_at = "firing", now
                events.append(self._event("fired", t, now))
        for key in list(self.tracked):
            if key in seen:
                continue
            t = self.tracked[key]
            if t.state == "pending":
                del self.tracked[key]  # never held long enough: nothing to resolve
                continue
            if t.state == "firing":
                t.state, t.absent_since = "clearing", now
            if t.absent_since is not None and now - t.absent_since >= self._timing(key[0]).clear_for_s:
                events.append(self._event("resolved", t, now))
                del self.tracked[key]
        return events

    def active(self) -> list[Finding]:
        """Findings that fired and have not resolved (firing or clearing), by key order."""
        return [t.finding for _, t in sorted(self.tracked.items()) if t.state in ("firing", "clearing")]

    def pending(self) -> list[Finding]:
        """Findings seen but not yet held for their ``for:``."""
        return [t.finding for _, t in sorted(self.tracked.items()) if t.state == "pending"]

    @staticmethod
    def _event(kind: str, t: Tracked, now: float) -> dict[str, Any]:
        f = t.finding
        return {
            "time": iso(now),
            "event": kind,
            "rule": f.rule,
            "severity": f.severity,
            "family": f.family,
            "engine": f.engine,
            "gpus": list(f.gpus),
            "title": f.title,
            "summary": f.summary,
            "suggested_flags": dict(f.suggested_flags),
            "first_seen": iso(t.first_seen),
            "duration_s": round(now - t.first_seen, 3),
        }


def event_line(event: dict[str, Any]) -> str:
    """One JSON line (no newline) for an event dict."""
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False, default=str)
