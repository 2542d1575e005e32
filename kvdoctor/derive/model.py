"""Family model: the model's size and KV geometry (config.json, else the built-in catalogue by
--model name; kvmath) and whether --kv-cache-dtype is valid for the version and the GPU."""

from __future__ import annotations

import functools

from kvdoctor import kvmath
from kvdoctor.derive.base import Family, Scope, Vars, gpu_spec
from kvdoctor.devices import FP8_KV_PLAIN, architecture_name, fp8_kv_cache_dtypes
from kvdoctor.vllm_flags import nearest_valid_kv_cache_dtype, valid_kv_cache_dtypes

WRITES: dict[str, str] = {
    "model_known": "bool; the model's architecture is known (config.json, else the built-in catalogue by --model name)",
    "model_source": "str; 'config.json' or 'catalogue'",
    "arch": "ModelArch; the model's architecture (config.json, else the catalogue), for kvmath functions",
    "num_attention_heads": "int; config.json",
    "num_kv_heads": "int; config.json num_key_value_heads",
    "vocab_size": "int; config.json vocab_size (logits per token)",
    "weights_bytes": "bytes; whole-model weights: 'Model loading took X GiB' × tp×pp, else estimate from config.json",
    "weights_logged_bytes": "bytes; per-worker 'Model loading took X GiB' (V0 'Loading model weights took X GB')",
    "kv_bytes_per_token": "bytes per token; KV per token per GPU rank at the configured kv_cache_dtype (kvmath)",
    "kv_bytes_per_token_fp8": "bytes per token; KV per token per GPU rank with fp8 KV (kvmath)",
    "fp8_supported": "bool; the GPU takes --kv-cache-dtype fp8 (e4m3; compute capability ≥ 8.9; Ampere's fp8_e5m2 is fp8_kv_dtypes), the capability as the log states it (vLLM's dtype check, PyTorch's capability warning, the GDN kernel line; 'does not have native support for FP8' → Ampere), else the GPU catalogue's by name (its fp8 flag for a non-CUDA GPU); None when unknown",
    "log_compute_capability": "str; the compute capability the log states ('7.0', '12.0'): vLLM's 'Your … GPU has compute capability X.Y', PyTorch's 'with CUDA capability sm_NN', 'Using FlashInfer GDN prefill kernel on CUDA compute capability NN'",
    "log_gpu_name": "str; the GPU name the log's capability line gives ('Tesla V100-SXM2-32GB'), for the catalogue when nvidia-smi is missing",
    "invalid_kv_dtype": "bool; 'Invalid kv_cache_dtype' logged, or --kv-cache-dtype not valid for the version",
    "invalid_kv_dtype_value": "str; the rejected value",
    "invalid_kv_dtype_line": "int; log line (None when from the launch command)",
    "suggested_kv_dtype": "str; nearest valid --kv-cache-dtype for the version",
    "fp8_kv_dtypes": "list[str]; the plain fp8 --kv-cache-dtype values this GPU's backends take, preferred first (kvdoctor.devices.fp8_kv_cache_dtypes): all three from compute capability 8.9, only fp8_e5m2 on Ampere (8.0–8.7, also when the log says 'does not have native support for FP8'), none on Volta/Turing; None when the capability is unknown",
    "fp8_kv_dtype": "str; the fp8 --kv-cache-dtype to suggest on this GPU: 'fp8' from compute capability 8.9, 'fp8_e5m2' on Ampere; None on Volta/Turing or when unknown",
    "compute_capability": "str; the engine GPU's compute capability ('8.0'): the log's, else the GPU catalogue's by name",
    "gpu_architecture": "str; its NVIDIA architecture name ('Volta', 'Turing', 'Ampere', 'Ada', 'Hopper', 'Blackwell')",
}
READS: frozenset[str] = frozenset({"tp", "pp", "tp_pp", "kv_cache_dtype", "gpu_name", "vllm_version"})


@functools.lru_cache(maxsize=32)
def _valid_kv_dtypes(version: str | None) -> tuple[str, ...]:
    """:func:`valid_kv_cache_dtypes` of a version, worked out once (every context asks)."""
    return tuple(valid_kv_cache_dtypes(version))


def derive(s: Scope, v: Vars) -> None:
    """Weights and KV bytes per token; validity of the KV cache dtype."""
    _sizes(s, v)
    _kv_dtype(s, v)


