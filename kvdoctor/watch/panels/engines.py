"""The engine panel: model, TP/PP/DP and GPUs; throughput (prompt and generation tokens per
second, finished requests per second); a KV usage gauge with its capacity in tokens and a
sparkline of KV usage over the window; running / waiting and preemptions per minute; TTFT and
inter-token latency p50/p99; max_model_len against the longest prompt seen, prompt-length
quantiles and the prefix-cache hit rate. Figures from :func:`kvdoctor.breakdown.engine_stats`
(the windowed ``kvdoctor.timeline`` helpers); nothing here is a diagnosis.

Colour never carries meaning alone: the gauge is followed by its percentage, a rising
preemption rate by its number and unit.
"""

from __future__ import annotations

from rich.text import Text

from kvdoctor.breakdown import EngineStats
from kvdoctor.watch.controller import View
from kvdoctor.watch.panels import pct, sparkline


def _n(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.1f}s"


def _rate(x: float | None, unit: str) -> str:
    """ "8.4k tok/s", "74 tok/s", "0.15 req/s"; "–" when unknown."""
    if x is None:
        return f"– {unit}"
    if x >= 10_000:
        return f"{x / 1000:.0f}k {unit}"
    if x >= 1000:
        return f"{x / 1000:.1f}k {unit}"
    if x >= 10:
        return f"{x:.0f} {unit}"
    return f"{x:.2g} {unit}" if x else f"0 {unit}"


def gauge(frac: float | None, width: int) -> Text:
    """A KV usage gauge: green below 0.8, yellow below 0.95, red above (the percentage is
    always printed beside it)."""
    t = Text()
    if frac is None:
        return Text("·" * width, style="grey30")
    n = round(max(0.0, min(1.0, frac)) * width)
    style = "green3" if frac < 0.8 else "yellow" if frac < 0.95 else "red1"
    t.append("█" * n, style=style)
    t.append("·" * (width - n), style="grey30")
    return t


def _name(e: EngineStats, width: int) -> Text:
    name = Text((e.model or e.id).rsplit("/", 1)[-1] if width < 120 else (e.model or e.id), style="bold")
    if e.model and e.id != e.model:
        suffix = e.id[len(e.model) :].strip() if e.id.startswith(e.model) else e.id
        name.append(f" {suffix}", style="dim")
    return name


def _throughput(e: EngineStats, short: bool = False) -> Text:
    """ "prompt 8.3k tok/s  gen 74 tok/s  0.15 req/s" (``short``: one "tok/s" for both)."""
    t = Text()
    t.append("prompt ", style="dim")
    t.append(_rate(e.prompt_tps, "tok/s").removesuffix(" tok/s") if short else _rate(e.prompt_tps, "tok/s"))
    t.append("  gen ", style="dim")
    t.append(_rate(e.gen_tps, "tok/s"), style="bold")
    t.append("  ")
    t.append(_rate(e.request_rate, "req/s"))
    return t


def _kv(e: EngineStats, width: int, spark: int) -> Text:
    kv = Text("KV ")
    kv.append_text(gauge(e.kv_usage, 10 if width < 100 else 16))
    kv.append(f" {pct(e.kv_usage)}", style="bold")
    if e.kv_capacity_tokens:
        kv.append(f" of {_n(e.kv_capacity_tokens)} tok", style="dim")
    if spark > 12 and e.kv_history:
        kv.append("  window ", style="dim")  # KV usage over the pipeline's window, oldest first
        kv.append(sparkline(e.kv_history, spark - 9), style="green3")
    return kv


def _queue(e: EngineStats) -> Text:
    q = Text("  run ")
    q.append(_n(e.running))
    q.append(" wait ")
    q.append(_n(e.waiting), style="bold yellow" if (e.waiting or 0) > 0 else "")
    q.append("  preempt ")
    hot = (e.preemptions_per_min or 0) >= 10
    q.append(
        f"{e.preemptions_per_min:.1f}/min" if e.preemptions_per_min is not None else "–",
        style="bold red1" if hot else "",
    )
    return q


def _latency(e: EngineStats) -> Text:
    t = Text()
    t.append("TTFT ", style="dim")
    t.append(f"p50 {_s(e.ttft_p50)} p99 {_s(e.ttft_p99)}")
    t.append("  ITL ", style="dim")
    t.append(f"p50 {_s(e.itl_p50)} p99 {_s(e.itl_p99)}")
    t.append("  prefix-cache hit ", style="dim")
    t.append(pct(e.prefix_hit_rate) if e.prefix_hit_rate is not None else "–")
    return t


def engine_lines(e: EngineStats, view: View, width: int, lines: int) -> list[Text]:
    """One engine in ``lines`` lines: 1: name, KV %, queue, generation tok/s; 2: name,
    placement and throughput, then KV gauge + sparkline and queue; 3: + TTFT / ITL p50/p99 and
    prefix-cache hits; 4: + max_model_len, longest prompt, prompt-length p50/p99."""
    name = _name(e, width)
    par = Text(f" TP{e.tp or '?'} PP{e.pp or '?'} DP{e.dp or 1}", style="dim")
    if e.gpus:
        par.append(f" GPU {','.join(str(g) for g in e.gpus)}", style="dim")
    no_metrics = e.metrics_label is None
    if lines <= 1:
        t = name.copy()
        t.append(f" GPU {','.join(str(g) for g in e.gpus)}" if e.gpus else "", style="dim")
        if no_metrics:
            t.append("  no /metrics for this engine", style="dim")
        else:
            t.append(" · KV ")
            t.append(pct(e.kv_usage), style="bold")
            t.append_text(_queue(e))
            t.append("  gen ", style="dim")
            t.append(_rate(e.gen_tps, "tok/s"))
        return [_cut(t, width)]
    l1 = name.copy()
    if no_metrics:
        l1.append_text(par)
        return [_cut(l1, width), _cut(Text(" no /metrics for this engine", style="dim"), width)]
    tput = Text("  ").append_text(_throughput(e))
    if l1.cell_len + par.cell_len + tput.cell_len > width:
        # Narrow: the GPUs stay, the parallelism goes; one "tok/s" for both rates.
        par = Text(f" GPU {','.join(str(g) for g in e.gpus)}" if e.gpus else "", style="dim")
        tput = Text("  ").append_text(_throughput(e, short=True))
    l1.append_text(par)
    l1.append_text(tput)
    queue = _queue(e)
    spark = max(0, min(30, width - 40 - queue.cell_len))
    l2 = Text(" ")
    l2.append_text(_kv(e, width, spark if width >= 90 else 0))
    l2.append_text(queue)
    out = [l1, l2]
    if lines >= 3:
        out.append(Text(" ").append_text(_latency(e)))
    if lines >= 4:
        mml = Text(f" max_model_len {_n(e.max_model_len)} · longest prompt ≤{_n(e.longest_prompt)}")
        mml.append(f" · prompt p50 {_n(e.prompt_p50)} p99 {_n(e.prompt_p99)}")
        out.append(mml)
    return [_cut(t, width) for t in out]


def _cut(t: Text, width: int) -> Text:
    t.truncate(width, overflow="ellipsis")
    return t


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
