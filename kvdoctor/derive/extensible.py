"""Family extensible: vLLM 0.34's KV sizing as rules read it (spec/vllm-0.34.md §1; reference
/vllm-facts.md §9).

The version and the mode (``vllm_v34``, ``vllm_sizing_mode``, with the evidence or the
assumption), the resolved gmu u and what it assumed, the committed KV pool against the
reservation ``Available KV cache memory`` (on the extensible path only an address reservation),
the ``Memory after warmup`` figures (F1, c, kept = max(Tr, Gr), Tr, Gr, N, R, the torch cap L),
the margin μ and the headroom torch may still grow into, the hint form of a KV-fit error and
whether it came after graph capture, the 0.34 auto-fit lines, the gmu cap WARNING, the V1-runner
error and environment, the block size in effect and where it came from, and the token
occupancy that 64-token blocks leave behind ``vllm:kv_cache_usage_perc``.

Engines of vLLM < 0.34 get ``vllm_sizing_mode`` "estimate" and the 0.34-only variables None;
engines whose version is unknown get None with the assumption stated. Nothing here changes
what a variable of another family means."""

from __future__ import annotations

from typing import Any

from kvdoctor import kvmath
from kvdoctor.derive.base import Family, Scope, Vars, num
from kvdoctor.derive.engines import sizing_decision
from kvdoctor.units import GiB
from kvdoctor.vllm_defaults import defaults_for, is_known_version, is_v034
from kvdoctor.vllm_flags import default_max_num_batched_tokens

#: μ's floor and the torch reserve outside the cap, CUDA (vllm-facts §9.2 steps 6 and 8);
#: ROCm uses 3 GiB and 1 GiB.
MARGIN_FLOOR_BYTES = GiB
NON_TORCH_RESERVE_BYTES = GiB // 2

