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
  version accepts, vllm_flags ``valid_kv_cache_dtypes("0.0")``) or already in effect;
- ``--kv-cache-memory-bytes`` not positive, before vLLM 0.10.2 (the flag did not exist), or equal
  to the value in effect;
- ``--enforce-eager`` when eager mode is on; ``PYTORCH_CUDA_ALLOC_CONF`` expandable segments when
  already set.

The rule engine calls :func:`valid_fix` with the rule context's variables (derive's names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdoctor.kvmath import derived_max_model_len
from kvdoctor.vllm_flags import valid_kv_cache_dtypes, version_tuple

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
    elif flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        if n is None or n < 1:
            return "below 1"
        # The value set or logged; vLLM's device default is a guess and rejects nothing.
        current = get("max_num_seqs") if flag == "--max-num-seqs" else get("max_num_batched_tokens")
        if _same(current, n):
            return "already in effect"
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
