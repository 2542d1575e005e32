"""Where each GPU's memory went, and the per-engine figures a live face shows.

Pure functions over facts and the :class:`~kvdoctor.report.Report` (no rule logic, no I/O), so
that every face shows the same numbers: ``kvdoctor watch`` draws them as memory bars and engine
panels, ``kvdoctor sidecar`` can export them (``kvdoctor_gpu_memory_bytes{part=...}``).

:func:`gpu_breakdown` splits one GPU's memory into parts (:data:`PARTS`), each with the source
it was read from:

- ``weights``: the engine's "Model loading took X GiB" log line (per worker, so per GPU rank).
- ``kv_cache``: the KV-cache pool, "Available KV cache memory: X GiB" (per worker), else
  ``vllm:cache_config_info`` num_gpu_blocks × block_size × KV bytes per token per rank
  (``kvmath.kv_bytes_per_token`` from config.json). On vLLM 0.34 with the extensible KV cache
  (the log has "Memory after warmup" or "Extended KV cache to"), "Available KV cache memory" is
  only an address reservation and is never used: the pool is the committed "Extended KV cache to
  N blocks (X GiB)" (smallest over workers), else the cache_config_info blocks.
- ``cuda_graphs`` (0.34 extensible only): "Graph capturing finished in S secs, took G GiB" —
  graphs are measured there, not estimated (vllm-facts §9.2 step 7).
- ``activation_and_graphs``: the rest of what the engine's processes hold on the card
  (activation peak, CUDA graphs unless split out above, non-torch memory such as the CUDA
  context and NCCL buffers, torch's growth after startup).
- ``engine``: what the engine holds when weights and KV pool are both unknown (not split).
- ``other_engines``: vLLM processes of another engine on the same card.
- ``foreign``: processes that are not vLLM (NVML ``nvmlDeviceGetComputeRunningProcesses``). A
  pid the host process table lacks while the table is known belongs to another PID namespace
  (NVML reports host pids; a pod sees its own): it is never called foreign on that ground
  alone, and counts to the engine placed on the GPU (``attribution`` "gpu").
- ``unlisted``: used memory no listed process accounts for (driver reservations, processes in
  other containers NVML cannot name).
- ``transient_headroom`` (0.34 extensible only): the part of free memory the engine keeps for
  transient activations by design, μ + kept from "Memory after warmup: … X GiB kept for transient
  activations (Tr GiB allocated at peak, …)" with μ = max(1 GiB, 0.75 × Tr) (vllm-facts §9.2
  step 8), at most the free memory: not memory another process may take.
- ``free``: NVML / nvidia-smi total − used (less ``transient_headroom``).

:attr:`GpuBreakdown.torch_cap_bytes` is the 0.34 torch cap L ("Torch may reserve up to L GiB"):
torch's reserved memory cannot grow beyond it after startup.

:func:`engine_stats` gives each engine's live figures from its /metrics series: KV usage and
capacity, running / waiting, preemptions per minute, prompt-length and TTFT quantiles from
histogram deltas, prefix-cache hit rate — the same windowed helpers (``kvdoctor.timeline``) the
rules' variables are computed with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdoctor.facts import Gpu, GpuProcess, Snapshot, Timeline

if TYPE_CHECKING:
    from kvdoctor.report import Report

#: memory parts of a GPU, in the order a bar draws them (free last).
PARTS: tuple[str, ...] = (
    "weights",
    "kv_cache",
    "cuda_graphs",
    "activation_and_graphs",
    "engine",
    "other_engines",
    "foreign",
    "unlisted",
    "transient_headroom",
    "free",
)
#: human names of :data:`PARTS` for legends.
PART_LABELS: dict[str, str] = {
    "weights": "weights",
    "kv_cache": "KV cache",
    "cuda_graphs": "CUDA graphs",
    "activation_and_graphs": "activation+graphs+non-torch",
    "transient_headroom": "kept free for transients",
    "engine": "engine",
    "other_engines": "other engines",
    "foreign": "foreign",
    "unlisted": "unlisted",
    "free": "free",
}


@dataclass
class MemoryPart:
    """One slice of a GPU's memory: ``part`` (one of :data:`PARTS`), ``bytes`` and ``source``
    (where the figure came from: "vllm.log line 21", "NVML processes", …)."""

    part: str
    bytes: int
    source: str


@dataclass
class GpuBreakdown:
    """One GPU's memory split into parts (bytes; they sum to ``total_bytes`` when it is known).

    ``engine`` is the report engine id that runs on this GPU (None when none does);
    ``gmu_bytes`` its ``--gpu-memory-utilization`` × total — the line vLLM budgets up to.
    ``processes`` are the GPU's processes with ``kind`` "engine", "other_engine" or "foreign".
    ``utilization`` fraction 0..1 (NVML ``utilization.gpu``). ``attribution`` says how the
    engine's memory was told apart: "pid" (NVML processes matched the engine's), "gpu" (no pid
    resolved — another PID namespace, a bundle without processes — so the GPU's used memory
    less other engines' and foreign processes' is the engine's, by its GPU placement), None
    when no engine is placed on the GPU.
    """

    index: int
    name: str | None
    total_bytes: int | None
    used_bytes: int | None
    engine: str | None = None
    gmu: float | None = None
    gmu_bytes: int | None = None
    parts: list[MemoryPart] = field(default_factory=list)
    processes: list[tuple[GpuProcess, str]] = field(default_factory=list)
    utilization: float | None = None
    attribution: str | None = None
    #: vLLM 0.34 extensible: torch's cap L ("Torch may reserve up to L GiB", smallest over
    #: workers) and the address reservation "Available KV cache memory" (not the pool); None else
    torch_cap_bytes: int | None = None
    kv_reservation_bytes: int | None = None

    def part(self, name: str) -> int | None:
        """Bytes of one part, None when the breakdown has no such part."""
        for p in self.parts:
            if p.part == name:
                return p.bytes
        return None


def _vllm_like(p: GpuProcess, vllm_pids: set[int]) -> bool:
    from kvdoctor.derive.base import is_vllm_process

    return p.pid in vllm_pids or is_vllm_process(p.name)


def _descendants(snapshot: Snapshot, root: int) -> set[int]:
    """``root`` and every host process whose parent chain reaches it (psutil ppid)."""
    children: dict[int, list[int]] = {}
    for hp in snapshot.processes:
        if hp.ppid is not None:
            children.setdefault(hp.ppid, []).append(hp.pid)
    out, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


@dataclass
class _LogFigures:
    """Per-rank figures from the log's latest run, each (bytes, source) or None."""

    weights: tuple[int, str] | None = None
    kv: tuple[int, str] | None = None
    #: 0.34 extensible only
    extensible: bool = False
    graphs: tuple[int, str] | None = None
    headroom: tuple[int, str] | None = None
    torch_cap: int | None = None
    reservation: int | None = None


#: μ's floor on CUDA (vllm-facts §9.2 step 8).
_MARGIN_FLOOR = 2**30


def _log_figures(snapshot: Snapshot) -> _LogFigures:
    """Weights and the KV pool per GPU rank from the log's latest run; on vLLM 0.34 with the
    extensible KV cache also CUDA graphs, the kept transient headroom and the torch cap."""
    out = _LogFigures()
    log = snapshot.log
    if log is None:
        return out
    from kvdoctor.derive import current_run

    run = current_run(log)
    name = log.origin.rsplit("/", 1)[-1] or "vllm.log"
    loads = [e for e in run.of("model_loading") if e.values.get("weights_bytes") is not None]
    if loads:
        e = max(loads, key=lambda e: e.values["weights_bytes"])
        out.weights = (int(e.values["weights_bytes"]), f"{name} line {e.line}: Model loading took …")
    avail = [e for e in run.of("available_kv_memory") if e.values.get("bytes") is not None]
    warm = [e for e in run.of("memory_after_warmup") if isinstance(e.values.get("kept_bytes"), int)]
    ext = [e for e in run.of("kv_extended") if isinstance(e.values.get("bytes"), int)]
    if warm or ext:
        out.extensible = True
        if avail:
            out.reservation = max(0, int(min(e.values["bytes"] for e in avail)))
        if ext:
            e = min(ext, key=lambda e: e.values["bytes"])
            out.kv = (int(e.values["bytes"]), f"{name} line {e.line}: Extended KV cache to N blocks (X GiB)")
        graphs = [e for e in run.of("graph_capture_done") if isinstance(e.values.get("bytes"), int)]
        if graphs:
            e = max(graphs, key=lambda e: e.values["bytes"])
            out.graphs = (
                max(0, int(e.values["bytes"])),
                f"{name} line {e.line}: Graph capturing finished … took G GiB",
            )
        if warm:
            kept = max(int(e.values["kept_bytes"]) for e in warm)
            tr = max(int(e.values.get("transient_peak_bytes") or 0) for e in warm)
            mu = max(_MARGIN_FLOOR, int(0.75 * tr))
            out.headroom = (
                kept + mu,
                f"{name} line {warm[-1].line}: Memory after warmup: kept + max(1 GiB, 0.75 × allocated at peak)",
            )
            caps = [
                int(e.values["torch_cap_bytes"])
                for e in warm
                if isinstance(e.values.get("torch_cap_bytes"), int)
            ]
            out.torch_cap = min(caps) if caps else None
        return out
    if avail:
        e = min(avail, key=lambda e: e.values["bytes"])
        out.kv = (max(0, int(e.values["bytes"])), f"{name} line {e.line}: Available KV cache memory")
    return out


def _kv_from_blocks(snapshot: Snapshot, cfg: dict[str, Any]) -> tuple[int, str] | None:
    """KV pool per rank from ``vllm:cache_config_info`` num_gpu_blocks × block bytes."""
    if snapshot.model is None or not snapshot.metrics:
        return None
    cc = snapshot.metrics[0].cache_config
    try:
        blocks = int(float(cc.get("num_gpu_blocks", "")))
        block_size = int(float(cc.get("block_size", "")))
    except ValueError:
        return None
    from kvdoctor import kvmath

    try:
        per_token = kvmath.kv_bytes_per_token(
            snapshot.model,
            tensor_parallel_size=int(cfg.get("tensor_parallel_size") or 1),
            pipeline_parallel_size=int(cfg.get("pipeline_parallel_size") or 1),
            kv_cache_dtype=str(cfg.get("kv_cache_dtype") or "auto"),
        )
    except (ValueError, ZeroDivisionError):
        return None
    if per_token <= 0:
        return None
    return blocks * block_size * per_token, "vllm:cache_config_info num_gpu_blocks × block bytes"


def _one_gpu(
    g: Gpu, snapshot: Snapshot, report: Report, vllm_pids: set[int], log_figs: _LogFigures
) -> GpuBreakdown:
    engines = [e for e in report.engines if g.index in (e.get("gpus") or [])]
    primary = engines[0] if engines else None
    out = GpuBreakdown(
        g.index, g.name, g.memory_total_bytes, g.memory_used_bytes, utilization=g.utilization_gpu
    )
    host_pids = {hp.pid for hp in snapshot.processes}
    if primary is not None:
        out.engine = primary["id"]
        gmu = (primary.get("config") or {}).get("gpu_memory_utilization")
        if gmu is not None and g.memory_total_bytes:
            out.gmu = float(gmu)
            out.gmu_bytes = int(float(gmu) * g.memory_total_bytes)
    # Which of the GPU's processes are the engine's own.
    own_pids: set[int] | None = None
    if primary is not None and len(engines) > 1 and primary.get("pid") is not None:
        own_pids = _descendants(snapshot, int(primary["pid"]))
    engine_b = other_b = foreign_b = 0
    listed = 0
    engine_known = True
    unresolved = False
    for p in g.processes:
        if _vllm_like(p, vllm_pids):
            mine = primary is not None and (own_pids is None or p.pid in own_pids)
            kind = "engine" if mine else "other_engine"
        elif primary is not None and snapshot.process_table_known and p.pid not in host_pids:
            # Another PID namespace: the engine's by placement, never "foreign" for that alone.
            kind, unresolved = "engine", True
        else:
            kind = "foreign"
        out.processes.append((p, kind))
        if p.used_bytes is None:
            if kind == "engine":
                engine_known = False
            continue
        listed += p.used_bytes
        if kind == "engine":
            engine_b += p.used_bytes
        elif kind == "other_engine":
            other_b += p.used_bytes
        else:
            foreign_b += p.used_bytes
    used = g.memory_used_bytes
    if primary is not None:
        by_pid = engine_known and not unresolved and any(k == "engine" for _, k in out.processes)
        out.attribution = "pid" if by_pid else "gpu"
    if primary is not None and (not engine_known or not any(k == "engine" for _, k in out.processes)):
        # No per-process figure for the engine (a container NVML cannot see into): what the
        # card uses beyond the other listed processes is the engine's.
        engine_b = max(0, (used or 0) - other_b - foreign_b) if used is not None else engine_b
        listed = engine_b + other_b + foreign_b
    parts: list[MemoryPart] = []
    first = primary is not None and primary is report.engines[0]
    figs = log_figs if first else _LogFigures()
    if figs.extensible:
        out.torch_cap_bytes, out.kv_reservation_bytes = figs.torch_cap, figs.reservation
    if primary is not None and engine_b > 0:
        weights, kv = figs.weights, figs.kv
        if kv is None:
            kv = (
                _kv_from_blocks(snapshot, primary.get("config") or {})
                if primary is report.engines[0]
                else None
            )
        rest = engine_b
        if weights is not None:
            w = min(weights[0], rest)
            parts.append(MemoryPart("weights", w, weights[1]))
            rest -= w
        if kv is not None:
            k = min(kv[0], rest)
            parts.append(MemoryPart("kv_cache", k, kv[1]))
            rest -= k
        if figs.graphs is not None and (weights is not None or kv is not None):
            c = min(figs.graphs[0], rest)
            parts.append(MemoryPart("cuda_graphs", c, figs.graphs[1]))
            rest -= c
        if weights is None and kv is None:
            parts.append(MemoryPart("engine", rest, "NVML processes (engine)"))
        else:
            parts.append(MemoryPart("activation_and_graphs", rest, "engine processes − weights − KV pool"))
    elif engine_b > 0:
        other_b += engine_b
    if other_b:
        parts.append(MemoryPart("other_engines", other_b, "NVML processes (vLLM, another engine)"))
    if foreign_b:
        parts.append(MemoryPart("foreign", foreign_b, "NVML processes (not vLLM)"))
    if used is not None and used > listed:
        parts.append(MemoryPart("unlisted", used - listed, "NVML used − listed processes"))
    if g.memory_free_bytes is not None:
        free = g.memory_free_bytes
        if figs.headroom is not None and primary is not None:
            h = min(figs.headroom[0], max(0, free))
            parts.append(MemoryPart("transient_headroom", h, figs.headroom[1]))
            free -= h
        parts.append(MemoryPart("free", free, "NVML total − used"))
    out.parts = parts
    return out


def gpu_breakdown(snapshot: Snapshot, report: Report) -> list[GpuBreakdown]:
    """Each GPU of ``snapshot`` (NVML / nvidia-smi facts) split into :data:`PARTS`, in bytes.

    ``report`` gives the engines and their GPUs (``report.engines[].gpus``, set by derive) and
    their gmu. The weights and KV-pool figures are the first engine's (the log belongs to it).
    Parts are clamped so they never exceed what the engine's processes hold. Never raises.
    """
    vllm_pids = {hp.pid for hp in snapshot.processes if hp.vllm_role is not None}
    figs = _log_figures(snapshot)
    return [_one_gpu(g, snapshot, report, vllm_pids, figs) for g in snapshot.gpus]


# --------------------------------------------------------------------------- engines


@dataclass
class EngineStats:
    """What one engine is doing now (``None`` = not read). Units: tokens, requests, fractions,
    seconds; ``preemptions_per_min`` per minute. Quantiles are over the window's histogram
    deltas (lifetime histograms when the window saw no request)."""

    id: str
    model: str | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    gpus: list[int] = field(default_factory=list)
    max_model_len: int | None = None
    #: tokens; upper bound of the highest non-empty vllm:request_prompt_tokens bucket (lifetime)
    longest_prompt: float | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_per_min: float | None = None
    prompt_p50: float | None = None
    prompt_p99: float | None = None
    #: fraction; Δvllm:prefix_cache_hits_total / Δvllm:prefix_cache_queries_total in the window
    prefix_hit_rate: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    #: seconds; inter-token latency quantiles (vllm:inter_token_latency_seconds, before 0.10.2
    #: vllm:time_per_output_token_seconds) over the window's histogram delta
    itl_p50: float | None = None
    itl_p99: float | None = None
    #: tokens per second; rate(vllm:prompt_tokens_total) and rate(vllm:generation_tokens_total)
    prompt_tps: float | None = None
    gen_tps: float | None = None
    #: finished requests per second; rate(vllm:request_success_total)
    request_rate: float | None = None
    #: the /metrics ``engine`` label this engine's figures come from (None: no /metrics)
    metrics_label: str | None = None
    #: KV usage over the window, oldest first (for sparklines)
    kv_history: list[float] = field(default_factory=list)


def _label_for(engine_id: str, index: int, labels: list[str]) -> str | None:
    # Mirrors derive.build_contexts: DP engines are "<id> [engine L]"; otherwise the first
    # engine reads the first label and the others have no /metrics of their own.
    if engine_id.endswith("]") and "[engine " in engine_id:
        return engine_id.rsplit("[engine ", 1)[1][:-1]
    if index == 0:
        return labels[0] if labels else ""
    return None


def _recent(timeline: Timeline, window_s: float) -> Timeline:
    """The snapshots of the last ``window_s`` seconds plus one before (the delta's baseline):
    a live Timeline holds an hour, and the figures read a minute of it every second."""
    snaps = timeline.snapshots
    latest = snaps[-1].timestamp if snaps else None
    if latest is None:
        return timeline
    i = len(snaps) - 1
    while i > 0:
        ts = snaps[i].timestamp
        if ts is not None and ts < latest - window_s:
            break
        i -= 1
    return Timeline(snapshots=snaps[i:], max_len=timeline.max_len)


def _latency(series: Any, name: str, window_s: float) -> tuple[float | None, float | None]:
    """p50, p99 seconds of a latency histogram over the window (lifetime when the window saw
    no request); (None, None) when the page has no such histogram."""
    from kvdoctor import timeline as tl

    h = tl.histogram_delta(series, name, window_s)
    if h is None or h.count <= 0:
        h = tl.histogram_latest(series, name)
    if h is None or h.count <= 0:
        return None, None
    return tl.histogram_quantile(h, 0.5), tl.histogram_quantile(h, 0.99)


def engine_stats(timeline: Timeline, report: Report, window_s: float = 60.0) -> list[EngineStats]:
    """One :class:`EngineStats` per ``report.engines`` entry, from the engine's /metrics series
    in ``timeline`` (vllm:kv_cache_usage_perc, num_requests_running/waiting,
    rate(num_preemptions_total), rate(prompt_tokens_total / generation_tokens_total /
    request_success_total), request_prompt_tokens, time_to_first_token_seconds and
    inter_token_latency_seconds histogram deltas, prefix_cache_hits/queries) and the report's config and KV figures.
    Never raises."""
    from kvdoctor import timeline as tl

    timeline = _recent(timeline, window_s)
    labels = sorted({m.engine for s in timeline.snapshots for m in s.metrics if m.engine is not None})
    out: list[EngineStats] = []
    for i, e in enumerate(report.engines):
        cfg = e.get("config") or {}
        kv = e.get("kv") or {}
        st = EngineStats(
            id=e["id"],
            model=e.get("model"),
            tp=cfg.get("tensor_parallel_size"),
            pp=cfg.get("pipeline_parallel_size"),
            dp=len(labels) if len(labels) > 1 else 1,
            gpus=list(e.get("gpus") or []),
            max_model_len=cfg.get("max_model_len"),
            kv_usage=kv.get("usage"),
            kv_capacity_tokens=kv.get("capacity_tokens"),
        )
        label = _label_for(st.id, i, labels)
        out.append(st)
        if label is None:
            continue
        series = tl.engine_series(timeline, label or None)
        if not series:
            continue
        st.metrics_label = label
        latest = series[-1]
        st.running, st.waiting = latest.num_requests_running, latest.num_requests_waiting
        if st.kv_usage is None:
            st.kv_usage = latest.kv_cache_usage
        rate = tl.counter_rate(series, "num_preemptions_total", window_s)
        st.preemptions_per_min = rate * 60 if rate is not None else None
        ph = tl.histogram_delta(series, "vllm:request_prompt_tokens", window_s)
        if ph is None or ph.count <= 0:
            ph = tl.histogram_latest(series, "vllm:request_prompt_tokens")
        if ph is not None and ph.count > 0:
            st.prompt_p50, st.prompt_p99 = tl.histogram_quantile(ph, 0.5), tl.histogram_quantile(ph, 0.99)
        life = tl.histogram_latest(series, "vllm:request_prompt_tokens")
        if life is not None and life.count > 0:
            st.longest_prompt = tl.histogram_max_bucket(life)
        st.ttft_p50, st.ttft_p99 = _latency(series, "vllm:time_to_first_token_seconds", window_s)
        st.itl_p50, st.itl_p99 = _latency(series, "vllm:inter_token_latency_seconds", window_s)
        st.prompt_tps = tl.counter_rate(series, "prompt_tokens_total", window_s)
        st.gen_tps = tl.counter_rate(series, "generation_tokens_total", window_s)
        st.request_rate = tl.counter_rate(series, "request_success_total", window_s)
        q = tl.counter_increase(series, "prefix_cache_queries_total", window_s)
        h = tl.counter_increase(series, "prefix_cache_hits_total", window_s)
        if q and h is not None:
            st.prefix_hit_rate = h / q
        st.kv_history = [
            m.kv_cache_usage for m in tl.window(series, window_s) if m.kv_cache_usage is not None
        ]
    return out


def engine_preemption_rates(timeline: Timeline, report: Report, window_s: float) -> dict[str, float | None]:
    """Preemptions per second over the last ``window_s`` seconds per report engine id:
    ``rate(vllm:num_preemptions_total)`` (``kvdoctor.timeline.counter_rate``, reset aware).

    A data-parallel engine id "M [engine 1]" reads the ``engine="1"`` series; any other engine
    the first ``engine`` label of the scrapes (None for V0 pages). None with fewer than two
    scrapes in the window."""
    from kvdoctor.timeline import counter_rate, engine_series

    labels = sorted({m.engine for s in timeline.snapshots for m in s.metrics if m.engine is not None})
    out: dict[str, float | None] = {}
    for idx, e in enumerate(report.engines):
        eid = str(e.get("id"))
        label: str | None = None
        if eid.endswith("]") and "[engine " in eid:
            label = eid.rsplit("[engine ", 1)[1][:-1]
        elif idx == 0:
            label = labels[0] if labels else None
        else:
            out[eid] = None
            continue
        series = engine_series(timeline, label)
        out[eid] = counter_rate(series, "num_preemptions_total", window_s) if series else None
    return out
