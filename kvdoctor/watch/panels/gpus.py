"""The GPU cards: a memory bar split into what holds it, the gmu × total line, sparklines of
utilisation and memory, temperature / power / throttle reasons, and the GPU's processes."""

from __future__ import annotations

from rich.text import Text

from kvdoctor.breakdown import PART_LABELS, GpuBreakdown
from kvdoctor.watch.controller import View
from kvdoctor.watch.panels import gib, pct, sparkline

#: colour of each breakdown part in the bar and legend.
PART_STYLE = {
    "weights": "dodger_blue2",
    "kv_cache": "green3",
    "cuda_graphs": "medium_purple",
    "activation_and_graphs": "magenta",
    "engine": "dodger_blue2",
    "other_engines": "orange1",
    "foreign": "red1",
    "unlisted": "grey50",
    "transient_headroom": "grey42",
    "free": "grey30",
}
PART_SHORT = {
    "activation_and_graphs": "act+graphs",
    "other_engines": "other eng",
    "kv_cache": "KV",
    "cuda_graphs": "graphs",
    "transient_headroom": "kept free",
}


#: the word written inside a part's run of the bar (colour never carries meaning alone)
PART_WORD = {
    "weights": "weights",
    "kv_cache": "KV",
    "activation_and_graphs": "act",
    "engine": "engine",
    "other_engines": "other engine",
    "foreign": "foreign",
    "unlisted": "unlisted",
}


def memory_bar(b: GpuBreakdown, width: int) -> Text:
    """``width`` cells: each part a run of cells in proportion to its bytes (largest
    remainder), its word written inside when the run has room ("foreign", "KV", …), free as
    "·"; the engine's gmu × total line drawn as "┃"."""
    total = b.total_bytes or sum(p.bytes for p in b.parts)
    text = Text()
    if width <= 0:
        return text
    if not total:
        return Text("?" * width, style="grey50")
    shares = [(p.part, p.bytes * width / total) for p in b.parts]
    cells = [int(s) for _, s in shares]
    order = sorted(range(len(shares)), key=lambda i: -(shares[i][1] - cells[i]))
    for i in order[: max(0, width - sum(cells))]:
        cells[i] += 1
    chars: list[str] = []
    styles: list[str] = []
    for (part, _), n in zip(shares, cells, strict=False):
        n = min(n, width - len(chars))
        if n <= 0:
            continue
        colour = PART_STYLE.get(part, "")
        if part == "free":
            chars += ["·"] * n
            styles += [colour] * n
            continue
        run = ["█"] * n
        run_styles = [colour] * n
        word = PART_WORD.get(part, "")
        if word and n >= len(word) + 2:
            at = (n - len(word)) // 2
            run[at : at + len(word)] = list(word)
            run_styles[at : at + len(word)] = [f"bold black on {colour}"] * len(word)
        chars += run
        styles += run_styles
    chars += ["·"] * (width - len(chars))
    styles += [PART_STYLE["free"]] * (width - len(styles))
    if b.gmu is not None:
        mark = min(width - 1, max(0, round(b.gmu * width)))
        under = styles[mark]
        bg = under.rsplit(" on ", 1)[-1] if " on " in under else under
        styles[mark] = "bold bright_white" if chars[mark] == "·" else f"bold bright_white on {bg}"
        chars[mark] = "┃"
    # One span per run of equal style (not per cell): cheap to draw every second.
    i = 0
    while i < width:
        j = i
        while j < width and styles[j] == styles[i]:
            j += 1
        text.append("".join(chars[i:j]), style=styles[i])
        i = j
    return text


def _title(b: GpuBreakdown, view: View, width: int) -> Text:
    g = next((g for g in view.snapshot.gpus if g.index == b.index), None)
    t = Text()
    t.append(f"GPU{b.index} ", style="bold")
    name = (b.name or "").replace("NVIDIA ", "")
    if name and width >= 60:
        t.append(name + " ", style="dim")
    util = g.utilization_gpu if g is not None else None
    spark_w = 16 if width >= 100 else 10 if width >= 70 else 0
    t.append("util ")
    if spark_w:
        t.append(sparkline(view.gpu_util.get(b.index, []), spark_w), style="cyan")
    t.append(f" {pct(util):>4} ")
    if spark_w and width >= 90:
        t.append("mem ")
        t.append(sparkline(view.gpu_mem.get(b.index, []), spark_w), style="green3")
        t.append(" ")
    if g is not None:
        if g.temperature_c is not None:
            hot = g.temperature_c >= 85
            t.append(f"{g.temperature_c:.0f}°C{' hot' if hot else ''} ", style="bold red" if hot else "")
        if g.power_w is not None:
            lim = f"/{g.power_limit_w:.0f}" if g.power_limit_w else ""
            t.append(f"{g.power_w:.0f}{lim}W ")
        if g.clock_event_reasons:
            t.append("⚠ " + ",".join(g.clock_event_reasons) + " ", style="yellow")
        if g.mig_enabled:
            t.append("MIG ", style="magenta")
    if b.engine:
        t.append("· " + b.engine.rsplit("/", 1)[-1], style="bold dodger_blue2")
    t.truncate(width, overflow="ellipsis")
    return t


def _bar_line(b: GpuBreakdown, width: int, prefix: str = "") -> Text:
    used = f" {gib(b.used_bytes)}/{gib(b.total_bytes)}"
    gmu = f" gmu {b.gmu:.2f}" if b.gmu is not None and width >= 60 else ""
    t = Text(prefix, style="bold")
    bar_w = max(8, width - len(prefix) - len(used) - len(gmu) - 2)
    t.append("▕")
    t.append_text(memory_bar(b, bar_w))
    t.append("▏")
    t.append(used)
    t.append(gmu, style="dim")
    t.truncate(width, overflow="ellipsis")
    return t


