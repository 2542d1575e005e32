"""The sidecar's ``/metrics``: kvdoctor's own evaluation cycle as Prometheus series.

Every value comes from the sidecar's last evaluation cycle (the Report of
:class:`~kvdoctor.pipeline.Pipeline`, the breakdown arithmetic of :mod:`kvdoctor.breakdown` and
the sources' statuses); nothing is computed at scrape time but the text. Conventions
(https://prometheus.io/docs/practices/naming/): base units (bytes, seconds), ratios 0..1, no
target labels (Prometheus adds ``namespace``/``pod``), no ``_created`` series.

Series. Labels mean what vLLM's own series' labels mean, so that one Prometheus joins them
(``on (namespace, pod, model_name, engine)``): ``model_name`` the served model name (vLLM's
``model_name``; kvdoctor's engine id where the model is unknown), ``engine`` the vLLM engine
index (vLLM's ``engine``: "0", "1" with data parallelism; "" where kvdoctor read no /metrics
page naming one), ``gpu`` the GPU index as text and ``uuid`` its NVML UUID (dcgm-exporter's
``UUID``):

- ``kvdoctor_finding{rule,severity,family,model_name,engine,gpu}`` 1 while a finding is active
  (it held its rule's ``for:``; see :mod:`kvdoctor.sidecar.transitions`); one series per GPU it
  names (``gpu=""`` when none);
- ``kvdoctor_suggested_flag_info{rule,model_name,engine,flag,value}`` 1 per suggested flag of
  an active one;
- ``kvdoctor_gpu_memory_bytes{gpu,uuid,part}``, ``kvdoctor_gpu_memory_total_bytes{gpu,uuid}``,
  ``kvdoctor_gpu_torch_cap_bytes{gpu,uuid}`` (vLLM 0.34 extensible only),
  ``kvdoctor_gpu_utilization_ratio{gpu,uuid}``,
  ``kvdoctor_gpu_info{gpu,uuid,name,model_name,engine,attribution}``;
- ``kvdoctor_engine_kv_capacity_tokens{model_name,engine}``,
  ``kvdoctor_engine_kv_usage_ratio{model_name,engine}``,
  ``kvdoctor_engine_preemptions_per_second{model_name,engine}``;
- ``kvdoctor_source_up{source,origin}``, ``kvdoctor_source_last_success_timestamp_seconds``,
  ``kvdoctor_source_errors_total``, ``kvdoctor_source_read_duration_seconds`` (when the loop
  measures it);
- ``kvdoctor_last_evaluation_timestamp_seconds``, ``kvdoctor_evaluation_duration_seconds``,
  ``kvdoctor_evaluations_total``, ``kvdoctor_build_info{version}``.

Each scrape shows the last cycle only: the series of a GPU, engine or finding that is gone
vanish with it; a source not read for :data:`SOURCE_FORGET_S` is dropped (a process that ended).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from kvdoctor.breakdown import GpuBreakdown
from kvdoctor.facts import SourceStatus
from kvdoctor.findings import Finding
from kvdoctor.redact import redact_text

_FROM = "(from kvdoctor's own evaluation cycle)"
#: seconds after which a source no cycle reported is dropped from the series (an engine's
#: /metrics URL or log of a process that ended): 10 minutes, the default --history.
SOURCE_FORGET_S = 600.0


@dataclass
class SourceHealth:
    """One source's health over the sidecar's life: ``up`` (its last read was ok), ``last_success``
    (unix s), ``errors`` (reads that failed, a counter), ``duration_s`` (its last read, seconds,
    when the loop measures it)."""

    up: bool = False
    last_success: float | None = None
    errors: int = 0
    duration_s: float | None = None

    def copy(self) -> SourceHealth:
        """This health as it is now (the tracker updates its own in place)."""
        return SourceHealth(self.up, self.last_success, self.errors, self.duration_s)


class SourceHealthTracker:
    """Per (kind, origin) :class:`SourceHealth`, updated from each cycle's
    ``snapshot.sources`` (``SourceStatus``; ``duration_s`` read when the status carries one).
    Bounded: at most ``max_sources`` entries (the least recently seen dropped), and a source no
    cycle reported for ``forget_s`` seconds is dropped."""

    def __init__(self, max_sources: int = 64, forget_s: float = SOURCE_FORGET_S) -> None:
        self.max_sources = max_sources
        self.forget_s = forget_s
        self.sources: dict[tuple[str, str], SourceHealth] = {}
        self._seen: dict[tuple[str, str], float] = {}

    def update(self, statuses: list[SourceStatus], now: float) -> None:
        """Fold one cycle's statuses in (a "missing" source is down but no error)."""
        for s in statuses:
            key = (s.kind, redact_text(s.origin))
            h = self.sources.pop(key, None) or SourceHealth()
            self.sources[key] = h  # re-insert: most recently seen last
            self._seen[key] = now
            h.up = s.status == "ok"
            if h.up:
                h.last_success = now
            elif s.status == "error":
                h.errors += 1
            dur = getattr(s, "duration_s", None)
            h.duration_s = float(dur) if isinstance(dur, (int, float)) else None
        for key in [k for k, t in self._seen.items() if now - t > self.forget_s]:
            self.sources.pop(key, None)
        while len(self.sources) > self.max_sources:
            del self.sources[next(iter(self.sources))]
        self._seen = {k: self._seen[k] for k in self.sources}


