"""The engine panel: model, TP/PP/DP, max_model_len vs the longest prompt seen, a KV usage gauge
with capacity in tokens, running / waiting, preemptions per minute, prompt-length and TTFT
p50/p99, prefix-cache hit rate (figures from :func:`kvdoctor.breakdown.engine_stats`)."""

from __future__ import annotations

from rich.text import Text

from kvdoctor.breakdown import EngineStats
from kvdoctor.watch.controller import View
from kvdoctor.watch.panels import pct


def _n(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.1f}s"


def gauge(frac: float | None, width: int) -> Text:
    """A KV usage gauge: green below 0.8, yellow below 0.95, red above."""
    t = Text()
    if frac is None:
        return Text("·" * width, style="grey30")
    n = round(max(0.0, min(1.0, frac)) * width)
    style = "green3" if frac < 0.8 else "yellow" if frac < 0.95 else "red1"
    t.append("█" * n, style=style)
    t.append("·" * (width - n), style="grey30")
    return t


def engine_lines(e: EngineStats, view: View, width: int, lines: int) -> list[Text]:
    """One engine in ``lines`` lines (1: name + KV gauge + queue; 2: + lengths; 3+: + latency)."""
    name = Text((e.model or e.id).rsplit("/", 1)[-1] if width < 100 else (e.model or e.id), style="bold")
    if e.model and e.id != e.model:
        suffix = e.id[len(e.model) :].strip() if e.id.startswith(e.model) else e.id
        name.append(f" {suffix}", style="dim")
    par = f" TP{e.tp or '?'} PP{e.pp or '?'} DP{e.dp or 1}"
    gpus = f" GPU {','.join(str(g) for g in e.gpus)}" if e.gpus else ""
    kv = Text(" KV ")
    kv.append_text(gauge(e.kv_usage, 12 if width < 100 else 20))
    cap = (
        f" {pct(e.kv_usage)} of {_n(e.kv_capacity_tokens)} tok"
        if e.kv_capacity_tokens
        else f" {pct(e.kv_usage)}"
    )
    kv.append(cap)
    pre_style = "bold red1" if (e.preemptions_per_min or 0) >= 10 else ""
    queue = Text(f"  run {_n(e.running)} wait ")
    queue.append(_n(e.waiting), style="bold yellow" if (e.waiting or 0) > 0 else "")
    queue.append("  preempt ")
    queue.append(
        f"{e.preemptions_per_min:.1f}/min" if e.preemptions_per_min is not None else "–", style=pre_style
    )
    if e.metrics_label is None:
        queue = Text("  no /metrics for this engine", style="dim")
    l1 = name.copy()
    l1.append(par + gpus, style="dim")
    if lines <= 1:
        l1.append_text(kv)
        l1.append_text(queue)
        l1.truncate(width, overflow="ellipsis")
        return [l1]
    l2 = kv.copy()
    l2.append_text(queue)
    out = [l1, l2]
    if lines >= 3:
        mml = Text(f" max_model_len {_n(e.max_model_len)} · longest prompt ≤{_n(e.longest_prompt)}")
        mml.append(f" · prompt p50 {_n(e.prompt_p50)} p99 {_n(e.prompt_p99)}")
        out.append(mml)
    if lines >= 4:
        lat = Text(f" TTFT p50 {_s(e.ttft_p50)} p99 {_s(e.ttft_p99)} · prefix-cache hit ")
        lat.append(pct(e.prefix_hit_rate) if e.prefix_hit_rate is not None else "–")
        out.append(lat)
    for t in out:
        t.truncate(width, overflow="ellipsis")
    return out


def render(view: View | None, width: int, lines_per_engine: int) -> Text:
    """Every engine at ``lines_per_engine`` lines."""
    if view is None:
        return Text("")
    if not view.engines:
        return Text("No vLLM engine found (no /metrics, log or launch command read).", style="dim")
    rows: list[Text] = []
    for e in view.engines:
        rows.extend(engine_lines(e, view, width, lines_per_engine))
    return Text("\n").join(rows)