WRITES: dict[str, str] = {
    "vllm_v34": "bool; the engine is vLLM ≥ 0.34: its version ('vLLM API server version', the banner, the engine-config line), or vllm:cache_config_info has the enable_extensible_kv_cache label (0.34+ only, vllm-facts §9.8)",
    "vllm_version_known": "bool; the engine's vLLM version was read and kvdoctor knows it (≤ 0.34.x)",
    "vllm_defaults_version": "str; the version whose defaults (gmu, block size, batch tiers) were applied: the engine's, '0.34' for a label-only 0.34 engine, else '0.33' (assumed)",
    "vllm_assumption": "str; what kvdoctor assumed about the version and sizing mode, in words (None when nothing was assumed)",
    "vllm_sizing_mode": "'extensible'|'estimate'|None; how the engine sized its KV cache (spec/vllm-0.34.md §1): extensible = 0.34's measured, after-warm-up pool; estimate = the profile-run estimate (every version before 0.34, and 0.34 with the extensible KV cache off); None when the version is unknown",
    "vllm_sizing_mode_source": "str; the evidence for vllm_sizing_mode: a log line ('Memory after warmup' / 'Extended KV cache to' / 'Disabling the extensible KV cache: …'), a flag, the cache_config_info label, the version, or 'assumed: …'",
    "vllm_sizing_mode_assumed": "bool; vllm_sizing_mode is 0.34's default, not proven by the log (the label 'True' is only the config-time value)",
    "extensible_configured": "bool; vllm:cache_config_info enable_extensible_kv_cache label (the frontend's config-time value, not proof it ran); None without the label",
    "extensible_disabled_reason": "str; 'Disabling the extensible KV cache: REASON' (run-time fallback, WARNING) or 'no IMEX channel' (INFO 'Extensible KV cache off: …')",
    "extensible_disabled_line": "int; its log line",
    "gmu_resolved": "fraction; u: the explicit --gpu-memory-utilization (flag, non-default args, cache_config_info label not 'None'), else 1.0 on 0.34 extensible, 0.92 on 0.34 estimate and 0.20–0.33, 0.9 before (vllm-facts §9.3); equals gmu",
    "gmu_assumption": "str; where gmu_resolved comes from ('explicit --gpu-memory-utilization 0.9', 'unset: 1.0 with the extensible KV cache', 'unset: 0.92 (vLLM 0.33 default, assumed: version unknown)', …)",
    "kv_reservation_bytes": "bytes per GPU; on 0.34 extensible the smallest 'Available KV cache memory: X GiB' over workers: an address-space reservation R − C − P, NOT the KV pool (vllm-facts §9.2 step 3); None in estimate mode (there it is the pool: log_available_kv_bytes)",
    "kv_pool_bytes": "bytes per GPU; the KV pool: extensible = smallest 'Extended KV cache to N blocks (X GiB)' (physical, granule-rounded), else kv_pool_blocks × kv_block_bytes, else 'Memory after warmup' '(X GiB)'; estimate = 'Available KV cache memory' (smallest over workers, ≥ 0)",
    "kv_pool_source": "str; where kv_pool_bytes comes from",
    "kv_pool_blocks": "blocks; N: smallest 'Extended KV cache to N blocks', else smallest 'Memory after warmup … N KV cache blocks' (the engine takes the minimum over ranks), else vllm:cache_config_info num_gpu_blocks ÷ data-parallel engines (0.34: the committed N)",
    "kv_block_bytes": "bytes; b: KV bytes per block per GPU rank at the block size in effect (kvmath over config.json; None without the model's config)",
    "warmup_line": "int; log line of the last 'Memory after warmup: …' (extensible only)",
    "warmup_free_bytes": "bytes; F1, 'X GiB free' of 'Memory after warmup' (smallest over ranks)",
    "warmup_committed_bytes": "bytes; c, 'X GiB committed to the KV cache' (KV blocks still mapped at the measurement)",
    "warmup_kept_bytes": "bytes; kept = max(Tr, Gr), 'X GiB kept for transient activations' (largest over ranks)",
    "warmup_transient_peak_bytes": "bytes; Tr, 'X GiB allocated at peak' (largest over ranks)",
    "warmup_torch_growth_bytes": "bytes; Gr, 'X GiB of torch reservation growth' (largest over ranks)",
    "warmup_blocks_per_rank": "list[int]; each rank's 'N KV cache blocks' of 'Memory after warmup', in log order (before the minimum over ranks)",
    "warmup_requested_bytes": "bytes; R, 'fit within the requested X GiB' (= ceil(u × T))",
    "torch_cap_bytes": "bytes; L, 'Torch may reserve up to X GiB' (smallest over ranks): torch's per-process cap after startup on 0.34 extensible",
    "warmup_margin_bytes": "bytes; μ = max(1 GiB, 0.75 × Tr) (CUDA; 3 GiB on ROCm, not detected): the device margin the after-warm-up sizing keeps (vllm-facts §9.2 step 8)",
    "torch_headroom_bytes": "bytes; H_torch = F1 − (kv_pool_bytes − c) − 0.5 GiB: what torch's reserved memory may still grow after startup before it hits the cap L (vllm-facts §9.2 step 8 left_free; exact up to granule rounding)",
    "idle_headroom_design_bytes": "bytes; μ + kept: the free memory a 0.34 extensible engine leaves at idle by design (spec §1 H_idle)",
    "kv_hint": "'H1'|'H2'|'H3'; the hint of the last KV-fit error (vllm-facts §9.4): H1 non-extensible (the 0.33 wording), H2 extensible with gmu < 1.0, H3 extensible at gmu 1.0",
    "kv_hint_error": "str; which error carried it: 'no_available_kv_memory', 'max_seq_len_exceeds_kv', 'autofit_failed'",
    "kv_hint_gmu": "fraction; the gmu an H2 hint prints",
    "kv_hint_line": "int; its log line",
    "kv_error_after_warmup": "bool; the last KV-fit error was raised after CUDA-graph capture and warm-up (its hint names 'CUDA graphs and warmup', 'CUDA graph capture and warmup left no memory for the KV cache', or it follows 'Memory after warmup')",
    "autofit_tentative_len": "tokens; the pre-warm-up auto-fit length ('Auto-fit max_model_len: … ; the final length is set after CUDA graph capture and warmup')",
    "autofit_final_len": "tokens; the final auto-fit length ('Auto-fit max_model_len: using max_model_len=N, …' or '--max-model-len auto reduced max_model_len from A to N …')",
    "autofit_final_from": "tokens; A of '--max-model-len auto reduced max_model_len from A to N' (None when not reduced)",
    "autofit_short": "bool; the WARNING form 'Requests longer than N tokens will be rejected' (final length < 8192)",
    "gmu_cap_warning": "bool; vLLM's WARNING 'gpu_memory_utilization=u caps this instance at R GiB, keeping W GiB of free device memory out of the KV cache' was logged",
    "gmu_cap_withheld_bytes": "bytes; W of that WARNING",
    "max_model_len_fit_pool": "tokens; the longest request the committed pool holds: vLLM's binary search over kv_pool_blocks × b (null block held back), a multiple of the block size for one full-attention group; None without N or the model",
    "kv_memory_for_pool_bytes": "bytes per GPU; kv_pool_blocks × kv_block_bytes: the --kv-cache-memory-bytes that reproduces the extensible pool (it turns the extensible cache off, vllm-facts §9.6)",
    "kv_cache_memory_disables_extensible": "bool; --kv-cache-memory-bytes (or --num-gpu-blocks-override) is set on a 0.34 engine: it turned the extensible KV cache off (budget 0.92 when gmu is unset, startup free check back, torch uncapped)",
    "kv_cache_device": "str; the device of the log's '<DEV> KV cache size' line, upper-case ('GPU' on CUDA/ROCm, 'CPU', 'XPU', …): the extensible KV cache exists only on CUDA/ROCm",
    "kv_cache_memory_bytes_value": "bytes per GPU; --kv-cache-memory-bytes in effect (the flag or 'non-default args' kv_cache_memory_bytes), None when unset",
    "graph_estimate_bytes": "bytes; E, the CUDA-graph estimate a non-extensible engine subtracted: 'CUDA graph pool memory: … E GiB (estimated)', else (u − u_equiv) × T from 'CUDA graph memory profiling is enabled … is equivalent to --gpu-memory-utilization=u_equiv'",
    "v1_runner_env": "str; VLLM_USE_V2_MODEL_RUNNER in the engine's environment (env.txt / live env / the command's VAR=value), None when unset",
    "v1_runner_removed_line": "int; log line of 'VLLM_USE_V2_MODEL_RUNNER=V is no longer supported: Model Runner V1 has been removed'",
    "vmm_driver_oom_line": "int; log line of the last 'GPU driver error 2: out of memory' (a KV commit / wake-up / restore that could not map memory)",
    "torch_cap_rejected_line": "int; log line of torch's 'Allocation was preemptively rejected because it would exceed per_process_memory_fraction limit'",
    "startup_plan_kv_bytes": "bytes per GPU; 'Applying persisted startup plan (fingerprint …): kv_cache_memory_bytes=N' (VLLM_ENABLE_STARTUP_PLAN=1)",
    "block_size_source": "str; where block_size comes from: 'cache_config_info', '--block-size', 'log' (a backend's 'Setting kv cache block size to N' or the KV lines), or 'default 64 (vLLM ≥ 0.34)' / 'default 16 (…)'",
    "decode_graph_max_requests": "requests; n_dec, the widest decode CUDA graph with no capture sizes set: max_num_seqs on SM100 (B200/GB200/B300), min(max_num_seqs, 512) elsewhere (spec §1; 0.34)",
    "prefill_graph_max_tokens": "tokens; t_pre, the widest prefill CUDA graph: min(8192, max_num_batched_tokens) on SM100, min(2 × max_num_seqs, 512, max_num_batched_tokens) elsewhere (spec §1; 0.34)",
    "startup_free_bytes": "bytes; F0, free device memory at the engine's start: 'Free memory on device (F0/T GiB) on startup' of the post-warm-up summary, else the startup refusal's free figure, else the DEBUG 'Initial free memory'",
    "typical_request_blocks": "blocks; req_blocks(typical_request_tokens): cdiv(n, B) for a full-attention model, the group-aware count of kvmath otherwise (vllm-facts §9.9: blocks, not tokens, run out)",
    "kv_pool_requests_typical": "requests; (kv_pool_blocks − 1) // typical_request_blocks: typical requests the committed pool holds at once, counted in blocks",
    "kv_shortfall_bytes": "bytes; S = b × req_blocks(max_model_len) − (kv_pool_blocks − 1) × b: what one max_model_len request lacks in the pool (≤ 0: it fits; spec N2)",
    "sampler_warmup_requests": "requests; N of the sampler warm-up, min(max_num_seqs, max_num_batched_tokens) (0.34 no longer prints it, gpu_worker.py:1184-1187)",
    "oom_allowed_bytes": "bytes; the last torch OOM's 'X allowed' part (torch's per-process cap, present under 0.34's torch cap)",
    "torch_cap_overrun_bytes": "bytes; Δ = allocated by PyTorch + reserved but unallocated + the failed allocation − L, from the last torch OOM and 'Torch may reserve up to L' (> 0: the step went past the torch cap)",
    "unified_memory_gpu": "bool; the GPU is an integrated / unified-memory device (name GB10 / DGX Spark, Jetson, Orin, Thor): vLLM reads its free memory from the host (vllm-facts §9, spec N6)",
    "block_size_16_valid": "bool; --block-size 16 is one the engine's attention backend takes (FLASH_ATTN, FLASHINFER, TRITON_ATTN, TRITON_MLA) and no hybrid alignment overrides it (vllm-facts §9.9); False for FLASHMLA, CUTLASS_MLA, FLASHINFER_MLA or a hybrid model; None when the backend is unknown",
    "kv_padding_tokens_per_request": "tokens; (B − 1)/2, the average padding a request's last block holds (31.5 at B = 64, 7.5 at B = 16; vllm-facts §9.9)",
    "kv_token_occupancy": "fraction; token occupancy behind kv_usage: kv_usage × n / (n + (B − 1)/2) with n = typical_request_tokens (vllm-facts §9.9); None without usage or n",
}
READS: frozenset[str] = frozenset(
    {
        "vllm_version",
        "gmu",
        "gmu_explicit",
        "block_size",
        "tp",
        "pp",
        "kv_cache_dtype",
        "max_model_len",
        "max_num_batched_tokens",
        "device_total_bytes",
        "log_available_kv_bytes",
        "engine_env",
        "max_num_seqs_effective",
        "gpu_name",
        "gpu_total_bytes",
        "kv_usage",
        "typical_request_tokens",
        "max_num_seqs",
        "attention_backend",
    }
)

