"""kvdoctor inside vLLM: a stat logger for engines run in Python, where there is no /metrics to scrape.

Two ways in (extra ``kvdoctor[vllm]``; vllm-facts.md §6):

- **AsyncLLM and ``vllm serve``**: :class:`KvdoctorStatLogger` implements vLLM's
  ``StatLoggerBase`` and is registered on the ``vllm.stat_logger_plugins`` entry point (vLLM ≥
  0.11.2 loads it by itself once kvdoctor is installed in the same environment; ``VLLM_PLUGINS``
  allow-lists apply). It can also be passed explicitly:
  ``AsyncLLM.from_engine_args(args, stat_loggers=[KvdoctorStatLogger])``.
- **Offline ``LLM(...)``**, which loads no plugins: :class:`LLMWatcher` polls ``llm.get_metrics()``
  (construct the LLM with ``disable_log_stats=False``, else vLLM records nothing).

Either way kvdoctor builds :class:`~kvdoctor.facts.Snapshot` s (one
:class:`~kvdoctor.facts.EngineMetrics` per engine, the engine's launch configuration from its
``VllmConfig``, the model geometry from its Hugging Face config) into a bounded
:class:`~kvdoctor.facts.Timeline`, evaluates the rules through
:class:`~kvdoctor.pipeline.Pipeline` every ``KVDOCTOR_VLLM_INTERVAL`` seconds (default 10) and
logs each finding that appears, changes severity or clears on the ``kvdoctor.vllm`` logger
(warning for warning/critical findings, info otherwise). Nothing here ever raises into vLLM: an
error is logged once and the logger goes quiet.

The base install never imports vLLM; this module does, and only when vLLM is importable: without
it the classes still work on duck-typed stats (the unit tests feed them), but vLLM cannot load
the plugin.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdoctor.facts import (
    EngineConfig,
    EngineMetrics,
    HistogramData,
    ModelArch,
    Snapshot,
    SourceStatus,
    Timeline,
)

if TYPE_CHECKING:
    from kvdoctor.findings import Finding
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.report import Report

try:  # vLLM's interface; absent in the base install
    from vllm.v1.metrics.loggers import StatLoggerBase as _StatLoggerBase
except ImportError:  # pragma: no cover - exercised where vLLM is not installed
    _StatLoggerBase = object

logger = logging.getLogger("kvdoctor.vllm")

#: seconds between rule evaluations (``KVDOCTOR_VLLM_INTERVAL`` overrides).
DEFAULT_EVAL_INTERVAL_S = 10.0
#: seconds between Snapshots taken from the per-step stats (rates need a few per window).
DEFAULT_SAMPLE_INTERVAL_S = 1.0
#: Snapshots kept (ten minutes at 1 s; evaluations read the last two windows of them).
DEFAULT_MAX_LEN = 600
ORIGIN = "vllm in-process"


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _1_2_5_buckets(max_value: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, … up to ``max_value`` (the bucket
    edges of ``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


@dataclass
class _Histogram:
    """A cumulative histogram kept from observations (Prometheus semantics: ``le`` buckets)."""

    edges: list[float]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.edges)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for i, edge in enumerate(self.edges):
            if value <= edge:
                self.counts[i] += 1

    def data(self) -> HistogramData:
        """A new HistogramData (the +Inf bucket last), never shared with a previous one."""
        buckets = [(e, float(c)) for e, c in zip(self.edges, self.counts, strict=True)]
        buckets.append((float("inf"), float(self.count)))
        return HistogramData(buckets=buckets, count=float(self.count), sum=self.total)


class StatsAccumulator:
    """Turns vLLM's per-step stats into the lifetime counters and gauges ``/metrics`` would show.

    ``record`` takes a ``SchedulerStats`` (``kv_cache_usage`` 0..1, ``gpu_cache_usage`` ≤ 0.9.1;
    ``num_running_reqs``; ``num_waiting_reqs``; ``prefix_cache_stats.queries/hits`` deltas) and an
    ``IterationStats`` (``num_preempted_reqs``, ``num_prompt_tokens``, ``num_generation_tokens``,
    ``finished_requests[].num_prompt_tokens / num_generation_tokens``), either None (vllm-facts.md
    §6.3). Missing attributes are skipped, never an error. :meth:`metrics` returns a fresh
    :class:`EngineMetrics` each call (facts are never mutated afterwards).
    """

    def __init__(self, engine: str, model_name: str | None, max_model_len: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cache_config: dict[str, str] = {}
        self.kv_cache_usage: float | None = None
        self.running: float | None = None
        self.waiting: float | None = None
        self.preemptions = 0.0
        self.prompt_tokens = 0.0
        self.generation_tokens = 0.0
        self.successes = 0.0
        self.prefix_queries = 0.0
        self.prefix_hits = 0.0
        self.steps = 0
        edges = _1_2_5_buckets(max_model_len or 131072)
        self._prompt = _Histogram(list(edges))
        self._generation = _Histogram(list(edges))

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Fold one step's stats in (either may be None)."""
        self.steps += 1
        if scheduler_stats is not None:
            usage = getattr(scheduler_stats, "kv_cache_usage", None)
            if usage is None:
                usage = getattr(scheduler_stats, "gpu_cache_usage", None)
            if usage is not None:
                self.kv_cache_usage = float(usage)
            if getattr(scheduler_stats, "num_running_reqs", None) is not None:
                self.running = float(scheduler_stats.num_running_reqs)
            if getattr(scheduler_stats, "num_waiting_reqs", None) is not None:
                self.waiting = float(scheduler_stats.num_waiting_reqs)
            pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
            if pcs is not None:
                self.prefix_queries += float(getattr(pcs, "queries", 0) or 0)
                self.prefix_hits += float(getattr(pcs, "hits", 0) or 0)
        if iteration_stats is not None:
            self.preemptions += float(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
            self.prompt_tokens += float(getattr(iteration_stats, "num_prompt_tokens", 0) or 0)
            self.generation_tokens += float(getattr(iteration_stats, "num_generation_tokens", 0) or 0)
            for fin in getattr(iteration_stats, "finished_requests", None) or []:
                self.successes += 1
                self._prompt.observe(float(getattr(fin, "num_prompt_tokens", 0) or 0))
                self._generation.observe(float(getattr(fin, "num_generation_tokens", 0) or 0))

    def metrics(self, now: float) -> EngineMetrics:
        """The counters and gauges now, as one scrape of ``/metrics`` would give them."""
        return EngineMetrics(
            timestamp=now,
            model_name=self.model_name,
            engine=self.engine,
            kv_cache_usage=self.kv_cache_usage,
            num_requests_running=self.running,
            num_requests_waiting=self.waiting,
            num_preemptions_total=self.preemptions,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            request_success_total=self.successes,
            prefix_cache_queries_total=self.prefix_queries,
            prefix_cache_hits_total=self.prefix_hits,
            histograms={
                "vllm:request_prompt_tokens": self._prompt.data(),
                "vllm:request_generation_tokens": self._generation.data(),
            },
            cache_config=dict(self.cache_config),
            engine_generation="v1",
        )


# --------------------------------------------------------------------------- VllmConfig → facts


def _get(obj: Any, *path: str) -> Any:
    for name in path:
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text.removeprefix("torch.")


def engine_config_from_vllm(vllm_config: Any, version: str | None = None) -> EngineConfig:
    """An :class:`EngineConfig` from a live ``VllmConfig`` (``model_config``, ``cache_config``,
    ``scheduler_config``, ``parallel_config``): the engine's effective values, not defaults.

    gmu, block_size and the KV dtype are marked explicit (they are the engine's own values, so
    vLLM's version defaults must not replace them); nothing else is, since in-process kvdoctor
    cannot tell what the user typed. Never raises: unknown attributes stay None."""
    cfg = EngineConfig()
    mc, cc = _get(vllm_config, "model_config"), _get(vllm_config, "cache_config")
    sc, pc = _get(vllm_config, "scheduler_config"), _get(vllm_config, "parallel_config")
    cfg.model = _get(mc, "model")
    served = _get(mc, "served_model_name")
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    cfg.served_model_name = served if isinstance(served, str) else None
    cfg.max_model_len = _get(mc, "max_model_len")
    cfg.dtype = _dtype_name(_get(mc, "dtype"))
    cfg.quantization = _get(mc, "quantization")
    cfg.enforce_eager = bool(_get(mc, "enforce_eager") or False)
    gmu = _get(cc, "gpu_memory_utilization")
    if isinstance(gmu, (int, float)):
        cfg.gpu_memory_utilization = float(gmu)
        cfg.explicit.add("gpu_memory_utilization")
    block = _get(cc, "block_size")
    if isinstance(block, int):
        cfg.block_size = block
        cfg.explicit.add("block_size")
    cache_dtype = _get(cc, "cache_dtype")
    if isinstance(cache_dtype, str):
        cfg.kv_cache_dtype = cache_dtype
        cfg.explicit.add("kv_cache_dtype")
    cfg.enable_prefix_caching = _get(cc, "enable_prefix_caching")
    cfg.num_gpu_blocks_override = _get(cc, "num_gpu_blocks_override")
    cfg.kv_cache_memory_bytes = _get(cc, "kv_cache_memory_bytes")
    # vLLM 0.34: the extensible KV cache as configured (None = its default; the engine may still
    # fall back at run time, which the log says). gpu_memory_utilization None there means unset.
    extensible = _get(cc, "enable_extensible_kv_cache")
    cfg.max_num_seqs = _get(sc, "max_num_seqs")
    cfg.max_num_batched_tokens = _get(sc, "max_num_batched_tokens")
    cfg.enable_chunked_prefill = _get(sc, "enable_chunked_prefill")
    for name, attr in (
        ("tensor_parallel_size", "tensor_parallel_size"),
        ("pipeline_parallel_size", "pipeline_parallel_size"),
        ("data_parallel_size", "data_parallel_size"),
    ):
        value = _get(pc, attr)
        if isinstance(value, int) and value > 0:
            setattr(cfg, name, value)
    cfg.vllm_version = version
    cfg.args = {
        k: v
        for k, v in {
            "model": cfg.model,
            "max_model_len": cfg.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "num_gpu_blocks_override": cfg.num_gpu_blocks_override,
            "enable_extensible_kv_cache": extensible if isinstance(extensible, bool) else None,
        }.items()
        if v is not None
    }
    return cfg


def cache_config_labels(vllm_config: Any) -> dict[str, str]:
    """The ``vllm:cache_config_info`` labels: ``cache_config.metrics_info()`` when vLLM has it
    (the exact labels its PrometheusStatLogger exports), else the same names read directly.
    Values are strings ("None" kept), as on the /metrics page."""
    cc = _get(vllm_config, "cache_config")
    info = getattr(cc, "metrics_info", None)
    if callable(info):
        try:
            return {str(k): str(v) for k, v in info().items()}
        except Exception:
            pass
    names = (
        "block_size",
        "num_gpu_blocks",
        "gpu_memory_utilization",
        "cache_dtype",
        "enable_prefix_caching",
        "enable_extensible_kv_cache",  # vLLM ≥ 0.34
    )
    return {n: str(getattr(cc, n, None)) for n in names if hasattr(cc, n)}


def model_from_vllm(vllm_config: Any) -> ModelArch | None:
    """The model's geometry from ``model_config.hf_config`` (its ``config.json``), or None."""
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.model_config import parse_model_config

    hf = _get(vllm_config, "model_config", "hf_config")
    to_dict = getattr(hf, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return parse_model_config(to_dict(), origin="hf_config")
    except (SourceError, TypeError, ValueError):
        return None


def vllm_version() -> str | None:
    """``vllm.__version__`` when vLLM is importable (only then)."""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "")) or None


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Transition:
    """A finding that appeared (``before`` None), changed severity, or cleared (``after`` None)."""

    rule: str
    engine: str | None
    before: str | None
    after: str | None
    summary: str
    suggested_flags: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """ "fired", "cleared" or "changed"."""
        if self.before is None:
            return "fired"
        if self.after is None:
            return "cleared"
        return "changed"