def _sizes(s: Scope, v: Vars) -> None:
    arch, cfg, log = s.arch, s.cfg, s.log
    logged = None
    if log is not None:
        loads = log.of("model_loading")
        if loads:
            logged = max(e.values.get("weights_bytes") or 0 for e in loads) or None
    v["weights_logged_bytes"] = logged
    v["model_known"] = arch is not None
    v["model_source"] = s.model_source
    v["arch"] = arch
    if logged:
        v["weights_bytes"] = logged * v["tp_pp"]
    if arch is None:
        return
    v["num_attention_heads"] = arch.num_attention_heads
    v["num_kv_heads"] = arch.num_key_value_heads
    v["vocab_size"] = arch.vocab_size
    dtype = v["kv_cache_dtype"] if v["kv_cache_dtype"] in _valid_kv_dtypes(None) else "auto"
    try:
        if v["weights_bytes"] is None:
            v["weights_bytes"] = kvmath.weights_bytes(arch, dtype=cfg.dtype, quantization=cfg.quantization)
        v["kv_bytes_per_token"] = kvmath.kv_bytes_per_token(
            arch, tensor_parallel_size=v["tp"], pipeline_parallel_size=v["pp"], kv_cache_dtype=dtype
        )
        v["kv_bytes_per_token_fp8"] = kvmath.kv_bytes_per_token(
            arch, tensor_parallel_size=v["tp"], pipeline_parallel_size=v["pp"], kv_cache_dtype="fp8"
        )
    except (ValueError, ZeroDivisionError, KeyError, TypeError):
        pass


def _log_capability(s: Scope, v: Vars) -> tuple[int, int] | None:
    """(major, minor) compute capability from the log's latest capability line, setting
    ``log_compute_capability`` / ``log_gpu_name``; None without one."""
    log = s.log
    if log is None:
        return None
    ev = log.last("compute_capability")
    cc: tuple[int, int] | None = None
    if ev is not None:
        cc = (int(ev.values.get("major") or 0), int(ev.values.get("minor") or 0))
        v["log_gpu_name"] = ev.values.get("gpu_name")
    else:
        gfi = log.last("gdn_flashinfer_prefill")
        n = int(gfi.values.get("compute_capability") or 0) if gfi is not None else 0
        if n:
            cc = (n // 10, n % 10)
    if cc is None or cc[0] <= 0:
        return None
    v["log_compute_capability"] = f"{cc[0]}.{cc[1]}"
    return cc


def _kv_dtype(s: Scope, v: Vars) -> None:
    """Launch-time validity of --kv-cache-dtype: the log's 'Invalid kv_cache_dtype', else the
    version's accepted values, else fp8 on a GPU without fp8."""
    inv = s.log.last("invalid_kv_cache_dtype") if s.log is not None else None
    dtype = s.cfg.kv_cache_dtype or "auto"
    if inv is not None:
        v["invalid_kv_dtype"] = True
        v["invalid_kv_dtype_value"] = inv.values.get("value")
        v["invalid_kv_dtype_line"] = inv.line
    else:
        v["invalid_kv_dtype"] = dtype not in _valid_kv_dtypes(v["vllm_version"])
        if v["invalid_kv_dtype"]:
            v["invalid_kv_dtype_value"] = dtype
    # The compute capability vLLM (or PyTorch) logs is the device's own word: it wins over the
    # catalogue's by name (an OEM or truncated name may match the wrong card, or none).
    cc = _log_capability(s, v)
    name = v["gpu_name"] or v["log_gpu_name"]
    try:
        spec = gpu_spec(name) if name else None
    except (KeyError, ValueError):
        spec = None
    if cc is None and spec is not None and spec.sm_major:
        try:
            major, minor = (int(x) for x in spec.sm.split(".", 1))
            cc = (major, minor)
        except ValueError:
            cc = None
    if cc is None and s.log is not None and s.log.last("fp8_not_native") is not None:
        cc = (8, 0)  # the Marlin weight-only FP8 fallback: Ampere (it needs ≥ 8.0, native fp8 is 8.9)
    if cc is not None:
        kv_fp8 = fp8_kv_cache_dtypes(cc)
        v["compute_capability"] = f"{cc[0]}.{cc[1]}"
        v["gpu_architecture"] = architecture_name(cc)
        v["fp8_kv_dtypes"] = list(kv_fp8)
        v["fp8_kv_dtype"] = kv_fp8[0] if kv_fp8 else None
        v["fp8_supported"] = "fp8" in kv_fp8  # the plain 'fp8' (e4m3) other rules suggest
    else:
        v["fp8_supported"] = spec.fp8 if spec is not None else None
    takes = v["fp8_kv_dtypes"]
    if not v["invalid_kv_dtype"] and dtype in FP8_KV_PLAIN and takes is not None and dtype not in takes:
        v["invalid_kv_dtype"], v["invalid_kv_dtype_value"] = True, dtype
        v["suggested_kv_dtype"] = v["fp8_kv_dtype"] or "auto"
    elif v["invalid_kv_dtype"] and v["invalid_kv_dtype_value"]:
        nearest = nearest_valid_kv_cache_dtype(str(v["invalid_kv_dtype_value"]), v["vllm_version"])
        if nearest in FP8_KV_PLAIN and takes is not None and nearest not in takes:
            nearest = v["fp8_kv_dtype"] or "auto"  # the fp8 form this GPU takes, else none
        v["suggested_kv_dtype"] = nearest


FAMILY = Family("model", WRITES, READS, derive)
