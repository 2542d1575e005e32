"""Family budget: the shared definitions of catalogue 2 (spec/rules-catalogue2.md §2), computed
once and read by every rule and family that needs them: the device total T, the engine budget
B, the fields of the last torch OOM (A, F, P, R), the overrun E = P + A − B, the run-time phase
and the headroom at idle H_idle. Also the vLLM release as a number and the engine's environment,
which the catalogue-2 families compare against version boundaries.

These are kvdoctor computations (not vLLM facts); a value that cannot be formed is None and the
rules that need it stay silent."""

from __future__ import annotations

import math

from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.units import GiB
from kvdoctor.vllm_flags import version_tuple

WRITES: dict[str, str] = {
    "vllm_release": "int; the vLLM version as major × 100 + minor (0.25.1 → 25), for version boundaries",
    "device_total_bytes": "bytes; T: the engine GPU's total memory (NVML / nvidia-smi memory.total, else the OOM's 'total capacity', else the post-warm-up summary)",
    "summary_consumed_bytes": "bytes; post-warm-up summary 'GiB for consumed memory' (weights + non-torch on ≤0.26)",
    "summary_activation_bytes": "bytes; post-warm-up summary 'GiB for peak activation' (else the DEBUG profile's torch peak increase)",
    "summary_non_torch_bytes": "bytes; post-warm-up summary 'GiB for non-torch memory' (else the DEBUG profile's non-torch increase)",
    "summary_cudagraph_bytes": "bytes; post-warm-up summary 'GiB for CUDAGraph memory'",
    "kv_cache_memory_bytes_set": "bool; --kv-cache-memory-bytes is given (gmu does not size the KV cache)",
    "engine_budget_bytes": "bytes; B: ceil(gmu × T) (vLLM's requested memory); with --kv-cache-memory-bytes, consumed + peak activation + CUDA graphs + KV bytes from the post-warm-up summary (None when it is not logged)",
    "oom_process_bytes": "bytes; P: 'this process has X memory in use' of the last torch OOM, else the engine pids' NVML used memory on its GPU",
    "oom_process_source": "str; where P comes from ('torch OOM message' or 'NVML per-process used memory')",
    "oom_overrun_bytes": "bytes; E = P + A − B: what the engine process tried to hold beyond its own budget (> 0: vLLM outgrew its plan)",
    "runtime_start_line": "int; log line where the run-time phase begins: 'init engine (profile, create kv cache, warmup model) took', else the first stats line with non-zero throughput",
    "oom_at_runtime": "bool; the last torch OOM is in the run-time phase (its phase, or a line after runtime_start_line)",
    "idle_headroom_bytes": "bytes; H_idle = T − NVML used, on the engine's fullest GPU, in the snapshot read (the last sample)",
    "engine_env": "dict[str, str]; the engine's environment: env.txt / live env, then the launch command's VAR=value prefix (which wins)",
    "alloc_conf_expandable": "bool; expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF",
    "vllm_kv_memory_fit_bytes": "bytes per GPU; vLLM's own suggestion '--kv-cache-memory=B1' to fit into requested memory (post-warm-up summary, vllm-facts §3.3 item 10: requested − consumed − peak activation − CUDA graphs − 150 MiB)",
    "vllm_kv_memory_full_bytes": "bytes per GPU; its '--kv-cache-memory=B2' to fully use the GPU (initial free − the same)",
    "vllm_kv_in_use_bytes": "bytes per GPU; 'Current kv cache memory in use is X' of that summary",
    "vllm_kv_memory_line": "int; the summary's log line",
    "startup_refusal_variant": "str; which startup refusal vLLM logged: 'util' (free < gmu × total), 'external_weights_exceed' ('Externally held weights on device … exceed the desired GPU memory utilization'), 'below_budget_excluding_external'",
    "external_weights_bytes": "bytes; weights held by another process (a `vllm preload` daemon) on the device: 'Externally held weights on device … (X/T GiB)', else gmu × total − the budget 'after excluding external process's weights'",
    "usable_device_bytes": "bytes; the memory the engine's device really has: on a MIG instance the total CUDA reports inside it (the torch OOM's 'total capacity', the post-warm-up summary, the startup refusal; never the parent card's nvidia-smi total), under NoPermission the catalogue's memory for the card's name, else nvidia-smi / NVML memory.total; None when unknown",
    "external_weights_gmu": "fraction; the gmu at which the engine's budget holds the external weights plus 1 GiB of KV and 0.5 GiB of margin (rounded up to 0.01), None above 0.95",
}
READS: frozenset[str] = frozenset(
    {
        "vllm_version",
        "gmu",
        "gpu_total_bytes",
        "gpu_used_bytes",
        "engine_gpus",
        "oom_line",
        "oom_phase",
        "oom_requested_bytes",
        "oom_total_bytes",
        "oom_gpu",
        "expandable_segments_on",
        "gpu_mig",
        "gpu_no_permission",
    }
)


