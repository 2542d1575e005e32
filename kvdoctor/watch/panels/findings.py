"""The findings panel, which leads the screen: each finding's title in full (wrapped, never
cut), its fix line, the engine and GPUs it is about, and — where rows are free — its summary.
Root causes come first, as the report orders them; a consequence sits under its root with "↳".
Severity is a word ("CRIT", "WARN", "INFO") on its colour; a finding that stopped firing is
shown, dimmed, as "✓ RESOLVED" for a while.

Detail levels (``level``), most room first: 4 the whole summary and the evidence (one line
each), 3 the whole summary, 2 the summary wrapped up to :data:`SUMMARY_LINES` lines, 1 the
summary on one line, 0 no summary (title, fix, scope). ``summary_lines`` overrides the level's
cap for one finding, so rows left over can lengthen the summaries that were cut.
:func:`rows_needed` says how many rows a level takes, so the layout can give the findings the
room they need before the GPU cards and engines grow.
"""

from __future__ import annotations

import io
import shlex
from typing import Any

from rich.console import Console
from rich.text import Text

from kvdoctor.report import fix_lines
from kvdoctor.watch.controller import FindingRow
from kvdoctor.watch.panels import SEVERITY_SHORT, SEVERITY_STYLE

#: lines of summary shown at level 2
SUMMARY_LINES = 3
#: cells a wrapped continuation line is indented by
INDENT = 6
_CONSOLE = Console(file=io.StringIO(), width=400, color_system=None, legacy_windows=False)


def alt_text(alt: Any) -> str:
    """One fix alternative as one line: a :class:`kvdoctor.findings.Fix` by its ``line()``
    ("kill 1 2; then relaunch with --max-num-seqs 26"), anything else with ``flags``, ``env``,
    ``commands`` (a dict or an object) pieced together the same way."""
    line = getattr(alt, "line", None)
    if callable(line):
        return str(line())

    def get(name: str) -> Any:
        return alt.get(name) if isinstance(alt, dict) else getattr(alt, name, None)

    cmds = [str(c) for c in list(get("commands") or [])]
    rest = [f"{k}={shlex.quote(str(v))}" for k, v in dict(get("env") or {}).items()]
    rest += [
        f"{k} {shlex.quote(str(v))}" if str(v) != "" else str(k) for k, v in dict(get("flags") or {}).items()
    ]
    if cmds and rest:
        return " && ".join(cmds) + "; then relaunch with " + " ".join(rest)
    return " && ".join(cmds) or " ".join(rest)


def fix_why(alt: Any) -> str:
    """The alternative's one-line "why" ("" when it has none)."""
    why = alt.get("why") if isinstance(alt, dict) else getattr(alt, "why", None)
    return str(why or "")


def fix_text(f: Any) -> str:
    """The fix line of a finding: the first (recommended) of its ``fixes`` alternatives, else
    its ``suggested_flags`` (``kvdoctor.report.fix_lines``) on one line; "" when none."""
    fixes = getattr(f, "fixes", None)
    if fixes:
        text = alt_text(fixes[0])
        if text:
            return text
    lines = fix_lines(f)
    return lines[0] if lines else ""


def scope_text(f: Any) -> str:
    """ "Llama-3.1-8B-Instruct · GPU 0,1": the engine (model name without its org) and GPUs."""
    scope = []
    if f.engine:
        scope.append(f.engine.rsplit("/", 1)[-1])
    if f.gpus:
        scope.append("GPU " + ",".join(str(g) for g in f.gpus))
    return " · ".join(scope)


def matches(row: FindingRow, needle: str) -> bool:
    """True when the filter text occurs in the rule id, title, summary, engine or the fix."""
    if not needle:
        return True
    f = row.finding
    hay = " ".join([f.rule, f.title, f.summary, f.engine or "", fix_text(f)]).lower()
    return needle.lower() in hay


def _wrap(t: Text, width: int, indent: int, max_lines: int = 0) -> list[Text]:
    """``t`` wrapped to ``width`` cells, continuation lines indented by ``indent``; at most
    ``max_lines`` (0: all), the last one ending in "…" when cut."""
    if width <= 0:
        return [t]
    lines = list(t.wrap(_CONSOLE, max(8, width - indent), overflow="fold"))
    if t.cell_len <= width:
        lines = [t]
    out = [lines[0]] + [Text(" " * indent).append_text(line) for line in lines[1:]]
    for line in out:
        line.rstrip()
    if max_lines and len(out) > max_lines:
        out = out[:max_lines]
        out[-1].truncate(max(1, width - 1))
        out[-1].append("…")
    return out


#: summary lines per level (0: no summary; None: all of it)
LEVEL_SUMMARY: dict[int, int | None] = {0: 0, 1: 1, 2: SUMMARY_LINES, 3: None, 4: None}
LEVELS = tuple(sorted(LEVEL_SUMMARY))


