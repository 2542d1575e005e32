"""Parse a Hugging Face ``config.json`` into :class:`kvdoctor.facts.ModelArch`.

Only the fields vLLM's KV-cache sizing reads are lifted (vllm-facts.md §2.2): layers, attention
and KV heads, head_dim, MLA ranks, sliding window / layer types, dtype, quantization, MoE and
Mamba geometry. Multimodal configs (``text_config``, ``llm_config``, ``language_config``) are
flattened so the language model's numbers win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvdoctor.facts import ModelArch, SourceError
from kvdoctor.sources.limits import MAX_CONFIG_BYTES, guarded, read_bytes
from kvdoctor.units import in_range

# Keys under which multimodal wrappers keep the language model's config.
_NESTED_TEXT_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")

# Mamba / SSM keys kept as given (model families spell them differently).
_MAMBA_KEYS = (
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_num_heads",
    "mamba_head_dim",
    "mamba_chunk_size",
    "ssm_state_size",
    "conv_kernel",
    "n_groups",
    "expand",
    "state_size",
    "d_state",
    "d_conv",
    "mamba_ssm_cache_dtype",
    "hybrid_override_pattern",
    "layers_block_type",
    "attn_layer_indices",
    "attn_layer_period",
    "attn_layer_offset",
    "layer_types",
)

_FULL = "full_attention"
_SLIDING = "sliding_attention"


def _int(d: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and not in_range(v):
            continue  # 1e309 (inf), a 400-digit int: corrupt, as if absent
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
    return None


def _flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge a nested language-model config over the outer one (outer keys kept as defaults)."""
    for key in _NESTED_TEXT_KEYS:
        inner = cfg.get(key)
        if isinstance(inner, dict) and (
            "num_hidden_layers" in inner or "num_attention_heads" in inner or "hidden_size" in inner
        ):
            merged = {k: v for k, v in cfg.items() if k not in _NESTED_TEXT_KEYS}
            # The outer dtype applies when the inner config has none (Gemma-3, LLaVA).
            merged.update(_flatten(inner))
            if "model_type" in inner:
                merged["outer_model_type"] = cfg.get("model_type")
            return merged
    return dict(cfg)


