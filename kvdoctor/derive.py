"""Facts → the variables rules read (one context per engine).

This is where the heavy lifting between facts and rules happens, in Python: which GPUs an engine
uses, which processes on them are foreign or orphaned, windowed rates and quantiles from the
metrics timeline (``kvdoctor.timeline``), the KV capacity (``kvdoctor.kvmath``), and the salient
log events. Rules (``rules/*.yaml``) only compare these and compute small formulas.

Every variable is declared in :data:`VARIABLES` with its unit and source; the rule loader refuses
a rule that names anything else. A value that could not be read is ``None``.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

from kvdoctor.facts import (
    Engine,
    EngineConfig,
    EngineMetrics,
    Gpu,
    GpuProcess,
    LogEvent,
    ModelArch,
    Snapshot,
    Timeline,
    VllmLog,
)
from kvdoctor.units import GiB

#: name → (unit, description and source). The catalogue rules are validated against.
VARIABLES: dict[str, str] = {
    # --- engine configuration (EngineConfig: launch command, log args, cache_config_info)
    "engine_id": "str; served model name or engine index",
    "model_name": "str; --model / served model name",
    "vllm_version": "str; 'vLLM API server version' / 'Initializing … engine (vX)' log line",
    "engine_generation": "'v0'|'v1'; from the log or /metrics names",
    "tp": "int; --tensor-parallel-size",
    "pp": "int; --pipeline-parallel-size",
    "tp_pp": "int; tp × pp (GPUs per engine replica)",
    "gmu": "fraction; --gpu-memory-utilization (vLLM default by version when not given)",
    "gmu_explicit": "bool; --gpu-memory-utilization was given",
    "max_model_len": "tokens; --max-model-len, 'Using max model len', or the model's max_position_embeddings",
    "max_num_seqs": "int; --max-num-seqs (None = vLLM's device default)",
    "max_num_seqs_effective": "int; --max-num-seqs or vLLM's device default (256 / 1024)",
    "max_num_batched_tokens": "tokens; --max-num-batched-tokens or 'Chunked prefill is enabled with max_num_batched_tokens=N'",
    "kv_cache_dtype": "str; --kv-cache-dtype",
    "block_size": "tokens per KV block; cache_config_info block_size, --block-size, else 16",
    "enforce_eager": "bool; --enforce-eager",
    "num_gpu_blocks_override": "int; --num-gpu-blocks-override",
    "is_pooling": "bool; --task embed / --runner pooling (KV usage reads 100 % on V0 pooling models)",
    # --- GPUs (NVML / nvidia-smi)
    "gpu_count": "int; GPUs visible (CUDA_VISIBLE_DEVICES, else all listed)",
    "engine_gpus": "list[int]; GPU indices the engine uses",
    "gpu_name": "str; first engine GPU's name",
    "gpu_total_bytes": "bytes; smallest total memory among the engine's GPUs (nvidia-smi Memory-Usage total)",
    "gpu_used_bytes": "bytes; largest used memory among the engine's GPUs",
    "gpu_used_fraction": "fraction; gpu_used_bytes / gpu_total_bytes",
    "gpu_free_bytes": "bytes; smallest total − used among the engine's GPUs",
    "gpu_util": "fraction; largest GPU-Util among the engine's GPUs",
    "gpu_util_known": "bool; utilization was read",
    "empty_gpu_count": "int; visible GPUs holding < 1 GiB and no process",
    "empty_gpus": "list[int]; their indices",
    "full_gpu_count": "int; GPUs with used ≥ 95 % of total",
    "full_gpus": "list[int]; their indices",
    "gpu_mig": "bool; MIG mode on any engine GPU",
    "throttle_reasons": "list[str]; NVML clock event reasons that slow the engine's GPUs (thermal, power, hardware)",
    "stacked_gpu": "int; a GPU on which two or more vLLM engines hold memory (None if none)",
    "stacked_pids": "list[int]; the engine processes stacked on it",
    "stacked_desc": "str; description of them",
    "rank_spread_bytes": "bytes; max − min used memory over the engine's GPUs (TP/PP ranks)",
    "rank_heavy_gpu": "int; the engine GPU using the most memory",
    "engine_gpu_total_min_bytes": "bytes; smallest card in the engine's group",
    "engine_gpu_total_max_bytes": "bytes; largest card in the engine's group",
    # --- processes on the GPUs
    "foreign_pids": "list[int]; processes on the engine's GPUs that are not this engine",
    "foreign_bytes": "bytes; memory they hold (sum)",
    "foreign_desc": "str; 'pid 48213 (/opt/conda/bin/python3.10) 15.42 GiB on GPU 0, …'",
    "orphan_pids": "list[int]; vLLM engine/worker processes holding GPU memory with no live server",
    "orphan_bytes": "bytes; memory they hold (sum)",
    "orphan_gpus": "list[int]; GPUs they sit on",
    "orphan_desc": "str; 'pid 48211 (VLLM::Worker_TP0) 12.53 GiB on GPU 0, …'",
    "orphan_reason": "str; why they are orphans",
    "engine_cpu_percent": "percent of one core; engine processes' largest CPU use (psutil / ps.txt)",
    # --- model and KV arithmetic (config.json + kvmath)
    "model_known": "bool; the model's architecture is known (config.json, else the built-in catalogue by --model name)",
    "model_source": "str; 'config.json' or 'catalogue'",
    "arch": "ModelArch object, for kvmath functions",
    "num_attention_heads": "int; config.json",
    "num_kv_heads": "int; config.json num_key_value_heads",
    "vocab_size": "int; config.json vocab_size (logits per token)",
    "weights_bytes": "bytes; whole-model weights: 'Model loading took X GiB' × tp×pp, else estimate from config.json",
    "weights_logged_bytes": "bytes; per-worker 'Model loading took X GiB' (V0 'Loading model weights took X GB')",
    "kv_bytes_per_token": "bytes per token per GPU rank at the configured kv_cache_dtype (kvmath)",
    "kv_bytes_per_token_fp8": "bytes per token per GPU rank with fp8 KV (kvmath)",
    "fp8_supported": "bool; the GPU supports fp8 KV (catalogue; None when unknown)",
    # --- log: startup memory
    "log_available_kv_bytes": "bytes; smallest 'Available KV cache memory: X GiB' over workers (may be negative)",
    "log_available_kv_line": "int; its line",
    "log_kv_tokens": "tokens; 'GPU KV cache size: N tokens' (V0: '# GPU blocks' × block_size)",
    "log_kv_line": "int; its line",
    "log_num_gpu_blocks": "int; V0 '# GPU blocks: N' / '# cuda blocks: N'",
    "v0_profile_kv_bytes": "bytes; V0 'the rest of the memory reserved for KV Cache is X GiB'",
    "v0_profile_total_bytes": "bytes; V0 total_gpu_memory",
    "v0_profile_weights_bytes": "bytes; V0 'model weights take X GiB'",
    "v0_profile_activation_bytes": "bytes; V0 'PyTorch activation peak memory takes X GiB'",
    "v0_profile_non_torch_bytes": "bytes; V0 'non_torch_memory takes X GiB'",
    "v0_profile_line": "int; its line",
    "no_kv_memory": "bool; 'No available memory for the cache blocks' logged",
    "no_kv_memory_line": "int; its line",
    "mml_error": "bool; V1 'To serve at least one request with the model's max seq len' or V0 'max seq len … larger than … KV cache'",
    "mml_error_line": "int; its line",
    "mml_error_max_model_len": "tokens; the max seq len in that message",
    "mml_error_needed_bytes": "bytes; KV needed for one request (V1 message)",
    "mml_error_available_bytes": "bytes; available KV memory (V1 message)",
    "mml_error_estimate": "tokens; 'the estimated maximum model length is N' (V1)",
    "mml_error_kv_tokens": "tokens; V0 'maximum number of tokens that can be stored in KV cache (N)'",
    "free_below_util": "bool; 'Free memory on device … is less than desired GPU memory utilization' logged",
    "fbu_line": "int; its line",
    "fbu_free_bytes": "bytes; free memory at startup from that line",
    "fbu_total_bytes": "bytes; total from that line",
    "fbu_gmu": "fraction; the requested gmu from that line",
    "invalid_kv_dtype": "bool; 'Invalid kv_cache_dtype' logged, or --kv-cache-dtype not valid for the version",
    "invalid_kv_dtype_value": "str; the rejected value",
    "invalid_kv_dtype_line": "int; log line (None when from the launch command)",
    "suggested_kv_dtype": "str; nearest valid --kv-cache-dtype for the version",
    "sampler_oom": "bool; 'CUDA out of memory occurred when warming up sampler with N dummy requests'",
    "sampler_oom_requests": "int; N",
    "sampler_oom_line": "int; its line",
    "graph_capture_bytes": "bytes; 'Graph capturing finished … took X GiB' (largest over workers)",
    # --- log: OOMs (PyTorch 'CUDA out of memory', every form)
    "oom_count": "int; distinct CUDA OOMs in the log",
    "oom_phases": "list[str]; their phases (weight_loading, profile_run, cuda_graph_capture, sampler_warmup, kv_cache_init, runtime, startup)",
    "oom_line": "int; line of the last OOM",
    "oom_phase": "str; phase of the last OOM",
    "oom_requested_bytes": "bytes; 'Tried to allocate X'",
    "oom_free_bytes": "bytes; 'of which X is free' (legacy: 'X free')",
    "oom_total_bytes": "bytes; 'total capacity of X'",
    "oom_reserved_unallocated_bytes": "bytes; 'X is reserved by PyTorch but unallocated' (legacy: reserved − allocated)",
    "oom_gpu": "int; 'GPU N'",
    "weight_loading_oom": "bool; an OOM while loading weights (or 'Failed to load model - not enough GPU memory')",
    "graph_capture_oom": "bool; an OOM during CUDA graph capture",
    "runtime_oom": "bool; an OOM after the engine was serving",
    "engine_failed": "bool; the engine failed to start or died ('EngineCore failed to start', 'Engine core initialization failed', EngineDeadError)",
    "startup_failed": "bool; any evidence the engine did not come up: engine_failed, a startup-phase OOM, a KV/memory check error, an invalid flag",
    # --- log: periodic stats lines (percent → fraction)
    "log_stats_count": "int; periodic stats lines",
    "log_kv_usage_max": "fraction; largest 'GPU KV cache usage' in the stats lines",
    "log_waiting_max": "int; largest Waiting/Pending",
    "log_running_last": "int; last Running",
    "log_running_first": "int; first Running",
    "log_gen_throughput_max": "tokens/s; largest 'Avg generation throughput'",
    "log_preemptions_sum": "int; Σ 'Preemptions: N' in stats lines (≥0.12) + V0 preemption warnings",
    # --- metrics (latest scrape) and windowed timeline
    "metrics_present": "bool; a /metrics page was read",
    "stats_enabled": "bool; vllm:* metrics present (False with --disable-log-stats)",
    "kv_usage": "fraction; vllm:kv_cache_usage_perc (or gpu_cache_usage_perc), latest",
    "kv_usage_max": "fraction; largest KV usage in the window (metrics, else stats lines)",
    "kv_usage_min": "fraction; smallest KV usage in the window",
    "running": "requests; vllm:num_requests_running, latest",
    "waiting": "requests; vllm:num_requests_waiting, latest",
    "waiting_max": "requests; largest waiting in the window (metrics or stats lines)",
    "running_trend": "requests; last − first running in the window",
    "waiting_trend": "requests; last − first waiting in the window",
    "window_seconds": "seconds; span of the metrics window (0 for one scrape)",
    "preemptions_per_min": "per minute; rate(vllm:num_preemptions_total) over the window",
    "preemptions_in_window": "count; increase of vllm:num_preemptions_total over the window",
    "prompt_tokens_per_s": "tokens/s; rate(vllm:prompt_tokens_total)",
    "generation_tokens_per_s": "tokens/s; rate(vllm:generation_tokens_total)",
    "requests_per_s": "requests/s; rate(vllm:request_success_total)",
    "traffic": "bool; requests running/waiting or tokens flowing in the window (metrics or log)",
    "prompt_p50": "tokens; median prompt length (vllm:request_prompt_tokens, window deltas, else lifetime)",
    "prompt_p99": "tokens; p99 prompt length",
    "prompt_max_bucket": "tokens; upper bound of the highest non-empty prompt-length bucket",
    "generation_p50": "tokens; median generated length (vllm:request_generation_tokens)",
    "prompt_hist_recent": "bool; the prompt quantiles come from window deltas (not lifetime)",
    "cache_num_gpu_blocks": "blocks; vllm:cache_config_info num_gpu_blocks (includes the null block)",
    "kv_capacity_tokens": "tokens per engine; cache_config_info kv_cache_size_tokens, else num_gpu_blocks × block_size, else the log's KV cache size",
    # --- host
    "engine_pids_known": "bool; the engine's own pids are known (live, ps.txt, or log prefixes)",
    "expandable_segments_on": "bool; PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True (env.txt / live env)",
    "max_num_seqs_explicit": "bool; --max-num-seqs was given",
    "max_num_batched_tokens_explicit": "bool; --max-num-batched-tokens was given",
    "typical_request_tokens": "tokens; p50 prompt + p50 generation (histograms), else KV in use / running requests, else max_model_len",
    "dp_engine": "str; the data-parallel engine label this context is about (None without DP)",
    # --- KV pressure (max-num-seqs-exceeds-kv)
    "kv_pressure": "bool; preemptions in the window (increase of vllm:num_preemptions_total; without a metrics timeline, 'Preemptions: N' stats lines / V0 preemption warnings of the log's current run), or requests waiting while KV usage ≥ 0.9 in two or more samples (scrapes in the window, or stats lines); never for pooling models",
    # --- V0 swapping (swap-preemption-stall)
    "swapped": "requests; vllm:num_requests_swapped, latest (V0 engines only)",
    "log_swapped_max": "requests; largest 'Swapped: N reqs' in V0 stats lines",
    "swap_preemptions": "count; V0 'Sequence group … is preempted by PreemptionMode.SWAP mode' warnings",
    "swap_stall": "bool; V0 stats line with Swapped > 0, Running > 0 and 'Avg generation throughput: 0.0' (or a SWAP preemption followed by such a zero-throughput line), or /metrics num_requests_swapped > 0 with running > 0 and no generated tokens in the window",
    "swap_stall_line": "int; log line of the first stalled stats line (None when from /metrics)",
    "swap_space_gib": "GiB; --swap-space (V0 default 4, removed in 0.18)",
    # --- run-time and profile OOMs by the code they hit (vllm_log cuda_oom ``hints``)
    "oom_hints": "list[str]; what the traceback of the last OOM mentions: logprobs, sampler, prefill, multimodal",
    "runtime_oom_hints": "list[str]; the same, over every run-time OOM",
    "runtime_oom_line": "int; log line of the last run-time OOM",
    "iteration_tokens_max_bucket": "tokens; upper bound of the highest non-empty bucket of vllm:iteration_tokens_total (tokens per engine step; window deltas, else lifetime)",
    "chunked_prefill_on": "bool; chunked prefill enabled (--enable-chunked-prefill, 'Chunked prefill is enabled' log line, vLLM ≥0.8 default); None when unknown",
    "mm_profile_oom": "bool; an OOM before serving whose traceback is in multimodal encoder / embedding code (the multimodal profile run)",
    "mm_profile_too_short": "bool; 'The sequence length used for profiling … is too short to hold the multi-modal embeddings in the worst case' warning",
    "mm_profile_line": "int; log line of that OOM or warning",
    "limit_mm_per_prompt": "str; --limit-mm-per-prompt as given (None when unset)",
    # --- hardware health (NVML / nvidia-smi ECC, kernel log XIDs)
    "xid_hw_count": "count; hardware XID errors (48, 63, 64, 74, 79, 92, 94, 95, 119, …) in dmesg.txt / --dmesg",
    "xid_app_count": "count; XIDs usually caused by the application (13, 31, 43, 45, …)",
    "xid_desc": "str; 'Xid 79 on GPU 1 (00000000:07:00.0, dmesg line 3): GPU has fallen off the bus, …'",
    "ecc_gpus": "list[int]; GPUs with uncorrectable ECC errors (nvidia-smi 'Volatile Uncorr. ECC' / NVML)",
    "ecc_desc": "str; 'GPU 0: 2 uncorrectable ECC errors, …'",
    "hw_error_gpus": "list[int]; GPUs with hardware XIDs or uncorrectable ECC errors",
    "hw_error_bus_ids": "list[str]; their PCI bus ids (XIDs whose bus id matches no listed GPU included)",
    # --- used memory over time (nvidia-smi -l loop / live samples)
    "mem_growth_gpu": "int; the engine GPU whose used memory rises fastest",
    "mem_growth_points": "int; readings of it over time",
    "mem_growth_span_s": "seconds; time the readings span",
    "mem_growth_rise_bytes": "bytes; last − first used memory",
    "mem_growth_bytes_per_hour": "bytes/hour; least-squares slope of used memory over all readings",
    "mem_growth_recent_bytes_per_hour": "bytes/hour; least-squares slope over the later half of the readings",
    "mem_growth_plateau": "bool; the later half is flat (slope under a quarter of the overall one): warm-up, not a leak",
    "mem_growth_hours_to_full": "hours; (total − last used) / slope, when growing",
    "mem_growth_used_bytes": "bytes; last used memory of that GPU",
    # --- several engines on one GPU (colocated-engines-overcommit)
    "colocated_gpu": "int; a GPU that two or more vLLM engines share (processes on it, or command lines not pinned apart)",
    "colocated_count": "int; engines on it",
    "colocated_gmus": "list[fraction]; each engine's --gpu-memory-utilization (its command line via ps.txt / cmdline.txt; else its used memory / total)",
    "colocated_gmu_sum": "fraction; their sum",
    "colocated_reserved_bytes": "bytes; Σ gmu × card total: what the engines reserve together",
    "colocated_total_bytes": "bytes; the card's total memory",
    "colocated_desc": "str; 'pid 5120 (Llama-3.1-8B) gmu 0.60, pid 5388 (Qwen3-4B) gmu 0.50'",
    "colocated_split": "list[fraction]; a gmu per engine, proportional to what each asked for, summing to ≤ 0.95",
    "colocated_split_desc": "str; 'Llama-3.1-8B 0.51, Qwen3-4B 0.43'",
    "colocated_gmu_fix": "fraction; this engine's share of that split (None when it is not one of them)",
    "colocated_start_gap_s": "seconds; smallest gap between the engines' start times (live process table only)",
}

#: inputs a rule can need (``needs:`` in rules/*.yaml) → what provides them.
INPUTS = {
    "gpus": "nvidia-smi / NVML",
    "metrics": "vLLM /metrics",
    "timeline": "two or more /metrics scrapes",
    "log": "vLLM log",
    "config": "launch command or the log's args",
    "model": "config.json",
    "processes": "host process table (live or ps.txt)",
}

_VLLM_PROC_RE = re.compile(r"VLLM::|vllm|VllmWorker|EngineCore", re.IGNORECASE)


#: events a server prints while it starts, before it does anything that a restart would repeat.
_CONFIG_KINDS = frozenset({"version", "args", "chunked_prefill", "max_model_len_used"})


_STARTS_CACHE: dict[int, tuple[weakref.ref[VllmLog], int, list[int]]] = {}


def _run_start_lines(log: VllmLog) -> list[int]:
    """Lines where a server run begins: its "vLLM API server version" line or its args dump
    (``non-default args`` / ``args: Namespace``), once the previous run had got past its
    configuration lines. A log cut mid-run has no start: all of it is one run.

    Cached per log object and event count: every engine context of every sample asks."""
    key = id(log)
    hit = _STARTS_CACHE.get(key)
    # The weak reference guards against a new log reusing a dead one's id.
    if hit is not None and hit[0]() is log and hit[1] == len(log.events):
        return hit[2]
    starts = _scan_run_starts(log)
    if len(_STARTS_CACHE) > 64:
        _STARTS_CACHE.clear()
    _STARTS_CACHE[key] = (weakref.ref(log), len(log.events), starts)
    return starts


def _scan_run_starts(log: VllmLog) -> list[int]:
    starts: list[int] = []
    progressed = True
    for e in log.events:
        candidate = (e.kind == "version" and "server version" in e.text.lower()) or (
            e.kind == "args" and e.values.get("source") in ("non_default", "namespace")
        )
        if candidate:
            if progressed:
                starts.append(e.line)
                progressed = False
        elif e.kind not in _CONFIG_KINDS:
            progressed = True
    return starts


def current_run(log: VllmLog) -> VllmLog:
    """The log's latest run only: an error of an earlier run that was restarted since is
    history, not the present state (its pids still matter for orphan detection)."""
    starts = _run_start_lines(log)
    if len(starts) <= 1:
        return log
    first = starts[-1]
    return VllmLog(
        origin=log.origin,
        events=[e for e in log.events if e.line >= first],
        vllm_version=log.vllm_version,
        engine_generation=log.engine_generation,
        args=log.args,
        line_count=log.line_count,
    )


def _pids_after(log: VllmLog, line: int) -> set[int]:
    return {e.pid for e in log.events if e.pid is not None and e.line >= line}


def _pids_before(log: VllmLog, line: int) -> set[int]:
    return {e.pid for e in log.events if e.pid is not None and e.line < line}


def _is_vllm_process(name: str) -> bool:
    return bool(_VLLM_PROC_RE.search(name or ""))


def _visible(snapshot: Snapshot) -> list[Gpu]:
    from kvdoctor.sources.env import visible_devices

    gpus = snapshot.gpus
    vis = visible_devices(snapshot.env) if snapshot.env else None
    if vis is not None:
        chosen = [g for g in gpus if g.index in vis]
        if chosen:
            return chosen
    return gpus


def _engine_gpus(snapshot: Snapshot, engine: Engine, engine_pids: set[int], tp_pp: int) -> list[Gpu]:
    """Which GPUs an engine uses: where its pids hold memory, else the first tp×pp visible GPUs."""
    visible = _visible(snapshot)
    if engine.gpus:
        got = [g for g in visible if g.index in engine.gpus]
        if got:
            return got
    if engine_pids:
        got = [g for g in visible if any(p.pid in engine_pids for p in g.processes)]
        if got:
            return got
    return visible[: max(1, tp_pp)]


def _engine_bytes_on(g: Gpu, engine_pids: set[int]) -> int:
    """Bytes the engine holds on one GPU: its processes' memory when the process table lists
    them (vLLM-named or known engine pids), else the GPU's used memory."""
    mine = [p for p in g.processes if p.pid in engine_pids or _is_vllm_process(p.name)]
    if mine and all(p.used_bytes is not None for p in mine):
        return sum(p.used_bytes or 0 for p in mine)
    return g.memory_used_bytes or 0


