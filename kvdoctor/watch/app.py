"""The Textual app of ``kvdoctor watch``: header, the findings first (given the free rows),
engines, GPU cards; a detail screen per finding, a process view and a help screen. It draws :class:`~kvdoctor.watch.controller.View` objects
that the controller's worker thread posts with ``call_from_thread``; it computes no diagnosis.

Keys follow nvitop / htop / k9s: q quit, ?/h help, p pause, +/- interval, r record, b bundle,
t processes, / filter, ↑↓ or j/k select, Enter/Esc open/back, 1–4 toggle panels; in replay
space play/pause, ←/→ seek, [/] speed. The one key that acts on the host (K in the process
view: SIGTERM to the processes kvdoctor calls orphaned) asks first, naming each pid and command
line, and exists only live. The mouse selects and opens findings.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.geometry import Region
from textual.screen import ModalScreen, Screen
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import DataTable, Footer, Input, OptionList, Static
from textual.widgets.option_list import Option

from kvdoctor.pipeline import Pipeline
from kvdoctor.report import fix_lines
from kvdoctor.watch import procs
from kvdoctor.watch.controller import Controller, FindingRow, View, write_support_bundle
from kvdoctor.watch.panels import SEVERITY_STYLE, gib
from kvdoctor.watch.panels import engines as engines_panel
from kvdoctor.watch.panels import findings as findings_panel
from kvdoctor.watch.panels import gpus as gpus_panel
from kvdoctor.watch.panels import header as header_panel

#: panels toggled with 1..4
PANELS = ("gpus", "engines", "findings", "sources")
#: replay seek step of ←/→, snapshots (shift: ten times more)
SEEK_STEP = 10


@dataclass
class Layout:
    """Rows and modes chosen for a screen size: lines per GPU card, GPU columns, lines per
    engine, the GPU/engine panel heights (title row included), the findings' detail level
    (``findings_panel.finding_lines``) and the header height. The findings box takes every
    row the others leave."""

    gpu_lines: int
    gpu_columns: int
    engine_lines: int
    gpu_height: int
    engine_height: int
    wide: bool
    header_height: int
    findings_level: int = 2


def plan_layout(
    width: int,
    height: int,
    busy: list[bool],
    n_engines: int,
    shown: dict[str, bool],
    findings_rows: tuple[int, ...] = (4, 4, 4, 4, 4),
) -> Layout:
    """The findings first: with the cards and engines at full size, the findings' whole
    summaries and evidence (levels 4, 3) if they fit; else the largest GPU-card and engine sizes (4 lines down to 1) that
    leave the findings every row they need with their summaries (level 2); failing that at the
    next level, down to titles, fixes and scopes (level 0); failing even that, cards and
    engines at one line and the findings scrolling in what is left. ``findings_rows``: rows
    the findings take at levels 0..4 (``findings_panel.rows_needed``). Wide screens (≥ 150
    columns) put GPU cards in two columns. ``busy``: per card (idle GPUs of one model drawn
    as one card), False for an idle one (one line whatever the size)."""
    header_h = 2 if shown.get("sources", True) else 1
    avail = max(1, height - header_h - 1)
    busy = busy or [True]
    has_engines = n_engines > 0  # none: one line says so
    n_engines = max(1, n_engines)
    wide = width >= 150
    cols = 2 if (wide and len(busy) >= 2) else 1
    pairs = [busy[i : i + cols] for i in range(0, len(busy), cols)]
    n_busy_rows = sum(1 for p in pairs if any(p))
    gpu_rows = len(pairs)
    show_g, show_e, show_f = shown.get("gpus", True), shown.get("engines", True), shown.get("findings", True)
    prefs = [(4, 4), (3, 4), (3, 3), (2, 3), (2, 2), (1, 2), (1, 1)]
    for level in range(len(findings_rows) - 1, -1, -1):
        want = findings_rows[level] + 1 if show_f else 0
        # Whole summaries and the evidence (levels 3-4) only fill rows the full-size cards and
        # engines leave free.
        for gl, el in prefs[:1] if level >= 3 else prefs:
            g_h = n_busy_rows * gl + (gpu_rows - n_busy_rows) + 1 if show_g else 0
            e_h = (n_engines * el + 1 if has_engines else 2) if show_e else 0
            if g_h + e_h + want <= avail:
                return Layout(gl, cols, el, g_h, e_h, wide, header_h, level)
    # Not even titles and fixes fit: cards and engines at one line; the findings keep at
    # least their title row and four rows, and scroll.
    f_min = min(findings_rows[0] + 1, 5) if show_f else 0
    g_h = min(gpu_rows + 1, max(2, avail - (n_engines + 1) - f_min)) if show_g else 0
    e_h = min(n_engines + 1, max(2, avail - g_h - f_min)) if show_e else 0
    return Layout(1, cols, 1, g_h, e_h, wide, header_h, 0)


class PanelView(Widget):
    """A panel drawn from the latest View by a renderer of the panel's width.

    Line API: the renderer's lines become Strips once per View (or resize), and
    :meth:`render_line` hands them out — no re-wrapping of the text for every frame."""

    DEFAULT_CSS = "PanelView { height: auto; }"

    def __init__(self, kind: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind = kind
        self.view: View | None = None
        self.lines = 4
        self.columns = 1
        self._strips: list[Strip] = []
        self._lines: list[Text] = []
        self._built_for: tuple[int, int, int] | None = None
        self._blank = Strip.blank(0)

    def text(self) -> Text:
        """The panel's text at its current width."""
        w = max(10, self.content_size.width or self.size.width)
        if self.kind == "gpus":
            return gpus_panel.render(self.view, w, self.lines, self.columns)
        return engines_panel.render(self.view, w, self.lines)

    def update_view(self, view: View | None) -> None:
        """Take a new View and redraw the lines that changed (no re-layout)."""
        self.view = view
        key = (self.size.width, self.lines, self.columns)
        if self._built_for != key or not self.size.width:
            self._built_for = None
            self.refresh()
            return
        old = self._strips
        self._build(key)
        changed = [y for y, strip in enumerate(self._strips) if y >= len(old) or old[y] != strip]
        changed += range(len(self._strips), len(old))
        for y in changed:
            self.refresh(Region(0, y, self.size.width, 1))

    def render(self) -> RenderableType:
        """The whole text (for tests and screenshots that ask for it)."""
        return self.text()

    def _build(self, key: tuple[int, int, int]) -> None:
        console = self.app.console
        width, style = key[0], self.rich_style
        old_lines, old_strips = (self._lines, self._strips) if self._built_for == key else ([], [])
        self._lines = list(self.text().split("\n", allow_blank=True))
        self._strips = []
        for y, line in enumerate(self._lines):
            if y < len(old_lines) and old_lines[y] == line:
                self._strips.append(old_strips[y])  # unchanged line: keep its Strip
                continue
            line.no_wrap = True
            # The widget's own style (background, colour) under the text's styles.
            segs = list(Segment.apply_style(line.render(console, end=""), style=style))
            self._strips.append(Strip(segs, line.cell_len).crop_extend(0, width, style))
        self._blank = Strip.blank(width, style)
        self._built_for = key

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the panel, cut or padded to the width (built once per View)."""
        key = (self.size.width, self.lines, self.columns)
        if self._built_for != key:
            self._build(key)
        return self._strips[y] if y < len(self._strips) else self._blank


class HelpScreen(ModalScreen[None]):
    """Every key, what it does."""

    BINDINGS = [Binding("escape,question_mark,h", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help { width: 84; height: auto; max-height: 90%; border: round $accent; padding: 0 1; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        """The key table."""
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold cyan", no_wrap=True)
        t.add_column()
        for keys, what in (
            ("q", "quit"),
            ("? h", "this help"),
            ("/", "filter findings (Esc clears)"),
            ("↑ ↓ j k", "select a finding"),
            ("Enter", "open the finding: evidence, sources, the rule's documentation"),
            ("Esc", "back"),
            ("b", "write a support bundle (as `kvdoctor bundle` from these inputs)"),
            ("t", "GPU processes: s sorts; K: SIGTERM to orphans (live, asks first)"),
            ("p", "pause / resume (replay: play / pause; at its end: again)"),
            ("r", "start / stop recording to ./kvdoctor-watch-TIME.jsonl.gz"),
            ("+ -", "longer / shorter interval (replay: slower / faster)"),
            ("1 2 3 4", "show / hide findings, engines, GPUs, sources line"),
            ("space", "replay: play / pause"),
            ("← →", f"replay: seek {SEEK_STEP} snapshots (shift: {SEEK_STEP * 10})"),
            ("[ ]", "replay: slower / faster"),
            ("mouse", "click a finding to open it; click footer keys"),
        ):
            t.add_row(keys, what)
        legend = Text("\nMemory bar (a part's word is written in it where it fits): ")
        for part, label in (
            ("weights", "weights"),
            ("kv_cache", "KV cache pool"),
            ("activation_and_graphs", "activation + CUDA graphs + non-torch"),
            ("other_engines", "other engines"),
            ("foreign", "foreign processes"),
            ("unlisted", "unlisted"),
        ):
            legend.append("█ ", style=gpus_panel.PART_STYLE[part])
            legend.append(label + "  ")
        legend.append("· free  ┃ gmu × total")
        yield Static(Group(Text("kvdoctor watch — keys", style="bold"), t, legend), id="help")


class DetailScreen(Screen[None]):
    """One finding: fix, summary, evidence with sources, the input sources, and the rule's
    documentation (the text of ``kvdoctor explain``)."""

    BINDINGS = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
        Binding("j,down", "scroll(1)", "Down", show=False),
        Binding("k,up", "scroll(-1)", "Up", show=False),
    ]

    def __init__(
        self, row: FindingRow, view: View | None, rule: Any, catalogue: list[Any] | None = None
    ) -> None:
        super().__init__()
        self.row, self.view_, self.rule = row, view, rule
        self.catalogue = catalogue or []

    def action_scroll(self, delta: int) -> None:
        """Scroll the detail text."""
        self.query_one(VerticalScroll).scroll_relative(y=delta)

    def compose(self) -> ComposeResult:
        """The detail text in a scrolling container and the footer."""
        yield VerticalScroll(Static(Group(*self._parts())))
        yield Footer()

    def _parts(self) -> list[RenderableType]:
        f = self.row.finding
        head = Text()
        head.append(f" {f.severity.upper()} ", style=SEVERITY_STYLE.get(f.severity, "bold"))
        head.append(f" {f.title}", style="bold")
        if self.row.resolved_at is not None and self.view_ is not None:
            head.append(f"  (resolved {int(self.view_.now - self.row.resolved_at)}s ago)", style="dim")
        parts: list[RenderableType] = [head, Text("")]
        alternatives = list(getattr(f, "fixes", None) or [])
        fixes = fix_lines(f)
        if alternatives:
            # Alternatives in the rule's order; the first is the fix line of the list.
            for i, alt in enumerate(alternatives):
                fix = Text("Fix: " if i == 0 else "  or ", style="bold green")
                fix.append(findings_panel.alt_text(alt), style="bold")
                why = findings_panel.fix_why(alt)
                if why:
                    fix.append(f"  — {why}", style="dim")
                parts.append(fix)
            parts.append(Text(""))
        elif fixes:
            fix = Text("Fix: ", style="bold green")
            fix.append("\n     ".join(fixes), style="bold")
            parts += [fix, Text("")]
        parts.append(Text(f.summary))
        if f.evidence:
            t = Table(title="Evidence", title_justify="left", show_header=True, header_style="bold", box=None)
            t.add_column("fact", overflow="fold")
            t.add_column("value", overflow="fold")
            t.add_column("source", style="dim", overflow="fold")
            for e in f.evidence:
                t.add_row(e.fact, e.value, e.source)
            parts += [Text(""), t]
        scope = [f"rule {f.rule}"]
        if f.engine:
            scope.append(f"engine {f.engine}")
        if f.gpus:
            scope.append("GPU " + ",".join(str(g) for g in f.gpus))
        parts += [Text(""), Text(" · ".join(scope), style="dim")]
        if self.view_ is not None and self.view_.report is not None:
            src = Table(title="Sources", title_justify="left", show_header=False, box=None)
            src.add_column(no_wrap=True)
            src.add_column(overflow="fold")
            from kvdoctor.report import status_word

            for s in self.view_.report.sources:
                src.add_row(
                    f"{s.kind} {status_word(s)}", f"{s.origin}" + (f" — {s.detail}" if s.detail else "")
                )
            parts += [Text(""), src]
        if self.rule is not None:
            from kvdoctor.rules_cli import explain_renderables

            parts += [
                Text(""),
                Text(f"── {f.docs} " + "─" * 20, style="dim"),
                *explain_renderables(self.rule, self.catalogue),
            ]
        return parts


class ProcessScreen(Screen[None]):
    """Every GPU's processes (``kvdoctor.watch.procs``): pid, user, what kvdoctor calls it,
    GPU memory, host CPU % and RSS, age, command line; sorted by a column (``s`` cycles, a
    click on a heading picks it). Live only, ``K`` asks to send SIGTERM to the processes the
    report calls orphaned, on a confirmation screen naming each pid and command line."""

    BINDINGS = [
        Binding("escape,t,backspace", "app.pop_screen", "Back"),
        Binding("s", "sort", "Sort"),
        Binding("K", "terminate", "SIGTERM orphans", key_display="K"),
        Binding("q", "app.quit", "Quit"),
    ]
    DEFAULT_CSS = """
    ProcessScreen { layout: vertical; }
    #proc-title { height: 1; }
    #proc-table { height: 1fr; overflow-x: hidden; }
    """
    #: seconds between psutil reads of the shown pids (live)
    HOST_EVERY_S = 2.0

    def __init__(self, view: View | None, *, live: bool) -> None:
        super().__init__()
        self.view_ = view
        self.live = live
        self.sort_by = "gpu_bytes"
        self.rows: list[procs.ProcRow] = []
        self._host: dict[int, procs.HostInfo] = {}
        self._load: procs.HostLoad | None = None
        self._reader = procs.HostReader() if live else None

    def compose(self) -> ComposeResult:
        """A title line, the table, the footer."""
        yield Static(id="proc-title")
        table: DataTable[Any] = DataTable(id="proc-table", cursor_type="row", zebra_stripes=True)
        for key, heading in procs.COLUMNS:
            table.add_column(heading, key=key)
        yield table
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        """Fill the table; live, read the pids' host figures every few seconds."""
        self._fill()
        if self._reader is not None:
            self._read_host()
            self.set_interval(self.HOST_EVERY_S, self._read_host)

    def _read_host(self) -> None:
        reader = self._reader
        if reader is None:
            return
        pids = sorted({r.pid for r in procs.process_rows(self.view_)})

        def work() -> None:
            host = reader.read(pids)
            load = procs.host_load()
            self.app.call_from_thread(self._took_host, host, load)

        self.run_worker(work, thread=True, group="host", exclusive=True)

    def _took_host(self, host: dict[int, procs.HostInfo], load: procs.HostLoad | None) -> None:
        self._host, self._load = host, load
        self._fill()

    def update_view(self, view: View) -> None:
        """A new View (the app calls this while the screen is shown)."""
        self.view_ = view
        self._fill()

    def _fill(self) -> None:
        table = self.query_one(DataTable)
        rows = procs.process_rows(self.view_, self._host)
        rows.sort(key=lambda r: (r.sort_key(self.sort_by), r.gpu, r.pid))
        self.rows = rows
        title = Text(" Processes on the GPUs", style="bold")
        heading = dict(procs.COLUMNS)[self.sort_by]
        title.append(f" — sorted by {heading} (s)", style="dim")
        load = self._load
        if load is not None:
            cpu = "–" if load.cpu_percent is None else f"{load.cpu_percent:.0f}%"
            title.append(f"  host CPU {cpu} of {load.cores} cores · RAM ")
            title.append(f"{gib(load.mem_used_bytes)}/{gib(load.mem_total_bytes)}")
        n_orphan = sum(1 for r in rows if r.role == "orphan")
        if n_orphan:
            title.append(f"  {n_orphan} orphan(s)", style="bold red1")
            title.append(
                " K sends SIGTERM" if self.live else " (signals only when watching live)", style="dim"
            )
        self.query_one("#proc-title", Static).update(title)
        row_at = table.cursor_row
        table.clear()
        for r in rows:
            role_style = {"orphan": "bold red1", "foreign": "red1", "other engine": "orange1"}.get(r.role, "")
            table.add_row(
                str(r.gpu),
                str(r.pid),
                r.user or "–",
                Text(r.role, style=role_style),
                gib(r.gpu_bytes, 2),
                "–" if r.cpu_percent is None else f"{r.cpu_percent:.0f}",
                mib_or_gib(r.rss_bytes),
                procs.fmt_age(r.age_s),
                r.command[:200],
                key=f"{r.gpu}:{r.pid}",
            )
        if not rows:
            table.add_row("", "", "", "", "", "", "", "", Text("no GPU process read", style="dim"))
        if rows and row_at is not None:
            table.move_cursor(row=min(row_at, len(rows) - 1))

    def action_sort(self) -> None:
        """Sort by the next column."""
        keys = [k for k, _ in procs.COLUMNS]
        self.sort_by = keys[(keys.index(self.sort_by) + 1) % len(keys)]
        self._fill()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A click on a heading sorts by that column."""
        key = event.column_key.value
        if key in dict(procs.COLUMNS):
            self.sort_by = key
            self._fill()

    def action_terminate(self) -> None:
        """Ask to send SIGTERM to the orphans (live only)."""
        if not self.live:
            self.notify("a replay or bundle is not this host: nothing is signalled", timeout=5)
            return
        orphans = [r for r in self.rows if r.role == "orphan"]
        if not orphans:
            self.notify("kvdoctor calls no process orphaned", timeout=4)
            return

        def done(ok: bool | None) -> None:
            if ok:
                for line in procs.terminate(orphans):
                    self.notify(line, timeout=8)

        self.app.push_screen(ConfirmTerminateScreen(orphans), done)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``K`` exists only live (never on a replay or a bundle)."""
        if action == "terminate":
            return self.live
        return True


