"""The header: host, engines found, health, mode (live interval, paused, recording, replay
position and speed), and each source with its status and last error."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text

from kvdoctor.watch.controller import View
from kvdoctor.watch.panels import SEVERITY_STYLE

_MARK = {"ok": ("✓", "green3"), "missing": ("–", "grey50"), "error": ("✗", "bold red1")}
#: a source read in part ("ok" with a ``cut``: the time budget for a bundle's files ran out in it)
_PART_MARK = ("◐", "yellow")


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
    static: bool = False


def _short_origin(origin: str) -> str:
    o = origin.replace("http://", "").replace("https://", "")
    return o if len(o) <= 28 else "…" + o[-27:]


def _mode_text(view: View | None, mode: Mode, width: int) -> Text:
    """▶ / ‖ / ■ END REPLAY…, ● LIVE…, ■ BUNDLE: what the loop does, as a word and a symbol."""
    t = Text()
    label = mode.label
    kind, _, path = label.partition(" ")
    if kind in ("bundle", "recording") and "/" in path:
        label = f"{kind} {path.rstrip('/').rsplit('/', 1)[-1]}"  # the name, not the whole path
    if len(label) > max(8, width // 2):
        label = "…" + label[-max(7, width // 2 - 1) :]
    if mode.static:
        t.append(f"■ {label or 'files'}", style="bold")
    elif mode.replay:
        pos = f"{(view.position or 0) + 1}/{view.length}" if view is not None and view.length else "–"
        if mode.ended:
            t.append(f"■ END of replay {pos} (p: again)", style="bold magenta")
        else:
            state = "‖ " if mode.paused else "▶ "
            t.append(f"{state}REPLAY {label} {pos} {mode.speed:g}×", style="bold magenta")
    elif mode.live:
        if mode.paused:
            t.append("‖ PAUSED", style="bold yellow")
        else:
            t.append(f"● LIVE {mode.interval_s:g}s", style="bold green3")
    else:
        t.append(f"■ {label or 'files'}" + (" END" if mode.ended else ""), style="bold")
    if mode.recording:
        t.append(" ● REC", style="bold red1")
    return t


def render(
    view: View | None, mode: Mode, host: str, width: int, extra: list[tuple[str, str]] | None = None
) -> Text:
    """Two lines: the status line (its clock always whole, at the right) and the sources line
    (errors first when narrow). ``extra``: (text, style) notes for the status line ("waiting
    for sources 5s"), dropped first when the line is short of room."""
    clock = Text()
    if view is not None:
        clock.append(time.strftime("%H:%M:%SZ", time.gmtime(view.now)), style="dim")
    wide = width >= 110
    parts: list[Text] = []
    counts = Text()
    parts.append(Text(" kvdoctor watch " if wide else " kvdoctor ", style="bold black on dodger_blue2"))
    if host:
        parts.append(Text(f" {host}", style="bold"))
    if view is not None and view.report is not None:
        n = len(view.report.engines)
        g = len(view.snapshot.gpus)
        counts = Text(f" · {n} engine{'s' if n != 1 else ''} · {g} GPU{'s' if g != 1 else ''}")
        parts.append(counts)
        health = view.report.health
        parts.append(Text(" "))
        parts.append(Text(f" {health.upper()} ", style=SEVERITY_STYLE.get(health, "bold black on green3")))
    parts.append(Text(" "))
    parts.append(_mode_text(view, mode, width))
    notes = [Text(f"  {msg}", style=style) for msg, style in extra or []]
    if wide and view is not None and not mode.static:
        notes.append(Text(f"  #{view.index}", style="dim"))
    room = width - clock.cell_len - 1
    if sum(p.cell_len for p in parts) > room:
        # narrow: the counts go first (the GPU and engine panels show them)
        parts = [p for p in parts if p is not counts]
    t = Text()
    for p in parts:
        t.append_text(p)
    for note in notes:
        if t.cell_len + note.cell_len <= room:
            t.append_text(note)
    if t.cell_len > room:
        t.truncate(max(1, room - 1), overflow="ellipsis")
        t.append("…")
    t.append(" " * max(1, width - t.cell_len - clock.cell_len))
    t.append_text(clock)
    t.truncate(width)
    s = Text(" ")
    if view is not None:
        rows = sorted(view.sources, key=lambda r: r.status.status != "error") if width < 120 else view.sources
        for r in rows:
            part = bool(r.status.cut) and r.status.status == "ok"
            mark, style = _PART_MARK if part else _MARK.get(r.status.status, ("?", ""))
            s.append(f"{mark} ", style=style)
            s.append(f"{r.status.kind} ", style="bold" if r.status.status == "error" else "")
            if part:
                s.append("(read in part: the time budget ran out) ", style="yellow")
            elif r.status.status == "error":
                s.append(f"{_short_origin(r.status.origin)}: {r.status.detail} ", style="red1")
            elif r.status.status == "missing" and r.status.kind in ("nvml", "nvidia-smi") and r.status.detail:
                s.append(f"({r.status.detail[:60]}) ", style="dim")  # said once, not retried
            elif r.last_error and r.last_error_at is not None:
                ago = max(0, int(view.now - r.last_error_at))
                s.append(f"(last error {ago}s ago: {r.last_error[:40]}) ", style="dim yellow")
            s.append(" ")
    s.truncate(width, overflow="ellipsis")
    return Text("\n").join([t, s])