def _looks_like_the_engine(p: GpuProcess, g: Gpu, gmu: float | None) -> bool:
    """A process holding gmu × total (±2 % of the card) is the engine itself, whatever its
    name or pid namespace (a container's ``/usr/bin/python3``)."""
    if gmu is None or not g.memory_total_bytes or p.used_bytes is None:
        return False
    return abs(p.used_bytes - gmu * g.memory_total_bytes) <= 0.02 * g.memory_total_bytes


def _desc(items: list[tuple[GpuProcess, int]]) -> str:
    from kvdoctor.units import fmt_bytes

    parts = []
    for proc, idx in items:
        parts.append(f"pid {proc.pid} ({proc.name or '?'}) {fmt_bytes(proc.used_bytes)} on GPU {idx}")
    return ", ".join(parts)


def _series_for(snapshots: list[Snapshot], engine_label: str | None) -> list[EngineMetrics]:
    out: list[EngineMetrics] = []
    for snap in snapshots:
        pick: EngineMetrics | None = None
        for m in snap.metrics:
            if engine_label is None or m.engine == engine_label:
                pick = m
                break
        if pick is None and snap.metrics:
            pick = snap.metrics[0]
        if pick is not None:
            if pick.timestamp is None:
                pick.timestamp = snap.timestamp
            out.append(pick)
    return out