@dataclass
class View:
    """What one cycle exposes (immutable once built; the collector reads the latest)."""

    findings: list[Finding] = field(default_factory=list)
    breakdown: list[GpuBreakdown] = field(default_factory=list)
    gpu_info: list[dict[str, Any]] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    preemptions_per_s: dict[str, float | None] = field(default_factory=dict)
    #: engine id (the report's) → vLLM engine index ("0"), where one /metrics page names one
    engine_index: dict[str, str] = field(default_factory=dict)
    sources: dict[tuple[str, str], SourceHealth] = field(default_factory=dict)
    last_evaluation: float | None = None
    evaluation_duration_s: float | None = None
    evaluations: int = 0


class SidecarCollector(Collector):
    """A prometheus-client collector over the latest :class:`View` (set by :meth:`publish`).

    A view may be published as a function that makes it: it is made on the first scrape that
    reads it (once; a cycle no scrape reads costs nothing more), and :meth:`text` keeps the
    view's exposition text for the scrapes after the first."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._view: View | Callable[[], View] = View()
        self._text: tuple[View | None, str] = (None, "")
        self._lock = threading.Lock()

    def publish(self, view: View | Callable[[], View]) -> None:
        """Make ``view`` (or what ``view()`` returns, made when first read) the one the next
        scrape shows."""
        with self._lock:
            self._view = view

    def view(self) -> View:
        """The current view (made now if it was published as a function)."""
        with self._lock:
            v = self._view
            if not isinstance(v, View):
                v = self._view = v()
            return v

    def collect(self) -> Iterator[Metric]:
        """The families of the current view (prometheus-client calls this per scrape)."""
        yield from _families(self.view(), self.version)

    def text(self) -> str:
        """The current view's families in the Prometheus text format: what
        ``generate_latest`` writes for this collector (:func:`exposition_text`), made once per
        view."""
        v = self.view()
        with self._lock:
            done, text = self._text
        if done is v:
            return text
        text = exposition_text(_families(v, self.version))
        with self._lock:
            self._text = (v, text)
        return text


# --------------------------------------------------------------------------- text format


class _Fixed(Collector):
    """Collects the given metrics (generate_latest over some of them)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def exposition_text(metrics: Iterable[Metric]) -> str:
    """The Prometheus text format (0.0.4) of ``metrics``: prometheus-client's
    ``generate_latest`` over a registry collecting them, decoded."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(metrics)))
    return generate_latest(registry).decode("utf-8")


def _families(v: View, version: str) -> Iterator[Metric]:
    finding = GaugeMetricFamily(
        "kvdoctor_finding",
        f"1 while a kvdoctor finding is active (held its rule's for: time) {_FROM}.",
        labels=["rule", "severity", "family", "model_name", "engine", "gpu"],
    )
    flags = GaugeMetricFamily(
        "kvdoctor_suggested_flag_info",
        f"A vLLM flag (or environment variable) an active finding suggests, with its value {_FROM}.",
        labels=["rule", "model_name", "engine", "flag", "value"],
    )

    def index(engine_id: str) -> str:
        return v.engine_index.get(engine_id, "")

    seen_f: set[tuple[str, ...]] = set()
    seen_s: set[tuple[str, ...]] = set()
    for f in v.findings:
        model, eidx = f.engine or "", index(f.engine or "")
        for gpu in [str(g) for g in f.gpus] or [""]:
            flabels: tuple[str, ...] = (f.rule, f.severity, f.family, model, eidx, gpu)
            if flabels not in seen_f:
                seen_f.add(flabels)
                finding.add_metric(list(flabels), 1.0)
        for flag, value in f.suggested_flags.items():
            labels = (f.rule, model, eidx, flag, value)
            if labels not in seen_s:
                seen_s.add(labels)
                flags.add_metric(list(labels), 1.0)
    yield finding
    yield flags

    mem = GaugeMetricFamily(
        "kvdoctor_gpu_memory_bytes",
        f"GPU memory by part: weights, kv_cache (the committed pool on vLLM 0.34's extensible KV cache, never "
        f"its reservation), cuda_graphs (0.34 extensible), activation_and_graphs, engine (not split), other_engines, "
        f"foreign, unlisted (used but held by no listed process), transient_headroom (free memory a 0.34 engine "
        f"keeps for transient activations by design), free {_FROM}.",
        labels=["gpu", "uuid", "part"],
    )
    total = GaugeMetricFamily(
        "kvdoctor_gpu_memory_total_bytes",
        f"GPU memory total (NVML memory.total) {_FROM}.",
        labels=["gpu", "uuid"],
    )
    util = GaugeMetricFamily(
        "kvdoctor_gpu_utilization_ratio",
        f"GPU utilisation 0..1 (NVML utilization.gpu) {_FROM}.",
        labels=["gpu", "uuid"],
    )
    torch_cap = GaugeMetricFamily(
        "kvdoctor_gpu_torch_cap_bytes",
        f"vLLM 0.34 extensible KV cache: the engine's torch allocator cap ('Torch may reserve up to L GiB', "
        f"Memory after warmup) {_FROM}.",
        labels=["gpu", "uuid"],
    )
    uuids = {int(g.get("index") or 0): str(g.get("uuid") or "") for g in v.gpu_info}
    for b in v.breakdown:
        gpu, uuid = str(b.index), uuids.get(b.index, "")
        for part in b.parts:
            mem.add_metric([gpu, uuid, part.part], float(part.bytes))
        if b.torch_cap_bytes is not None:
            torch_cap.add_metric([gpu, uuid], float(b.torch_cap_bytes))
        if b.total_bytes is not None:
            total.add_metric([gpu, uuid], float(b.total_bytes))
        if b.utilization is not None:
            util.add_metric([gpu, uuid], float(b.utilization))
    info = GaugeMetricFamily(
        "kvdoctor_gpu_info",
        f"The GPUs kvdoctor reads, by index; attribution: how engine memory was told apart "
        f"(pid: NVML processes matched the engine's pids; gpu: by the engine's GPUs, pids unresolvable; "
        f"gpu_uuid: the GPUs the engine's container was given, NVML's pids another PID namespace's) {_FROM}.",
        labels=["gpu", "uuid", "name", "model_name", "engine", "attribution"],
    )
    how = {b.index: (b.engine or "", b.attribution or "") for b in v.breakdown}
    for e in v.engines:  # the report's word when it matched the GPUs by UUID (derive/container.py)
        if e.get("attribution") == "gpu_uuid":
            for idx in e.get("gpus") or []:
                how[int(idx)] = (str(e.get("id") or ""), "gpu_uuid")
    for g in v.gpu_info:
        engine, attribution = how.get(int(g.get("index") or 0), ("", ""))
        info.add_metric(
            [
                str(g.get("index")),
                str(g.get("uuid") or ""),
                str(g.get("name") or ""),
                engine,
                index(engine),
                attribution,
            ],
            1.0,
        )
    yield from (mem, total, util, info, torch_cap)

    cap = GaugeMetricFamily(
        "kvdoctor_engine_kv_capacity_tokens",
        f"Tokens the engine's KV cache holds (num_gpu_blocks x block_size) {_FROM}.",
        labels=["model_name", "engine"],
    )
    usage = GaugeMetricFamily(
        "kvdoctor_engine_kv_usage_ratio",
        f"KV cache usage 0..1 (vllm:kv_cache_usage_perc) {_FROM}.",
        labels=["model_name", "engine"],
    )
    pre = GaugeMetricFamily(
        "kvdoctor_engine_preemptions_per_second",
        f"Preemptions per second over the rules' window (rate of vllm:num_preemptions_total) {_FROM}.",
        labels=["model_name", "engine"],
    )
    for e in v.engines:
        eid = str(e.get("id"))
        elabels = [eid, index(eid)]
        kv = e.get("kv") or {}
        if kv.get("capacity_tokens") is not None:
            cap.add_metric(elabels, float(kv["capacity_tokens"]))
        if kv.get("usage") is not None:
            usage.add_metric(elabels, float(kv["usage"]))
        rate = v.preemptions_per_s.get(eid)
        if rate is not None:
            pre.add_metric(elabels, float(rate))
    yield from (cap, usage, pre)

    up = GaugeMetricFamily(
        "kvdoctor_source_up", f"1 when the source's last read succeeded {_FROM}.", labels=["source", "origin"]
    )
    last = GaugeMetricFamily(
        "kvdoctor_source_last_success_timestamp_seconds",
        f"Unix time of the source's last successful read {_FROM}.",
        labels=["source", "origin"],
    )
    errors = CounterMetricFamily(
        "kvdoctor_source_errors",
        f"Reads of the source that failed {_FROM}.",
        labels=["source", "origin"],
    )
    dur = GaugeMetricFamily(
        "kvdoctor_source_read_duration_seconds",
        f"Seconds the source's last read took {_FROM}.",
        labels=["source", "origin"],
    )
    for (kind, origin), h in v.sources.items():
        up.add_metric([kind, origin], 1.0 if h.up else 0.0)
        if h.last_success is not None:
            last.add_metric([kind, origin], h.last_success)
        errors.add_metric([kind, origin], float(h.errors))
        if h.duration_s is not None:
            dur.add_metric([kind, origin], h.duration_s)
    yield from (up, last, errors, dur)

    if v.last_evaluation is not None:
        yield GaugeMetricFamily(
            "kvdoctor_last_evaluation_timestamp_seconds",
            f"Unix time of the last evaluation {_FROM}.",
            value=v.last_evaluation,
        )
    if v.evaluation_duration_s is not None:
        yield GaugeMetricFamily(
            "kvdoctor_evaluation_duration_seconds",
            f"Seconds the last read + evaluation took {_FROM}.",
            value=v.evaluation_duration_s,
        )
    yield CounterMetricFamily(
        "kvdoctor_evaluations", f"Evaluation cycles run {_FROM}.", value=float(v.evaluations)
    )
    build = GaugeMetricFamily("kvdoctor_build_info", "kvdoctor's version; always 1.", labels=["version"])
    build.add_metric([version], 1.0)
    yield build