def release(version: str | None) -> int | None:
    """``"0.25.1"`` → 25, ``"1.2.0"`` → 102; None when unknown."""
    vt = version_tuple(version)
    if not vt:
        return None
    return vt[0] * 100 + (vt[1] if len(vt) > 1 else 0)


def engine_env(s: Scope) -> dict[str, str]:
    """The engine's environment variables (redacted already by the sources): the snapshot's
    env (env.txt, live env), overridden by the launch command's ``VAR=value`` prefix."""
    env = {k: str(v) for k, v in (s.snapshot.env or {}).items()}
    cmd_env = s.cfg.args.get("_env") if s.cfg is not None else None
    if isinstance(cmd_env, dict):
        env.update({str(k): str(v) for k, v in cmd_env.items()})
    return env


def derive(s: Scope, v: Vars) -> None:
    """T, B, the OOM fields and E, the run-time phase and H_idle."""
    v["vllm_release"] = release(v["vllm_version"])
    env = engine_env(s)
    v["engine_env"] = env
    confs = (env.get("PYTORCH_CUDA_ALLOC_CONF") or "") + "," + (env.get("PYTORCH_ALLOC_CONF") or "")
    v["alloc_conf_expandable"] = bool(v["expandable_segments_on"]) or (
        "expandable_segments:true" in confs.replace(" ", "").lower()
    )
    log = s.log
    summary = log.last("memory_summary") if log is not None else None
    sv = summary.values if summary is not None else {}
    prof = log.last("memory_profile_v1") if log is not None else None
    pv = prof.values if prof is not None else {}
    v["summary_consumed_bytes"] = sv.get("consumed_bytes")
    v["summary_activation_bytes"] = (
        sv.get("activation_peak_bytes")
        if sv.get("activation_peak_bytes") is not None
        else pv.get("torch_peak_increase_bytes")
    )
    v["summary_non_torch_bytes"] = (
        sv.get("non_torch_bytes")
        if sv.get("non_torch_bytes") is not None
        else pv.get("non_torch_increase_bytes")
    )
    v["summary_cudagraph_bytes"] = sv.get("cudagraph_bytes")
    total = v["gpu_total_bytes"] or v["oom_total_bytes"] or sv.get("total_bytes")
    v["device_total_bytes"] = total
    if v["gpu_mig"]:
        # nvidia-smi's memory.total of a MIG-enabled card is the parent's; CUDA inside the
        # instance reports the slice (what vLLM's profiler and torch's OOM message see).
        fbu = log.last("free_memory_below_util") if log is not None else None
        v["usable_device_bytes"] = (
            v["oom_total_bytes"]
            or sv.get("total_bytes")
            or (fbu.values.get("total_bytes") if fbu is not None else None)
        )
    else:
        v["usable_device_bytes"] = v["gpu_total_bytes"]
    v["vllm_kv_memory_fit_bytes"] = sv.get("kv_cache_memory_fit_bytes")
    v["vllm_kv_memory_full_bytes"] = sv.get("kv_cache_memory_full_bytes")
    v["vllm_kv_in_use_bytes"] = sv.get("kv_in_use_bytes")
    v["vllm_kv_memory_line"] = summary.line if summary is not None else None
    _external(s, v)
    _budget(s, v, sv)
    _oom(s, v)
    if total and v["gpu_used_bytes"] is not None:
        v["idle_headroom_bytes"] = max(0, total - v["gpu_used_bytes"])