def build_engines(snapshot: Snapshot, configs: list[EngineConfig]) -> list[Engine]:
    """Engines from launch commands, the log's args and /metrics (cache_config_info).

    One engine per launch command; with no command but a log or metrics, one engine built from
    those. Fields the user set on the command line win; the log's args fill the rest; then
    ``vllm:cache_config_info`` labels; then vLLM's defaults for the detected version.
    """
    from kvdoctor.sources.cmdline import update_config_from_args
    from kvdoctor.vllm_flags import apply_defaults

    log = snapshot.log
    version = log.vllm_version if log else None
    cfgs = list(configs)
    if not cfgs and (log is not None and (log.args or log.events) or snapshot.metrics):
        cfgs = [EngineConfig()]
    engines: list[Engine] = []
    for i, cfg in enumerate(cfgs):
        if log is not None and log.args and i == 0:
            args = {k: v for k, v in log.args.items() if not k.startswith("_")}
            explicit_keys = set(log.args.get("_explicit", []) or [])
            fill = {k: v for k, v in args.items() if k not in cfg.explicit}
            tmp = EngineConfig()
            update_config_from_args(tmp, {k: v for k, v in fill.items() if k in explicit_keys}, explicit=True)
            update_config_from_args(
                tmp, {k: v for k, v in fill.items() if k not in explicit_keys}, explicit=False
            )
            for name in vars(tmp):
                if name in ("explicit", "args", "command"):
                    continue
                if name in cfg.explicit:
                    continue
                if name in tmp.explicit or (name in fill or _field_from_args(name, fill)):
                    val = getattr(tmp, name)
                    if val is not None:
                        setattr(cfg, name, val)
            cfg.explicit |= tmp.explicit
        if snapshot.metrics and i == 0:
            cc = snapshot.metrics[-1].cache_config
            _fill_from_cache_config(cfg, cc)
        if version and not cfg.vllm_version:
            cfg.vllm_version = version
        cfg = apply_defaults(cfg, cfg.vllm_version)
        engine_name = (
            cfg.served_model_name
            or cfg.model
            or (snapshot.metrics[0].model_name if snapshot.metrics else None)
        )
        engines.append(Engine(id=str(engine_name) if engine_name else f"engine{i}", config=cfg))
    return engines


def _field_from_args(name: str, args: dict[str, Any]) -> bool:
    aliases = {"max_model_len": ("max_seq_len",), "gpu_memory_utilization": ("gpu_memory_utilization",)}
    return any(a in args for a in aliases.get(name, ()))