def finding_lines(
    row: FindingRow,
    now: float,
    width: int,
    level: int = 2,
    summary_lines: int | None = -1,
    evidence_lines: int = -1,
) -> list[Text]:
    """One finding as lines of at most ``width`` cells (0: not wrapped): the severity word and
    the whole title; "Fix: …" (whole); "[engine · GPU n]" with the summary (lines as
    ``level`` says, or ``summary_lines``: 0 none, None all); the evidence at level 4 (or its
    first ``evidence_lines``)."""
    cap = LEVEL_SUMMARY.get(level, None) if summary_lines == -1 else summary_lines
    f = row.finding
    if row.resolved_at is not None:
        ago = max(0, int(now - row.resolved_at))
        t = Text()
        t.append(" ✓ RESOLVED ", style="bold black on grey50")
        t.append(f" {f.title}", style="dim strike")
        t.append(f"  {ago}s ago", style="dim")
        return _wrap(t, width, INDENT, 1)
    sub = bool(f.caused_by)
    pad = "   " if sub else ""
    indent = INDENT + len(pad)
    t = Text(pad)
    if sub:
        t = Text(" ↳ ", style="dim")
    t.append(
        f" {SEVERITY_SHORT.get(f.severity, f.severity.upper())} ",
        style=SEVERITY_STYLE.get(f.severity, "bold"),
    )
    t.append(f" {f.title}", style="bold")
    if sub and width >= 120:
        t.append(f"  (follows from {f.caused_by})", style="dim")
    out = _wrap(t, width, indent)
    body = " " * indent
    fix = fix_text(f)
    if fix:
        line = Text(body)
        line.append("Fix: ", style="bold green")
        line.append(fix, style="bold")
        more = len(getattr(f, "fixes", None) or []) - 1
        if more > 0:
            line.append(f"  (+{more} alternative{'s' if more > 1 else ''}: Enter)", style="dim")
        out += _wrap(line, width, indent + 5)
    scope = scope_text(f)
    line = Text(body)
    if scope:
        line.append(f"[{scope}]", style="cyan")
    if cap != 0 and f.summary:
        line.append(" " if scope else "")
        line.append(f.summary, style="dim")
    if line.cell_len > len(body):
        out += _wrap(line, width, indent, cap if cap else (1 if cap == 0 else 0))
    n_ev = (len(f.evidence) if level >= 4 else 0) if evidence_lines < 0 else evidence_lines
    if n_ev:
        for e in f.evidence[:n_ev]:
            ev = Text(body + "· ", style="dim")
            ev.append(f"{e.fact}: ", style="dim")
            ev.append(e.value)
            if e.source:
                ev.append(f"  ({e.source})", style="dim")
            out += _wrap(ev, width, indent + 2, 1)
    return out


def finding_prompt(
    row: FindingRow,
    now: float,
    width: int = 0,
    level: int = 2,
    summary_lines: int | None = -1,
    evidence_lines: int = -1,
) -> Text:
    """:func:`finding_lines` joined into one multi-line Text (an OptionList prompt)."""
    return Text("\n").join(finding_lines(row, now, width, level, summary_lines, evidence_lines))


def level_rows(row: FindingRow, now: float, width: int) -> tuple[int, ...]:
    """Rows one finding takes at each level of :data:`LEVELS` (two wraps, not one per level)."""
    low = len(finding_lines(row, now, width, 0))
    if row.resolved_at is not None:
        return (low,) * len(LEVELS)
    high = len(finding_lines(row, now, width, 4))
    f = row.finding
    whole = high - len(f.evidence)  # level 3: the whole summary
    head = low - (1 if scope_text(f) else 0)  # title and fix lines
    summary = whole - head  # the summary's lines (with the scope that leads it)
    out = []
    for level in LEVELS:
        cap = LEVEL_SUMMARY[level]
        if level >= 4:
            out.append(high)
        elif cap is None:
            out.append(whole)
        else:
            out.append(head + max(min(cap, summary), low - head))
    return tuple(out)


def summary_caps(
    rows: list[FindingRow], counts: list[tuple[int, ...]], level: int, room: int
) -> list[int | None]:
    """Summary lines per finding at ``level`` when ``room`` rows are there: the level's cap,
    and the rows left over given to the summaries it cut, first finding first. ``counts``:
    :func:`level_rows` of each finding."""
    base = LEVEL_SUMMARY.get(level, None)
    caps: list[int | None] = [base] * len(rows)
    if base is None:
        return caps
    spare = room - sum(c[level] for c in counts)
    for i, c in enumerate(counts):
        if spare <= 0:
            break
        extra = min(spare, c[3] - c[level])  # up to the whole summary
        if extra > 0:
            caps[i] = (base or 1) + extra
            spare -= extra
    return caps


def evidence_caps(rows: list[FindingRow], counts: list[tuple[int, ...]], level: int, room: int) -> list[int]:
    """Evidence lines per finding: all at level 4; at level 3 the rows left over, first
    finding first (-1: as the level says)."""
    caps = [-1] * len(rows)
    if level != 3:
        return caps
    spare = room - sum(c[3] for c in counts)
    for i, r in enumerate(rows):
        n = min(max(0, spare), len(r.finding.evidence) if r.resolved_at is None else 0)
        caps[i] = n
        spare -= n
    return caps


def rows_needed(rows: list[FindingRow], now: float, width: int, level: int) -> int:
    """Rows the findings take at ``level`` and ``width`` (at least 1: the "no findings" line)."""
    return max(1, sum(len(finding_lines(r, now, width, level)) for r in rows))


def rows_by_level(counts: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Rows all findings take at each level (at least 1: the "no findings" line), from
    :func:`level_rows` of each."""
    return tuple(max(1, sum(c[i] for c in counts)) for i in range(len(LEVELS)))