class Doctor:
    """The timeline and the rules for one in-process engine.

    :meth:`add` appends a Snapshot of the given metrics (with ``config`` and ``model`` attached,
    so the Snapshot diagnoses on its own); :meth:`evaluate` runs the pipeline over the timeline,
    keeps the Report in :attr:`report` and logs what changed since the previous evaluation.
    Each evaluation reads the Snapshots of the last ``2 × pipeline.window_s`` seconds.
    Thread-safe (a lock around the timeline). ``pipeline`` None loads the shipped rules and the
    user config (``$KVDOCTOR_CONFIG``); :class:`~kvdoctor.pipeline.PipelineError` propagates.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: ModelArch | None = None,
        pipeline: Pipeline | None = None,
        max_len: int = DEFAULT_MAX_LEN,
        log: logging.Logger = logger,
    ) -> None:
        from kvdoctor.pipeline import Pipeline

        self.config = config
        self.model = model
        self.pipeline = pipeline if pipeline is not None else Pipeline.load()
        self.timeline = Timeline(max_len=max_len)
        self.report: Report | None = None
        self.transitions: list[Transition] = []
        self._active: dict[tuple[str, str | None], Finding] = {}
        self._lock = threading.Lock()
        self._log = log

    def add(self, metrics: Iterable[EngineMetrics], now: float) -> Snapshot:
        """Append one Snapshot at unix time ``now`` and return it."""
        ms = list(metrics)
        snap = Snapshot(
            timestamp=now,
            metrics=ms,
            model=self.model,
            configs=[self.config],
            sources=[SourceStatus("metrics", ORIGIN, "ok", f"{len(ms)} engine(s)")],
        )
        with self._lock:
            self.timeline.append(snap)
        return snap

    def evaluate(self, now: float | None = None) -> list[Transition]:
        """Evaluate the rules over the timeline; log and return the transitions."""
        with self._lock:
            snapshot_list = list(self.timeline.snapshots)
        if not snapshot_list:
            return []
        # The rules read the recent window; evaluating only its last two lengths keeps each
        # evaluation's cost flat however long the engine has run (bench/vllm_plugin.py).
        newest = snapshot_list[-1].timestamp
        if newest is not None:
            horizon = newest - 2 * self.pipeline.window_s
            snapshot_list = [s for s in snapshot_list if s.timestamp is None or s.timestamp >= horizon]
        report = self.pipeline.evaluate(
            Timeline(snapshots=snapshot_list, max_len=len(snapshot_list)), now=now
        )
        self.report = report
        current = {(f.rule, f.engine): f for f in report.findings}
        changes: list[Transition] = []
        for key, f in current.items():
            old = self._active.get(key)
            if old is None or old.severity != f.severity:
                changes.append(
                    Transition(
                        f.rule,
                        f.engine,
                        old.severity if old else None,
                        f.severity,
                        f.summary,
                        dict(f.suggested_flags),
                    )
                )
        for key, old in self._active.items():
            if key not in current:
                changes.append(Transition(old.rule, old.engine, old.severity, None, old.summary))
        self._active = current
        self.transitions.extend(changes)
        for t in changes:
            self._emit(t)
        return changes

    def _emit(self, t: Transition) -> None:
        level = logging.WARNING if t.after in ("warning", "critical") else logging.INFO
        flags = " ".join(f"{k} {v}" for k, v in t.suggested_flags.items())
        if t.kind == "cleared":
            self._log.info("kvdoctor: %s cleared (was %s) [engine %s]", t.rule, t.before, t.engine)
            return
        self._log.log(
            level,
            "kvdoctor: %s %s (%s) [engine %s]: %s%s",
            t.rule,
            t.kind,
            t.after if t.kind == "fired" else f"{t.before} -> {t.after}",
            t.engine,
            " ".join(t.summary.split()),
            f" | suggested: {flags}" if flags else "",
        )


class _Guard:
    """Runs callbacks for vLLM and swallows (logs once) whatever they raise: kvdoctor must never
    take an engine down."""

    def __init__(self, log: logging.Logger) -> None:
        self.broken = False
        self._log = log

    def run(self, fn: Callable[[], None]) -> None:
        if self.broken:
            return
        try:
            fn()
        except Exception as e:
            self.broken = True
            self._log.error("kvdoctor: disabled after an internal error: %s: %s", type(e).__name__, e)


def _log_through_vllm() -> None:
    """Inside vLLM, when the program set up no logging of its own, print kvdoctor's lines
    through vLLM's handler (same format, same stream as vLLM's own lines)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    host = logging.getLogger("vllm")
    if not host.handlers:
        return
    for handler in host.handlers:
        logger.addHandler(handler)
    logger.setLevel(host.getEffectiveLevel())
    logger.propagate = False


