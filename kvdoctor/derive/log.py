"""Family log: what the vLLM log's latest run says (startup memory lines, KV sizing errors,
every form of CUDA OOM, the periodic stats lines). Events come parsed from
``kvdoctor.sources.vllm_log``; this family only picks and combines them."""

from __future__ import annotations

from kvdoctor.derive.base import Family, LogView, Scope, Vars, engine_stats
from kvdoctor.facts import LogEvent

WRITES: dict[str, str] = {
    # --- startup memory
    "log_available_kv_bytes": "bytes; smallest 'Available KV cache memory: X GiB' over workers (may be negative)",
    "log_available_kv_line": "int; its line",
    "log_kv_tokens": "tokens; 'GPU KV cache size: N tokens' (V0: '# GPU blocks' × block_size)",
    "log_kv_line": "int; its line",
    "log_kv_concurrency": "requests; C of 'Maximum concurrency for L tokens per request: Cx' (num_blocks / blocks per request, vllm-facts §2.4)",
    "log_kv_concurrency_len": "tokens; L of that line (the max_model_len it was computed for)",
    "log_num_gpu_blocks": "int; V0 '# GPU blocks: N' / '# cuda blocks: N'; V1 'Overriding num_gpu_blocks=… with num_gpu_blocks_override=N'",
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
    "sampler_oom": "bool; 'CUDA out of memory occurred when warming up sampler with N dummy requests'",
    "sampler_oom_requests": "int; N",
    "sampler_oom_line": "int; its line",
    "graph_capture_bytes": "bytes; 'Graph capturing finished … took X GiB' (largest over workers)",
    # --- OOMs (PyTorch 'CUDA out of memory', every form)
    "oom_count": "int; distinct CUDA OOMs in the log",
    "oom_phases": "list[str]; their phases (weight_loading, profile_run, cuda_graph_capture, sampler_warmup, kv_cache_init, runtime, startup)",
    "oom_line": "int; line of the last OOM",
    "oom_phase": "str; phase of the last OOM",
    "oom_requested_bytes": "bytes; 'Tried to allocate X'",
    "oom_free_bytes": "bytes; 'of which X is free' (legacy: 'X free')",
    "oom_total_bytes": "bytes; 'total capacity of X'",
    "oom_reserved_unallocated_bytes": "bytes; 'X is reserved by PyTorch but unallocated' (legacy: reserved − allocated)",
    "oom_gpu": "int; 'GPU N'",
    "oom_allocated_bytes": "bytes; 'Of the allocated memory X is allocated by PyTorch' of the last OOM (legacy: 'X already allocated')",
    "weight_loading_oom": "bool; an OOM while loading weights (or 'Failed to load model - not enough GPU memory')",
    "graph_capture_oom": "bool; an OOM during CUDA graph capture",
    "runtime_oom": "bool; an OOM after the engine was serving",
    "engine_failed": "bool; the engine failed to start or died ('EngineCore failed to start', 'Engine core initialization failed', EngineDeadError)",
    "startup_failed": "bool; any evidence the engine did not come up: engine_failed, a startup-phase OOM, a KV/memory check error, an invalid flag",
    # --- a crash (issue 24 kind 5): what killed the engine, and whether a specific error explains it
    "engine_crashed": "bool; the latest run died: engine_failed, or a traceback before serving after which the engine got no further",
    "engine_crash_line": "int; log line of the crash evidence (the engine_failed line, else the exception line)",
    "engine_error_text": "str; the last exception line of the crash's tracebacks that is not a wrapper (EngineDeadError, 'Engine core initialization failed'), redacted, ≤ 300 chars; else the wrapper's line",
    "engine_error_line": "int; its log line",
    "engine_error_exception": "str; its exception class name ('RuntimeError', 'torch.distributed.DistBackendError')",
    "crash_explained": "bool; the latest run logged an error a specific rule reads (any CUDA OOM, a KV sizing / memory check error, an invalid kv_cache_dtype, a cuMem / Triton / FlashInfer / 0.34 VMM error, …); None without a crash",
    # --- periodic stats lines (percent → fraction)
    "log_stats_count": "int; periodic stats lines",
    "log_kv_usage_max": "fraction; largest 'GPU KV cache usage' in the stats lines",
    "log_waiting_max": "int; largest Waiting/Pending",
    "log_running_last": "int; last Running",
    "log_running_first": "int; first Running",
    "log_gen_throughput_max": "tokens/s; largest 'Avg generation throughput'",
    "log_preemptions_sum": "int; Σ 'Preemptions: N' in stats lines (≥0.12) + V0 preemption warnings",
}
READS: frozenset[str] = frozenset({"block_size", "dp_engine"})


def derive(s: Scope, v: Vars) -> None:
    """Variables of the log's latest run; all None without a log."""
    log = s.log
    if log is None:
        return
    _startup(v, log)
    _ooms(v, log)
    _stats(v, log, v["dp_engine"])
    _crash(v, log)