def _fill_from_cache_config(cfg: EngineConfig, cc: dict[str, str]) -> None:
    def num(key: str) -> float | None:
        v = cc.get(key)
        try:
            return float(v) if v not in (None, "None", "") else None
        except ValueError:
            return None

    if "block_size" not in cfg.explicit and num("block_size") is not None:
        cfg.block_size = int(num("block_size") or 16)
    if "gpu_memory_utilization" not in cfg.explicit and num("gpu_memory_utilization") is not None:
        cfg.gpu_memory_utilization = float(num("gpu_memory_utilization") or 0.0)
        cfg.explicit.add("gpu_memory_utilization")  # the engine's real value, not a guess
    dtype = cc.get("cache_dtype")
    if dtype and "kv_cache_dtype" not in cfg.explicit:
        cfg.kv_cache_dtype = dtype


def build_contexts(
    timeline: Timeline, configs: list[EngineConfig], *, window_s: float = 60.0
) -> tuple[list[Engine], list[tuple[str | None, dict[str, Any], set[str]]], dict[str, dict[str, Any]]]:
    """Engines, one (engine id, variables, inputs present) per engine, and per-engine KV facts
    for the report (``num_gpu_blocks``, ``block_size``, ``capacity_tokens``, ``usage``).

    A snapshot with no engine at all (only nvidia-smi, say) still gets one context, so GPU and
    process rules run. Never raises for missing inputs: variables are None instead.
    """
    snapshot = timeline.latest or Snapshot()
    engines = build_engines(snapshot, configs)
    snapshot.engines = engines
    contexts: list[tuple[str | None, dict[str, Any], set[str]]] = []
    kv_report: dict[str, dict[str, Any]] = {}
    # Data parallelism: one PrometheusStatLogger serves every DP engine, told apart by the
    # ``engine`` label (vllm-facts §1.1): each label is an engine of its own for the rules.
    labels = sorted({m.engine for s in timeline.snapshots for m in s.metrics if m.engine is not None})
    targets: list[tuple[Engine | None, str | None]] = []
    for idx, eng in enumerate(engines or [None]):
        if idx == 0 and eng is not None and len(labels) > 1:
            for dp_label in labels:
                dp = Engine(id=f"{eng.id} [engine {dp_label}]", config=eng.config, pid=eng.pid)
                targets.append((dp, dp_label))
        else:
            targets.append((eng, labels[0] if (idx == 0 and labels) else None))
    if len(labels) > 1 and engines:
        engines = [t for t, _ in targets if t is not None] + engines[1:]
        snapshot.engines = engines
    for idx, (eng, label) in enumerate(targets):
        series = _series_for(timeline.snapshots, label) if (label is not None or idx == 0) else []
        variables, inputs = _variables(
            snapshot,
            eng,
            series,
            window_s,
            dp_label=label if len(labels) > 1 else None,
            history=timeline.snapshots,
            all_engines=engines,
        )
        contexts.append((eng.id if eng else None, variables, inputs))
        if eng is not None:
            kv_report[eng.id] = {
                "num_gpu_blocks": variables.get("cache_num_gpu_blocks")
                or variables.get("log_num_gpu_blocks"),
                "block_size": variables.get("block_size"),
                "capacity_tokens": variables.get("kv_capacity_tokens"),
                "usage": variables.get("kv_usage"),
            }
            eng.gpus = list(variables.get("engine_gpus") or [])
    return engines, contexts, kv_report


def _variables(
    snapshot: Snapshot,
    engine: Engine | None,
    series: list[EngineMetrics],
    window_s: float,
    *,
    dp_label: str | None = None,
    history: list[Snapshot] | None = None,
    all_engines: list[Engine] | None = None,
) -> tuple[dict[str, Any], set[str]]:
    v: dict[str, Any] = dict.fromkeys(VARIABLES)
    inputs: set[str] = set()
    log = current_run(snapshot.log) if snapshot.log is not None else None
    cfg = engine.config if engine else EngineConfig()
    arch = snapshot.model
    model_source = "config.json" if arch is not None else None
    if arch is None and cfg.model:
        arch = _catalogue_arch(cfg.model)
        model_source = "catalogue" if arch is not None else None

    if snapshot.gpus:
        inputs.add("gpus")
    if series:
        inputs.add("metrics")
    if len(series) >= 2:
        inputs.add("timeline")
    if log is not None and log.events:
        inputs.add("log")
    if engine is not None and (cfg.explicit or cfg.model or cfg.command):
        inputs.add("config")
    if arch is not None:
        inputs.add("model")
    if snapshot.process_table_known:
        inputs.add("processes")

    _config_vars(v, engine, cfg, log, arch)
    engine_pids = _engine_pids(snapshot, log)
    v["engine_pids_known"] = bool(engine_pids)
    _gpu_vars(v, snapshot, engine, engine_pids)
    _model_vars(v, cfg, arch, log)
    v["model_source"] = model_source
    if log is not None:
        _log_vars(v, log, cfg, dp_label)
    _metrics_vars(v, series, window_s)
    _combined_vars(v, cfg, log)
    v["dp_engine"] = dp_label
    conf = (snapshot.env.get("PYTORCH_CUDA_ALLOC_CONF") or "").replace(" ", "").lower()
    v["expandable_segments_on"] = "expandable_segments:true" in conf
    v["max_num_seqs_explicit"] = "max_num_seqs" in cfg.explicit
    v["max_num_batched_tokens_explicit"] = "max_num_batched_tokens" in cfg.explicit
    _typical_request(v)
    _pressure_vars(v, log, series)
    _swap_vars(v, cfg, log, series, window_s)
    _oom_code_vars(v, cfg, log, series, window_s)
    _hardware_vars(v, snapshot)
    _growth_vars(v, snapshot, history or [snapshot])
    _colocation_vars(v, snapshot, engine, all_engines or ([engine] if engine else []))
    return v, inputs


def _typical_request(v: dict[str, Any]) -> None:
    """Tokens a typical request holds in the KV cache, for "how many sequences fit"."""
    if v["prompt_p50"]:
        v["typical_request_tokens"] = int(v["prompt_p50"] + (v["generation_p50"] or 0))
        return
    running = v["running"] if v["running"] else v["log_running_last"]
    usage = v["kv_usage_max"]
    if running and usage and v["kv_capacity_tokens"]:
        # What the running batch actually holds per request (V0 logs without histograms).
        v["typical_request_tokens"] = max(1, int(usage * v["kv_capacity_tokens"] / running))
        return
    v["typical_request_tokens"] = v["max_model_len"]


def _config_vars(
    v: dict[str, Any], engine: Engine | None, cfg: EngineConfig, log: VllmLog | None, arch: ModelArch | None
) -> None:
    v["engine_id"] = engine.id if engine else None
    v["model_name"] = cfg.served_model_name or cfg.model
    v["vllm_version"] = cfg.vllm_version or (log.vllm_version if log else None)
    v["engine_generation"] = log.engine_generation if log else None
    v["tp"] = cfg.tensor_parallel_size or 1
    v["pp"] = cfg.pipeline_parallel_size or 1
    v["tp_pp"] = v["tp"] * v["pp"]
    v["gmu"] = cfg.gpu_memory_utilization
    v["gmu_explicit"] = "gpu_memory_utilization" in cfg.explicit
    mml = cfg.max_model_len
    if mml is None and log is not None:
        ev = log.last("max_model_len_used")
        if ev is not None:
            mml = ev.values.get("max_model_len")
    if (mml is None or mml <= 0) and arch is not None:
        mml = arch.max_position_embeddings
    v["max_model_len"] = mml
    v["max_num_seqs"] = cfg.max_num_seqs
    mnbt = cfg.max_num_batched_tokens
    if mnbt is None and log is not None:
        ev = log.last("chunked_prefill")
        if ev is not None:
            mnbt = ev.values.get("max_num_batched_tokens")
    v["max_num_batched_tokens"] = mnbt
    v["kv_cache_dtype"] = cfg.kv_cache_dtype or "auto"
    v["block_size"] = cfg.block_size or 16
    v["enforce_eager"] = bool(cfg.enforce_eager)
    v["num_gpu_blocks_override"] = cfg.num_gpu_blocks_override
    task = (cfg.task or "").lower()
    v["is_pooling"] = task in ("embed", "embedding", "pooling", "score", "classify", "reward")


def _engine_pids(snapshot: Snapshot, log: VllmLog | None) -> set[int]:
    """Pids that belong to the current engine: live vLLM processes, or the log's latest run."""
    pids: set[int] = set()
    for p in snapshot.processes:
        if p.vllm_role is not None:
            pids.add(p.pid)
    if log is not None:
        starts = _run_start_lines(log)
        pids |= _pids_after(log, starts[-1] if starts else 0)
    return pids


