"""Finding lines (root cause first, as the report orders them) with severity colours and the
fix on the first line; findings that stopped firing are shown dimmed as resolved."""

from __future__ import annotations

from rich.text import Text

from kvdoctor.report import fix_lines
from kvdoctor.watch.controller import FindingRow
from kvdoctor.watch.panels import SEVERITY_SHORT, SEVERITY_STYLE


def matches(row: FindingRow, needle: str) -> bool:
    """True when the filter text occurs in the rule id, title, summary, engine or a fix."""
    if not needle:
        return True
    f = row.finding
    hay = " ".join([f.rule, f.title, f.summary, f.engine or "", *fix_lines(f)]).lower()
    return needle.lower() in hay


def finding_prompt(row: FindingRow, now: float, two_lines: bool = True, width: int = 0) -> Text:
    """One finding: "WARN title  Fix: --flag value" then (``two_lines``) the summary, dimmed;
    each line cut to ``width`` cells (0: not cut)."""
    f = row.finding
    t = Text(no_wrap=True, overflow="ellipsis")
    if row.resolved_at is not None:
        ago = max(0, int(now - row.resolved_at))
        t.append(" ✓ RESOLVED ", style="bold black on grey50")
        t.append(f" {f.title}", style="dim strike")
        t.append(f"  {ago}s ago", style="dim")
        return _cut(t, width)
    if f.caused_by:
        # A consequence sits under its root cause (the report orders them so): one fix to read.
        t.append("  ↳", style="dim")
    t.append(
        f" {SEVERITY_SHORT.get(f.severity, f.severity.upper())} ",
        style=SEVERITY_STYLE.get(f.severity, "bold"),
    )
    fixes = fix_lines(f)
    if fixes and 0 < width < 110:
        # Narrow: the fix first, so it survives the cut.
        t.append(" Fix: ", style="bold green")
        t.append(" ".join(fixes), style="bold")
        t.append(" ·")
    t.append(f" {f.title}", style="bold")
    if f.caused_by:
        t.append(f"  (follows from {f.caused_by})", style="dim")
    if fixes and not 0 < width < 110:
        t.append("  Fix: ", style="bold green")
        t.append(" ".join(fixes), style="bold")
    if not two_lines:
        return _cut(t, width)
    if two_lines:
        scope = []
        if f.engine:
            scope.append(f.engine.rsplit("/", 1)[-1])
        if f.gpus:
            scope.append("GPU " + ",".join(str(g) for g in f.gpus))
        second = Text("      " if f.caused_by else "   ")
        if scope:
            second.append("[" + " · ".join(scope) + "] ", style="dim cyan")
        second.append(f.summary, style="dim")
        return Text("\n").join([_cut(t, width), _cut(second, width)])
    return t


def _cut(t: Text, width: int) -> Text:
    if width > 0:
        t.truncate(width, overflow="ellipsis")
    return t
