"""The header: host, engines found, health, mode (live interval, paused, recording, replay
position and speed), and each source with its status and last error."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text

from kvdoctor.watch.controller import View
from kvdoctor.watch.panels import SEVERITY_STYLE

_MARK = {"ok": ("✓", "green3"), "missing": ("–", "grey50"), "error": ("✗", "bold red1")}


@dataclass
class Mode:
    """What the loop is doing, for the header: ``live`` or replay, paused, recording, interval
    (seconds), replay ``speed``, ``ended`` at the end of a finite input."""

    live: bool
    replay: bool
    paused: bool
    recording: bool
    interval_s: float
    speed: float = 1.0
    ended: bool = False
    label: str = ""


def _short_origin(origin: str) -> str:
    o = origin.replace("http://", "").replace("https://", "")
    return o if len(o) <= 28 else "…" + o[-27:]


def render(view: View | None, mode: Mode, host: str, width: int) -> Text:
    """Two lines: the status line and the sources line (errors first when narrow)."""
    t = Text()
    t.append(" kvdoctor watch ", style="bold black on dodger_blue2")
    t.append(f" {host} ", style="bold")
    if view is not None and view.report is not None:
        n = len(view.report.engines)
        t.append(f"· {n} engine{'s' if n != 1 else ''} · {len(view.snapshot.gpus)} GPUs ")
        health = view.report.health
        t.append(f" {health.upper()} ", style=SEVERITY_STYLE.get(health, "bold black on green3"))
    t.append(" ")
    if mode.replay:
        pos = f"{(view.position or 0) + 1}/{view.length}" if view is not None and view.length else "–"
        state = "‖ " if mode.paused else "■ END " if mode.ended else "▶ "
        t.append(f"{state}REPLAY {mode.label} {pos} {mode.speed:g}×", style="bold magenta")
    elif mode.live:
        if mode.paused:
            t.append("‖ PAUSED", style="bold yellow")
        else:
            t.append(f"● LIVE {mode.interval_s:g}s", style="bold green3")
    else:
        t.append(f"■ {mode.label or 'files'}", style="bold")
    if mode.recording:
        t.append("  ● REC", style="bold red1")
    if view is not None:
        ts = time.strftime("%H:%M:%S", time.gmtime(view.now))
        t.append(f"  {ts}Z #{view.index}", style="dim")
    t.truncate(width, overflow="ellipsis")
    s = Text(" ")
    if view is not None:
        rows = sorted(view.sources, key=lambda r: r.status.status != "error") if width < 120 else view.sources
        for r in rows:
            mark, style = _MARK.get(r.status.status, ("?", ""))
            s.append(f"{mark} ", style=style)
            s.append(f"{r.status.kind} ", style="bold" if r.status.status == "error" else "")
            if r.status.status == "error":
                s.append(f"{_short_origin(r.status.origin)}: {r.status.detail} ", style="red1")
            elif r.last_error and r.last_error_at is not None:
                ago = max(0, int(view.now - r.last_error_at))
                s.append(f"(last error {ago}s ago: {r.last_error[:40]}) ", style="dim yellow")
            s.append(" ")
    s.truncate(width, overflow="ellipsis")
    return Text("\n").join([t, s])