def _gpu_vars(v: dict[str, Any], snapshot: Snapshot, engine: Engine | None, engine_pids: set[int]) -> None:
    visible = _visible(snapshot)
    v["gpu_count"] = len(visible) if visible else None
    if not visible:
        return
    egpus = _engine_gpus(snapshot, engine, engine_pids, v["tp_pp"]) if engine is not None else visible
    v["engine_gpus"] = [g.index for g in egpus]
    v["gpu_name"] = egpus[0].name if egpus else None
    totals = [g.memory_total_bytes for g in egpus if g.memory_total_bytes]
    used = [g.memory_used_bytes for g in egpus if g.memory_used_bytes is not None]
    free = [g.memory_free_bytes for g in egpus if g.memory_free_bytes is not None]
    utils = [g.utilization_gpu for g in egpus if g.utilization_gpu is not None]
    v["gpu_total_bytes"] = min(totals) if totals else None
    v["gpu_used_bytes"] = max(used) if used else None
    if v["gpu_total_bytes"] and v["gpu_used_bytes"] is not None:
        v["gpu_used_fraction"] = v["gpu_used_bytes"] / v["gpu_total_bytes"]
    v["gpu_free_bytes"] = min(free) if free else None
    v["gpu_util"] = max(utils) if utils else None
    v["gpu_util_known"] = bool(utils)
    empty = [g.index for g in visible if (g.memory_used_bytes or 0) < GiB and not g.processes]
    v["empty_gpus"], v["empty_gpu_count"] = empty, len(empty)
    full = [
        g.index
        for g in visible
        if g.memory_total_bytes
        and g.memory_used_bytes is not None
        and g.memory_used_bytes >= 0.95 * g.memory_total_bytes
    ]
    v["full_gpus"], v["full_gpu_count"] = full, len(full)
    v["gpu_mig"] = any(g.mig_enabled for g in egpus)
    slow = ("thermal", "power", "hw_slowdown", "slowdown")
    v["throttle_reasons"] = sorted(
        {r for g in egpus for r in g.clock_event_reasons if any(k in r for k in slow)}
    )
    if len(egpus) > 1 and all(g.memory_used_bytes is not None for g in egpus):
        # Compare what the engine itself holds on each rank: another job on one GPU is
        # gpu-shared-with-foreign-process, not an imbalance of the engine's ranks.
        own = {g.index: _engine_bytes_on(g, engine_pids) for g in egpus}
        heavy_idx = max(own, key=lambda i: own[i])
        v["rank_spread_bytes"] = own[heavy_idx] - min(own.values())
        v["rank_heavy_gpu"] = heavy_idx
    if totals:
        v["engine_gpu_total_min_bytes"], v["engine_gpu_total_max_bytes"] = min(totals), max(totals)
    for g in visible:
        holders = [p for p in g.processes if _is_vllm_process(p.name) and (p.used_bytes or 0) >= GiB]
        if len(holders) >= 2:
            v["stacked_gpu"] = g.index
            v["stacked_pids"] = [p.pid for p in holders]
            v["stacked_desc"] = _desc([(p, g.index) for p in holders])
            break

    # Foreign and orphaned processes.
    log = snapshot.log
    starts = _run_start_lines(log) if log is not None else []
    old_pids = _pids_before(log, starts[-1]) if (log is not None and len(starts) > 1) else set()
    live = {p.pid for p in snapshot.processes} if snapshot.process_table_known else None
    servers_alive = (
        any(p.vllm_role == "api_server" for p in snapshot.processes) if snapshot.process_table_known else None
    )
    foreign: list[tuple[GpuProcess, int]] = []
    orphans: list[tuple[GpuProcess, int]] = []
    reasons: set[str] = set()
    startup_refused = log is not None and current_run(log).last("free_memory_below_util") is not None
    egpu_idx = set(v["engine_gpus"] or [])
    # The log's pids may come from a container's pid namespace: trust them for "this process is
    # not the engine" only when some GPU process carries one of them (or the table is live).
    on_gpu = {p.pid for g in visible for p in g.processes}
    pids_comparable = snapshot.process_table_known or bool(engine_pids & on_gpu)
    for g in visible:
        for p in g.processes:
            vllm_like = _is_vllm_process(p.name)
            if vllm_like and p.pid not in engine_pids:
                if live is not None and p.pid not in live:
                    orphans.append((p, g.index))
                    reasons.add("their pids are not in the host's process table")
                    continue
                if p.pid in old_pids:
                    orphans.append((p, g.index))
                    reasons.add(
                        "their pids belong to an earlier run in the log and the server was restarted since"
                    )
                    continue
                if servers_alive is False:
                    orphans.append((p, g.index))
                    reasons.add("no vLLM API server is running")
                    continue
            # Without the engine's own pids a process can only be called foreign when the engine
            # never got to allocate anything (it failed the startup free-memory check).
            # MIG instances have memory of their own: a neighbour in another instance is not
            # on the engine's device.
            if (
                g.index in egpu_idx
                and not g.mig_enabled
                and p.pid not in engine_pids
                and not vllm_like
                and ((engine_pids and pids_comparable) or startup_refused)
                and (startup_refused or not _looks_like_the_engine(p, g, v["gmu"]))
            ):
                foreign.append((p, g.index))
    v["foreign_pids"] = [p.pid for p, _ in foreign]
    v["foreign_bytes"] = sum(p.used_bytes or 0 for p, _ in foreign)
    v["foreign_desc"] = _desc(foreign) if foreign else None
    v["orphan_pids"] = [p.pid for p, _ in orphans]
    v["orphan_bytes"] = sum(p.used_bytes or 0 for p, _ in orphans)
    v["orphan_gpus"] = sorted({i for _, i in orphans})
    v["orphan_desc"] = _desc(orphans) if orphans else None
    v["orphan_reason"] = "; ".join(sorted(reasons)) if reasons else None
    cpus = [p.cpu_percent for p in snapshot.processes if p.vllm_role and p.cpu_percent is not None]
    v["engine_cpu_percent"] = max(cpus) if cpus else None


def _model_vars(v: dict[str, Any], cfg: EngineConfig, arch: ModelArch | None, log: VllmLog | None) -> None:
    from kvdoctor import kvmath

    logged = None
    if log is not None:
        loads = log.of("model_loading")
        if loads:
            logged = max(e.values.get("weights_bytes") or 0 for e in loads) or None
    v["weights_logged_bytes"] = logged
    v["model_known"] = arch is not None
    v["arch"] = arch
    if logged:
        v["weights_bytes"] = logged * v["tp_pp"]
    if arch is None:
        return
    v["num_attention_heads"] = arch.num_attention_heads
    v["num_kv_heads"] = arch.num_key_value_heads
    v["vocab_size"] = arch.vocab_size
    try:
        if v["weights_bytes"] is None:
            v["weights_bytes"] = kvmath.weights_bytes(arch, dtype=cfg.dtype, quantization=cfg.quantization)
        v["kv_bytes_per_token"] = kvmath.kv_bytes_per_token(
            arch,
            tensor_parallel_size=v["tp"],
            pipeline_parallel_size=v["pp"],
            kv_cache_dtype=_valid_dtype(v["kv_cache_dtype"]),
        )
        v["kv_bytes_per_token_fp8"] = kvmath.kv_bytes_per_token(
            arch, tensor_parallel_size=v["tp"], pipeline_parallel_size=v["pp"], kv_cache_dtype="fp8"
        )
    except (ValueError, ZeroDivisionError, KeyError, TypeError):
        pass


def _catalogue_arch(model: str) -> ModelArch | None:
    """The built-in catalogue's architecture for a model id (``meta-llama/Llama-3.1-70B``), so a
    bundle without config.json still gets weights and KV sizes; None when not catalogued."""
    from kvdoctor import catalog
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.model_config import parse_model_config

    raw = catalog.model_config(model)
    if raw is None:
        return None
    try:
        return parse_model_config(raw, origin=f"catalogue:{model}")
    except SourceError:
        return None


def _valid_dtype(dtype: str) -> str:
    from kvdoctor.vllm_flags import valid_kv_cache_dtypes

    return dtype if dtype in valid_kv_cache_dtypes(None) else "auto"


def _stats_engine(e: LogEvent) -> int:
    try:
        return int(e.values.get("engine") or 0)
    except (TypeError, ValueError):
        return 0