_SM100_NAMES = ("B200", "B300", "GB200", "GB300", "B100")


def _min(xs: list[Any]) -> Any:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return min(xs) if xs else None


def _max(xs: list[Any]) -> Any:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return max(xs) if xs else None


def derive(s: Scope, v: Vars) -> None:
    """0.34 sizing variables of one engine (see :data:`WRITES`)."""
    log = s.log
    version = v["vllm_version"]
    cc = s.series[-1].cache_config if s.series else {}
    decision = sizing_decision(s.cfg, log, cc)
    v34 = is_v034(version) or decision is not None
    known = is_known_version(version)
    v["vllm_v34"] = v34
    v["vllm_version_known"] = known
    notes: list[str] = []
    if decision is not None:
        mode: str | None = decision.mode
        v["vllm_sizing_mode_source"] = decision.source
        v["vllm_sizing_mode_assumed"] = decision.assumed
        v["extensible_configured"] = decision.configured
        v["vllm_defaults_version"] = version if is_v034(version) else "0.34"
        if not is_v034(version):
            notes.append(
                "vLLM version not read; 0.34 from the cache_config_info enable_extensible_kv_cache label"
            )
        if decision.assumed:
            src = decision.source.removeprefix("assumed: ")
            notes.append(f"KV sizing mode {decision.mode}: {src}")
    elif known:
        mode = "estimate"
        v["vllm_sizing_mode_source"] = f"vLLM {version}: estimate-based sizing (the only mode before 0.34)"
        v["vllm_sizing_mode_assumed"] = False
        v["vllm_defaults_version"] = version
    else:
        mode = None
        resolved = defaults_for(version)
        v["vllm_defaults_version"] = resolved.version
        v["vllm_sizing_mode_assumed"] = True
        v["vllm_sizing_mode_source"] = "unknown: the vLLM version was not read"
        if resolved.assumption:
            notes.append(resolved.assumption)
    v["vllm_sizing_mode"] = mode
    v["vllm_assumption"] = "; ".join(notes) or None
    _gmu(s, v, mode, known)
    _block_size(s, v, cc)
    layout = _layout(s, v)
    if log is not None:
        _log(s, v, mode)
    _pool(s, v, mode, cc, layout)
    _graphs(v)
    _occupancy(v)
    _block16(s, v)
    _requests(s, v, layout)
    env = v["engine_env"] or {}
    v["v1_runner_env"] = env.get("VLLM_USE_V2_MODEL_RUNNER")
    v["kv_cache_memory_bytes_value"] = s.cfg.kv_cache_memory_bytes
    size = log.last("kv_cache_size") if log is not None else None
    if size is not None and size.values.get("device"):
        v["kv_cache_device"] = str(size.values["device"]).upper()[:16]
    v["kv_cache_memory_disables_extensible"] = bool(
        v34 and (s.cfg.kv_cache_memory_bytes is not None or s.cfg.num_gpu_blocks_override is not None)
    )