def _external(s: Scope, v: Vars) -> None:
    """Externally held weights (vLLM ≥ 0.32, a ``vllm preload`` daemon): the refusal's variant,
    the external bytes and the gmu that holds them (vllm-facts §2.1 and §3.5)."""
    log = s.log
    ev = log.last("free_memory_below_util") if log is not None else None
    if ev is None:
        return
    fv = ev.values
    variant = fv.get("variant") or "util"
    v["startup_refusal_variant"] = variant
    total = fv.get("total_bytes")
    ext: int | None = None
    if variant == "external_weights_exceed":
        ext = fv.get("free_bytes")  # that message's "(X/T GiB)" is the external weights
    elif (
        variant == "below_budget_excluding_external" and total and fv.get("gmu") and fv.get("requested_bytes")
    ):
        # "the engine's budget after excluding external process's weights (gmu, B GiB)"
        ext = max(0, math.ceil(fv["gmu"] * total) - int(fv["requested_bytes"]))
    v["external_weights_bytes"] = ext
    if variant == "external_weights_exceed" and ext and total:
        need = (ext + GiB + GiB // 2) / total
        gmu = math.ceil(need * 100 - 1e-9) / 100
        v["external_weights_gmu"] = gmu if gmu <= 0.95 else None


def _budget(s: Scope, v: Vars, sv: dict[str, int | None]) -> None:
    total, gmu = v["device_total_bytes"], v["gmu"]
    v["kv_cache_memory_bytes_set"] = bool(s.cfg.kv_cache_memory_bytes)
    if s.cfg.kv_cache_memory_bytes:
        # vllm-facts §3.3 item 10: with explicit KV bytes gmu does not size the engine.
        parts = [sv.get("consumed_bytes"), sv.get("activation_peak_bytes")]
        if all(p is not None for p in parts):
            v["engine_budget_bytes"] = int(
                sum(p or 0 for p in parts) + (sv.get("cudagraph_bytes") or 0) + s.cfg.kv_cache_memory_bytes
            )
        return
    if total and gmu:
        v["engine_budget_bytes"] = math.ceil(gmu * total)


def _oom(s: Scope, v: Vars) -> None:
    log = s.log
    if log is None:
        return
    inits = log.of("engine_init_done")
    start = inits[0].line if inits else None
    if start is None:
        for e in log.of("stats"):
            if (e.values.get("prompt_throughput") or 0) > 0 or (
                e.values.get("generation_throughput") or 0
            ) > 0:
                start = e.line
                break
    v["runtime_start_line"] = start
    ooms = log.of("cuda_oom")
    if not ooms:
        return
    last = ooms[-1]
    v["oom_at_runtime"] = v["oom_phase"] == "runtime" or (start is not None and last.line > start)
    p = last.values.get("this_process_bytes")
    source = "torch OOM message" if p is not None else None
    if p is None:
        # torch drops the per-process figure when NVML fails: the engine pids' NVML used memory.
        gpu_idx = v["oom_gpu"] if v["oom_gpu"] is not None else (v["engine_gpus"] or [None])[0]
        for g in s.visible:
            if g.index == gpu_idx:
                mine = [q.used_bytes for q in g.processes if q.pid in s.engine_pids and q.used_bytes]
                if mine:
                    p, source = sum(mine), "NVML per-process used memory"
    v["oom_process_bytes"], v["oom_process_source"] = p, source
    a, b = v["oom_requested_bytes"], v["engine_budget_bytes"]
    if p is not None and a is not None and b is not None:
        v["oom_overrun_bytes"] = int(p + a - b)


FAMILY = Family("budget", WRITES, READS, derive)