def _log_vars(v: dict[str, Any], log: VllmLog, cfg: EngineConfig, dp_label: str | None = None) -> None:
    avail = log.of("available_kv_memory")
    if avail:
        low = min(avail, key=lambda e: e.values.get("bytes") or 0)
        v["log_available_kv_bytes"], v["log_available_kv_line"] = low.values.get("bytes"), low.line
    size = log.last("kv_cache_size")
    blocks = log.last("v0_blocks")
    if blocks is not None:
        v["log_num_gpu_blocks"] = blocks.values.get("gpu_blocks")
    if size is not None:
        v["log_kv_tokens"], v["log_kv_line"] = size.values.get("tokens"), size.line
    elif blocks is not None and blocks.values.get("gpu_blocks") is not None:
        v["log_kv_tokens"] = int(blocks.values["gpu_blocks"]) * int(v["block_size"] or 16)
        v["log_kv_line"] = blocks.line
    prof = log.last("memory_profile_v0")
    if prof is not None:
        pv = prof.values
        v["v0_profile_kv_bytes"] = pv.get("kv_bytes")
        v["v0_profile_total_bytes"] = pv.get("total_bytes")
        v["v0_profile_weights_bytes"] = pv.get("weights_bytes")
        v["v0_profile_activation_bytes"] = pv.get("activation_peak_bytes")
        v["v0_profile_non_torch_bytes"] = pv.get("non_torch_bytes")
        v["v0_profile_line"] = prof.line
    nok = log.last("no_available_kv_memory")
    v["no_kv_memory"] = nok is not None
    v["no_kv_memory_line"] = nok.line if nok else None
    mml = log.last("max_seq_len_exceeds_kv")
    mml0 = log.last("v0_max_seq_len_exceeds_kv")
    if mml is not None:
        mv = mml.values
        v["mml_error"], v["mml_error_line"] = True, mml.line
        v["mml_error_max_model_len"] = mv.get("max_model_len")
        v["mml_error_needed_bytes"] = mv.get("needed_bytes")
        v["mml_error_available_bytes"] = mv.get("available_bytes")
        v["mml_error_estimate"] = mv.get("estimated_max_len")
    elif mml0 is not None:
        v["mml_error"], v["mml_error_line"] = True, mml0.line
        v["mml_error_max_model_len"] = mml0.values.get("max_model_len")
        v["mml_error_kv_tokens"] = mml0.values.get("kv_tokens")
    else:
        v["mml_error"] = False
    fbu = log.last("free_memory_below_util")
    v["free_below_util"] = fbu is not None
    if fbu is not None:
        fv = fbu.values
        v["fbu_line"], v["fbu_free_bytes"], v["fbu_total_bytes"], v["fbu_gmu"] = (
            fbu.line,
            fv.get("free_bytes"),
            fv.get("total_bytes"),
            fv.get("gmu"),
        )
    inv = log.last("invalid_kv_cache_dtype")
    if inv is not None:
        v["invalid_kv_dtype"] = True
        v["invalid_kv_dtype_value"] = inv.values.get("value")
        v["invalid_kv_dtype_line"] = inv.line
    so = log.last("sampler_warmup_oom")
    v["sampler_oom"] = so is not None
    if so is not None:
        v["sampler_oom_requests"], v["sampler_oom_line"] = so.values.get("num_requests"), so.line
    caps = log.of("graph_capture_done")
    if caps:
        v["graph_capture_bytes"] = max(e.values.get("bytes") or 0 for e in caps)
    ooms = log.of("cuda_oom")
    v["oom_count"] = len(ooms)
    v["oom_phases"] = [e.values.get("phase") for e in ooms]
    if ooms:
        last = ooms[-1].values
        v["oom_line"], v["oom_phase"] = ooms[-1].line, last.get("phase")
        v["oom_requested_bytes"] = last.get("requested_bytes")
        v["oom_free_bytes"] = last.get("free_bytes")
        v["oom_total_bytes"] = last.get("total_bytes")
        v["oom_reserved_unallocated_bytes"] = last.get("reserved_unallocated_bytes")
        v["oom_gpu"] = last.get("gpu")
    phases = set(v["oom_phases"])
    v["weight_loading_oom"] = "weight_loading" in phases or bool(log.of("load_model_oom"))
    v["graph_capture_oom"] = "cuda_graph_capture" in phases
    v["runtime_oom"] = "runtime" in phases
    v["engine_failed"] = bool(log.of("engine_failed"))
    startup_ooms = [p for p in v["oom_phases"] if p not in ("runtime", None)]
    v["startup_failed"] = bool(
        v["engine_failed"]
        or startup_ooms
        or v["weight_loading_oom"]
        or v["sampler_oom"]
        or v["mml_error"]
        or v["no_kv_memory"]
        or v["free_below_util"]
        or inv is not None
        or log.of("profiling_assertion")
    )
    # ``log`` is the latest run already; with data parallelism each engine reads its own
    # "Engine 00N:" lines.
    stats = log.of("stats")
    if dp_label is not None and dp_label.isdigit():
        stats = [e for e in stats if _stats_engine(e) == int(dp_label)]
    v["log_stats_count"] = len(stats)
    if stats:
        kvs = [float(e.values["kv_usage"]) for e in stats if e.values.get("kv_usage") is not None]
        waits = [(e.values.get("waiting") or 0) + (e.values.get("pending") or 0) for e in stats]
        runs = [e.values.get("running") for e in stats if e.values.get("running") is not None]
        gens = [e.values.get("generation_throughput") or 0 for e in stats]
        v["log_kv_usage_max"] = max(kvs) if kvs else None
        v["log_waiting_max"] = max(waits) if waits else None
        v["log_running_first"] = runs[0] if runs else None
        v["log_running_last"] = runs[-1] if runs else None
        v["log_gen_throughput_max"] = max(gens) if gens else None
    pre = sum(int(e.values.get("preemptions") or 0) for e in stats) + len(log.of("preempted_v0"))
    v["log_preemptions_sum"] = pre


def _metrics_vars(v: dict[str, Any], series: list[EngineMetrics], window_s: float) -> None:
    from kvdoctor import timeline as tl

    v["metrics_present"] = bool(series)
    if not series:
        return
    latest = series[-1]
    v["stats_enabled"] = latest.stats_enabled
    v["kv_usage"] = latest.kv_cache_usage
    v["running"] = latest.num_requests_running
    v["waiting"] = latest.num_requests_waiting
    win = tl.window(series, window_s)
    ts = [m.timestamp for m in win if m.timestamp is not None]
    v["window_seconds"] = (max(ts) - min(ts)) if len(ts) >= 2 else 0.0
    kv = tl.gauge_stats(series, "kv_cache_usage", window_s)
    if kv is not None:
        v["kv_usage_max"], v["kv_usage_min"] = kv.max, kv.min
    wt = tl.gauge_stats(series, "num_requests_waiting", window_s)
    if wt is not None:
        v["waiting_max"], v["waiting_trend"] = wt.max, wt.last - wt.first
    rn = tl.gauge_stats(series, "num_requests_running", window_s)
    if rn is not None:
        v["running_trend"] = rn.last - rn.first
    rate = tl.counter_rate(series, "num_preemptions_total", window_s)
    v["preemptions_per_min"] = rate * 60 if rate is not None else None
    v["preemptions_in_window"] = tl.counter_increase(series, "num_preemptions_total", window_s)
    v["prompt_tokens_per_s"] = tl.counter_rate(series, "prompt_tokens_total", window_s)
    v["generation_tokens_per_s"] = tl.counter_rate(series, "generation_tokens_total", window_s)
    v["requests_per_s"] = tl.counter_rate(series, "request_success_total", window_s)
    hist = tl.histogram_delta(series, "vllm:request_prompt_tokens", window_s)
    v["prompt_hist_recent"] = hist is not None and hist.count > 0
    if hist is None or hist.count <= 0:
        hist = tl.histogram_latest(series, "vllm:request_prompt_tokens")
    if hist is not None and hist.count > 0:
        v["prompt_p50"] = tl.histogram_quantile(hist, 0.5)
        v["prompt_p99"] = tl.histogram_quantile(hist, 0.99)
        v["prompt_max_bucket"] = tl.histogram_max_bucket(hist)
    gh = tl.histogram_delta(series, "vllm:request_generation_tokens", window_s)
    if gh is None or gh.count <= 0:
        gh = tl.histogram_latest(series, "vllm:request_generation_tokens")
    if gh is not None and gh.count > 0:
        v["generation_p50"] = tl.histogram_quantile(gh, 0.5)
    cc = latest.cache_config
    blocks = _num(cc.get("num_gpu_blocks"))
    v["cache_num_gpu_blocks"] = int(blocks) if blocks is not None else None
    tokens = _num(cc.get("kv_cache_size_tokens"))
    bs = _num(cc.get("block_size")) or v["block_size"] or 16
    if tokens is not None:
        v["kv_capacity_tokens"] = int(tokens)
    elif blocks is not None:
        v["kv_capacity_tokens"] = int(blocks * bs)


def _num(s: str | None) -> float | None:
    if s in (None, "", "None"):
        return None
    try:
        return float(s)  # type: ignore[arg-type]
    except ValueError:
        return None