def _gmu(s: Scope, v: Vars, mode: str | None, known: bool) -> None:
    u = v["gmu"]
    v["gmu_resolved"] = u
    if u is None:
        return
    if v["gmu_explicit"]:
        v["gmu_assumption"] = f"explicit --gpu-memory-utilization {u:g}"
    elif mode == "extensible":
        v["gmu_assumption"] = f"unset: {float(u)!r} with the extensible KV cache (vLLM ≥ 0.34)"
    elif mode == "estimate":
        v["gmu_assumption"] = (
            f"unset: {float(u)!r}, vLLM {v['vllm_defaults_version']}'s default without the extensible KV cache"
        )
    else:
        v["gmu_assumption"] = (
            f"unset: {float(u)!r} (vLLM {v['vllm_defaults_version']}'s default, assumed: version unknown)"
        )


def _block_size(s: Scope, v: Vars, cc: dict[str, str]) -> None:
    cfg = s.cfg
    if "block_size" in cfg.explicit:
        src = "--block-size"
    elif num(cc.get("block_size")) is not None:
        src = "cache_config_info"
    elif s.log is not None and s.log.last("backend_block_size") is not None:
        src = "log: 'Setting kv cache block size to N for … backend(s)'"
    elif v["block_size"] not in (16, 64) or (v["block_size"] == 16 and v["vllm_v34"]):
        src = "log: the KV-cache lines"
    else:
        src = f"default {v['block_size']} (vLLM {v['vllm_defaults_version']})"
    v["block_size_source"] = src