def mib_or_gib(nbytes: int | None) -> str:
    """ "512M" below 1 GiB, else "6.00G"; "–" when unknown."""
    if nbytes is None:
        return "–"
    return f"{nbytes / 2**20:.0f}M" if nbytes < 2**30 else gib(nbytes, 2)


class ConfirmTerminateScreen(ModalScreen[bool]):
    """ "Send SIGTERM to these processes?" with each pid, GPU, memory and command line in full;
    ``y`` sends, ``n`` / Esc does not."""

    BINDINGS = [
        Binding("y", "answer(True)", "Send SIGTERM"),
        Binding("n,escape", "answer(False)", "Cancel"),
    ]
    DEFAULT_CSS = """
    ConfirmTerminateScreen { align: center middle; }
    #confirm { width: 90%; height: auto; max-height: 90%; border: thick $error; padding: 0 1; background: $surface; }
    """

    def __init__(self, rows: list[procs.ProcRow]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        """The question, one block per process, the keys."""
        parts: list[RenderableType] = [
            Text(f"Send SIGTERM to {len(self.rows)} process(es) kvdoctor calls orphaned?", style="bold"),
            Text(""),
        ]
        for r in self.rows:
            head = Text(f"pid {r.pid}", style="bold")
            head.append(f"  GPU {r.gpu}  {gib(r.gpu_bytes, 2)}  user {r.user or '–'}")
            parts += [head, Text(f"  {r.command}", overflow="fold")]
        parts += [
            Text(""),
            Text("They hold GPU memory with no live vLLM server (see the finding). "),
            Text("y: send SIGTERM    n / Esc: cancel", style="bold"),
        ]
        yield Static(Group(*parts), id="confirm")

    def action_answer(self, ok: bool) -> None:
        """Close with the answer."""
        self.dismiss(bool(ok))


class WatchApp(App[None]):
    """``kvdoctor watch``. ``feed``/``pipeline`` as every face gets them (``open_feed``,
    ``Pipeline.load``); ``start_at`` seeks a replay there first; ``host`` overrides the host
    name shown (tests make it deterministic); ``opts`` are the inputs the feed was opened from
    (:class:`kvdoctor.inputs.InputOptions`): the ``b`` bundle copies their files, as
    ``kvdoctor bundle`` does."""

    TITLE = "kvdoctor watch"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: 2; }
    .panel { border-top: solid $primary-darken-1; border-title-color: $text; border-title-style: bold; padding: 0 0; }
    #gpus { height: auto; }
    #engines { height: auto; }
    #findings-box { height: 1fr; }
    #findings-list { height: 1fr; border: none; padding: 0; }
    #filter { height: 1; border: none; padding: 0 1; display: none; }
    #filter.-on { display: block; }
    .-hidden { display: none; }
    """
    # Footer order: what every session needs first (it must fit 80 columns).
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark,h", "help", "Help", key_display="?"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("b", "bundle", "Bundle"),
        Binding("t", "processes", "Procs"),
        Binding("p", "pause", "Pause"),
        Binding("space", "play", "Play", show=False),
        # Replay only (hidden from the footer and inactive otherwise; see check_action).
        # priority: the findings list would take ←/→ for scrolling otherwise
        Binding("left", "seek(-1)", "Seek", key_display="←→", priority=True),
        Binding("right", "seek(1)", "Seek+", show=False, priority=True),
        Binding("shift+left", "seek(-10)", show=False, priority=True),
        Binding("shift+right", "seek(10)", show=False, priority=True),
        Binding("left_square_bracket", "speed(-1)", "Speed", key_display="[]"),
        Binding("right_square_bracket", "speed(1)", "Faster", show=False),
        Binding("r", "record", "Rec"),
        Binding("plus,equals_sign", "interval(2)", "Interval", key_display="+-"),
        Binding("minus", "interval(0.5)", "Interval-", show=False),
        # In a replay +/- change the speed as [/] do, without a footer entry of their own.
        Binding("plus,equals_sign", "replay_interval(2)", show=False),
        Binding("minus", "replay_interval(0.5)", show=False),
        Binding("j", "cursor(1)", "Down", show=False),
        Binding("k", "cursor(-1)", "Up", show=False),
        Binding("enter", "open", "Open", show=False),
        Binding("escape", "escape", "Back", show=False),
        Binding("1", "panel('findings')", "Findings", show=False),
        Binding("2", "panel('engines')", "Engines", show=False),
        Binding("3", "panel('gpus')", "GPUs", show=False),
        Binding("4", "panel('sources')", "Sources", show=False),
    ]
    #: actions that only a replay has
    REPLAY_ACTIONS = frozenset({"play", "seek", "speed"})
    #: actions a static input (a bundle, artifacts: one state) cannot use
    READING_ACTIONS = frozenset({"pause", "record", "interval"})

    def __init__(
        self,
        feed: Any,
        pipeline: Pipeline,
        *,
        interval_s: float = 1.0,
        start_at: int | None = None,
        host: str | None = None,
        out_dir: Path | None = None,
        autostart: bool = True,
        opts: Any = None,
    ) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.controller = Controller(feed, pipeline, self._post, interval_s=interval_s, start_at=start_at)
        self.controller.on_end = self._post_end
        self.opts = opts
        self.host = host or (socket.gethostname() if feed.live else "")
        self.label = getattr(feed, "label", "")
        self.out_dir = out_dir or Path.cwd()
        self.autostart = autostart
        self.view: View | None = None
        self.views_seen = 0
        self.shown = dict.fromkeys(PANELS, True)
        self.filter_text = ""
        self.exit_message: str | None = None
        self.layout_plan: Layout | None = None
        self._selected_key: Any = None
        self._w: dict[str, Any] = {}
        self._layout_key: Any = None
        self._findings_key: Any = None
        self._findings_rows: list[Any] = []
        self._rows: list[FindingRow] = []
        #: rows each shown finding takes per detail level (findings_panel.level_rows)
        self._counts: list[tuple[int, ...]] = []
        self._last_post = time.monotonic()
        self._rules = {r.id: r for r in pipeline.rules}

    # ------------------------------------------------------------------ composition

    def compose(self) -> ComposeResult:
        """Header, the findings (first, and given the free rows), engines, GPU cards, and the
        footer of keys."""
        yield Static(id="header")
        with Vertical(id="findings-box", classes="panel") as box:
            box.border_title = "[1] Findings — Enter opens, / filters"
            yield Input(placeholder="filter findings (Esc clears)", id="filter")
            yield OptionList(id="findings-list")
        ep = PanelView("engines", id="engines", classes="panel")
        ep.border_title = "[2] Engines"
        yield ep
        gp = PanelView("gpus", id="gpus", classes="panel")
        gp.border_title = "[3] GPUs — t: processes"
        yield gp
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        """Start the worker thread and a 1 s tick that keeps the header's age current."""
        # Kept: queries go to the active screen, and a detail or help screen may be on top.
        self._w = {
            name: self.query_one(f"#{name}")
            for name in ("header", "gpus", "engines", "findings-box", "findings-list", "filter")
        }
        self._draw_header()
        self._ol.focus()
        self.set_interval(1.0, self._tick)
        if self.autostart:
            self.run_worker(self.controller.start, thread=True, group="control")

    @property
    def _ol(self) -> OptionList:
        ol = self._w["findings-list"]
        assert isinstance(ol, OptionList)
        return ol

    @property
    def _filter(self) -> Input:
        f = self._w["filter"]
        assert isinstance(f, Input)
        return f

    def on_unmount(self) -> None:
        """Stop the loop (without waiting for a worker that may be handing over a View)."""
        self.controller.stop(wait=False)

    # ------------------------------------------------------------------ views

    def _post(self, view: View) -> None:
        # Worker thread → UI thread; blocks until the UI took the View (natural back-pressure).
        if not self.is_running:
            return
        try:
            self.call_from_thread(self.apply_view, view)
        except RuntimeError:
            pass  # the app is closing

    def _post_end(self) -> None:
        # Worker thread: a finite input has ended; the header and footer say so.
        if not self.is_running:
            return
        try:
            self.call_from_thread(self._ended)
        except RuntimeError:
            pass

    def _ended(self) -> None:
        self._draw_header()
        self.refresh_bindings()

    def apply_view(self, view: View) -> None:
        """Show a new View (UI thread)."""
        if not self._w:
            return
        self.view = view
        self.views_seen += 1
        self._last_post = time.monotonic()
        self._relayout()
        for name in ("gpus", "engines"):
            self._w[name].update_view(view)
        self._fill_findings()
        self._draw_header()
        screen = self.screen
        if isinstance(screen, ProcessScreen):
            screen.update_view(view)

    def _mode(self) -> header_panel.Mode:
        c = self.controller
        return header_panel.Mode(
            live=c.live,
            replay=c.replay,
            paused=c.paused,
            recording=c.recording,
            interval_s=c.interval_s,
            speed=c.speed,
            ended=c.ended,
            label=self.label,
            static=c.static,
        )

    def _draw_header(self) -> None:
        if not self._w:
            return
        extra: list[tuple[str, str]] = []
        if self.controller.live and self.view is not None:
            age = time.monotonic() - self._last_post
            if age > 2 * self.controller.interval_s + 1 and not self.controller.paused:
                extra.append((f"waiting for sources {age:.0f}s", "yellow"))
        if self.controller.error:
            extra.append((self.controller.error, "bold red"))
        text = header_panel.render(
            self.view, self._mode(), self.host or self.label, self.size.width or 80, extra=extra
        )
        if not self.shown["sources"]:
            text = text.split("\n")[0]
        self._w["header"].update(text, layout=False)  # fixed height: no re-layout

    def _tick(self) -> None:
        if self.controller.live:  # only live shows an age that changes between Views
            self._draw_header()

    def on_resize(self) -> None:
        """Re-plan panel sizes for the new terminal size."""
        self._relayout()
        self._fill_findings()
        self._draw_header()

    def _findings_width(self) -> int:
        # The list's width less its scrollbar (2) and a margin (1).
        return max(20, (self.size.width or 80) - 3)

    def _shown_rows(self) -> list[FindingRow]:
        v = self.view
        return [r for r in (v.findings if v else []) if findings_panel.matches(r, self.filter_text)]

    def _relayout(self) -> None:
        if not self._w:
            return
        v = self.view
        cards = gpus_panel.groups(v.gpus) if v else []
        busy = [not gpus_panel.is_idle(g[0]) for g in cards] or [True]
        n_e = len(v.engines) if v else 1
        rows = self._shown_rows()
        now = v.now if v else 0.0
        width = self._findings_width()
        self._counts = [findings_panel.level_rows(r, now, width) for r in rows]
        need = findings_panel.rows_by_level(self._counts)
        if self._filter.has_class("-on"):
            need = tuple(n + 1 for n in need)
        lay = plan_layout(self.size.width or 80, self.size.height or 24, busy, n_e, self.shown, need)
        if v is not None:
            # A panel shorter than planned ("No GPUs: …", an engine without /metrics) gives its
            # rows back to the findings.
            w = self.size.width or 80
            g_n = len(gpus_panel.render(v, w, lay.gpu_lines, lay.gpu_columns).plain.split("\n")) + 1
            e_n = len(engines_panel.render(v, w, lay.engine_lines).plain.split("\n")) + 1
            lay = replace(lay, gpu_height=min(lay.gpu_height, g_n), engine_height=min(lay.engine_height, e_n))
        self.layout_plan = lay
        gp, ep = self._w["gpus"], self._w["engines"]
        key = (lay, tuple(self.shown.values()))
        if key == self._layout_key:
            return  # same sizes: a style change would re-run the layout for nothing
        self._layout_key = key
        hdr = self._w["header"]
        hdr.styles.height = lay.header_height
        gp.lines, gp.columns = lay.gpu_lines, lay.gpu_columns
        gp.styles.height = lay.gpu_height
        gp.set_class(not self.shown["gpus"], "-hidden")
        ep.lines = lay.engine_lines
        ep.styles.height = lay.engine_height
        ep.set_class(not self.shown["engines"], "-hidden")
        self._w["findings-box"].set_class(not self.shown["findings"], "-hidden")
        gp.update_view(v)
        ep.update_view(v)

    def _fill_findings(self) -> None:
        if not self._w:
            return
        ol = self._ol
        v = self.view
        rows = self._shown_rows()
        keep = self._selected_key
        if keep is None and ol.highlighted is not None and ol.highlighted < len(self._rows):
            keep = self._rows[ol.highlighted].key
        self._rows = rows
        lay = self.layout_plan
        level = lay.findings_level if lay is not None else 2
        width = self._findings_width()
        now = v.now if v else 0.0
        room = 0
        if lay is not None:
            room = (self.size.height or 24) - lay.header_height - 1 - lay.gpu_height - lay.engine_height - 1
            room -= 1 if self._filter.has_class("-on") else 0
        counts = self._counts if len(self._counts) == len(rows) else []
        if not counts:
            counts = [findings_panel.level_rows(r, now, width) for r in rows]
        caps = findings_panel.summary_caps(rows, counts, level, room)
        evs = findings_panel.evidence_caps(rows, counts, level, room)
        prompts = [
            findings_panel.finding_prompt(r, now, width, level, c, ev)
            for r, c, ev in zip(rows, caps, evs, strict=True)
        ]
        fkey = (tuple(p.markup for p in prompts), self.filter_text, v is None)
        if fkey == self._findings_key:
            return  # unchanged: rebuilding the list would redraw it for nothing
        same_rows = [r.key for r in rows] == self._findings_rows and v is not None and bool(rows)
        prev = self._findings_key[0] if self._findings_key else None
        self._findings_key = fkey
        self._findings_rows = [r.key for r in rows]
        if same_rows:
            # Same findings, new numbers: replace the prompts in place (no list rebuild).
            for i, p in enumerate(prompts):
                if prev is None or i >= len(prev) or prev[i] != p.markup:
                    ol.replace_option_prompt_at_index(i, p)
            return
        ol.clear_options()
        if not rows:
            msg = "no findings" if not self.filter_text else f"no finding matches '{self.filter_text}'"
            if v is None:
                msg = "reading…"
            ol.add_option(Option(Text(msg, style="dim"), disabled=True))
            return
        ol.add_options([Option(p) for p in prompts])
        idx = next((i for i, r in enumerate(rows) if r.key == keep), 0)
        ol.highlighted = idx

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        """Remember the selected finding by identity, so an update keeps it selected."""
        if 0 <= event.option_index < len(self._rows):
            self._selected_key = self._rows[event.option_index].key

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Enter or a click on a finding opens its detail screen."""
        if 0 <= event.option_index < len(self._rows):
            self._open(self._rows[event.option_index])

    def _open(self, row: FindingRow) -> None:
        self.push_screen(
            DetailScreen(row, self.view, self._rules.get(row.finding.rule), list(self._rules.values()))
        )

    # ------------------------------------------------------------------ actions

    def action_help(self) -> None:
        """Show the key help."""
        self.push_screen(HelpScreen())

    def action_processes(self) -> None:
        """Open the process view (every GPU's processes; SIGTERM for orphans, live only)."""
        self.push_screen(ProcessScreen(self.view, live=self.controller.live))

    def action_pause(self) -> None:
        """Pause / resume reading (a replay at its end plays again from the start)."""
        if self.controller.static:
            return
        if self.controller.replay and self.controller.ended:
            self.run_worker(self.controller.toggle_pause, thread=True, group="control")
        else:
            self.controller.toggle_pause()
        self._draw_header()
        self.refresh_bindings()

    def action_play(self) -> None:
        """Replay: play / pause (live: pause)."""
        self.action_pause()

    def action_interval(self, factor: float) -> None:
        """Longer (factor > 1) or shorter interval; in replay slower / faster."""
        self.controller.change_interval(float(factor))
        self._draw_header()

    def action_replay_interval(self, factor: float) -> None:
        """Replay: + slower, - faster (as ``[`` and ``]``)."""
        self.action_interval(factor)

    def action_speed(self, step: int) -> None:
        """Replay: next speed up / down."""
        if self.controller.replay:
            self.controller.change_speed(int(step))
            self._draw_header()

    def action_seek(self, steps: int) -> None:
        """Replay: seek by ``steps`` × SEEK_STEP snapshots (off the UI thread)."""
        if not self.controller.replay:
            return
        delta = int(steps) * SEEK_STEP
        self.run_worker(lambda: self.controller.seek_by(delta), thread=True, group="control", exclusive=True)

    def action_record(self) -> None:
        """Start / stop recording what is read (RecordingWriter)."""
        c = self.controller
        if c.static:
            return
        if c.recording:
            path = c.recording_path
            n = c.stop_recording()
            self.notify(f"recording stopped: {n} snapshots in {path}", timeout=6)
        else:
            path = self.out_dir / f"kvdoctor-watch-{time.strftime('%Y%m%d-%H%M%S')}.jsonl.gz"
            try:
                c.start_recording(path)
            except OSError as e:
                self.notify(f"cannot record to {path}: {e.strerror or e}", severity="error", timeout=6)
                return
            self.notify(f"recording to {path} (r stops)", timeout=6)
        self._draw_header()

    def action_bundle(self) -> None:
        """Write a support bundle of what was read, as ``kvdoctor bundle`` writes it from the
        same inputs (off the UI thread)."""
        c = self.controller

        def work() -> None:
            _path, msg = write_support_bundle(
                c.loop.timeline,
                self.out_dir,
                source=self.label or "watch",
                opts=self.opts,
                raw_metrics=c.raw_metrics(),
                live=c.live,
            )
            self.call_from_thread(self.notify, msg, timeout=8)

        self.run_worker(work, thread=True, group="bundle")

    def action_filter(self) -> None:
        """Show the filter box and focus it."""
        f = self._filter
        f.add_class("-on")
        f.focus()
        self._relayout()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter findings as the text changes."""
        self.filter_text = event.value.strip()
        self._relayout()
        self._fill_findings()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the filter box goes back to the list."""
        self._ol.focus()

    def action_escape(self) -> None:
        """Esc clears and hides the filter."""
        f = self._filter
        if f.has_class("-on") or self.filter_text:
            f.value = ""
            self.filter_text = ""
            f.remove_class("-on")
            self._ol.focus()
            self._relayout()
            self._fill_findings()

    def action_cursor(self, delta: int) -> None:
        """j / k move the selection."""
        ol = self._ol
        if int(delta) > 0:
            ol.action_cursor_down()
        else:
            ol.action_cursor_up()

    def action_open(self) -> None:
        """Enter opens the selected finding."""
        ol = self._ol
        if ol.highlighted is not None and 0 <= ol.highlighted < len(self._rows):
            self._open(self._rows[ol.highlighted])

    def action_panel(self, panel: str) -> None:
        """Show / hide one panel (1 findings, 2 engines, 3 GPUs, 4 sources line)."""
        self.shown[panel] = not self.shown[panel]
        self._relayout()
        self._fill_findings()
        self._draw_header()

    def action_quit(self) -> None:  # type: ignore[override]
        """Quit (the worker is told to stop; it is a daemon thread)."""
        self.controller.stop(wait=False)
        self.exit()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Replay keys (space, ←/→, [/]) act and show in the footer only in a replay, and not
        while the filter box has the focus (it takes the arrows and letters); a static input
        (a bundle: one state) has no pause, record or interval either."""
        c = self.controller
        if self.screen.id != "_default" and action not in ("quit", "help", "pop_screen"):
            return False  # the main screen's keys: not on the process, detail or help screens
        if action in self.REPLAY_ACTIONS:
            return c.replay and not isinstance(self.focused, Input)
        if action in self.READING_ACTIONS and c.static:
            return False
        if action == "interval":
            return c.live
        if action == "replay_interval":
            return c.replay
        return True
