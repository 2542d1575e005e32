"""The Textual app of ``kvdoctor watch``: header, GPU cards, engine panel, findings; a detail
screen per finding and a help screen. It draws :class:`~kvdoctor.watch.controller.View` objects
that the controller's worker thread posts with ``call_from_thread``; it computes no diagnosis.

Keys follow nvitop / htop / k9s: q quit, ?/h help, p pause, +/- interval, r record, b bundle,
/ filter, ↑↓ or j/k select, Enter/Esc open/back, 1–4 toggle panels; in replay space play/pause,
←/→ seek, [/] speed. Nothing destructive is bound. The mouse selects and opens findings.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical, VerticalScroll
from textual.geometry import Region
from textual.screen import ModalScreen, Screen
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option

from kvdoctor.pipeline import Pipeline
from kvdoctor.report import fix_lines
from kvdoctor.watch.controller import Controller, FindingRow, View, write_support_bundle
from kvdoctor.watch.panels import SEVERITY_STYLE
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
    engine, the GPU/engine panel heights (title row included) and whether the lower panels sit
    side by side (``wide``)."""

    gpu_lines: int
    gpu_columns: int
    engine_lines: int
    gpu_height: int
    engine_height: int
    wide: bool
    header_height: int


def plan_layout(
    width: int,
    height: int,
    busy: list[bool],
    n_engines: int,
    shown: dict[str, bool],
    min_findings: int = 5,
) -> Layout:
    """Collapse panels rather than overflow: the largest card and engine sizes (4 lines down
    to 1) whose rows fit ``height`` with at least ``min_findings`` rows left for findings; wide
    screens (≥ 150 columns) put GPU cards in two columns and engines beside findings.
    ``busy``: per GPU, False for an idle one (its card is one line whatever the size)."""
    header_h = 2 if shown.get("sources", True) else 1
    avail = max(1, height - header_h - 1)
    busy = busy or [True]
    n_engines = max(1, n_engines)
    wide = width >= 150
    cols = 2 if (wide and len(busy) >= 2) else 1
    pairs = [busy[i : i + cols] for i in range(0, len(busy), cols)]
    n_busy_rows = sum(1 for p in pairs if any(p))
    gpu_rows = len(pairs)
    show_g, show_e, show_f = shown.get("gpus", True), shown.get("engines", True), shown.get("findings", True)
    f_min = min_findings if show_f else 0
    prefs = [(4, 4), (3, 4), (3, 3), (2, 3), (2, 2), (1, 2), (1, 1)]
    for gl, el in prefs:
        g_h = n_busy_rows * gl + (gpu_rows - n_busy_rows) + 1 if show_g else 0
        e_h = n_engines * el + 1 if show_e else 0
        need = g_h + (max(e_h, f_min) if wide else e_h + f_min)
        if need <= avail:
            return Layout(gl, cols, el, g_h, e_h, wide, header_h)
    g_h = min(gpu_rows + 1, max(2, avail - (n_engines + 1) - f_min)) if show_g else 0
    e_h = min(n_engines + 1, max(2, avail - g_h - f_min)) if show_e else 0
    return Layout(1, cols, 1, g_h, e_h, wide, header_h)


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
    #help { width: 76; height: auto; max-height: 90%; border: round $accent; padding: 0 1; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        """The key table."""
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold cyan", no_wrap=True)
        t.add_column()
        for keys, what in (
            ("q", "quit"),
            ("? h", "this help"),
            ("p", "pause / resume reading"),
            ("+ -", "longer / shorter interval (replay: slower / faster)"),
            ("r", "start / stop recording to ./kvdoctor-watch-TIME.jsonl.gz"),
            ("b", "write a support bundle of what was read"),
            ("/", "filter findings (Esc clears)"),
            ("↑ ↓ j k", "select a finding"),
            ("Enter", "open the finding: evidence, sources, the rule's documentation"),
            ("Esc", "back"),
            ("1 2 3 4", "show / hide GPUs, engines, findings, sources line"),
            ("space", "replay: play / pause"),
            ("← →", f"replay: seek {SEEK_STEP} snapshots (shift: {SEEK_STEP * 10})"),
            ("[ ]", "replay: slower / faster"),
            ("mouse", "click a finding to open it; click footer keys"),
        ):
            t.add_row(keys, what)
        legend = Text("\nMemory bar: ")
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
        fixes = fix_lines(f)
        if fixes:
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
            for s in self.view_.report.sources:
                src.add_row(f"{s.kind} {s.status}", f"{s.origin}" + (f" — {s.detail}" if s.detail else ""))
            parts += [Text(""), src]
        if self.rule is not None:
            from kvdoctor.rules_cli import explain_renderables

            parts += [
                Text(""),
                Text(f"── {f.docs} " + "─" * 20, style="dim"),
                *explain_renderables(self.rule, self.catalogue),
            ]
        return parts