class KvdoctorStatLogger(_StatLoggerBase):  # type: ignore[misc,valid-type]
    """vLLM stat logger (``StatLoggerBase``, vLLM ≥ 0.11.2) that diagnoses the engine it runs in.

    vLLM calls ``KvdoctorStatLogger(vllm_config, engine_index)`` once per engine, :meth:`record`
    after each engine step with that step's ``SchedulerStats`` / ``IterationStats``, :meth:`log`
    every ``VLLM_LOG_STATS_INTERVAL`` seconds and :meth:`log_engine_initialized` once the KV
    cache is sized. A Snapshot is taken at most every ``KVDOCTOR_VLLM_SAMPLE_INTERVAL`` seconds
    (default 1) and the rules run at most every ``KVDOCTOR_VLLM_INTERVAL`` seconds (default 10);
    findings are logged on the ``kvdoctor.vllm`` logger as they change (:class:`Doctor`).
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        _log_through_vllm()
        self.vllm_config = vllm_config
        self.engine_index = engine_index
        self.eval_interval_s = _env_float("KVDOCTOR_VLLM_INTERVAL", DEFAULT_EVAL_INTERVAL_S)
        self.sample_interval_s = _env_float("KVDOCTOR_VLLM_SAMPLE_INTERVAL", DEFAULT_SAMPLE_INTERVAL_S)
        self._guard = _Guard(logger)
        self._clock: Callable[[], float] = time.time
        self._last_sample = float("-inf")
        self._last_eval = float("-inf")
        self.doctor: Doctor | None = None
        cfg = engine_config_from_vllm(vllm_config, vllm_version())
        self.stats = StatsAccumulator(
            str(engine_index), cfg.served_model_name or cfg.model, max_model_len=cfg.max_model_len
        )

        def setup() -> None:
            self.doctor = Doctor(cfg, model=model_from_vllm(vllm_config))

        self._guard.run(setup)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """One engine step's stats (vLLM's signature since 0.11.2)."""
        self._guard.run(lambda: self._record(scheduler_stats, iteration_stats))

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        self.stats.record(scheduler_stats, iteration_stats)
        self._tick(self._clock())

    def _tick(self, now: float) -> None:
        if self.doctor is None:
            return
        if now - self._last_sample >= self.sample_interval_s:
            self._last_sample = now
            self.doctor.add([self.stats.metrics(now)], now)
        if now - self._last_eval >= self.eval_interval_s:
            self._last_eval = now
            self.doctor.evaluate(now)

    def log(self) -> None:
        """Periodic call: sample (an idle engine records nothing) and evaluate when due."""
        self._guard.run(lambda: self._tick(self._clock()))

    def log_engine_initialized(self) -> None:
        """The KV cache is sized now: read its labels (``num_gpu_blocks`` among them)."""

        def init() -> None:
            self.stats.cache_config = cache_config_labels(self.vllm_config)
            cc = self.stats.cache_config
            logger.info(
                "kvdoctor: watching engine %s (%s): num_gpu_blocks %s, block_size %s, gmu %s; rules every %.0f s",
                self.engine_index,
                self.stats.model_name,
                cc.get("num_gpu_blocks"),
                cc.get("block_size"),
                cc.get("gpu_memory_utilization"),
                self.eval_interval_s,
            )

        self._guard.run(init)

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """Sleep mode changes nothing kvdoctor reads."""


# --------------------------------------------------------------------------- offline LLM(...)


def metrics_from_vllm_snapshot(items: Iterable[Any], now: float) -> list[EngineMetrics]:
    """``llm.get_metrics()`` (vLLM's ``Counter``/``Gauge``/``Histogram``/``Vector`` dataclasses,
    each with ``name`` and ``labels``) → :class:`EngineMetrics`, one per ``engine`` label.

    The items are written out as Prometheus text and read by kvdoctor's /metrics parser, so
    names, fallbacks and label handling are exactly those of a scrape."""
    from kvdoctor.sources.metrics import parse_metrics

    lines: list[str] = []
    for m in items:
        name = getattr(m, "name", None)
        if not isinstance(name, str):
            continue
        labels = getattr(m, "labels", None) or {}
        kind = type(m).__name__.lower()
        if kind == "histogram":
            lines.append(f"# TYPE {name} histogram")
            buckets = getattr(m, "buckets", {}) or {}
            for le, count in buckets.items():
                lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {float(count)}")
            if "+Inf" not in buckets:
                lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {float(m.count)}")
            lines.append(f"{name}_count{_labels(labels)} {float(m.count)}")
            lines.append(f"{name}_sum{_labels(labels)} {float(m.sum)}")
        elif kind in ("counter", "gauge"):
            base = name.removesuffix("_total") if kind == "counter" else name
            lines.append(f"# TYPE {base} {kind}")
            sample = name if kind == "gauge" or name.endswith("_total") else f"{name}_total"
            lines.append(f"{sample}{_labels(labels)} {float(m.value)}")
    return parse_metrics("\n".join(lines) + "\n", origin="llm.get_metrics()", timestamp=now)


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc, strict=True)) + "}"


class LLMWatcher:
    """kvdoctor for offline ``LLM(...)`` (which loads no stat-logger plugins).

    ``LLMWatcher(llm)`` reads ``llm.llm_engine.vllm_config`` once; :meth:`poll` reads
    ``llm.get_metrics()`` into a Snapshot, and evaluates the rules when ``interval_s`` has passed
    (or ``evaluate=True``); :meth:`start` polls every ``sample_interval_s`` on a daemon thread
    until :meth:`stop` (also a context manager). Build the LLM with ``disable_log_stats=False``:
    otherwise ``get_metrics()`` is empty and :meth:`poll` logs that once.
    """

    def __init__(
        self,
        llm: Any,
        *,
        interval_s: float | None = None,
        sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
        pipeline: Pipeline | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.llm = llm
        self.interval_s = (
            interval_s
            if interval_s is not None
            else _env_float("KVDOCTOR_VLLM_INTERVAL", DEFAULT_EVAL_INTERVAL_S)
        )
        self.sample_interval_s = sample_interval_s
        vcfg = _get(llm, "llm_engine", "vllm_config")
        self.doctor = Doctor(
            engine_config_from_vllm(vcfg, vllm_version()), model=model_from_vllm(vcfg), pipeline=pipeline
        )
        self._clock = clock
        self._last_eval = float("-inf")
        self._warned_empty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def report(self) -> Report | None:
        """The latest Report (None before the first evaluation)."""
        return self.doctor.report

    def poll(self, *, evaluate: bool = False) -> list[Transition]:
        """One read of ``llm.get_metrics()``; returns transitions when the rules ran."""
        now = self._clock()
        metrics = metrics_from_vllm_snapshot(self.llm.get_metrics(), now)
        if not metrics:
            if not self._warned_empty:
                self._warned_empty = True
                logger.warning(
                    "kvdoctor: llm.get_metrics() is empty: build the LLM with disable_log_stats=False"
                )
            return []
        self.doctor.add(metrics, now)
        if evaluate or now - self._last_eval >= self.interval_s:
            self._last_eval = now
            return self.doctor.evaluate(now)
        return []

    def _loop(self) -> None:
        guard = _Guard(logger)

        def poll_once() -> None:
            self.poll()

        while not self._stop.wait(self.sample_interval_s):
            guard.run(poll_once)

    def start(self) -> LLMWatcher:
        """Poll on a daemon thread until :meth:`stop`; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvdoctor-llm-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and evaluate once more over everything read."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.poll(evaluate=True)

    def __enter__(self) -> LLMWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