def _layout(s: Scope, v: Vars) -> kvmath.KvLayout | None:
    if s.arch is None or not v["block_size"]:
        return None
    try:
        layout = kvmath.kv_layout(
            s.arch,
            tensor_parallel_size=v["tp"] or 1,
            pipeline_parallel_size=v["pp"] or 1,
            kv_cache_dtype=v["kv_cache_dtype"] or "auto",
            block_size=int(v["block_size"]),
            max_num_batched_tokens=v["max_num_batched_tokens"],
            dtype=s.cfg.dtype,
        )
    except (ValueError, ZeroDivisionError):
        return None
    v["kv_block_bytes"] = layout.bytes_per_block
    return layout


def _log(s: Scope, v: Vars, mode: str | None) -> None:
    log = s.log
    assert log is not None
    off = log.last("extensible_disabled")
    if off is not None:
        v["extensible_disabled_reason"] = off.values.get("reason")
        v["extensible_disabled_line"] = off.line
    warm = log.of("memory_after_warmup")
    if warm:
        vals = [e.values for e in warm]
        v["warmup_line"] = warm[-1].line
        v["warmup_free_bytes"] = _min([x.get("free_bytes") for x in vals])
        v["warmup_committed_bytes"] = _max([x.get("committed_bytes") for x in vals])
        v["warmup_kept_bytes"] = _max([x.get("kept_bytes") for x in vals])
        v["warmup_transient_peak_bytes"] = tr = _max([x.get("transient_peak_bytes") for x in vals])
        v["warmup_torch_growth_bytes"] = _max([x.get("torch_growth_bytes") for x in vals])
        v["warmup_blocks_per_rank"] = [int(x["blocks"]) for x in vals if isinstance(x.get("blocks"), int)]
        v["warmup_requested_bytes"] = _max([x.get("requested_bytes") for x in vals])
        v["torch_cap_bytes"] = _min([x.get("torch_cap_bytes") for x in vals])
        if tr is not None:
            v["warmup_margin_bytes"] = max(MARGIN_FLOOR_BYTES, int(0.75 * tr))
            if v["warmup_kept_bytes"] is not None:
                v["idle_headroom_design_bytes"] = v["warmup_margin_bytes"] + v["warmup_kept_bytes"]
    hint = log.last("kv_hint")
    if hint is not None:
        v["kv_hint"] = hint.values.get("hint")
        v["kv_hint_error"] = hint.values.get("error")
        v["kv_hint_gmu"] = hint.values.get("gmu")
        v["kv_hint_line"] = hint.line
    errs = [
        e for k in ("no_available_kv_memory", "max_seq_len_exceeds_kv", "autofit_failed") for e in log.of(k)
    ]
    if errs:
        last = max(errs, key=lambda e: e.line)
        after = bool(hint is not None and hint.line == last.line and hint.values.get("after_warmup"))
        after = after or any(e.line == last.line for e in log.of("autofit_failed_after_warmup"))
        after = after or bool(warm and warm[0].line < last.line)
        v["kv_error_after_warmup"] = after
    for e in log.of("autofit_034"):
        if e.values.get("phase") == "tentative":
            v["autofit_tentative_len"] = e.values.get("to")
        else:
            v["autofit_final_len"] = e.values.get("to")
            v["autofit_final_from"] = e.values.get("from")
            v["autofit_short"] = bool(e.values.get("short"))
    cap = log.last("gmu_cap_warning")
    v["gmu_cap_warning"] = cap is not None
    if cap is not None:
        v["gmu_cap_withheld_bytes"] = cap.values.get("withheld_bytes")
    for kind, name in (
        ("v1_runner_removed", "v1_runner_removed_line"),
        ("torch_cap_rejected", "torch_cap_rejected_line"),
    ):
        ev = log.last(kind)
        v[name] = ev.line if ev is not None else None
    vmm = [e for e in log.of("vmm_driver_error") if e.values.get("oom")]
    v["vmm_driver_oom_line"] = vmm[-1].line if vmm else None
    plan = log.last("startup_plan_applied")
    if plan is not None:
        v["startup_plan_kv_bytes"] = plan.values.get("kv_cache_memory_bytes")
    if mode == "estimate" and v["vllm_v34"]:
        pool = log.last("cudagraph_pool")
        prof = log.last("cudagraph_profiling")
        total = v["device_total_bytes"]
        if pool is not None and pool.values.get("estimated_bytes") is not None:
            v["graph_estimate_bytes"] = pool.values["estimated_bytes"]
        elif (
            prof is not None
            and total
            and prof.values.get("equivalent_gmu") is not None
            and prof.values.get("gmu")
        ):
            v["graph_estimate_bytes"] = max(
                0, int((prof.values["gmu"] - prof.values["equivalent_gmu"]) * total)
            )