def _combined_vars(v: dict[str, Any], cfg: EngineConfig, log: VllmLog | None) -> None:
    from kvdoctor.vllm_flags import nearest_valid_kv_cache_dtype, valid_kv_cache_dtypes

    # The KV usage and queue: metrics first, the log's stats lines otherwise.
    if v["kv_usage_max"] is None:
        v["kv_usage_max"] = v["log_kv_usage_max"] if v["log_kv_usage_max"] is not None else v["kv_usage"]
    if v["waiting_max"] is None:
        v["waiting_max"] = v["log_waiting_max"] if v["log_waiting_max"] is not None else v["waiting"]
    if (
        v["running_trend"] is None
        and v["log_running_first"] is not None
        and v["log_running_last"] is not None
    ):
        v["running_trend"] = v["log_running_last"] - v["log_running_first"]
    if v["kv_capacity_tokens"] is None and v["log_kv_tokens"] is not None:
        v["kv_capacity_tokens"] = v["log_kv_tokens"]
    tokens_flowing = any(
        (x or 0) > 0 for x in (v["prompt_tokens_per_s"], v["generation_tokens_per_s"], v["requests_per_s"])
    )
    busy = (v["running"] or 0) > 0 or (v["waiting"] or 0) > 0 or (v["waiting_max"] or 0) > 0
    log_busy = (v["log_gen_throughput_max"] or 0) > 0 or (v["log_running_last"] or 0) > 0
    v["traffic"] = bool(tokens_flowing or busy or log_busy)
    # vLLM's device default for max_num_seqs (vllm-facts §4.2) when not set.
    if v["max_num_seqs"] is not None:
        v["max_num_seqs_effective"] = v["max_num_seqs"]
    elif v["gpu_total_bytes"]:
        big = v["gpu_total_bytes"] >= 70 * GiB and "A100" not in (v["gpu_name"] or "")
        v["max_num_seqs_effective"] = (
            1024 if big and (v["vllm_version"] is None or _ver(v["vllm_version"]) >= (0, 10)) else 256
        )
    else:
        v["max_num_seqs_effective"] = 256
    # Launch-time validity of --kv-cache-dtype for the version.
    dtype = cfg.kv_cache_dtype or "auto"
    if not v["invalid_kv_dtype"]:
        valid = valid_kv_cache_dtypes(v["vllm_version"])
        v["invalid_kv_dtype"] = dtype not in valid
        if v["invalid_kv_dtype"]:
            v["invalid_kv_dtype_value"] = dtype
    from kvdoctor import catalog

    try:
        spec = catalog.gpu(v["gpu_name"]) if v["gpu_name"] else None
    except (KeyError, ValueError):
        spec = None
    v["fp8_supported"] = spec.fp8 if spec is not None else None
    if not v["invalid_kv_dtype"] and dtype.startswith("fp8") and v["fp8_supported"] is False:
        v["invalid_kv_dtype"], v["invalid_kv_dtype_value"] = True, dtype
        v["suggested_kv_dtype"] = "auto"
    elif v["invalid_kv_dtype"] and v["invalid_kv_dtype_value"]:
        v["suggested_kv_dtype"] = nearest_valid_kv_cache_dtype(
            str(v["invalid_kv_dtype_value"]), v["vllm_version"]
        )


def _ver(s: str) -> tuple[int, ...]:
    out = []
    for part in re.findall(r"\d+", s)[:3]:
        out.append(int(part))
    return tuple(out)


# --------------------------------------------------------------------------- more rules' inputs


def _pressure_vars(v: dict[str, Any], log: VllmLog | None, series: list[EngineMetrics]) -> None:
    """KV pressure seen in the window: preemptions, or a queue with the KV cache nearly full."""
    if v["is_pooling"]:
        v["kv_pressure"] = False
        return
    if len(series) >= 2 and v["preemptions_in_window"] is not None:
        preempted = v["preemptions_in_window"] > 0
    else:
        preempted = (v["log_preemptions_sum"] or 0) > 0
    # A queue with the cache nearly full, seen more than once: one scrape of a busy server
    # catching two requests in the queue is not pressure.
    from kvdoctor import timeline as tl

    win = tl.window(series, 60.0) if series else []
    samples = sum(1 for m in win if (m.num_requests_waiting or 0) > 0 and (m.kv_cache_usage or 0) >= 0.9)
    if log is not None:
        stats = log.of("stats")
        if v["dp_engine"] is not None and str(v["dp_engine"]).isdigit():
            stats = [e for e in stats if _stats_engine(e) == int(v["dp_engine"])]
        samples_log = sum(
            1
            for e in stats
            if ((e.values.get("waiting") or 0) + (e.values.get("pending") or 0)) > 0
            and (e.values.get("kv_usage") or 0) >= 0.9
        )
        samples = max(samples, samples_log)
    v["kv_pressure"] = bool(preempted or samples >= 2)


def _swap_vars(
    v: dict[str, Any], cfg: EngineConfig, log: VllmLog | None, series: list[EngineMetrics], window_s: float
) -> None:
    """V0 swap preemption followed by a stall (vllm-facts §1.5 V0 metrics, §3.4 V0 stats line)."""
    v["swap_space_gib"] = cfg.swap_space_gib
    stall_line: int | None = None
    if log is not None:
        stats = log.of("stats")
        swapped = [int(e.values["swapped"]) for e in stats if e.values.get("swapped") is not None]
        v["log_swapped_max"] = max(swapped) if swapped else None
        swaps = [e for e in log.of("preempted_v0") if "swap" in str(e.values.get("mode") or "")]
        v["swap_preemptions"] = len(swaps)
        first_swap = swaps[0].line if swaps else None
        for e in stats:
            ev = e.values
            stalled = (ev.get("running") or 0) > 0 and (ev.get("generation_throughput") or 0) == 0
            if not stalled:
                continue
            if (ev.get("swapped") or 0) > 0 or (first_swap is not None and e.line > first_swap):
                stall_line = e.line
                break
    if series:
        v["swapped"] = series[-1].num_requests_swapped
    metric_stall = (
        (v["swapped"] or 0) > 0
        and (v["running"] or 0) > 0
        and v["generation_tokens_per_s"] is not None
        and v["generation_tokens_per_s"] == 0
    )
    v["swap_stall"] = stall_line is not None or bool(metric_stall)
    v["swap_stall_line"] = stall_line


def _oom_code_vars(
    v: dict[str, Any], cfg: EngineConfig, log: VllmLog | None, series: list[EngineMetrics], window_s: float
) -> None:
    """Which code the OOMs hit, the biggest engine step, chunked prefill, multimodal profiling."""
    from kvdoctor import timeline as tl

    v["chunked_prefill_on"] = cfg.enable_chunked_prefill
    limit = cfg.args.get("limit_mm_per_prompt")
    v["limit_mm_per_prompt"] = (
        None
        if limit in (None, "", {})
        else (limit if isinstance(limit, str) else json.dumps(limit, separators=(",", ":")))
    )
    hist = tl.histogram_delta(series, "vllm:iteration_tokens_total", window_s) if series else None
    if hist is None or hist.count <= 0:
        hist = tl.histogram_latest(series, "vllm:iteration_tokens_total") if series else None
    if hist is not None and hist.count > 0:
        v["iteration_tokens_max_bucket"] = tl.histogram_max_bucket(hist)
    if log is None:
        return
    if log.of("chunked_prefill"):
        v["chunked_prefill_on"] = True
    ooms = log.of("cuda_oom")
    if ooms:
        v["oom_hints"] = list(ooms[-1].values.get("hints") or [])
    runtime = [e for e in ooms if e.values.get("phase") == "runtime"]
    v["runtime_oom_hints"] = sorted({h for e in runtime for h in (e.values.get("hints") or [])})
    v["runtime_oom_line"] = runtime[-1].line if runtime else None
    mm_oom = [
        e
        for e in ooms
        if e.values.get("phase") not in ("runtime", "sampler_warmup")
        and "multimodal" in (e.values.get("hints") or [])
    ]
    short = [e for e in log.of("mm_profile") if "too short" in e.text]
    v["mm_profile_oom"] = bool(mm_oom)
    v["mm_profile_too_short"] = bool(short)
    picked = mm_oom[-1] if mm_oom else (short[-1] if short else None)
    v["mm_profile_line"] = picked.line if picked is not None else None


def _hardware_vars(v: dict[str, Any], snapshot: Snapshot) -> None:
    """Uncorrectable ECC (nvidia-smi / NVML) and NVIDIA XIDs from the kernel log, by GPU."""
    from kvdoctor.sources.nvidia_smi import normalize_bus_id

    by_bus = {normalize_bus_id(g.bus_id): g for g in snapshot.gpus if g.bus_id}
    hw = [x for x in snapshot.xid_events if x.get("hardware")]
    v["xid_hw_count"] = len(hw)
    v["xid_app_count"] = len(snapshot.xid_events) - len(hw)
    gpus: set[int] = set()
    buses: list[str] = []
    parts: list[str] = []
    seen: set[tuple[Any, Any]] = set()
    for x in hw:
        g = by_bus.get(x.get("bus_id"))
        if g is not None:
            gpus.add(g.index)
        if x.get("bus_id") and x["bus_id"] not in buses:
            buses.append(x["bus_id"])
        key = (x.get("xid"), x.get("bus_id"))
        if key in seen:
            continue
        seen.add(key)
        where = f"GPU {g.index} ({x.get('bus_id')})" if g is not None else f"PCI {x.get('bus_id') or '?'}"
        parts.append(
            f"Xid {x.get('xid')} on {where}, dmesg line {x.get('line')}: {str(x.get('message') or '').rstrip('.')}"
        )
    v["xid_desc"] = "; ".join(parts) if parts else None
    ecc = [g for g in snapshot.gpus if (g.ecc_uncorrectable or 0) > 0]
    v["ecc_gpus"] = [g.index for g in ecc]
    v["ecc_desc"] = (
        ", ".join(f"GPU {g.index}: {g.ecc_uncorrectable} uncorrectable ECC error(s)" for g in ecc)
        if ecc
        else None
    )
    for g in ecc:
        gpus.add(g.index)
        bid = normalize_bus_id(g.bus_id)
        if bid and bid not in buses:
            buses.append(bid)
    v["hw_error_gpus"] = sorted(gpus)
    v["hw_error_bus_ids"] = buses