class WatchApp(App[None]):
    """``kvdoctor watch``. ``feed``/``pipeline`` as every face gets them (``open_feed``,
    ``Pipeline.load``); ``start_at`` seeks a replay there first; ``host`` overrides the host
    name shown (tests make it deterministic)."""

    TITLE = "kvdoctor watch"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: 2; }
    .panel { border-top: solid $primary-darken-1; border-title-color: $text; border-title-style: bold; padding: 0 0; }
    #gpus { height: auto; }
    #lower { height: 1fr; layout: vertical; }
    #engines { height: auto; }
    #findings-box { height: 1fr; }
    #findings-list { height: 1fr; border: none; padding: 0; }
    #filter { height: 1; border: none; padding: 0 1; display: none; }
    #filter.-on { display: block; }
    .-hidden { display: none; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark,h", "help", "Help", key_display="?"),
        Binding("p", "pause", "Pause"),
        Binding("plus,equals_sign", "interval(2)", "Interval", key_display="+/-"),
        Binding("minus", "interval(0.5)", "Interval-", show=False),
        # Replay only (hidden from the footer and inactive live; see check_action).
        Binding("space", "play", "Play", key_display="space"),
        # priority: the findings list would take ←/→ for scrolling otherwise
        Binding("left", "seek(-1)", "Seek", key_display="←→", priority=True),
        Binding("right", "seek(1)", "Seek+", show=False, priority=True),
        Binding("shift+left", "seek(-10)", show=False, priority=True),
        Binding("shift+right", "seek(10)", show=False, priority=True),
        Binding("left_square_bracket", "speed(-1)", "Speed", key_display="[]"),
        Binding("right_square_bracket", "speed(1)", "Faster", show=False),
        Binding("r", "record", "Record"),
        Binding("b", "bundle", "Bundle"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("j", "cursor(1)", "Down", show=False),
        Binding("k", "cursor(-1)", "Up", show=False),
        Binding("enter", "open", "Open", show=False),
        Binding("escape", "escape", "Back", show=False),
        Binding("1", "panel('gpus')", "GPUs", show=False),
        Binding("2", "panel('engines')", "Engines", show=False),
        Binding("3", "panel('findings')", "Findings", show=False),
        Binding("4", "panel('sources')", "Sources", show=False),
    ]
    #: actions that only a replay has
    REPLAY_ACTIONS = frozenset({"play", "seek", "speed"})

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
    ) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.controller = Controller(feed, pipeline, self._post, interval_s=interval_s, start_at=start_at)
        self.host = host or (socket.gethostname() if feed.live else "")
        self.label = getattr(feed, "label", "")
        self.out_dir = out_dir or Path.cwd()
        self.autostart = autostart
        self.view: View | None = None
        self.views_seen = 0
        self.shown = dict.fromkeys(PANELS, True)
        self.filter_text = ""
        self.exit_message: str | None = None
        self._selected_key: Any = None
        self._w: dict[str, Any] = {}
        self._layout_key: Any = None
        self._findings_key: Any = None
        self._findings_rows: list[Any] = []
        self._rows: list[FindingRow] = []
        self._last_post = time.monotonic()
        self._rules = {r.id: r for r in pipeline.rules}

    # ------------------------------------------------------------------ composition

    def compose(self) -> ComposeResult:
        """Header, GPU cards, then engines and findings, and the footer of keys."""
        yield Static(id="header")
        gp = PanelView("gpus", id="gpus", classes="panel")
        gp.border_title = "[1] GPUs"
        yield gp
        with Container(id="lower"):
            ep = PanelView("engines", id="engines", classes="panel")
            ep.border_title = "[2] Engines"
            yield ep
            with Vertical(id="findings-box", classes="panel") as box:
                box.border_title = "[3] Findings — Enter opens, / filters"
                yield Input(placeholder="filter findings (Esc clears)", id="filter")
                yield OptionList(id="findings-list")
        yield Footer()

    def on_mount(self) -> None:
        """Start the worker thread and a 1 s tick that keeps the header's age current."""
        # Kept: queries go to the active screen, and a detail or help screen may be on top.
        self._w = {
            name: self.query_one(f"#{name}")
            for name in ("header", "gpus", "engines", "lower", "findings-box", "findings-list", "filter")
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

    def apply_view(self, view: View) -> None:
        """Show a new View (UI thread)."""
        if not self._w:
            return
        self.view = view
        self.views_seen += 1
        self._last_post = time.monotonic()
        for name in ("gpus", "engines"):
            self._w[name].update_view(view)
        self._relayout()
        self._fill_findings()
        self._draw_header()
        if isinstance(self.screen, DetailScreen):
            pass  # a detail screen shows the finding as it was when opened

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
        )

    def _draw_header(self) -> None:
        if not self._w:
            return
        text = header_panel.render(self.view, self._mode(), self.host or self.label, self.size.width or 80)
        if not self.shown["sources"]:
            text = text.split("\n")[0]
        if self.controller.live and self.view is not None:
            age = time.monotonic() - self._last_post
            if age > 2 * self.controller.interval_s + 1 and not self.controller.paused:
                lines = text.split("\n")
                lines[0].append(f"  waiting for sources {age:.0f}s", style="yellow")
                text = Text("\n").join(lines)
        if self.controller.error:
            lines = text.split("\n")
            lines[0].append(f"  {self.controller.error}", style="bold red")
            text = Text("\n").join(lines)
        self._w["header"].update(text, layout=False)  # fixed height: no re-layout

    def _tick(self) -> None:
        if self.controller.live:  # only live shows an age that changes between Views
            self._draw_header()

    def on_resize(self) -> None:
        """Re-plan panel sizes for the new terminal size."""
        self._relayout()
        self._draw_header()

    def _relayout(self) -> None:
        if not self._w:
            return
        v = self.view
        busy = [not gpus_panel.is_idle(b) for b in v.gpus] if v else [True]
        n_e = len(v.engines) if v else 1
        lay = plan_layout(self.size.width or 80, self.size.height or 24, busy, n_e, self.shown)
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
        lower = self._w["lower"]
        box = self._w["findings-box"]
        box.set_class(not self.shown["findings"], "-hidden")
        ep.set_class(not self.shown["engines"], "-hidden")
        if lay.wide:
            lower.styles.layout = "horizontal"
            ep.styles.height = "1fr"
            ep.styles.width = "1fr"
            box.styles.width = "1fr"
        else:
            lower.styles.layout = "vertical"
            ep.styles.height = lay.engine_height
            ep.styles.width = "1fr"
            box.styles.width = "1fr"
        gp.update_view(v)
        ep.update_view(v)

    def _fill_findings(self) -> None:
        ol = self._ol
        v = self.view
        rows = [r for r in (v.findings if v else []) if findings_panel.matches(r, self.filter_text)]
        keep = self._selected_key
        if keep is None and ol.highlighted is not None and ol.highlighted < len(self._rows):
            keep = self._rows[ol.highlighted].key
        self._rows = rows
        two = (self.size.height or 24) >= 30
        width = max(20, (ol.content_size.width or ol.size.width or self.size.width or 80) - 3)
        prompts = [findings_panel.finding_prompt(r, v.now if v else 0, two, width) for r in rows]
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
        ol.add_options(
            [Option(findings_panel.finding_prompt(r, v.now if v else 0, two, width)) for r in rows]
        )
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

    def action_pause(self) -> None:
        """Pause / resume reading."""
        if self.controller.replay and self.controller.ended:
            self.run_worker(self.controller.toggle_pause, thread=True, group="control")
        else:
            self.controller.toggle_pause()
        self._draw_header()

    def action_play(self) -> None:
        """Replay: play / pause (live: pause)."""
        self.action_pause()

    def action_interval(self, factor: float) -> None:
        """Longer (factor > 1) or shorter interval; in replay slower / faster."""
        self.controller.change_interval(float(factor))
        self._draw_header()

    def action_speed(self, step: int) -> None:
        """Replay: next speed up / down."""
        if self.controller.replay:
            self.controller.change_speed(int(step))
            self._draw_header()
        else:
            self.notify("speed applies to a replay (--recording, --demo)", timeout=3)

    def action_seek(self, steps: int) -> None:
        """Replay: seek by ``steps`` × SEEK_STEP snapshots (off the UI thread)."""
        if not self.controller.replay:
            if int(steps) in (-1, 1):
                return
            self.notify("seek applies to a replay (--recording, --demo)", timeout=3)
            return
        delta = int(steps) * SEEK_STEP
        self.run_worker(lambda: self.controller.seek_by(delta), thread=True, group="control", exclusive=True)

    def action_record(self) -> None:
        """Start / stop recording what is read (RecordingWriter)."""
        c = self.controller
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
        """Write a support bundle of what was read (off the UI thread)."""

        def work() -> None:
            _path, msg = write_support_bundle(self.controller.loop.timeline, self.out_dir)
            self.call_from_thread(self.notify, msg, timeout=8)

        self.run_worker(work, thread=True, group="bundle")

    def action_filter(self) -> None:
        """Show the filter box and focus it."""
        f = self._filter
        f.add_class("-on")
        f.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter findings as the text changes."""
        self.filter_text = event.value.strip()
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
        """Show / hide one panel (1 GPUs, 2 engines, 3 findings, 4 sources line)."""
        self.shown[panel] = not self.shown[panel]
        self._relayout()
        self._draw_header()

    def action_quit(self) -> None:  # type: ignore[override]
        """Quit (the worker is told to stop; it is a daemon thread)."""
        self.controller.stop(wait=False)
        self.exit()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Replay keys (space, ←/→, [/]) act and show in the footer only in a replay, and not
        while the filter box has the focus (it takes the arrows and letters)."""
        if action in self.REPLAY_ACTIONS:
            return self.controller.replay and not isinstance(self.focused, Input)
        return True