def _pool(s: Scope, v: Vars, mode: str | None, cc: dict[str, str], layout: kvmath.KvLayout | None) -> None:
    log = s.log
    b = v["kv_block_bytes"]
    n: int | None = None
    src: str | None = None
    pool: int | None = None
    if mode == "extensible":
        if log is not None:
            v["kv_reservation_bytes"] = v["log_available_kv_bytes"]
            ext = log.of("kv_extended")
            if ext:
                e = min(ext, key=lambda e: e.values.get("blocks") or 0)
                n = e.values.get("blocks")
                pool = e.values.get("bytes")
                src = f"log line {e.line}: Extended KV cache to N blocks (X GiB)"
            elif v["warmup_blocks_per_rank"]:
                n = min(v["warmup_blocks_per_rank"])
                warm = [e for e in log.of("memory_after_warmup") if e.values.get("blocks") == n]
                if b:
                    pool, src = n * b, "'Memory after warmup' N KV cache blocks × b"
                elif warm:
                    pool, src = warm[0].values.get("blocks_bytes"), "'Memory after warmup' (X GiB)"
        if n is None:
            blocks = num(cc.get("num_gpu_blocks"))
            if blocks:
                # summed over data-parallel engines (vllm-facts §9.8)
                n = int(blocks) // max(1, s.cfg.data_parallel_size or 1)
                if b:
                    pool, src = n * b, "cache_config_info num_gpu_blocks × b"
    elif mode == "estimate" or mode is None:
        a = v["log_available_kv_bytes"]
        if a is not None:
            pool, src = max(0, int(a)), "'Available KV cache memory' (the pool in estimate mode)"
    v["kv_pool_blocks"] = n
    v["kv_pool_bytes"] = pool
    v["kv_pool_source"] = src
    if n is not None and b:
        v["kv_memory_for_pool_bytes"] = n * b
        mml = v["max_model_len"]
        if layout is not None and isinstance(mml, int) and mml > 0:
            try:
                v["max_model_len_fit_pool"] = kvmath.estimated_max_model_len(n * b, layout, mml)
            except (ValueError, ZeroDivisionError):
                pass
    f1, c = v["warmup_free_bytes"], v["warmup_committed_bytes"]
    if mode == "extensible" and f1 is not None and pool is not None:
        v["torch_headroom_bytes"] = max(0, int(f1 - (pool - (c or 0)) - NON_TORCH_RESERVE_BYTES))


