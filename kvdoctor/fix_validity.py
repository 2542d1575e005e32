"""A suggested fix is always valid: every value a rule's ``fix`` computes is checked against what
vLLM accepts and what is already in effect before it reaches ``suggested_flags``.

A value is dropped when vLLM would reject it or when it changes nothing (spec/rules.md "What every
finding carries"; house rule "never a value vLLM rejects, one already in effect, or one that
changes nothing"):

- ``--max-model-len`` not below the configured / derived max model length, or above the model's
  ``max_position_embeddings``;
- ``--gpu-memory-utilization`` outside (0, 1], or equal (±0.005) to the gmu in effect;
- ``--max-num-seqs`` / ``--max-num-batched-tokens`` below 1 or equal to the value in effect
  (set on the command line or logged);
- ``--tensor-parallel-size`` that does not divide the attention heads, nor the KV heads (or, with
  fewer KV heads than ranks, is not a multiple of them: vLLM replicates them only that way), needs
  more GPUs than are visible, or equals the TP in effect;
  ``--pipeline-parallel-size`` above the layer count or equal to the PP in effect;
- ``--kv-cache-dtype`` not accepted by that vLLM version (unknown version → the values every
  version accepts, vllm_flags ``valid_kv_cache_dtypes("0.0")``), an fp8 form the GPU's backends
  refuse (``fp8_kv_dtypes``: e4m3 below compute capability 8.9, any fp8 below 8.0), or already
  in effect;
- ``--kv-cache-memory-bytes`` not positive, before vLLM 0.10.2 (the flag did not exist), or equal
  to the value in effect;
- ``--enforce-eager`` when eager mode is on; ``PYTORCH_CUDA_ALLOC_CONF`` expandable segments when
  already set;
- any ``--flag`` the engine's vLLM version does not have (``vllm_flags.flag_available``).

A value is also dropped when it would leave vLLM unable to serve (issue 24, the fix contract):

- ``--gpu-memory-utilization`` lowered so far that the KV cache left (the KV memory in effect
  minus (gmu − value) × total) no longer holds one ``max_model_len`` request: vLLM refuses to
  start;
- ``--max-num-seqs`` of 1 or 2 (the engine serialised) unless the KV cache holds fewer than three
  ``max_model_len`` requests, or below the concurrency the traffic needed before the trouble
  (derive ``running_before_trouble``; unknown when the series starts in trouble).

The rule engine calls :func:`valid_fix` with the rule context's variables (derive's names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdoctor.devices import FP8_KV_PLAIN
from kvdoctor.kvmath import derived_max_model_len
from kvdoctor.vllm_flags import FlagError, flag_available, lookup_option, valid_kv_cache_dtypes, version_tuple

__all__ = ["valid_fix"]


def _num(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _same(a: Any, b: float | None, tol: float = 0.0) -> bool:
    return isinstance(a, (int, float)) and b is not None and abs(float(a) - b) <= tol


def valid_fix(flag: str, value: str, names: Mapping[str, Any]) -> str | None:
    """Why ``flag value`` (as rendered for ``suggested_flags``) is not a valid, effective fix for
    the context ``names`` (derive variables: ``max_model_len``, ``gmu``, ``tp``, ``pp``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_dtype``, ``vllm_version``,
    ``num_attention_heads``, ``arch``, ``enforce_eager``, ``expandable_segments_on``), or None
    when it is valid. Unknown context values never reject a fix."""
    n = _num(value)
    get = names.get
    arch = get("arch")
    if flag.startswith("--"):
        try:
            known = lookup_option(flag)
        except FlagError:
            known = None
        version = get("vllm_version")
        if known is not None and isinstance(version, str) and not flag_available(known[0].dest, version):
            return f"vLLM {version} has no {flag}"
    if flag == "--max-model-len":
        if n is None or n < 1:
            return "not a positive length"
        current = _num(str(get("max_model_len")))
        if current is not None and n >= current:
            return "not below the max model length in effect"
        # The model's maximum as vLLM derives it (rope scaling included), else max_position_embeddings.
        try:
            limit = derived_max_model_len(arch) if arch is not None else None
        except (TypeError, ValueError, AttributeError):
            limit = None
        if not limit:
            limit = getattr(arch, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0 and n > limit:
            return "above the model's maximum"
    elif flag == "--gpu-memory-utilization":
        if n is None or not 0 < n <= 1:
            return "outside (0, 1]"
        if _same(get("gmu"), n, 0.005):
            return "already in effect"
        short = _kv_short_after_gmu(names, n)
        if short:
            return short
    elif flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        if n is None or n < 1:
            return "below 1"
        # The value set or logged; vLLM's device default is a guess and rejects nothing.
        current = get("max_num_seqs") if flag == "--max-num-seqs" else get("max_num_batched_tokens")
        if _same(current, n):
            return "already in effect"
        if flag == "--max-num-seqs":
            serial = _serialises(names, n)
            if serial:
                return serial
    elif flag == "--tensor-parallel-size":
        if n is None or n < 1 or n != int(n):
            return "not a positive integer"
        heads = get("num_attention_heads")
        if isinstance(heads, int) and heads > 0 and heads % int(n):
            return "does not divide the attention heads"
        kv = get("num_kv_heads")
        if isinstance(kv, int) and kv > 0 and (kv % int(n) if kv >= n else int(n) % kv):
            return "does not divide the KV heads (nor is a multiple of them)"
        gpus, pp = get("gpu_count"), get("pp")
        if (
            isinstance(gpus, int)
            and gpus > 0
            and int(n) * (pp if isinstance(pp, int) and pp > 0 else 1) > gpus
        ):
            return "needs more GPUs than are visible"
        if _same(get("tp"), n):
            return "already in effect"
    elif flag == "--pipeline-parallel-size":
        if n is None or n < 1 or n != int(n):
            return "not a positive integer"
        layers = getattr(arch, "num_hidden_layers", 0)
        if isinstance(layers, int) and layers > 0 and n > layers:
            return "more stages than layers"
        if _same(get("pp"), n):
            return "already in effect"
    elif flag == "--kv-cache-dtype":
        version = get("vllm_version")
        valid = valid_kv_cache_dtypes(version if version else "0.0")
        if value not in valid:
            return "not a kv-cache dtype this vLLM version accepts"
        takes = get("fp8_kv_dtypes")
        if value in FP8_KV_PLAIN and isinstance(takes, (list, tuple)) and value not in takes:
            cc, arch = get("compute_capability"), get("gpu_architecture")
            if takes:
                return f"{arch} (compute capability {cc}) backends take fp8 KV only as {', '.join(takes)}"
            return f"no fp8 KV-cache kernel in vLLM's attention backends for {arch} (compute capability {cc})"
        if value == get("kv_cache_dtype"):
            return "already in effect"
    elif flag == "--kv-cache-memory-bytes":
        if n is None or n <= 0:
            return "not a positive byte count"
        vt = version_tuple(get("vllm_version")) if get("vllm_version") else None
        if vt and vt < (0, 10, 2):
            return "the flag does not exist before vLLM 0.10.2"
        if _same(get("kv_cache_memory_bytes"), n):
            return "already in effect"
    elif flag == "--enforce-eager":
        if get("enforce_eager") is True:
            return "already in effect"
    elif flag == "PYTORCH_CUDA_ALLOC_CONF":
        if "expandable_segments:True" in value and get("expandable_segments_on") is True:
            return "already in effect"
    return None


def _kv_bytes_now(names: Mapping[str, Any]) -> float | None:
    """The KV memory in effect per GPU: "Available KV cache memory", else the capacity in
    tokens × the bytes a token takes."""
    get = names.get
    avail = get("log_available_kv_bytes")
    if isinstance(avail, (int, float)) and avail > 0:
        return float(avail)
    tokens, per_token = get("kv_capacity_tokens"), get("kv_bytes_per_token")
    if isinstance(tokens, int) and isinstance(per_token, int) and tokens > 0 and per_token > 0:
        return float(tokens * per_token)
    return None


def _kv_short_after_gmu(names: Mapping[str, Any], new_gmu: float) -> str | None:
    """Why a lower gmu would leave less KV than one max_model_len request (None: it would not,
    or unknown)."""
    get = names.get
    gmu, total, per_token, mml = (
        get("gmu"),
        get("gpu_total_bytes"),
        get("kv_bytes_per_token"),
        get("max_model_len"),
    )
    now = _kv_bytes_now(names)
    if not (
        isinstance(gmu, float)
        and isinstance(total, int)
        and isinstance(per_token, int)
        and isinstance(mml, int)
    ):
        return None
    if now is None or new_gmu >= gmu or per_token <= 0 or mml <= 0:
        return None
    left = now - (gmu - new_gmu) * total
    if left < per_token * mml:
        return f"leaves {max(left, 0) / 2**30:.2f} GiB of KV cache, less than one {mml}-token request: vLLM would not start"
    return None


def _serialises(names: Mapping[str, Any], n: float) -> str | None:
    """Why ``--max-num-seqs n`` would serialise a serving engine (None: it would not)."""
    get = names.get
    mml = get("max_model_len")
    capacity = get("kv_capacity_tokens") or get("log_kv_tokens")
    holds = capacity // mml if isinstance(capacity, int) and isinstance(mml, int) and mml > 0 else None
    if n <= 2 and (holds is None or holds >= 3):
        return "serialises the engine (1 or 2 sequences at a time)"
    # the peak running before the trouble (derive episodes: scrapes over the whole series, else
    # stats lines); unknown when the series starts in trouble (then nothing is refused here)
    before = get("running_before_trouble")
    if isinstance(before, (int, float)) and before > n:
        before = int(before)
        return f"below the {before} requests running before the trouble"
    return None