def _startup(v: Vars, log: LogView) -> None:
    avail = log.of("available_kv_memory")
    if avail:
        low = min(avail, key=lambda e: e.values.get("bytes") or 0)
        v["log_available_kv_bytes"], v["log_available_kv_line"] = low.values.get("bytes"), low.line
    size = log.last("kv_cache_size")
    blocks = log.last("v0_blocks")
    override = log.last("num_gpu_blocks_override")
    if blocks is not None:
        v["log_num_gpu_blocks"] = blocks.values.get("gpu_blocks")
    elif override is not None:
        # V1 logs no block count, except the override it applied (the engine's real count)
        v["log_num_gpu_blocks"] = override.values.get("override")
    conc = log.last("max_concurrency")
    if conc is not None:
        v["log_kv_concurrency"] = conc.values.get("concurrency")
        v["log_kv_concurrency_len"] = conc.values.get("max_model_len")
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
    so = log.last("sampler_warmup_oom")
    v["sampler_oom"] = so is not None
    if so is not None:
        v["sampler_oom_requests"], v["sampler_oom_line"] = so.values.get("num_requests"), so.line
    caps = log.of("graph_capture_done")
    if caps:
        v["graph_capture_bytes"] = max(e.values.get("bytes") or 0 for e in caps)


def _ooms(v: Vars, log: LogView) -> None:
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
        allocated = last.get("allocated_by_pytorch_bytes")
        v["oom_allocated_bytes"] = allocated if allocated is not None else last.get("already_allocated_bytes")
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
        or log.last("invalid_kv_cache_dtype") is not None
        or log.of("profiling_assertion")
    )


def _stats(v: Vars, log: LogView, dp_label: str | None) -> None:
    # ``log`` is the latest run already; with data parallelism each engine reads its own
    # "Engine 00N:" lines.
    stats = engine_stats(log, dp_label)
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


#: log error kinds (kvdoctor.sources.vllm_log) a specific rule reads as the cause of a failure:
#: an engine that died after one is not engine-crashed's (an unrecognised crash);
#: ``swap_space_too_large`` counts only when fatal. tests/rules/test_engine_crashed.py holds the
#: two sets against the parser's error kinds.
RECOGNISED_ERROR_KINDS = frozenset(
    {
        "cuda_oom",  # the OOM rules (oom_* variables)
        "flashinfer_overflow",  # flashinfer-workspace-overflow
        "free_memory_below_util",  # free_below_util
        "invalid_kv_cache_dtype",  # invalid-kv-cache-dtype
        "load_model_oom",  # weight_loading_oom
        "max_seq_len_exceeds_kv",  # mml_error
        "no_available_kv_memory",  # no_kv_memory
        "sampler_warmup_oom",  # sampler_oom
        "swap_space_too_large",  # swap-space rules (fatal only)
        "triton_oom",  # triton-autotune-oom
        "v0_max_seq_len_exceeds_kv",  # mml_error
        # the 0.34 rules of spec/vllm-0.34.md §3
        "torch_cap_rejected",  # torch-cap-oom
        "v1_runner_removed",  # v1-runner-env-removed
        "autofit_failed_after_warmup",  # graphs-warmup-left-no-kv
    }
)
#: the parser's error kinds no rule reads as the cause of a death (engine-crashed quotes them),
#: and the engine's death itself; cumem_oom counts through wake_oom (wake-up-oom) in the rule
UNRECOGNISED_ERROR_KINDS = frozenset(
    {
        "engine_failed",
        "vmm_driver_error",
        "kv_hint",
        "cumem_oom",
        "cuda_error_oom",
        "profiling_assertion",
        "user_max_model_len_too_large",
        "autofit_failed",
        "extensible_config_error",
        "weight_update_no_room",
    }
)

#: exception classes and words that only wrap the real error (the API server re-raising the
#: engine core's death): quoted only when nothing else was raised.
_WRAPPER_EXCEPTIONS = (
    "EngineDeadError",
    "EngineGenerateError",
    "CancelledError",
    "SystemExit",
    "KeyboardInterrupt",
)
_WRAPPER_WORDS = (
    "Engine core initialization failed",
    "EngineCore failed to start",
    "Engine process failed to start",
    "See root cause above",
    "See stack trace (above)",
    "Worker failed with error",
    "please check the stack trace above",
)
#: events that show an engine got further after a startup traceback (it was not fatal)
_PROGRESS_KINDS = frozenset(
    {"stats", "request", "model_loading", "available_kv_memory", "kv_cache_size", "graph_capture_done"}
)


def _is_wrapper(e: LogEvent) -> bool:
    name = str(e.values.get("exception") or "")
    return name.rsplit(".", 1)[-1] in _WRAPPER_EXCEPTIONS or any(w in e.text for w in _WRAPPER_WORDS)


def _crash(v: Vars, log: LogView) -> None:
    """Whether the run crashed, the error line it died of, and whether a specific error explains it."""
    failed = log.of("engine_failed")
    exceptions = log.of("exception")
    crash: LogEvent | None = failed[0] if failed else None
    if crash is None:
        # a traceback before serving after which the engine got no further: a startup crash
        startup = [e for e in exceptions if not e.values.get("serving")]
        if startup:
            last = startup[-1].line
            if not any(e.line > last for k in _PROGRESS_KINDS for e in log.of(k)):
                crash = startup[-1]
    v["engine_crashed"] = crash is not None
    if crash is None:
        return
    v["engine_crash_line"] = crash.line
    real = [e for e in exceptions if not _is_wrapper(e)]
    picked = real[-1] if real else (exceptions[-1] if exceptions else crash)
    v["engine_error_text"] = picked.text[:300]
    v["engine_error_line"] = picked.line
    v["engine_error_exception"] = picked.values.get("exception")
    v["crash_explained"] = any(
        log.of(kind) and (kind != "swap_space_too_large" or any(e.values.get("fatal") for e in log.of(kind)))
        for kind in RECOGNISED_ERROR_KINDS
    )


FAMILY = Family("log", WRITES, READS, derive)