def _graphs(v: Vars) -> None:
    if not v["vllm_v34"]:
        return
    seqs = v["max_num_seqs_effective"]
    name = (v["gpu_name"] or "").upper()
    mnbt = v["max_num_batched_tokens"] or default_max_num_batched_tokens(
        v["vllm_defaults_version"], v["gpu_total_bytes"], v["gpu_name"]
    )
    if not seqs:
        return
    sm100 = any(t in name for t in _SM100_NAMES)
    v["decode_graph_max_requests"] = int(seqs) if sm100 else min(int(seqs), 512)
    v["prefill_graph_max_tokens"] = min(8192, mnbt) if sm100 else min(2 * int(seqs), 512, mnbt)


_UNIFIED_NAMES = ("GB10", "JETSON", "ORIN", "THOR", "DGX SPARK")


def _requests(s: Scope, v: Vars, layout: kvmath.KvLayout | None) -> None:
    """F0, requests in blocks, the sampler warm-up size, the torch-cap overrun of a torch OOM."""
    log = s.log
    bs = v["block_size"]
    if log is not None:
        summary = log.last("memory_summary")
        refusal = log.last("free_memory_below_util")
        request = log.last("memory_request")
        for ev, key in ((summary, "free_bytes"), (refusal, "free_bytes"), (request, "initial_free_bytes")):
            if ev is not None and isinstance(ev.values.get(key), int):
                v["startup_free_bytes"] = ev.values[key]
                break
        oom = log.last("cuda_oom")
        if oom is not None:
            ov = oom.values
            v["oom_allowed_bytes"] = ov.get("allowed_bytes")
            parts = (
                ov.get("allocated_by_pytorch_bytes"),
                ov.get("reserved_unallocated_bytes"),
                ov.get("requested_bytes"),
            )
            cap = v["torch_cap_bytes"]
            if cap is not None and all(isinstance(x, (int, float)) for x in parts):
                v["torch_cap_overrun_bytes"] = int(sum(parts)) - int(cap)  # type: ignore[arg-type]
    n_typ = v["typical_request_tokens"]
    if bs and n_typ:
        blocks = layout.blocks_per_request(int(n_typ)) if layout is not None else -(-int(n_typ) // int(bs))
        v["typical_request_blocks"] = blocks
        if v["kv_pool_blocks"] and blocks > 0:
            v["kv_pool_requests_typical"] = max(0, v["kv_pool_blocks"] - 1) // blocks
    b, n, mml = v["kv_block_bytes"], v["kv_pool_blocks"], v["max_model_len"]
    if b and n and bs and isinstance(mml, int) and mml > 0:
        need = layout.blocks_per_request(mml) if layout is not None else -(-mml // int(bs))
        v["kv_shortfall_bytes"] = b * need - (n - 1) * b
    seqs = v["max_num_seqs"] or v["max_num_seqs_effective"]
    mnbt = v["max_num_batched_tokens"] or (
        default_max_num_batched_tokens(v["vllm_defaults_version"], v["gpu_total_bytes"], v["gpu_name"])
        if v["gpu_total_bytes"]
        else None
    )
    if seqs and mnbt:
        v["sampler_warmup_requests"] = min(int(seqs), int(mnbt))
    name = (v["gpu_name"] or "").upper()
    v["unified_memory_gpu"] = any(t in name for t in _UNIFIED_NAMES) if name else None


#: attention backends that take 16-token blocks, and those that fix the block size (vllm-facts §9.3, §9.9)
_TAKES_16 = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "TRITON_MLA"})
_FIXED_BLOCK = frozenset({"FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASHMLA_SPARSE"})


def _block16(s: Scope, v: Vars) -> None:
    backend = str(v["attention_backend"] or "").upper()
    hybrid = s.log is not None and s.log.last("hybrid_block_size") is not None
    if hybrid or backend in _FIXED_BLOCK:
        v["block_size_16_valid"] = False
    elif backend in _TAKES_16:
        v["block_size_16_valid"] = True


def _occupancy(v: Vars) -> None:
    bs = v["block_size"]
    if not bs:
        return
    pad = (int(bs) - 1) / 2
    v["kv_padding_tokens_per_request"] = pad
    usage, n = v["kv_usage"], v["typical_request_tokens"]
    if usage is not None and n:
        v["kv_token_occupancy"] = usage * n / (n + pad)


FAMILY = Family("extensible", WRITES, READS, derive)