def _legend(b: GpuBreakdown, width: int) -> Text:
    t = Text(" ")
    for p in b.parts:
        if p.bytes <= 0:
            continue
        t.append("■ " if p.part != "free" else "· ", style=PART_STYLE.get(p.part, ""))
        t.append(f"{PART_SHORT.get(p.part, PART_LABELS.get(p.part, p.part))} {gib(p.bytes)}  ")
    if b.torch_cap_bytes is not None:
        # vLLM 0.34: torch's reserved memory may not grow past this after startup
        t.append(f"torch cap {gib(b.torch_cap_bytes)}  ", style="dim")
    t.truncate(width, overflow="ellipsis")
    return t


def _processes(b: GpuBreakdown, width: int, orphans: set[int] | frozenset[int] = frozenset()) -> Text:
    t = Text(" ")
    if not b.processes:
        t.append("no processes", style="dim")
    for p, kind in sorted(b.processes, key=lambda pk: -(pk[0].used_bytes or 0)):
        if p.pid in orphans:
            kind = "orphan"  # the report's word for it (orphaned-engine-processes)
        style = {"foreign": "red1", "other_engine": "orange1", "orphan": "bold red1"}.get(kind, "")
        t.append(f"{p.pid} ", style="dim")
        t.append(f"{(p.name or '?')[:28]} ", style=style)
        t.append(f"{gib(p.used_bytes)}", style="bold")
        if kind != "engine":
            t.append(f" ({kind.replace('_', ' ')})", style=style)
        t.append("  ")
    t.truncate(width, overflow="ellipsis")
    return t


def is_idle(b: GpuBreakdown) -> bool:
    """No process and under 1 GiB used: the card collapses to one line."""
    return not b.processes and (b.used_bytes or 0) < 2**30


def _idle_line(group: list[GpuBreakdown], view: View, width: int) -> Text:
    """One line for one idle GPU or a run of idle GPUs of one model ("GPU1,2,3 L40S idle")."""
    b = group[0]
    g = next((g for g in view.snapshot.gpus if g.index == b.index), None)
    t = Text("GPU" + ",".join(str(x.index) for x in group) + " ", style="bold")
    t.append(f"{(b.name or '').replace('NVIDIA ', '')} ", style="dim")
    t.append("idle", style="grey62")
    each = " each" if len(group) > 1 else ""
    t.append(f" · {gib(b.used_bytes)}/{gib(b.total_bytes)}{each} · no processes", style="dim")
    if len(group) == 1 and g is not None and g.utilization_gpu:
        t.append(f" · util {pct(g.utilization_gpu)}")
    if g is not None and g.temperature_c is not None:
        t.append(f" · {g.temperature_c:.0f}°C", style="dim")
    t.truncate(width, overflow="ellipsis")
    return t


def groups(gpus: list[GpuBreakdown]) -> list[list[GpuBreakdown]]:
    """The cards to draw: each busy GPU alone, runs of idle GPUs of one model and size
    together (one line for all of them)."""
    out: list[list[GpuBreakdown]] = []
    for b in gpus:
        prev = out[-1][0] if out else None
        if (
            prev is not None
            and is_idle(b)
            and is_idle(prev)
            and (b.name, b.total_bytes) == (prev.name, prev.total_bytes)
        ):
            out[-1].append(b)
        else:
            out.append([b])
    return out


def card_lines(b: GpuBreakdown, lines: int) -> int:
    """Lines a card takes at ``lines`` per card (an idle GPU takes one)."""
    return 1 if is_idle(b) else lines


def card(b: GpuBreakdown, view: View, width: int, lines: int) -> list[Text]:
    """One GPU card in ``lines`` lines (1: a bar line; 2: + title; 3: + legend; 4: + processes);
    an idle GPU in one line."""
    if is_idle(b):
        return [_idle_line([b], view, width)]
    if lines <= 1:
        g = next((g for g in view.snapshot.gpus if g.index == b.index), None)
        line = _bar_line(b, max(20, width - 6), prefix=f"GPU{b.index}")
        line.append(f" {pct(g.utilization_gpu if g else None):>4}")
        line.truncate(width, overflow="ellipsis")
        return [line]
    out = [_title(b, view, width), _bar_line(b, width)]
    if lines >= 3:
        out.append(_legend(b, width))
    if lines >= 4:
        from kvdoctor.watch.procs import orphan_pids

        out.append(_processes(b, width, orphan_pids(view)))
    return out


def render(view: View | None, width: int, lines_per_card: int, columns: int = 1) -> Text:
    """The GPU panel: every card at ``lines_per_card`` lines, in ``columns`` side by side."""
    if view is None:
        return Text("waiting for the first read…", style="dim")
    if not view.gpus:
        src = [s for s in view.sources if s.status.kind in ("nvml", "nvidia-smi")]
        why = src[0].status.detail if src and src[0].status.detail else "no GPU read"
        return Text(f"No GPUs: {why}", style="dim")
    col_w = max(20, (width - (columns - 1)) // columns)
    cards = [
        card(g[0], view, col_w, lines_per_card) if len(g) == 1 else [_idle_line(g, view, col_w)]
        for g in groups(view.gpus)
    ]
    rows: list[Text] = []
    for start in range(0, len(cards), columns):
        group = cards[start : start + columns]
        for i in range(max(len(c) for c in group)):
            line = Text()
            for j, c in enumerate(group):
                cell = c[i].copy() if i < len(c) else Text()
                cell.truncate(col_w, pad=j < len(group) - 1)
                line.append_text(cell)
                if j < len(group) - 1:
                    line.append("│", style="grey30")
            rows.append(line)
    return Text("\n").join(rows)