def _slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes) points, in bytes per hour."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    cov = sum((t - mt) * (y - my) for t, y in points)
    return cov / var * 3600.0


def _growth_vars(v: dict[str, Any], snapshot: Snapshot, history: list[Snapshot]) -> None:
    """Used memory of the engine's GPUs over time: slope, plateau or steady growth."""
    moments: list[list[Gpu]] = list(snapshot.gpu_series)
    if not moments:
        moments = [
            [dataclass_replace_ts(g, s.timestamp) for g in s.gpus]
            for s in history
            if s.gpus and (s.timestamp is not None or all(g.timestamp is not None for g in s.gpus))
        ]
    wanted = set(v["engine_gpus"] or [])
    series: dict[int, list[tuple[float, float]]] = {}
    totals: dict[int, int] = {}
    for moment in moments:
        for g in moment:
            if g.timestamp is None or g.memory_used_bytes is None or (wanted and g.index not in wanted):
                continue
            series.setdefault(g.index, []).append((g.timestamp, float(g.memory_used_bytes)))
            if g.memory_total_bytes:
                totals[g.index] = g.memory_total_bytes
    best: tuple[float, int, list[tuple[float, float]]] | None = None
    for idx, pts in series.items():
        pts.sort()
        if len(pts) < 3:
            continue
        slope = _slope_per_hour(pts)
        if slope is None:
            continue
        if best is None or slope > best[0]:
            best = (slope, idx, pts)
    if best is None:
        return
    slope, idx, pts = best
    half = pts[len(pts) // 2 :]
    recent = _slope_per_hour(half) if len(half) >= 2 else None
    v["mem_growth_gpu"] = idx
    v["mem_growth_points"] = len(pts)
    v["mem_growth_span_s"] = pts[-1][0] - pts[0][0]
    v["mem_growth_rise_bytes"] = int(pts[-1][1] - pts[0][1])
    v["mem_growth_bytes_per_hour"] = slope
    v["mem_growth_recent_bytes_per_hour"] = recent
    v["mem_growth_used_bytes"] = int(pts[-1][1])
    v["mem_growth_plateau"] = slope > 0 and recent is not None and recent < 0.25 * slope
    total = totals.get(idx)
    rate = recent if recent is not None and recent > 0 and not v["mem_growth_plateau"] else slope
    if total and rate > 0:
        v["mem_growth_hours_to_full"] = max(0.0, (total - pts[-1][1]) / rate)


def dataclass_replace_ts(g: Gpu, ts: float | None) -> Gpu:
    """A copy of a GPU reading stamped with its snapshot's time when it has none of its own."""
    from dataclasses import replace

    return g if g.timestamp is not None or ts is None else replace(g, timestamp=ts)


def _cmdline_gmu(argv: list[str], version: str | None) -> tuple[float | None, str | None]:
    """(gmu, model) of a vLLM launch command line; (None, None) when it is not one."""
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.cmdline import parse_argv
    from kvdoctor.vllm_flags import apply_defaults

    try:
        cfg = apply_defaults(parse_argv(argv), version)
    except (SourceError, ValueError, TypeError):
        return None, None
    return cfg.gpu_memory_utilization, cfg.served_model_name or cfg.model


def _server_of(snapshot: Snapshot, pid: int) -> Any:
    """The process (this pid or an ancestor) whose command line launched vLLM, from ps / psutil."""
    from kvdoctor.sources.cmdline import locate_vllm_args

    procs = {p.pid: p for p in snapshot.processes}
    cur = procs.get(pid)
    seen: set[int] = set()
    while cur is not None and cur.pid not in seen:
        seen.add(cur.pid)
        if cur.cmdline and locate_vllm_args(list(cur.cmdline)) is not None:
            return cur
        cur = procs.get(cur.ppid) if cur.ppid is not None else None
    return None


def _pinned_devices(cfg: EngineConfig, visible: list[Gpu], tp_pp: int) -> list[int]:
    """GPU indices an engine started from a command line lands on: its CUDA_VISIBLE_DEVICES
    prefix when given (first tp×pp of them), else the first tp×pp visible devices."""
    env = cfg.args.get("_env") or {}
    cvd = str(env.get("CUDA_VISIBLE_DEVICES") or "").strip()
    if cvd:
        ids = [int(x) for x in re.findall(r"\d+", cvd)]
        if ids and len(ids) == len([x for x in cvd.split(",") if x.strip()]):
            return ids[: max(1, tp_pp)]
    base = [g.index for g in visible] or list(range(max(1, tp_pp)))
    return base[: max(1, tp_pp)]


def _colocation_vars(
    v: dict[str, Any], snapshot: Snapshot, engine: Engine | None, engines: list[Engine]
) -> None:
    """Two or more engines on one GPU: what each asked for (gmu) and whether it fits the card."""
    from kvdoctor.units import floor_to

    visible = [g for g in _visible(snapshot) if not g.mig_enabled]
    version = v["vllm_version"]
    configs = [e.config for e in engines]
    entries: list[dict[str, Any]] = []
    gpu: Gpu | None = None
    for g in visible:
        holders = [p for p in g.processes if _is_vllm_process(p.name) and (p.used_bytes or 0) >= GiB]
        if len(holders) < 2:
            continue
        found: list[dict[str, Any]] = []
        servers: set[int] = set()
        for p in holders:
            server = _server_of(snapshot, p.pid)
            if server is not None and server.pid in servers:
                continue  # two processes of one engine
            if server is not None:
                servers.add(server.pid)
            gmu, model = _cmdline_gmu(list(server.cmdline), version) if server is not None else (None, None)
            found.append(
                {
                    "pid": p.pid,
                    "gmu": gmu,
                    "model": model,
                    "bytes": p.used_bytes,
                    "start": server.create_time if server is not None else None,
                }
            )
        if len(found) < 2:
            continue
        if all(e["gmu"] is None for e in found) and len(configs) == len(found):
            for e, c in zip(found, configs, strict=True):
                e["gmu"], e["model"] = c.gpu_memory_utilization, c.served_model_name or c.model
        gpu, entries = g, found
        break
    engine_gpus_seen = {
        g.index
        for g in visible
        if any(_is_vllm_process(p.name) and (p.used_bytes or 0) >= GiB for p in g.processes)
    }
    if gpu is None and len(configs) >= 2 and len(engine_gpus_seen) <= 1:
        # Command lines (the GPUs show the engines on one device at most, e.g. the second one
        # failed to start): engines not pinned apart land on the same device.
        placed = [
            (c, _pinned_devices(c, visible, (c.tensor_parallel_size or 1) * (c.pipeline_parallel_size or 1)))
            for c in configs
        ]
        for dev in sorted({d for _, ds in placed for d in ds}):
            on = [c for c, ds in placed if dev in ds]
            if len(on) >= 2:
                gpu = next((g for g in visible if g.index == dev), None) or Gpu(index=dev)
                entries = [
                    {"pid": None, "gmu": c.gpu_memory_utilization, "model": c.served_model_name or c.model,
                     "bytes": None, "start": None}
                    for c in on
                ]  # fmt: skip
                break
    if gpu is None or len(entries) < 2:
        return
    total = gpu.memory_total_bytes
    for e in entries:
        if e["gmu"] is None and e["bytes"] is not None and total:
            e["gmu"] = round(e["bytes"] / total, 2)
    gmus = [e["gmu"] for e in entries]
    v["colocated_gpu"] = gpu.index
    v["colocated_count"] = len(entries)
    v["colocated_gmus"] = gmus
    v["colocated_total_bytes"] = total
    known = [x for x in gmus if x is not None]
    if len(known) == len(gmus):
        gsum = round(sum(known), 4)
        v["colocated_gmu_sum"] = gsum
        if total:
            v["colocated_reserved_bytes"] = int(sum(x * total for x in known))
        scale = min(1.0, 0.95 / gsum) if gsum > 0 else 1.0
        split = [floor_to(x * scale, 0.01) for x in known]
        v["colocated_split"] = split
        names = [
            str(e["model"] or (f"pid {e['pid']}" if e["pid"] else f"engine {i}"))
            for i, e in enumerate(entries)
        ]
        v["colocated_split_desc"] = ", ".join(f"{n} {x:.2f}" for n, x in zip(names, split, strict=True))
        mine = None
        if engine is not None:
            ids = {engine.config.served_model_name, engine.config.model, engine.id}
            for e, x in zip(entries, split, strict=True):
                if e["model"] is not None and e["model"] in ids:
                    mine = x
                    break
        v["colocated_gmu_fix"] = mine
    desc = []
    for e in entries:
        who = f"pid {e['pid']}" if e["pid"] else "engine"
        what = f" ({e['model']})" if e["model"] else ""
        share = f" gmu {e['gmu']:.2f}" if e["gmu"] is not None else ""
        desc.append(f"{who}{what}{share}")
    v["colocated_desc"] = ", ".join(desc)
    starts = sorted(e["start"] for e in entries if e["start"] is not None)
    if len(starts) >= 2:
        v["colocated_start_gap_s"] = min(b - a for a, b in zip(starts, starts[1:], strict=False))
