"""Per-GPU memory breakdown and per-engine rates: arithmetic over facts, for the faces to show.

vLLM exports no GPU-memory breakdown; the sidecar (``kvdoctor_gpu_memory_bytes{gpu,part}``)
and watch show one. This module only adds up what the sources read (no rule, no threshold):

- ``weights``: vLLM's "Model loading took X GiB" (per worker, so per GPU) of the engine on the GPU;
- ``kv_cache``: "Available KV cache memory: X GiB" (per worker; the smallest when several);
- ``activation_and_graphs``: the rest of the engine's memory on that GPU (activations, CUDA
  graphs, the CUDA context, NCCL buffers) = engine used − weights − KV, never below 0;
- ``other_engines``: memory of vLLM processes on the GPU that belong to another engine;
- ``foreign``: memory of processes on the GPU that are not vLLM;
- ``free``: total − used (NVML ``memory.used``).

Engine memory on a GPU is what its processes hold (NVML per-process ``usedGpuMemory``); when
no process resolves (containers: NVML reports host PIDs, absent from the pod's PID namespace)
the GPU's whole used memory minus other_engines/foreign is the engine's when the report places an
engine on it. Parts are bytes; a part that cannot be known is None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdoctor.facts import Snapshot, Timeline

if TYPE_CHECKING:
    from kvdoctor.report import Report

#: process names of vLLM's own processes (API server, EngineCore, workers) as NVML shows them.
_VLLM_NAME = re.compile(r"vllm|VLLM::|EngineCore|VllmWorker", re.I)

#: the ``part`` label values, in display order.
PARTS: tuple[str, ...] = ("weights", "kv_cache", "activation_and_graphs", "other_engines", "foreign", "free")


@dataclass
class GpuBreakdown:
    """One GPU's memory in bytes by part (see the module doc); ``engine`` the report's engine
    id placed on it (None when none); ``total``/``used`` from NVML / nvidia-smi; ``utilization``
    fraction 0..1 (``utilization.gpu``)."""

    gpu: int
    total: int | None
    used: int | None
    utilization: float | None
    engine: str | None
    weights: int | None = None
    kv_cache: int | None = None
    activation_and_graphs: int | None = None
    other_engines: int | None = None
    foreign: int | None = None
    free: int | None = None
    #: how the engine's memory on this GPU was told apart: "pid" (NVML processes matched the
    #: engine's pids), "gpu" (no pid resolved — another PID namespace, a bundle without
    #: processes — so the GPU's used memory less other engines' and foreign processes' is the
    #: engine's, by the engine's GPU placement: CUDA/NVIDIA_VISIBLE_DEVICES UUIDs or indices),
    #: None when no engine is placed on it.
    attribution: str | None = None

    def parts(self) -> dict[str, int | None]:
        """``{part: bytes | None}`` in :data:`PARTS` order."""
        return {p: getattr(self, p) for p in PARTS}


def _log_per_worker(snapshot: Snapshot) -> tuple[int | None, int | None]:
    """(weights bytes per worker, KV bytes per worker) from the log, None when not logged."""
    log = snapshot.log
    if log is None:
        return None, None
    loads = [e.values.get("weights_bytes") for e in log.of("model_loading")]
    weights = max((int(w) for w in loads if w), default=None)
    kvs = [e.values.get("bytes") for e in log.of("available_kv_memory")]
    kv_known = [int(k) for k in kvs if k is not None]
    kv = max(0, min(kv_known)) if kv_known else None
    return weights, kv


def gpu_breakdown(snapshot: Snapshot, report: Report) -> list[GpuBreakdown]:
    """One :class:`GpuBreakdown` per GPU of ``snapshot`` (index order).

    Engine placement from ``report.engines[].gpus`` (derive's attribution) and pids; process
    ownership from ``snapshot.processes`` (``vllm_role``). Never raises for missing facts."""
    engine_pids: dict[int, str] = {}
    engine_of_gpu: dict[int, str] = {}
    for e in report.engines:
        eid = str(e.get("id"))
        if e.get("pid") is not None:
            engine_pids[int(e["pid"])] = eid
        for g in e.get("gpus") or []:
            engine_of_gpu.setdefault(int(g), eid)
    host_procs = {p.pid: p for p in snapshot.processes}
    weights, kv = _log_per_worker(snapshot)
    out: list[GpuBreakdown] = []
    for g in sorted(snapshot.gpus, key=lambda g: g.index):
        engine = engine_of_gpu.get(g.index)
        b = GpuBreakdown(g.index, g.memory_total_bytes, g.memory_used_bytes, g.utilization_gpu, engine)
        b.free = g.memory_free_bytes
        own = other = foreign = 0
        for p in g.processes:
            used = p.used_bytes or 0
            owner = engine_pids.get(p.pid)
            host = host_procs.get(p.pid)
            if owner is None and host is not None and host.ppid in engine_pids:
                owner = engine_pids[host.ppid]  # an engine core / worker of an API server
            vllm_like = bool(_VLLM_NAME.search(p.name or "")) or (host is not None and host.vllm_role)
            if owner is None and vllm_like and len(report.engines) == 1:
                owner = engine  # the one engine's process (its pid unknown to the report)
            if owner == engine and engine is not None:
                own += used
            elif owner is not None or vllm_like:
                other += used
            elif snapshot.process_table_known and host is None:
                # Another PID namespace (a container): NVML's host pid resolves to nothing here.
                # Never called foreign on that ground alone: it stays in the engine's share.
                continue
            else:
                foreign += used
        b.other_engines, b.foreign = other, foreign
        if engine is not None and g.memory_used_bytes is not None:
            engine_used = own or max(0, g.memory_used_bytes - other - foreign)
            b.attribution = "pid" if own else "gpu"
            b.weights = weights
            b.kv_cache = kv
            if weights is not None and kv is not None:
                b.activation_and_graphs = max(0, engine_used - weights - kv)
        elif engine is None and g.memory_used_bytes is not None:
            b.weights = b.kv_cache = b.activation_and_graphs = 0
        out.append(b)
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
