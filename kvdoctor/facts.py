"""Typed facts: what the sources read, in one vocabulary every rule and face shares.

Units everywhere: bytes for memory (GiB = 2**30 only at display), fractions 0..1 for ratios
(nvidia-smi "GPU-Util 21%" -> 0.21, vLLM's log "GPU KV cache usage: 99.7%" -> 0.997), seconds
for time (unix seconds for instants). A value a source could not read is ``None``, never 0.

Sources fill these dataclasses and know nothing of rules; rules read them (through
``kvdoctor.derive``) and know nothing of where they came from. Live and offline sources of the
same kind produce the same facts (NVML and ``nvidia-smi.txt`` both produce :class:`Gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvdoctor.dcmethods import shared_methods
from kvdoctor.redact import redact_url_credentials

SourceKind = Literal[
    "nvml",
    "nvidia-smi",
    "metrics",
    "log",
    "cmdline",
    "config",
    "env",
    "processes",
    "recording",
    "bundle",
]
SourceStatusValue = Literal["ok", "missing", "error"]


class SourceError(Exception):
    """An input could not be read or parsed.

    ``str(err)`` is one line a user can act on: what, where (file and line when known) and why.
    Sources raise it; the collector turns it into a :class:`SourceStatus` with status "error" and
    keeps every other source working.
    """

    def __init__(self, message: str, *, origin: str | None = None, line: int | None = None) -> None:
        if origin and "@" in origin:  # a URL or "user:pw@host" a user typed: no password in errors
            origin = redact_url_credentials(origin)
        if "@" in message:
            message = redact_url_credentials(message)
        self.origin = origin
        self.line = line
        where = origin or ""
        if line is not None:
            where = f"{where}:{line}" if where else f"line {line}"
        super().__init__(f"{where}: {message}" if where else message)


class SourceUnavailable(SourceError):
    """A live source that cannot exist on this host (no NVIDIA driver library, no pynvml): the
    sampler reports it once as "missing" and does not try it again."""


@shared_methods
@dataclass(repr=False, eq=False)
class SourceStatus:
    """What one input gave: ``kind`` (spec/report.md ``sources[].kind``), ``origin`` (file path,
    URL or "NVML"), ``status`` ok|missing|error and a one-line ``detail``; ``cut`` says what of
    it the time budget for offline inputs (``--time-budget``) left unread."""

    kind: str
    origin: str
    status: SourceStatusValue
    detail: str = ""
    #: seconds the read took (live sources), None when not timed.
    duration_s: float | None = None
    #: unix seconds of the source's last successful read (live sources), None when unknown.
    last_success: float | None = None
    #: what of this source was not read because the time budget for reading offline inputs
    #: ran out, in one line: with "ok", a log's line ranges counted but not parsed
    #: (``VllmLog.cut``); with "error", that the source was not read at all. "" when nothing
    #: was cut.
    cut: str = ""

    def __post_init__(self) -> None:
        # the origin is what the user typed (--metrics http://user:pw@…): every face, the
        # manifest and recordings show it, so the password goes here, where it enters
        if "@" in self.origin:
            self.origin = redact_url_credentials(self.origin)
        if "@" in self.detail:
            self.detail = redact_url_credentials(self.detail)


# --------------------------------------------------------------------------- GPUs


@shared_methods
@dataclass(repr=False, eq=False)
class GpuProcess:
    """A process holding memory on one GPU.

    Source: NVML ``nvmlDeviceGetComputeRunningProcesses`` (+ ``GetGraphicsRunningProcesses``),
    nvidia-smi's ``Processes:`` table, ``--query-compute-apps`` CSV, or ``-q -x`` ``<process_info>``.
    """

    pid: int
    name: str = ""
    #: bytes; nvidia-smi "GPU Memory Usage" column (MiB -> bytes), NVML ``usedGpuMemory``.
    used_bytes: int | None = None
    #: "C" compute, "G" graphics, "C+G"; None when unknown.
    type: str | None = None
    gpu_uuid: str | None = None
    #: PCI bus id of its GPU ("00000000:07:00.0"), from ``--query-compute-apps=gpu_bus_id,…``.
    gpu_bus_id: str | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class Gpu:
    """One GPU at one instant.

    Sources: NVML (``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetUtilizationRates``, …) or
    nvidia-smi (table, ``--query-gpu`` CSV, ``-q -x`` XML).
    """

    index: int
    uuid: str | None = None
    name: str | None = None
    #: PCI bus id, e.g. "00000000:07:00.0" (nvidia-smi "Bus-Id"; NVML ``nvmlDeviceGetPciInfo``).
    bus_id: str | None = None
    #: bytes; nvidia-smi "Memory-Usage" right side / ``memory.total``; NVML ``memory.total``.
    memory_total_bytes: int | None = None
    #: bytes; nvidia-smi "Memory-Usage" left side / ``memory.used``; NVML ``memory.used``.
    memory_used_bytes: int | None = None
    #: fraction 0..1; nvidia-smi "GPU-Util" / ``utilization.gpu``; NVML ``utilization.gpu``/100.
    utilization_gpu: float | None = None
    #: fraction 0..1 of time the memory controller was busy (``utilization.memory``).
    utilization_memory: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    #: True/False when known; nvidia-smi "MIG M." column, NVML ``nvmlDeviceGetMigMode``.
    mig_enabled: bool | None = None
    #: Active clock event (throttle) reasons by name, e.g. ["sw_thermal_slowdown"];
    #: NVML ``nvmlDeviceGetCurrentClocksEventReasons``, XML ``<clocks_event_reasons>``.
    clock_event_reasons: list[str] = field(default_factory=list)
    #: Uncorrectable ECC errors (volatile), nvidia-smi "Volatile Uncorr. ECC".
    ecc_uncorrectable: int | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    #: Node name for multi-node bundles (``nodes/<name>/``), else None.
    node: str | None = None
    #: True when the driver refused to read device memory (nvidia-smi "[Insufficient
    #: Permissions]", NVML ``NVMLError_NoPermission``): not the same as N/A (vllm-facts §4.2).
    no_permission: bool = False
    #: unix seconds the reading was taken, when the source says (CSV ``timestamp``).
    timestamp: float | None = None

    @property
    def memory_free_bytes(self) -> int | None:
        """total − used in bytes, None if either is unknown."""
        if self.memory_total_bytes is None or self.memory_used_bytes is None:
            return None
        return max(0, self.memory_total_bytes - self.memory_used_bytes)


# --------------------------------------------------------------------------- model


@shared_methods
@dataclass(repr=False, eq=False)
class ModelArch:
    """The model's attention geometry and size, from its Hugging Face ``config.json``.

    Nested configs (``text_config`` of multimodal models) are flattened by the parser.
    """

    model_type: str | None = None
    architectures: list[str] = field(default_factory=list)
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    #: ``num_key_value_heads`` (GQA); equals num_attention_heads for MHA configs without it.
    num_key_value_heads: int = 0
    #: explicit ``head_dim`` or hidden_size // num_attention_heads.
    head_dim: int = 0
    hidden_size: int = 0
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    #: "bfloat16", "float16", "float32" (``torch_dtype`` / ``dtype``); None when absent.
    dtype: str | None = None
    tie_word_embeddings: bool = False
    # MLA (DeepSeek-V2/V3, Kimi-K2): kv_lora_rank + qk_rope_head_dim per token per layer.
    use_mla: bool = False
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Sliding window: ``sliding_window`` tokens; ``layer_types`` per layer
    # ("full_attention", "sliding_attention", "chunked_attention", "mamba", "linear_attention", …).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attention_chunk_size: int | None = None
    # Mixture of experts (for the weights estimate).
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    #: ``quantization_config.quant_method`` ("awq", "gptq", "fp8", …) and bits when given.
    quant_method: str | None = None
    quant_bits: int | None = None
    #: Mamba/SSM state geometry for hybrid models (raw config keys kept as given).
    mamba: dict[str, Any] = field(default_factory=dict)
    #: the whole raw config, for anything not lifted into a field.
    raw: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- engine


@shared_methods
@dataclass(repr=False, eq=False)
class EngineConfig:
    """An engine's launch configuration, vLLM's own names (``--max-model-len`` → max_model_len).

    Sources, later overriding earlier: vLLM defaults for the version → the launch command
    (``cmdline.txt``, ``/proc/PID/cmdline``, ``--config FILE.yaml``) → the log's
    ``non-default args``/``args: Namespace(...)``/``Initializing … with config:`` lines →
    ``vllm:cache_config_info`` labels. ``explicit`` names the fields the user set.
    """

    model: str | None = None
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    #: fraction of total GPU memory; default 0.92 from vLLM 0.20, 0.9 before.
    gpu_memory_utilization: float = 0.92
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    #: "auto", "bfloat16", "float16", … (``--dtype``)
    dtype: str | None = None
    quantization: str | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    cpu_offload_gb: float | None = None
    swap_space_gib: float | None = None
    max_num_batched_tokens_default: int | None = None
    host: str | None = None
    port: int | None = None
    #: "generate", "embed", "pooling", … (``--task``/``--runner``)
    task: str | None = None
    vllm_version: str | None = None
    #: field names the user set explicitly (command line, config file or non-default args).
    explicit: set[str] = field(default_factory=set)
    #: every parsed flag, canonical dest name → value (redacted), including ones without a field.
    args: dict[str, Any] = field(default_factory=dict)
    #: the launch command as a redacted shell string, for evidence.
    command: str | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class HistogramData:
    """A Prometheus histogram at one scrape: cumulative ``buckets`` [(le, count)] sorted by le
    (the +Inf bucket last, le = float("inf")), ``count`` and ``sum`` (in the metric's unit)."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float = 0.0
    sum: float = 0.0


@shared_methods
@dataclass(repr=False, eq=False)
class EngineMetrics:
    """One scrape of vLLM's ``/metrics`` for one engine (one ``engine`` label value, or the
    whole page for V0 engines that have no such label). See vllm-facts.md §1.

    Gauges are instantaneous; ``*_total`` fields are lifetime counters (rates come from
    :class:`Timeline`, never from these totals).
    """

    #: unix seconds of the scrape (file name ``metrics/<unix-seconds>.txt`` or clock).
    timestamp: float | None = None
    model_name: str | None = None
    engine: str | None = None
    #: fraction 0..1: ``vllm:kv_cache_usage_perc``, falling back to ``vllm:gpu_cache_usage_perc``.
    kv_cache_usage: float | None = None
    #: ``vllm:num_requests_running``
    num_requests_running: float | None = None
    #: ``vllm:num_requests_waiting``
    num_requests_waiting: float | None = None
    #: ``vllm:num_requests_swapped`` (V0 only)
    num_requests_swapped: float | None = None
    #: ``vllm:num_preemptions_total`` (counter)
    num_preemptions_total: float | None = None
    #: ``vllm:prompt_tokens_total`` (counter)
    prompt_tokens_total: float | None = None
    #: ``vllm:generation_tokens_total`` (counter)
    generation_tokens_total: float | None = None
    #: Σ ``vllm:request_success_total`` over finished_reason (counter)
    request_success_total: float | None = None
    #: ``vllm:prefix_cache_queries_total`` (falls back to ``vllm:gpu_prefix_cache_queries_total``)
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    #: histograms by vLLM name without suffix, e.g. "vllm:request_prompt_tokens",
    #: "vllm:time_to_first_token_seconds", "vllm:iteration_tokens_total".
    histograms: dict[str, HistogramData] = field(default_factory=dict)
    #: ``vllm:cache_config_info`` labels as strings ("None" kept as given).
    cache_config: dict[str, str] = field(default_factory=dict)
    #: False when the page has ``http_*`` metrics but no ``vllm:*`` (``--disable-log-stats``).
    stats_enabled: bool = True
    #: "v1" or "v0" (V0 has num_requests_swapped / cpu_cache_usage_perc), None if unknown.
    engine_generation: str | None = None
    #: ``vllm:engine_sleep_state`` by its ``sleep_state`` label ("awake", "weights_offloaded",
    #: "discard_all") → 0/1; empty when the gauge is absent (before 0.12, vllm-facts §1.2).
    sleep_state: dict[str, float] = field(default_factory=dict)
    #: ``vllm:spec_decode_num_drafts_total`` (counter; present only with speculative decoding)
    spec_decode_num_drafts_total: float | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class LogEvent:
    """One meaningful line (or multi-line message) of a vLLM log.

    ``kind`` is one of the names documented in ``kvdoctor.sources.vllm_log`` (e.g.
    "model_loading", "available_kv_memory", "kv_cache_size", "max_seq_len_exceeds_kv",
    "free_memory_below_util", "cuda_oom", "sampler_warmup_oom", "stats", …); ``values`` holds its
    numbers in base units (bytes, fractions, seconds, tokens). ``line`` is 1-based in the file.
    """

    kind: str
    line: int
    values: dict[str, Any] = field(default_factory=dict)
    #: the message text (prefix, ANSI and timestamps stripped; secrets redacted).
    text: str = ""
    #: "APIServer", "EngineCore_DP0", "Worker_TP1", "VllmWorkerProcess", … when the line says.
    process: str | None = None
    pid: int | None = None
    level: str | None = None
    #: "MM-DD HH:MM:SS" as vLLM prints it, when present.
    time: str | None = None
    #: the node the line came from when a prefix names it (Ray ``ip=``, journald hostname).
    host: str | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class LogEngine:
    """One engine of a log that holds several (two servers started together, an application
    building several ``LLM(...)`` engines): what its own lines say."""

    index: int
    #: line of its engine-initialisation line ("Initializing a V1 LLM engine … with config").
    init_line: int
    pids: list[int] = field(default_factory=list)
    #: the args of its own engine-config line (vLLM dest names → values), overlaid with its API
    #: server's "non-default args" (those keys listed under "_explicit": the user set them).
    args: dict[str, Any] = field(default_factory=dict)
    #: "startup", "weight_loading", "profiling", "graph_capture", "ready", "serving" (last seen).
    phase: str = "startup"
    #: True when its startup failed (an error event before it got ready), None when unknown.
    failed: bool | None = None
    #: seconds since the start of the log's year of its first line ("MM-DD HH:MM:SS"), for
    #: gaps between engines only.
    start_s: float | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class VllmLog:
    """A parsed vLLM log: every event in file order plus what the startup lines say."""

    origin: str = ""
    events: list[LogEvent] = field(default_factory=list)
    #: "0.10.2" from "vLLM API server version …" / "Initializing a V1 LLM engine (v…)".
    vllm_version: str | None = None
    #: "v1" or "v0" when the log tells.
    engine_generation: str | None = None
    #: args from ``non-default args: {…}`` / ``args: Namespace(…)`` / engine config line,
    #: vLLM dest names → Python values.
    args: dict[str, Any] = field(default_factory=dict)
    line_count: int = 0
    #: the engines one log holds, told apart by process prefix / pid and the order of their
    #: engine-initialisation lines (``kvdoctor.sources.log_engines``); [] when it holds one or
    #: none that the log tells apart.
    engines: list[LogEngine] = field(default_factory=list)
    #: what of the file was not parsed and why (a time budget ran out: line ranges counted, not
    #: read), in one line; "" when every line was parsed.
    cut: str = ""

    def of(self, kind: str) -> list[LogEvent]:
        """All events of one kind, in file order."""
        return [e for e in self.events if e.kind == kind]

    def last(self, kind: str) -> LogEvent | None:
        """The last event of one kind, or None."""
        for e in reversed(self.events):
            if e.kind == kind:
                return e
        return None


@shared_methods
@dataclass(repr=False, eq=False)
class HostProcess:
    """A host process (psutil, or ``ps.txt`` in a bundle)."""

    pid: int
    ppid: int | None = None
    name: str = ""
    #: command line, redacted (``--api-key`` values and tokens replaced by "***").
    cmdline: list[str] = field(default_factory=list)
    #: percent of one core (psutil ``cpu_percent``; 100 = one core saturated).
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    #: TCP ports it listens on (psutil ``net_connections``).
    listen_ports: list[int] = field(default_factory=list)
    #: "api_server", "engine_core", "worker", "coordinator", "weight_daemon" (`vllm preload`), or
    #: None for non-vLLM processes (``kvdoctor.sources.processes``).
    vllm_role: str | None = None
    create_time: float | None = None
    #: The vLLM launch its command line states, parsed when the process was read (psutil,
    #: ``ps.txt``; ``kvdoctor.sources.cmdline``): True when the command line launches vLLM
    #: (``vllm serve``, ``python -m vllm.entrypoints…``, a container running it).
    launches_vllm: bool = False
    #: served model name, else ``--model`` / the positional model of that launch.
    launch_model: str | None = None
    #: fraction; ``--gpu-memory-utilization`` as given on that command line (None: not given,
    #: vLLM's default for the version applies).
    launch_gmu: float | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class Engine:
    """One vLLM serving engine (an API server and its engine core / workers).

    ``id`` is the served model name, or "engine" + index when unknown.
    """

    id: str
    config: EngineConfig = field(default_factory=EngineConfig)
    pid: int | None = None
    #: GPU indices it runs on (CUDA_VISIBLE_DEVICES, NVML processes, or the log), when known.
    gpus: list[int] = field(default_factory=list)
    #: its own pids when they are told apart from other engines' (one log holding several
    #: engines: ``LogEngine.pids``); [] when unknown.
    pids: list[int] = field(default_factory=list)
    metrics_url: str | None = None
    #: True/False when the API server's liveness is known (live mode, ps.txt), else None.
    api_server_alive: bool | None = None


@shared_methods
@dataclass(repr=False, eq=False)
class Snapshot:
    """Everything read at one instant (or from one bundle)."""

    timestamp: float | None = None
    gpus: list[Gpu] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    #: metrics per engine label ("0", "1", …; "" for pages without one).
    metrics: list[EngineMetrics] = field(default_factory=list)
    processes: list[HostProcess] = field(default_factory=list)
    model: ModelArch | None = None
    log: VllmLog | None = None
    env: dict[str, str] = field(default_factory=dict)
    sources: list[SourceStatus] = field(default_factory=list)
    #: True when the host process table is known (live, or ps.txt): a pid absent from it is dead.
    process_table_known: bool = False
    #: NVIDIA XID errors from the kernel log (a bundle's ``dmesg.txt``, ``--dmesg FILE``), file
    #: order; each {"xid": int, "bus_id": "00000000:07:00.0" | None, "pid": int | None,
    #: "name": str | None, "message": str, "line": int, "hardware": bool, "application": bool} (see
    #: ``kvdoctor.sources.dmesg``).
    xid_events: list[dict[str, Any]] = field(default_factory=list)
    #: GPU readings over time (nvidia-smi ``-l`` loops: a ``--query-gpu`` CSV with a timestamp
    #: column, or repeated tables), oldest moment first, each moment one list of :class:`Gpu`
    #: with ``timestamp`` set; empty when only one moment was read. ``gpus`` is the latest.
    gpu_series: list[list[Gpu]] = field(default_factory=list)
    #: engine launch configurations known at this instant (launch command, ``cmdline.txt``,
    #: ``/proc/PID/cmdline``), redacted. The Snapshot carries them so that a recording or a
    #: bundle replays a diagnosis on its own; derive reads the latest snapshot's.
    configs: list[EngineConfig] = field(default_factory=list)


@shared_methods
@dataclass(repr=False, eq=False)
class Timeline:
    """A bounded series of snapshots, oldest first. Windowed helpers live in
    ``kvdoctor.timeline`` (rates from counter deltas, histogram quantiles from bucket deltas)."""

    snapshots: list[Snapshot] = field(default_factory=list)
    max_len: int = 3600

    def append(self, snap: Snapshot) -> None:
        """Add a snapshot, dropping the oldest beyond ``max_len``."""
        self.snapshots.append(snap)
        if len(self.snapshots) > self.max_len:
            del self.snapshots[: len(self.snapshots) - self.max_len]

    @property
    def latest(self) -> Snapshot | None:
        """The newest snapshot, or None when empty."""
        return self.snapshots[-1] if self.snapshots else None

    def gpu_moments(self) -> list[list[Gpu]]:
        """GPU readings over time in one shape, oldest first: each moment a list of
        :class:`Gpu` with ``timestamp`` set (unix seconds). An ``nvidia-smi -l`` loop read
        offline is the latest Snapshot's ``gpu_series``; live, each Snapshot's ``gpus`` is one
        moment (stamped with the Snapshot's time when the source did not)."""
        from dataclasses import replace

        latest = self.latest
        if latest is not None and latest.gpu_series:
            return [list(m) for m in latest.gpu_series]
        out: list[list[Gpu]] = []
        for s in self.snapshots:
            if not s.gpus:
                continue
            moment = [g if g.timestamp is not None else replace(g, timestamp=s.timestamp) for g in s.gpus]
            if all(g.timestamp is not None for g in moment):
                out.append(moment)
        return out
