"""Family workspace: kernel workspaces that live outside vLLM's memory profile
(spec/rules-catalogue2.md §3.2): FlashInfer's fixed workspace buffer
(``flashinfer-workspace-overflow``) and Triton's autotuner scratch (``triton-autotune-oom``).

vLLM facts used (vllm-facts §4.2 env table, catalogue 2 §4.2): the FlashInfer workspace is
``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`` bytes (default 394 MiB from 0.12; a fixed 256 MiB up to
0.11; 2 GiB with ``VLLM_BATCH_INVARIANT=1``); from 0.26 the prefill path enlarges it to
max_num_batched_tokens × query heads per rank × head_dim × 16 B when that is larger. Gated-delta-net
models tune their Triton kernels inside the profile run from 0.18; off compute capability 9.0,
0.17 and earlier tune them on the first real request."""

from __future__ import annotations

from kvdoctor.derive.base import Family, Scope, Vars, gpu_spec
from kvdoctor.units import GiB, MiB

#: config.json architectures with gated-delta-net layers (vLLM 0.18.0 registry).
GDN_ARCHITECTURES = frozenset(
    {"Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}
)
FLASHINFER_DEFAULT_BYTES = 394 * MiB  # 0.12 and later
FLASHINFER_FIXED_OLD_BYTES = 256 * MiB  # up to 0.11, no variable
FLASHINFER_BATCH_INVARIANT_BYTES = 2 * GiB

WRITES: dict[str, str] = {
    "fi_overflow": "bool; FlashInfer 'Buffer overflow when allocating memory for NAME with size S and alignment N, but only R bytes available in AlignedAllocator' logged (not a CUDA OOM)",
    "fi_overflow_line": "int; its log line",
    "fi_overflow_buffer": "str; NAME in that line",
    "fi_overflow_size_bytes": "bytes; S, the failed allocation",
    "fi_overflow_available_bytes": "bytes; R, what was left in the workspace",
    "fi_overflow_phase": "str; phase of the overflow (cuda_graph_capture, runtime, …)",
    "fi_workspace_bytes": "bytes; W, the workspace in force: VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, else 394 MiB (≥0.12) / 256 MiB (≤0.11), 2 GiB with VLLM_BATCH_INVARIANT=1, on ≥0.26 at least the prefill estimate; at least R",
    "fi_workspace_source": "str; where W comes from",
    "fi_env_var_exists": "bool; the vLLM version has VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE (≥0.12; True when the version is unknown)",
    "fi_need_bytes": "bytes; Need = (W − R) + S",
    "fi_sparse_mla_computed_bytes": "bytes; the workspace vLLM 0.33 computed for sparse MLA ('… is below the N bytes computed …' warning)",
    "attention_backend": "str; --attention-backend / VLLM_ATTENTION_BACKEND, else the backend the log says it uses",
    "triton_oom": "bool; 'Triton Error [CUDA]: out of memory' logged (Triton's driver, outside PyTorch's allocator)",
    "triton_oom_line": "int; its log line",
    "triton_oom_phase": "str; its phase",
    "triton_oom_hints": "list[str]; what its traceback mentions (triton_autotune, fla_ops, …)",
    "gdn_warmup_failed": "bool; 'GDN prefill kernel warmup (T=N) failed for layer L' warning (≥0.18)",
    "gdn_warmup_failed_line": "int; its log line",
    "gdn_model": "bool; config.json architectures has a gated-delta-net model (Qwen3-Next, Qwen3.5)",
    "gpu_compute_capability": "str; the engine GPU's compute capability ('9.0'): the one the log states (model family's log_compute_capability), else the GPU catalogue",
}
READS: frozenset[str] = frozenset(
    {
        "vllm_release",
        "engine_env",
        "max_num_batched_tokens",
        "tp",
        "arch",
        "gpu_name",
        "log_compute_capability",
    }
)


def derive(s: Scope, v: Vars) -> None:
    """FlashInfer workspace size, overflow and need; Triton OOM and the GDN context."""
    env = v["engine_env"] or {}
    backend = s.cfg.args.get("attention_backend") or env.get("VLLM_ATTENTION_BACKEND")
    log = s.log
    if backend is None and log is not None:
        ev = log.last("attention_backend")
        backend = ev.values.get("backend") if ev else None
    v["attention_backend"] = backend
    arch = v["arch"]
    v["gdn_model"] = bool(arch is not None and GDN_ARCHITECTURES & set(arch.architectures or []))
    cc = v["log_compute_capability"]
    if cc is None and v["gpu_name"]:
        try:
            spec = gpu_spec(v["gpu_name"])
        except (KeyError, ValueError):
            spec = None
        cc = getattr(spec, "sm", None) if spec is not None else None
    v["gpu_compute_capability"] = cc
    if log is None:
        return
    _flashinfer(s, v, env)
    tri = log.of("triton_oom")
    v["triton_oom"] = bool(tri)
    if tri:
        v["triton_oom_line"] = tri[-1].line
        v["triton_oom_phase"] = tri[-1].values.get("phase")
        v["triton_oom_hints"] = list(tri[-1].values.get("frames") or [])
    gdn = log.last("gdn_warmup_failed")
    v["gdn_warmup_failed"] = gdn is not None
    v["gdn_warmup_failed_line"] = gdn.line if gdn else None


def _flashinfer(s: Scope, v: Vars, env: dict[str, str]) -> None:
    log = s.log
    assert log is not None
    sparse = log.last("flashinfer_sparse_mla_warning")
    v["fi_sparse_mla_computed_bytes"] = sparse.values.get("computed_bytes") if sparse else None
    over = log.of("flashinfer_overflow")
    v["fi_overflow"] = bool(over)
    rel = v["vllm_release"]
    v["fi_env_var_exists"] = rel is None or rel >= 12
    if not over:
        return
    ev = over[-1]
    size, avail = ev.values.get("size_bytes"), ev.values.get("available_bytes")
    v["fi_overflow_line"], v["fi_overflow_buffer"] = ev.line, ev.values.get("buffer")
    v["fi_overflow_size_bytes"], v["fi_overflow_available_bytes"] = size, avail
    v["fi_overflow_phase"] = ev.values.get("phase")
    w, source = _workspace(s, v, env, avail or 0)
    v["fi_workspace_bytes"], v["fi_workspace_source"] = w, source
    if size is not None and avail is not None:
        v["fi_need_bytes"] = (w - avail) + size


def _workspace(s: Scope, v: Vars, env: dict[str, str], avail: int) -> tuple[int, str]:
    rel = v["vllm_release"]
    raw = env.get("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE")
    if env.get("VLLM_BATCH_INVARIANT") in ("1", "true", "True"):
        w, source = FLASHINFER_BATCH_INVARIANT_BYTES, "VLLM_BATCH_INVARIANT=1 (2 GiB)"
    elif raw is not None and raw.strip().isdigit() and (rel is None or rel >= 12):
        w, source = int(raw.strip()), "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
    elif rel is not None and rel <= 11:
        w, source = FLASHINFER_FIXED_OLD_BYTES, "fixed 256 MiB (vLLM ≤ 0.11)"
    else:
        w, source = FLASHINFER_DEFAULT_BYTES, "default 394 MiB (vLLM ≥ 0.12)"
    arch, mnbt = v["arch"], v["max_num_batched_tokens"]
    if rel is not None and rel >= 26 and arch is not None and mnbt and arch.num_attention_heads:
        prefill = int(mnbt * (arch.num_attention_heads // max(1, v["tp"] or 1)) * (arch.head_dim or 0) * 16)
        if prefill > w:
            w, source = (
                prefill,
                "prefill estimate (max_num_batched_tokens × heads per rank × head_dim × 16 B, ≥0.26)",
            )
    # The buffer is at least what was still free in it.
    return max(w, avail), source


FAMILY = Family("workspace", WRITES, READS, derive)