def _layer_types(cfg: dict[str, Any], n_layers: int, window: int | None) -> list[str] | None:
    """Per-layer attention kinds, as vLLM decides which layers use the sliding window."""
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and all(isinstance(x, str) for x in lt) and lt:
        return list(lt)
    model_type = str(cfg.get("model_type") or "")
    if window is not None:
        if model_type.startswith("gemma2"):
            # HF Gemma2: even layers slide, odd layers are global.
            return [_SLIDING if (i + 1) % 2 else _FULL for i in range(n_layers)]
        pattern = _int(cfg, "sliding_window_pattern")
        if pattern and pattern > 1:
            # Gemma-3 / Cohere2: every pattern-th layer is global.
            return [_SLIDING if (i + 1) % pattern else _FULL for i in range(n_layers)]
    chunk = _int(cfg, "attention_chunk_size")
    nrl = cfg.get("no_rope_layers")
    if chunk and isinstance(nrl, list) and len(nrl) == n_layers:
        # Llama-4: RoPE layers (no_rope_layers[i] == 1) use chunked local attention.
        return ["chunked_attention" if x else _FULL for x in nrl]
    # Qwen3-Next-style hybrids: every k-th layer (1-based) is full attention, the others are
    # Gated-DeltaNet linear attention (vllm-facts §2.2 "Which layers are linear attention").
    interval = _int(cfg, "full_attention_interval")
    if interval and interval > 0 and cfg.get("linear_num_value_heads") is not None:
        return [_FULL if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    # Hybrid Mamba models: Nemotron-H "M-M*-" pattern, Jamba/Bamba layers_block_type.
    pat = cfg.get("hybrid_override_pattern")
    if isinstance(pat, str) and len(pat) == n_layers:
        return ["mamba" if c == "M" else _FULL if c == "*" else "mlp" for c in pat]
    lbt = cfg.get("layers_block_type")
    if isinstance(lbt, list) and len(lbt) == n_layers:
        return ["mamba" if str(x).lower() == "mamba" else _FULL for x in lbt]
    period, offset = _int(cfg, "attn_layer_period"), _int(cfg, "attn_layer_offset")
    if period and offset is not None and cfg.get("mamba_d_state") is not None:
        return [_FULL if i % period == offset else "mamba" for i in range(n_layers)]
    idx = cfg.get("attn_layer_indices")
    if isinstance(idx, list) and (cfg.get("mamba_d_state") or cfg.get("mamba_n_heads")):
        s = set(idx)
        return [_FULL if i in s else "mamba" for i in range(n_layers)]
    return None


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window vLLM really applies, or None (vllm-facts.md §2.2 sliding window)."""
    sw = cfg.get("sliding_window")
    if isinstance(sw, list):  # some configs give one per layer; the window is the non-null one
        vals = [int(x) for x in sw if isinstance(x, int) and x > 0]
        sw = max(vals) if vals else None
    if not isinstance(sw, int) or isinstance(sw, bool) or sw <= 0:
        return None
    # Qwen2/Qwen2.5/Qwen3 ship sliding_window set but use_sliding_window false: unused.
    if cfg.get("use_sliding_window") is False:
        return None
    return sw


#: physical ranges of a transformer config (the largest real models are ~0.1% of these)
_MAX_LAYERS = 10_000
_MAX_HEADS = 65_536
_MAX_HEAD_DIM = 65_536
_MAX_HIDDEN = 10_000_000


@guarded("origin", 1)
def parse_model_config(data: str | bytes | dict[str, Any], origin: str = "") -> ModelArch:
    """Turn a Hugging Face ``config.json`` (text, bytes or parsed dict) into a :class:`ModelArch`.

    Values come from the config keys vLLM itself reads (vllm-facts.md §2.2):
    ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA); ``head_dim`` is explicit
    or ``hidden_size // num_attention_heads``; MLA when ``kv_lora_rank`` is present (DeepSeek
    V2/V3/R1, Kimi-K2); the sliding window only when the model really uses it; dtype from
    ``torch_dtype`` or ``dtype``; ``quantization_config.quant_method``/``bits``; MoE counts;
    Mamba/SSM keys are copied to ``mamba`` as given.

    Raises :class:`SourceError` (one line, with ``origin``) for non-JSON, non-object, missing
    ``num_hidden_layers``/``num_attention_heads`` and zero or negative head counts.
    """
    where = origin or None
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError("model config is not UTF-8 text (binary file?)", origin=where) from None
    if isinstance(data, str):
        if not data.strip():
            raise SourceError("model config is empty", origin=where)
        try:
            parsed: Any = json.loads(data)
        except json.JSONDecodeError as e:
            raise SourceError(
                f"model config is not valid JSON: {e.msg}", origin=where, line=e.lineno
            ) from None
    else:
        parsed = data
    if not isinstance(parsed, dict):
        raise SourceError("model config must be a JSON object", origin=where)
    raw: dict[str, Any] = parsed
    cfg = _flatten(raw)

    n_layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if n_layers is None:
        raise SourceError("model config has no num_hidden_layers", origin=where)
    heads = _int(cfg, "num_attention_heads", "n_head")
    if heads is None:
        raise SourceError("model config has no num_attention_heads", origin=where)
    if n_layers <= 0:
        raise SourceError(f"num_hidden_layers is {n_layers}; must be positive", origin=where)
    if heads <= 0:
        raise SourceError(f"num_attention_heads is {heads}; must be positive", origin=where)
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") is True else heads
    if kv_heads <= 0:
        raise SourceError(f"num_key_value_heads is {kv_heads}; must be positive", origin=where)
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model") or 0
    head_dim = _int(cfg, "head_dim", "attention_head_dim")
    if head_dim is None or head_dim <= 0:
        if hidden <= 0:
            raise SourceError("model config has neither head_dim nor hidden_size", origin=where)
        head_dim = hidden // heads
    if head_dim <= 0:
        raise SourceError(f"head_dim is {head_dim}; must be positive", origin=where)

    for name, value, top in (
        ("num_hidden_layers", n_layers, _MAX_LAYERS),
        ("num_attention_heads", heads, _MAX_HEADS),
        ("num_key_value_heads", kv_heads, _MAX_HEADS),
        ("head_dim", head_dim, _MAX_HEAD_DIM),
        ("hidden_size", hidden, _MAX_HIDDEN),
    ):
        if value > top:
            # physical range: a config with absurd sizes is an error, not a 4 GiB list
            raise SourceError(f"{name} out of range (at most {top})", origin=where)
    for key, top in (("vocab_size", 10**8), ("max_position_embeddings", 10**9), ("num_experts", 10**5)):
        v = _int(cfg, key)
        if v is not None and not 0 <= v <= top:
            raise SourceError(f"{key} out of range (0..{top})", origin=where)

    kv_lora = _int(cfg, "kv_lora_rank")
    use_mla = kv_lora is not None and kv_lora > 0

    window = _sliding_window(cfg)
    layer_types = _layer_types(cfg, n_layers, window)
    if layer_types is not None and window is None and _SLIDING in layer_types:
        # layer_types says sliding but no usable window: treat those layers as full attention.
        layer_types = [_FULL if t == _SLIDING else t for t in layer_types]

    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    qc = cfg.get("quantization_config")
    quant_method: str | None = None
    quant_bits: int | None = None
    if isinstance(qc, dict):
        qm = qc.get("quant_method")
        quant_method = str(qm).lower() if qm else None
        quant_bits = _int(qc, "bits", "w_bit", "num_bits")
        if quant_bits is None and isinstance(qc.get("config_groups"), dict):
            # compressed-tensors: bits live under config_groups.<g>.weights.num_bits
            for g in qc["config_groups"].values():
                w = g.get("weights") if isinstance(g, dict) else None
                if isinstance(w, dict) and isinstance(w.get("num_bits"), int):
                    quant_bits = w["num_bits"]
                    break

    mamba = {k: cfg[k] for k in _MAMBA_KEYS if k in cfg and k != "layer_types"}
    num_experts = _int(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

    return ModelArch(
        model_type=cfg.get("model_type"),
        architectures=[str(a) for a in cfg.get("architectures") or raw.get("architectures") or []],
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", "ffn_dim", "n_inner"),
        vocab_size=_int(cfg, "vocab_size", "padded_vocab_size"),
        max_position_embeddings=_int(
            cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length"
        ),
        dtype=str(dtype) if dtype else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        use_mla=use_mla,
        kv_lora_rank=kv_lora if use_mla else None,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim") if use_mla else None,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim") if use_mla else None,
        v_head_dim=_int(cfg, "v_head_dim") if use_mla else None,
        sliding_window=window,
        layer_types=layer_types,
        attention_chunk_size=_int(cfg, "attention_chunk_size"),
        num_experts=num_experts,
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", "moe_topk", "top_k"),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", "expert_intermediate_size"),
        quant_method=quant_method,
        quant_bits=quant_bits,
        mamba=mamba,
        raw=raw,
    )


@guarded("path", 0)
def parse_model_config_file(path: str | Path) -> ModelArch:
    """Read and parse a ``config.json`` file (or a model directory holding one).

    Raises :class:`SourceError` when the file is missing, unreadable or not a valid config.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = read_bytes(p, MAX_CONFIG_BYTES)
    return parse_model_config(data, origin=str(p))
