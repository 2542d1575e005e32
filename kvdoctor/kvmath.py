"""KV-cache arithmetic that agrees with vLLM's own, to the block (vllm-facts.md §2).

Pure functions over :class:`kvdoctor.facts.ModelArch`. Units: bytes (int), tokens (int),
fractions 0..1. Everything is **per GPU rank** unless a name says otherwise: under tensor
parallelism each rank holds its shard of KV heads (replicated when kv_heads < TP; MLA's latent
cache is replicated on every rank), under pipeline parallelism each stage holds its own layers
and every rank gets the same ``num_gpu_blocks`` (the minimum over ranks).

The pipeline, as vLLM 0.33 runs it (§2.1–2.4):

1. page size per layer = ``block_size × bytes per token per layer`` (§2.2), where the bytes per
   token are ``kv_heads_per_rank × (head_size + head_size_v) × dtype`` (+8 B of fp32 scales per
   head for ``*_per_token_head``), ``(kv_lora_rank + qk_rope_head_dim) × dtype`` for MLA, 656 B
   for ``fp8_ds_mla``; Mamba layers have a fixed state page, padded to the attention page after
   the attention block size is enlarged to cover it;
2. layers are grouped (one group for uniform models; equal-size groups for hybrids), and
   ``bytes_per_block`` = max over groups of Σ page sizes of the group's layers on the rank;
3. ``num_gpu_blocks = available // bytes_per_block``; block 0 is the null block;
4. a request needs ``Σ_groups cdiv(max_memory_usage_bytes, page)`` blocks (sliding windows and
   chunked attention cap it, with the in-flight term); it fits when
   ``bytes_per_block × blocks ≤ available − bytes_per_block``;
5. ``max_concurrency = num_blocks / blocks_per_request``, ``kv_cache_tokens = int(conc × len)``.

The diagnose rules call these same functions: there is no second copy of this arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import ModelArch
from kvdoctor.units import GiB, MiB, ceil_to, floor_to
from kvdoctor.vllm_defaults import HINT_H1, SizingMode, is_v034, kv_memory_hint
from kvdoctor.vllm_defaults import default_block_size as default_block_size_for_version

#: ``CacheConfig.DEFAULT_BLOCK_SIZE`` up to vLLM 0.33 (vllm-facts.md §4.2 ``--block-size``); 64
#: from 0.34 (:func:`kvdoctor.vllm_defaults.default_block_size`).
DEFAULT_BLOCK_SIZE = 16
#: Packed per-token sizes of the DeepSeek MLA cache dtypes (§2.2 MLA).
FP8_DS_MLA_BYTES_PER_TOKEN = 656
NVFP4_DS_MLA_BYTES_PER_TOKEN = 352
#: fp32 k and v scales per (token, head) for ``*_per_token_head`` KV dtypes (§2.2).
PER_TOKEN_HEAD_SCALE_BYTES = 8
#: Flash-attention kernels take block sizes that are multiples of 16 (hybrid alignment, §2.2).
KERNEL_BLOCK_ALIGNMENT = 16
#: Mamba cache "align" mode (prefix caching on, the default): attention blocks of hybrid models
#: are multiples of 64 tokens, and each request holds 2 + 1 prefill-checkpoint pages per Mamba
#: group (no speculative decoding) (vllm-facts §2.2 "Mamba cache mode follows prefix caching").
ALIGN_MODE_BLOCK_ALIGNMENT = 64
ALIGN_MODE_MAMBA_PAGES = 3
#: What ``smallest_tensor_parallel_size`` keeps free per GPU for the activation peak of the
#: profile run, the non-torch increase and the CUDA-graph estimate (§2.1 step 3): an estimate;
#: vLLM logs ~0.3–1.5 GiB of graphs and ~0.5–2 GiB of activation peak for common models.
DEFAULT_ACTIVATION_RESERVE_BYTES = 2 * GiB

_MODEL_DTYPE_BYTES = {
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float64": 8,
}

# Valid --kv-cache-dtype values in vLLM 0.33 (§4.1) -> bytes per element (None = model dtype).
_KV_DTYPE_BYTES: dict[str, Fraction | None] = {
    "auto": None,
    "float16": Fraction(2),
    "bfloat16": Fraction(2),
    "fp8": Fraction(1),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "fp8_inc": Fraction(1),
    "fp8_ds_mla": Fraction(1),
    "nvfp4_ds_mla": Fraction(1, 2),
    "int8_per_token_head": Fraction(1),
    "fp8_per_token_head": Fraction(1),
    "int4_per_token_head": Fraction(1, 2),
    # Estimates (not verified against vLLM's page-size code): 4-bit payload + 1 fp8 scale / 16.
    "nvfp4": Fraction(9, 16),
    "nvfp4_4over6": Fraction(9, 16),
    "turboquant_k8v4": Fraction(3, 4),
    "turboquant_4bit_nc": Fraction(1, 2),
    "turboquant_k3v4_nc": Fraction(7, 16),
    "turboquant_3bit_nc": Fraction(3, 8),
    "octave_k3v4": Fraction(7, 16),
    "octave_k3v3": Fraction(3, 8),
    "octave_k3v3_compact": Fraction(3, 8),
    "ultraquant_4bit": Fraction(1, 2),
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (vLLM's ``cdiv``)."""
    return -(-a // b)


def _version_tuple(v: str | None) -> tuple[int, int, int] | None:
    from kvdoctor.vllm_flags import version_tuple

    got = version_tuple(v, 3)
    return None if got is None else (got[0], got[1], got[2])


def model_dtype_bytes(model_dtype: str | None) -> int:
    """Bytes per element of the model dtype (``torch_dtype``/``--dtype``); bf16 when unknown.

    Raises ValueError for a dtype name that is not a float type.
    """
    if model_dtype is None or model_dtype == "auto":
        return 2
    key = model_dtype.lower().replace("torch.", "")
    if key not in _MODEL_DTYPE_BYTES:
        raise ValueError(f"unknown model dtype {model_dtype!r}")
    return _MODEL_DTYPE_BYTES[key]


_DTYPE_NAMES = {
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
}


def served_dtype(config_dtype: str | None, dtype_flag: str | None = None, gpu: Any = None) -> str:
    """The dtype vLLM serves the weights (and an "auto" KV cache) in (vllm-facts §2.2).

    ``--dtype`` given and not "auto" wins. With ``--dtype auto`` (the default) a 16-bit
    checkpoint stays as it is, and a **float32 checkpoint is downcast to 16-bit**: bfloat16, or
    float16 on a GPU without bf16 (compute capability < 8.0; ``gpu`` a
    :class:`kvdoctor.catalog.GpuSpec`, None = assume bf16 support). Unknown → "bfloat16".
    Raises ValueError for a ``--dtype`` that is not a float type."""
    if dtype_flag and dtype_flag.lower() != "auto":
        key = dtype_flag.lower().replace("torch.", "")
        if key not in _DTYPE_NAMES:
            raise ValueError(f"unknown --dtype {dtype_flag!r}")
        return _DTYPE_NAMES[key]
    key = (config_dtype or "bfloat16").lower().replace("torch.", "")
    name = _DTYPE_NAMES.get(key, "bfloat16")
    if name == "float32":
        major = getattr(gpu, "sm_major", 0) if gpu is not None else 0
        return "float16" if 0 < major < 8 else "bfloat16"
    return name


def _served(arch: ModelArch, dtype_flag: str | None, gpu: Any) -> ModelArch:
    """``arch`` with ``dtype`` set to :func:`served_dtype` (a copy; facts are not mutated)."""
    served = served_dtype(arch.dtype, dtype_flag, gpu)
    return arch if served == arch.dtype else dataclasses.replace(arch, dtype=served)


def _kv_elem_bytes(kv_cache_dtype: str, model_dtype: str | None) -> Fraction:
    if kv_cache_dtype not in _KV_DTYPE_BYTES:
        hint = " (vLLM accepts int8_per_token_head)" if kv_cache_dtype == "int8" else ""
        raise ValueError(f"invalid kv_cache_dtype {kv_cache_dtype!r}{hint}")
    b = _KV_DTYPE_BYTES[kv_cache_dtype]
    return Fraction(model_dtype_bytes(model_dtype)) if b is None else b


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str | None) -> float:
    """Bytes per KV element for ``--kv-cache-dtype`` (vllm-facts.md §4.1): "auto" = the model
    dtype (2 for bf16/fp16, 4 for fp32), ``fp8*`` and ``*_per_token_head`` 1 (int4 0.5).
    Scales are separate: :func:`kv_scale_overhead_bytes`.

    Raises ValueError for values vLLM rejects (plain "int8", typos).
    """
    return float(_kv_elem_bytes(kv_cache_dtype, model_dtype))


def kv_scale_overhead_bytes(kv_cache_dtype: str) -> int:
    """Extra bytes per (token, KV head) for quantized KV with dynamic scales: two fp32 scales
    (8 B) for ``*_per_token_head`` (§2.2, ``triton_attn.py:307-319``), else 0."""
    return PER_TOKEN_HEAD_SCALE_BYTES if kv_cache_dtype.endswith("_per_token_head") else 0


def num_kv_heads_per_rank(arch: ModelArch, tensor_parallel_size: int = 1) -> int:
    """KV heads each TP rank holds: ``max(1, kv_heads // tp)``; 1 for MLA (§2.2 TP, MLA)."""
    if arch.use_mla:
        return 1
    return max(1, arch.num_key_value_heads // max(1, tensor_parallel_size))


def attention_bytes_per_token_per_layer(
    arch: ModelArch, *, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one attention layer stores per token on one rank (the page size of a 1-token block).

    Full/sliding/chunked attention: ``kv_heads_per_rank × (head_dim + head_dim) × dtype`` (+8 B
    per head for per-token-head scales). MLA: ``(kv_lora_rank + qk_rope_head_dim) × dtype``, or
    656 B (``fp8_ds_mla``) / 352 B (``nvfp4_ds_mla``), never divided by TP (§2.2).
    Raises ValueError for an invalid kv_cache_dtype.
    """
    if arch.use_mla:
        if kv_cache_dtype == "fp8_ds_mla":
            return FP8_DS_MLA_BYTES_PER_TOKEN
        if kv_cache_dtype == "nvfp4_ds_mla":
            return NVFP4_DS_MLA_BYTES_PER_TOKEN
        head = (arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)
        return math.ceil(head * _kv_elem_bytes(kv_cache_dtype, arch.dtype))
    per_head = 2 * arch.head_dim * _kv_elem_bytes(kv_cache_dtype, arch.dtype)
    per_head += kv_scale_overhead_bytes(kv_cache_dtype)
    return math.ceil(num_kv_heads_per_rank(arch, tensor_parallel_size) * per_head)


# --------------------------------------------------------------------------- layers


def layer_kinds(arch: ModelArch) -> list[str | None]:
    """What each decoder layer caches: "full", "sliding", "chunked", "mla", "mamba", or None
    (no cache: MLP-only blocks of Nemotron-H). From ``layer_types`` when the config has them,
    else every layer is sliding (a real window, e.g. Mistral v0.1), MLA or full."""
    n = arch.num_hidden_layers
    full = "mla" if arch.use_mla else "full"
    if arch.layer_types and len(arch.layer_types) == n:
        out: list[str | None] = []
        for t in arch.layer_types:
            t = t.lower()
            if t in ("sliding_attention", "sliding", "local", "local_attention") and arch.sliding_window:
                out.append("sliding")
            elif t in ("chunked_attention",) and arch.attention_chunk_size:
                out.append("chunked")
            elif t in ("mamba", "mamba2", "linear_attention", "ssm"):
                out.append("mamba")
            elif t in ("mlp", "moe", "ffn", "-"):
                out.append(None)
            else:
                out.append(full)
        return out
    if arch.sliding_window and not arch.use_mla:
        return ["sliding"] * n
    return [full] * n


def mamba_state_bytes(arch: ModelArch, *, tensor_parallel_size: int = 1) -> int:
    """Bytes of one Mamba layer's per-request state on one rank (conv + ssm), before padding.

    Mamba2 (``mamba_n_heads``/``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
    ``n_groups``, ``conv_kernel``): conv ``(conv_kernel − 1) × (d_inner + 2·n_groups·d_state)/tp``
    and ssm ``heads/tp × head_dim × d_state``. Mamba1 (Jamba: ``mamba_d_state``, ``mamba_d_conv``,
    ``mamba_expand``): conv ``(d_conv − 1) × d_inner/tp``, ssm ``d_inner/tp × d_state``. Gated
    delta-net (``linear_*`` keys, Qwen3-Next). Conv state in the model dtype, ssm state in
    ``mamba_ssm_cache_dtype`` when the config names one, else the model dtype (§2.2 Mamba).
    Returns 0 when the config has no recognisable state geometry.
    """
    m: dict[str, Any] = {**arch.raw, **arch.mamba}
    tp = max(1, tensor_parallel_size)
    dt = model_dtype_bytes(arch.dtype)
    ssm_dt = dt
    if isinstance(m.get("mamba_ssm_cache_dtype"), str) and m["mamba_ssm_cache_dtype"] != "auto":
        ssm_dt = model_dtype_bytes(m["mamba_ssm_cache_dtype"])

    def gi(*keys: str) -> int | None:
        for k in keys:
            v = m.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    if gi("linear_num_value_heads") and gi("linear_key_head_dim"):
        nk, dk = gi("linear_num_key_heads") or 0, gi("linear_key_head_dim") or 0
        nv, dv = gi("linear_num_value_heads") or 0, gi("linear_value_head_dim") or 0
        kern = gi("linear_conv_kernel_dim") or 4
        conv = (kern - 1) * (2 * nk * dk + nv * dv) // tp
        return conv * dt + (nv // tp) * dk * dv * ssm_dt
    heads = gi("mamba_num_heads", "mamba_n_heads")
    d_state = gi("ssm_state_size", "mamba_d_state", "state_size", "d_state")
    if heads and d_state:
        head_dim = gi("mamba_head_dim", "mamba_d_head") or 0
        groups = gi("n_groups", "mamba_n_groups") or 1
        kern = gi("conv_kernel", "mamba_d_conv", "d_conv") or 4
        d_inner = heads * head_dim
        # groups are replicated when fewer than TP ranks (vLLM's extra_groups_for_head_shards)
        groups_rank = groups // tp if groups % tp == 0 else 1
        conv_dim = d_inner // tp + 2 * groups_rank * d_state
        return (kern - 1) * conv_dim * dt + (heads // tp) * head_dim * d_state * ssm_dt
    if d_state:
        expand = gi("mamba_expand", "expand") or 2
        kern = gi("mamba_d_conv", "conv_kernel", "d_conv") or 4
        d_inner = expand * arch.hidden_size // tp
        return (kern - 1) * d_inner * dt + d_inner * d_state * ssm_dt
    return 0


def pp_layer_ranges(
    num_layers: int, pipeline_parallel_size: int = 1, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """[start, end) layer indices of each PP stage, as vLLM's ``get_pp_indices`` splits them:
    ``num_layers // pp`` each, the remainder going to the stages before the last, or an explicit
    ``VLLM_PP_LAYER_PARTITION`` list. Raises ValueError on a partition that does not add up."""
    pp = max(1, pipeline_parallel_size)
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers:
            raise ValueError(f"PP partition {partition} does not split {num_layers} layers into {pp} stages")
        sizes = list(partition)
    else:
        sizes = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


# --------------------------------------------------------------------------- layout


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class KvGroup:
    """One KV-cache group: layers sharing a block table (§2.2 hybrid grouping).

    ``kind`` is "full", "sliding", "chunked", "mla" or "mamba"; ``layers`` the global layer
    indices; ``page_size_bytes`` per layer per block on one rank.
    """

    kind: str
    layers: tuple[int, ...]
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    #: mamba pages a request holds: 1 with mamba_cache_mode "none", 3 with "align" (§2.2).
    mamba_pages_per_request: int = 1

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Worst-case bytes of one layer of this group for one request of ``max_model_len``
        tokens (``KVCacheSpec.max_memory_usage_bytes``, §2.2)."""
        bs, page = self.block_size, self.page_size_bytes
        if self.kind == "mamba":
            return page * self.mamba_pages_per_request
        if self.kind == "sliding" and self.sliding_window:
            tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
            return (cdiv(tokens, bs) + 1) * page
        if self.kind == "chunked" and self.attention_chunk_size:
            tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
            return cdiv(tokens, bs) * page
        return cdiv(max_model_len, bs) * page

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks of this group one request of ``max_model_len`` tokens can hold."""
        return cdiv(self.max_memory_usage_bytes(max_model_len, max_in_flight_tokens), self.page_size_bytes)


@shared_methods
@dataclass(repr=False, eq=False)
class KvLayout:
    """How one rank's KV cache is laid out, everything vLLM derives before counting blocks.

    Bytes are per GPU rank. ``bytes_per_block`` is the largest over PP stages (the rank that
    bounds ``num_gpu_blocks``); ``bytes_per_block_per_stage`` lists each stage.
    """

    block_size: int
    page_size_bytes_per_layer: int
    bytes_per_block: int
    bytes_per_block_per_stage: list[int]
    num_layers_per_stage: list[int]
    groups: list[KvGroup]
    #: ``max_concurrent_batches × max_num_batched_tokens`` (sliding/chunked cap, §2.2)
    max_in_flight_tokens: int
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    #: full-attention-equivalent KV bytes per token on the largest stage's rank
    kv_bytes_per_token: int = 0
    #: the ``--block-size`` the user gave, None when vLLM picked it
    block_size_flag: int | None = None
    #: unpadded Mamba state page (bytes), 0 for models without Mamba layers
    mamba_state_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request of ``max_model_len`` tokens needs, summed over groups (§2.4)."""
        return sum(g.blocks_per_request(max_model_len, self.max_in_flight_tokens) for g in self.groups)

    def max_memory_usage_bytes(self, max_model_len: int, stage: int | None = None) -> int:
        """Bytes one request of ``max_model_len`` needs on a rank of ``stage`` (default: the
        largest), ``bytes_per_block × blocks_per_request`` (§2.3)."""
        bpb = self.bytes_per_block if stage is None else self.bytes_per_block_per_stage[stage]
        return bpb * self.blocks_per_request(max_model_len)


def max_concurrent_batches(
    pipeline_parallel_size: int = 1, *, async_scheduling: bool = True, use_v2_model_runner: bool = True
) -> int:
    """Batches in flight at once (``VllmConfig.max_concurrent_batches``): with async scheduling
    ``pp + 1`` on the V2 model runner, 2 when pp = 1 on V1; otherwise ``pp``."""
    pp = max(1, pipeline_parallel_size)
    if async_scheduling:
        if use_v2_model_runner:
            return pp + 1
        if pp <= 1:
            return 2
    return pp


def default_max_num_batched_tokens(
    gpu: Any = None, *, server: bool = True, vllm_version: str | None = None
) -> int:
    """vLLM's device default for ``--max-num-batched-tokens`` (§4.2) for a catalogue GPU
    (:class:`kvdoctor.catalog.GpuSpec`; None = an H100-class device is assumed):
    :func:`kvdoctor.vllm_defaults.default_max_num_batched_tokens`, the one table (≥160 GiB →
    16384; ≥70 GiB and not A100 → 8192 for the server, 16384 for ``LLM``; otherwise 2048 / 8192).
    ``vllm_version`` None = 0.33 (assumed)."""
    from kvdoctor.vllm_defaults import default_max_num_batched_tokens as _default

    if gpu is None:
        return 8192 if server else 16384
    return _default(vllm_version, gpu.memory_bytes, gpu.name, server)


def default_max_num_seqs(gpu: Any = None, vllm_version: str | None = None) -> int:
    """vLLM's device default for ``--max-num-seqs`` (§4.2) for a catalogue GPU (``GpuSpec`` or
    None = unknown device): :func:`kvdoctor.vllm_flags.default_max_num_seqs`, the one copy."""
    from kvdoctor.vllm_flags import default_max_num_seqs as _default

    if gpu is None:
        return 256
    return _default(vllm_version, gpu.memory_bytes, gpu.name)


def default_gpu_memory_utilization(vllm_version: str | None = None, mode: SizingMode | None = None) -> float:
    """vLLM's default ``--gpu-memory-utilization`` (§2.1, §9.3) for the version and KV sizing mode:
    :func:`kvdoctor.vllm_defaults.default_gpu_memory_utilization`, the one table."""
    from kvdoctor.vllm_defaults import default_gpu_memory_utilization as _default

    return _default(vllm_version, mode)


def default_block_size(
    arch: ModelArch, *, gpu: Any = None, kv_cache_dtype: str = "auto", vllm_version: str | None = None
) -> int:
    """The attention block size vLLM picks when ``--block-size`` is not given, before hybrid
    alignment: 16 (``CacheConfig.DEFAULT_BLOCK_SIZE``) except for MLA, whose backend decides —
    on Hopper (SM 9.x) 16 with bf16 KV and 64 with fp8 KV (FlashMLA), 64 for the packed
    ``*_ds_mla`` dtypes anywhere, 128 on Blackwell (CUTLASS MLA; not verified here).

    From vLLM 0.34 the default is 64 (vllm-facts §9.3): every backend that accepts 64 keeps it
    (FLASH_ATTN, TRITON_ATTN, FLASHINFER, FlashMLA, TRITON_MLA), CUTLASS MLA on Blackwell asks
    for 128. ``vllm_version`` None or unknown = 0.33 (assumed)."""
    if is_v034(vllm_version):
        if arch.use_mla and gpu is not None and getattr(gpu, "sm_major", 0) >= 10:
            return 128
        return default_block_size_for_version(vllm_version)
    if not arch.use_mla:
        return DEFAULT_BLOCK_SIZE
    if kv_cache_dtype in ("fp8_ds_mla", "nvfp4_ds_mla"):
        return 64
    major = getattr(gpu, "sm_major", 0) if gpu is not None else 0
    if major == 9:
        return 64 if kv_cache_dtype.startswith("fp8") else 16
    if major >= 10:
        return 128
    return DEFAULT_BLOCK_SIZE


def _groups_for(buckets: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """vLLM's ``_get_kv_cache_groups_uniform_page_size``: split buckets into equal-size groups."""
    if len(buckets) == 1:
        return buckets
    sizes = [len(layers) for _, layers in buckets]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    out: list[tuple[str, list[int]]] = []
    for kind, layers in buckets:
        n = cdiv(len(layers), group_size)
        for i in range(n):
            out.append((kind, layers[i::n]))
    return out


def kv_layout(
    arch: ModelArch,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    gpu: Any = None,
    max_num_batched_tokens: int | None = None,
    vllm_version: str | None = None,
    async_scheduling: bool = True,
    use_v2_model_runner: bool | None = None,
    mamba_cache_mode: str | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    pp_layer_partition: list[int] | None = None,
    dtype: str | None = None,
    enable_prefix_caching: bool | None = None,
) -> KvLayout:
    """Build one rank's KV layout the way vLLM 0.33 does (§2.2).

    ``block_size`` None = vLLM's default for the model and ``gpu`` (:func:`default_block_size`),
    then enlarged for hybrid Mamba models until the attention page covers the Mamba state
    (multiple of 16 tokens). ``max_num_batched_tokens`` None = the device default
    (:func:`default_max_num_batched_tokens`). ``use_v2_model_runner`` None = True for dense
    non-MoE non-hybrid models (vLLM's default; every model from 0.34, which removed V1), which
    with async scheduling makes the in-flight term ``(pp + 1) × max_num_batched_tokens``.
    ``vllm_version`` picks the default block size (64 from 0.34, 16 before; None = 0.33); the
    page arithmetic has not changed across V1 versions.

    ``dtype`` is ``--dtype`` (None = "auto": a float32 checkpoint is served, and its "auto" KV
    cache stored, in 16-bit; :func:`served_dtype`). ``mamba_cache_mode`` None follows prefix
    caching (``enable_prefix_caching`` None = on, as ``vllm serve`` defaults): "align" costs 3
    Mamba pages per group per request and aligns the hybrid attention block to 64 tokens;
    "none" (prefix caching off) 1 page and 16-token alignment (§2.2 Mamba cache mode).

    Raises ValueError for an invalid kv_cache_dtype, non-positive sizes, or a model with no
    KV-cache layer.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be ≥ 1")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    notes: list[str] = []
    arch = _served(arch, dtype, gpu)
    mode = mamba_cache_mode or ("none" if enable_prefix_caching is False else "align")
    kinds = layer_kinds(arch)
    if disable_hybrid_kv_cache_manager:
        kinds = ["full" if k in ("sliding", "chunked") else k for k in kinds]
    attn_kinds = {"full", "sliding", "chunked", "mla"}
    has_attn = any(k in attn_kinds for k in kinds)
    has_mamba = any(k == "mamba" for k in kinds)
    if not has_attn and not has_mamba:
        raise ValueError("model has no KV-cache layers")

    p1 = attention_bytes_per_token_per_layer(arch, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype)
    bs = (
        block_size
        if block_size is not None
        else default_block_size(arch, gpu=gpu, kv_cache_dtype=kv_cache_dtype, vllm_version=vllm_version)
    )
    mamba_page = mamba_state_bytes(arch, tensor_parallel_size=tp) if has_mamba else 0
    if has_mamba and has_attn and mamba_page > 0:
        # Platform._align_hybrid_block_size: 64-token alignment in "align" mode (lcm of the
        # kernel's 16 and the prefill-checkpoint alignment), else the kernel's 16 (§2.2).
        align = ALIGN_MODE_BLOCK_ALIGNMENT if mode == "align" else max(KERNEL_BLOCK_ALIGNMENT, bs)
        attn_bs = align * cdiv(mamba_page, align * p1)
        if bs < attn_bs:
            notes.append(
                f"Setting attention block size to {attn_bs} tokens to ensure that attention page size is >= mamba page size."
            )
            bs = attn_bs
    page = bs * p1 if has_attn else mamba_page
    if has_mamba and has_attn and mamba_page and page > mamba_page:
        notes.append(f"Padding mamba page size by {100 * (page - mamba_page) / mamba_page:.2f}%")

    # Buckets of identical specs, in first-appearance order (vLLM groups by spec).
    bucket_map: dict[str, list[int]] = {}
    for i, k in enumerate(kinds):
        if k is not None:
            bucket_map.setdefault(k, []).append(i)
    grouped = _groups_for(list(bucket_map.items()))
    pages_per_req = ALIGN_MODE_MAMBA_PAGES if mode == "align" else 1
    groups = [
        KvGroup(
            kind=k,
            layers=tuple(layers),
            block_size=bs,
            page_size_bytes=page,
            sliding_window=arch.sliding_window if k == "sliding" else None,
            attention_chunk_size=arch.attention_chunk_size if k == "chunked" else None,
            mamba_pages_per_request=pages_per_req,
        )
        for k, layers in grouped
    ]

    ranges = pp_layer_ranges(arch.num_hidden_layers, pp, pp_layer_partition)
    bpb_stage: list[int] = []
    layers_stage: list[int] = []
    attn_layers_stage: list[int] = []
    for start, end in ranges:
        bpb_stage.append(max(sum(1 for i in g.layers if start <= i < end) * page for g in groups))
        layers_stage.append(sum(1 for i in range(start, end) if kinds[i] is not None))
        attn_layers_stage.append(sum(1 for i in range(start, end) if kinds[i] in attn_kinds))
    if max(bpb_stage) <= 0:
        raise ValueError("no KV-cache layer on any pipeline stage")

    if use_v2_model_runner is None:
        # 0.34 removed Model Runner V1 (vllm-facts §9.5): every model runs on V2
        use_v2_model_runner = is_v034(vllm_version) or not (arch.num_experts or has_mamba)
    mnbt = (
        max_num_batched_tokens
        if max_num_batched_tokens is not None
        else default_max_num_batched_tokens(gpu, vllm_version=vllm_version)
    )
    in_flight = mnbt * max_concurrent_batches(
        pp, async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner
    )
    return KvLayout(
        block_size=bs,
        page_size_bytes_per_layer=page,
        bytes_per_block=max(bpb_stage),
        bytes_per_block_per_stage=bpb_stage,
        num_layers_per_stage=layers_stage,
        groups=groups,
        max_in_flight_tokens=in_flight,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_bytes_per_token=max(attn_layers_stage) * p1,
        block_size_flag=block_size,
        mamba_state_bytes=mamba_page,
        notes=notes,
    )


def kv_bytes_per_token(
    arch: ModelArch,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
) -> int:
    """KV bytes one token costs on one GPU rank, full-attention equivalent (what people mean by
    "KV per token"): attention layers on the largest PP stage × bytes per token per layer
    (§7 "Reproducing vLLM's sizing"). Mamba layers hold no per-token state and add nothing.
    E.g. Llama-2-7B bf16 512 KiB, Qwen3-4B 144 KiB, Llama-3.1-70B 80/40/40 KiB at TP 4/8/16.
    ``dtype`` is ``--dtype`` (None = auto: float32 checkpoints count 2 bytes, :func:`served_dtype`).
    Raises ValueError for an invalid kv_cache_dtype.
    """
    arch = _served(arch, dtype, None)
    p1 = attention_bytes_per_token_per_layer(
        arch, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype
    )
    kinds = layer_kinds(arch)
    per_stage = [
        sum(1 for i in range(s, e) if kinds[i] in ("full", "sliding", "chunked", "mla"))
        for s, e in pp_layer_ranges(arch.num_hidden_layers, pipeline_parallel_size)
    ]
    return max(per_stage) * p1


# --------------------------------------------------------------------------- capacity


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class KvCapacity:
    """What vLLM logs as ``GPU KV cache size: T tokens, Maximum concurrency for L tokens per
    request: C x`` (§2.4): ``kv_cache_tokens`` T, ``max_concurrency`` C (float, unrounded),
    ``blocks_per_request`` for ``max_model_len`` L, from ``num_gpu_blocks`` (null block
    included)."""

    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    blocks_per_request: int
    max_model_len: int

    def log_line(self, device: str = "GPU") -> str:
        """The 0.33 one-line capacity log vLLM prints for these numbers."""
        return (
            f"{device} KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )


def num_gpu_blocks(available_bytes: int, layout: KvLayout) -> int:
    """``available // bytes_per_block`` (§2.1 step 4), the minimum over PP stages; ≤ 0 → 0.
    ``available_bytes`` is per GPU ("Available KV cache memory", or ``--kv-cache-memory-bytes``)."""
    if available_bytes <= 0:
        return 0
    return min(available_bytes // b for b in layout.bytes_per_block_per_stage if b > 0)


def kv_capacity(
    num_blocks: int, layout: KvLayout, max_model_len: int, *, vllm_version: str | None = None
) -> KvCapacity:
    """KV cache size and max concurrency exactly as vLLM logs them (§2.4).

    0.21+: ``conc = num_blocks / blocks_per_request``, ``tokens = int(conc × max_model_len)``.
    0.9–0.20: ``tokens = num_blocks // num_groups × block_size``, ``conc = num_blocks /
    cdiv(per-request bytes, bytes_per_block)``. 0.8.x: ``tokens = num_blocks × block_size``,
    ``conc = tokens / max_model_len``. Raises ValueError for max_model_len < 1.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    bpr = layout.blocks_per_request(max_model_len)
    v = _version_tuple(vllm_version)
    nb = max(0, num_blocks)
    if v is not None and v < (0, 9, 0):
        tokens = nb * layout.block_size
        return KvCapacity(nb, tokens, tokens / max_model_len, bpr, max_model_len)
    if v is not None and v < (0, 21, 0):
        per_req = sum(
            len(g.layers) * g.max_memory_usage_bytes(max_model_len, layout.max_in_flight_tokens)
            for g in layout.groups
        )
        conc = nb / cdiv(per_req, layout.bytes_per_block)
        tokens = nb // len(layout.groups) * layout.block_size
        return KvCapacity(nb, tokens, conc, bpr, max_model_len)
    conc = nb / bpr
    return KvCapacity(nb, int(conc * max_model_len), conc, bpr, max_model_len)


def _check_memory(available_bytes: int, bpb: int) -> int:
    # The null block is held back before any fit check (§2.1 step 4, §2.3).
    return available_bytes - bpb


def fits(available_bytes: int, layout: KvLayout, max_model_len: int) -> bool:
    """True when every rank can hold one request of ``max_model_len`` tokens:
    ``bytes_per_block × blocks_per_request ≤ available − bytes_per_block`` (null block), and
    that remainder is positive (§2.3)."""
    bpr = layout.blocks_per_request(max_model_len)
    for bpb in layout.bytes_per_block_per_stage:
        if bpb <= 0:
            continue
        check = _check_memory(available_bytes, bpb)
        if check <= 0 or bpb * bpr > check:
            return False
    return True


def estimated_max_model_len(available_bytes: int, layout: KvLayout, max_model_len: int) -> int:
    """vLLM's binary search over ``[1, max_model_len]`` for the longest request that fits the
    per-rank memory after the null block (``_estimate_max_model_len_from_groups``, §2.3); the
    minimum over PP stages; 0 when not even one token fits. Also the auto-fit result for
    ``--max-model-len -1`` with ``max_model_len`` = the model's derived length."""
    best = max_model_len
    for bpb in layout.bytes_per_block_per_stage:
        if bpb <= 0:
            continue
        check = _check_memory(available_bytes, bpb)

        def ok(n: int, bpb: int = bpb, check: int = check) -> bool:
            return bpb * layout.blocks_per_request(n) <= check

        if not ok(1):
            return 0
        lo, hi, result = 1, max_model_len, 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if ok(mid):
                result, lo = mid, mid + 1
            else:
                hi = mid - 1
        best = min(best, result)
    return best


def _format_gib(nbytes: int) -> float:
    # vllm.utils.mem_utils.format_gib: GiB rounded to 2 decimals.
    return round(nbytes / GiB, 2)


_DOCS_TAIL = "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."


def vllm_fit_error(
    available_bytes: int,
    layout: KvLayout,
    max_model_len: int,
    *,
    vllm_version: str | None = None,
    mode: SizingMode | None = None,
    gpu_memory_utilization: float = 1.0,
    after_warmup: bool = True,
) -> str | None:
    """The ValueError text vLLM raises when one request does not fit (§2.3, §9.4), or None when
    it fits. Evaluated on the rank with the largest ``bytes_per_block``.

    ``vllm_version`` None or before 0.34: the 0.33 texts. From 0.34 the hint depends on the
    sizing ``mode`` (None = extensible, 0.34's default): H1 (estimate), H2 (extensible,
    ``gpu_memory_utilization`` < 1.0) or H3 (extensible at 1.0), with the check after graph
    capture and warm-up when ``after_warmup`` (where an extensible engine's final check runs);
    the "To serve …" text ends with "Decreasing `max_model_len` also reduces what is needed."
    (``kv_cache_planning.py:106-131``)."""
    bpb = layout.bytes_per_block
    check = _check_memory(available_bytes, bpb)
    v34 = is_v034(vllm_version)
    hint = (
        kv_memory_hint(mode or "extensible", gpu_memory_utilization, after_warmup=after_warmup)
        if v34
        else HINT_H1
    )
    if check <= 0:
        return f"No available memory for the cache blocks. {hint} {_DOCS_TAIL}"
    needed = layout.max_memory_usage_bytes(max_model_len)
    if needed <= check:
        return None
    est = estimated_max_model_len(available_bytes, layout, max_model_len)
    est_msg = (
        f"Based on the available memory, the estimated maximum model length is {est}. " if est > 0 else ""
    )
    head = (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({_format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({_format_gib(check)} GiB). {est_msg}"
    )
    if v34:
        return f"{head}{hint} Decreasing `max_model_len` also reduces what is needed. {_DOCS_TAIL}"
    return (
        f"{head}Try increasing `gpu_memory_utilization` (which also "
        f"controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
        f"engine. {_DOCS_TAIL}"
    )


def required_kv_bytes(layout: KvLayout, max_model_len: int, num_requests: int = 1) -> int:
    """Smallest per-GPU KV memory that holds ``num_requests`` requests of ``max_model_len``:
    ``bytes_per_block × (num_requests × blocks_per_request + 1)`` (the +1 is the null block)."""
    return layout.bytes_per_block * (num_requests * layout.blocks_per_request(max_model_len) + 1)


def max_model_len_for_tokens(tokens: int, block_size: int) -> int:
    """Round a token capacity down to a multiple of ``block_size`` (a safe ``--max-model-len``);
    0 for non-positive input. Raises ValueError for block_size < 1."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    return max(0, tokens) // block_size * block_size


def max_num_seqs_for(kv_tokens: int, tokens_per_request: int) -> int:
    """How many requests of ``tokens_per_request`` tokens the KV cache holds at once (a
    ``--max-num-seqs`` that avoids preemption), rounded down, ≥ 0.
    Raises ValueError for tokens_per_request < 1."""
    if tokens_per_request < 1:
        raise ValueError("tokens_per_request must be positive")
    return max(0, kv_tokens) // tokens_per_request


# --------------------------------------------------------------------------- memory budget


def gmu_for_bytes(required_bytes: int, total_bytes: int) -> float:
    """The ``--gpu-memory-utilization`` whose budget ``total × gmu`` covers ``required_bytes``,
    rounded UP to 0.01. Raises ValueError for total_bytes ≤ 0."""
    if total_bytes <= 0:
        raise ValueError("total_bytes must be positive")
    return ceil_to(required_bytes / total_bytes, 0.01)


def gmu_fitting(free_bytes: int, total_bytes: int, margin_bytes: int = 0) -> float:
    """The largest ``--gpu-memory-utilization`` that passes vLLM's startup check "free memory ≥
    gmu × total" with ``margin_bytes`` to spare: ``(free − margin) / total`` rounded DOWN to
    0.01, ≥ 0 (§3.5). Raises ValueError for total_bytes ≤ 0."""
    if total_bytes <= 0:
        raise ValueError("total_bytes must be positive")
    return max(0.0, floor_to((free_bytes - margin_bytes) / total_bytes, 0.01))


def requested_memory_bytes(total_bytes: int, gpu_memory_utilization: float) -> int:
    """``ceil(total × gmu)``: the per-GPU budget vLLM requests (§2.1 step 1)."""
    return math.ceil(total_bytes * gpu_memory_utilization)


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class OverheadEstimate:
    """Non-KV memory inside the gmu budget besides weights (bytes per GPU), all estimates:
    ``non_torch`` (NCCL/cuBLAS growth after the init snapshot), ``activation_peak`` (profile
    run at max_num_batched_tokens + sampler warm-up), ``cudagraph`` (the CUDA-graph estimate,
    subtracted by default since vLLM 0.20, §2.1 step 3)."""

    non_torch: int
    activation_peak: int
    cudagraph: int

    @property
    def total(self) -> int:
        """Sum of the three, bytes."""
        return self.non_torch + self.activation_peak + self.cudagraph


def estimate_overheads(
    arch: ModelArch,
    *,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    enforce_eager: bool = False,
    vllm_version: str | None = None,
) -> OverheadEstimate:
    """Rough allowances for what vLLM's profiler subtracts besides weights (§2.1 step 3).

    activation peak ≈ ``T × (3·I/tp + 4·H) × 2 B`` for the MLP/attention temporaries of a
    ``T = max_num_batched_tokens`` dummy forward (MoE: I = moe_intermediate × top-k) plus
    ``3 × max_num_seqs × vocab × 4 B`` of fp32 sampler logits; non-torch 256 MiB (+256 MiB with
    TP for NCCL); CUDA graphs 512 MiB (+0.25 GiB per 8 GiB of activations), 0 with
    ``--enforce-eager`` or before vLLM 0.20 (then graphs come out of the 1 − gmu headroom).
    These are estimates: a real log's "Available KV cache memory" always wins.
    """
    tp = max(1, tensor_parallel_size)
    h = arch.hidden_size
    inter = arch.intermediate_size or 4 * h
    if arch.num_experts and arch.moe_intermediate_size:
        inter = arch.moe_intermediate_size * (arch.num_experts_per_tok or 1)
    act = max_num_batched_tokens * (3 * inter // tp + 4 * h) * 2
    act += 3 * max_num_seqs * (arch.vocab_size or 32000) * 4
    non_torch = 256 * 2**20 + (256 * 2**20 if tp > 1 else 0)
    v = _version_tuple(vllm_version)
    graphs = 0
    if not enforce_eager and (v is None or v >= (0, 20, 0)):
        graphs = 512 * 2**20 + (act // (8 * GiB)) * (GiB // 4)
    return OverheadEstimate(non_torch=non_torch, activation_peak=act, cudagraph=graphs)


def estimate_available_kv_bytes(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes_per_gpu: int,
    overheads: OverheadEstimate,
) -> int:
    """``ceil(total × gmu) − weights − non_torch − activation_peak − cudagraph`` (§2.1 step 3,
    0.27+ formula), per GPU; may be negative (vLLM then fails "No available memory…")."""
    return (
        requested_memory_bytes(total_bytes, gpu_memory_utilization) - weights_bytes_per_gpu - overheads.total
    )


#: What a CUDA context and the cuBLAS/NCCL handles take before vLLM's init snapshot, so that
#: free memory at start F0 ≈ total − this (an assumption: vllm-facts §9.2's example has 560 MiB).
CONTEXT_BYTES = 560 * MiB
#: μ's floor on CUDA (3 GiB on ROCm), vllm-facts §9.2 step 8.
EXTENSIBLE_MARGIN_FLOOR_BYTES = GiB


def estimate_extensible_kv_bytes(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes_per_gpu: int,
    overheads: OverheadEstimate,
    *,
    context_bytes: int = CONTEXT_BYTES,
) -> int:
    """The KV pool vLLM 0.34's extensible KV cache commits after warm-up (vllm-facts §9.2 step 8),
    per GPU, from estimates: ``K = min(R − U, F0 − U − μ) − kept`` with ``R = ceil(total × gmu)``,
    ``U = weights + non_torch + cudagraph`` (graphs are measured, not subtracted as an estimate),
    ``kept = Tr = activation_peak`` (the warm-up's transient peak), ``μ = max(1 GiB, 0.75 × Tr)``
    and ``F0 = total − context_bytes``; may be negative. Granule rounding (2 MiB steps per layer
    segment) is left out: the result is an upper bound by up to one granule per layer."""
    r = requested_memory_bytes(total_bytes, gpu_memory_utilization)
    u = weights_bytes_per_gpu + overheads.non_torch + overheads.cudagraph
    kept = overheads.activation_peak
    mu = max(EXTENSIBLE_MARGIN_FLOOR_BYTES, int(0.75 * kept))
    f0 = total_bytes - context_bytes
    return min(r - u, f0 - u - mu) - kept


# --------------------------------------------------------------------------- weights


def param_count(arch: ModelArch) -> int:
    """Parameters of the model, counted from its config (embeddings, lm_head unless tied,
    attention — GQA or MLA —, dense / MoE MLPs, Mamba mixers). An estimate: biases and norms
    are ignored (< 0.1 %)."""
    raw = arch.raw
    text = raw
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(raw.get(key), dict):
            text = {**raw, **raw[key]}
    h, heads, kvh, hd = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    vocab = arch.vocab_size or 0
    total = vocab * h * (1 if arch.tie_word_embeddings else 2)
    if arch.use_mla:
        nope, rope = arch.qk_nope_head_dim or 0, arch.qk_rope_head_dim or 0
        v, kvl = arch.v_head_dim or 0, arch.kv_lora_rank or 0
        qlr = text.get("q_lora_rank")
        q = (
            (h * qlr + qlr * heads * (nope + rope))
            if isinstance(qlr, int) and qlr
            else h * heads * (nope + rope)
        )
        attn = q + h * (kvl + rope) + kvl * heads * (nope + v) + heads * v * h
    else:
        attn = h * heads * hd + 2 * h * kvh * hd + heads * hd * h
    inter = arch.intermediate_size or 4 * h
    dense_mlp = 3 * h * inter
    moe_mlp = dense_mlp
    if arch.num_experts:
        e_inter = arch.moe_intermediate_size or inter
        shared = text.get("n_shared_experts") or 0
        shared_inter = text.get("shared_expert_intermediate_size") or 0
        moe_mlp = (arch.num_experts + shared) * 3 * h * e_inter + 3 * h * shared_inter + h * arch.num_experts
    first_dense = text.get("first_k_dense_replace") or 0
    m = {**raw, **arch.mamba}
    for i, kind in enumerate(layer_kinds(arch)):
        if kind == "mamba":
            heads_m = m.get("mamba_num_heads") or m.get("mamba_n_heads") or 0
            d_inner = heads_m * (m.get("mamba_head_dim") or m.get("mamba_d_head") or 0) or (
                (m.get("mamba_expand") or 2) * h
            )
            d_state = m.get("ssm_state_size") or m.get("mamba_d_state") or 16
            ng = m.get("n_groups") or m.get("mamba_n_groups") or 1
            total += h * (2 * d_inner + 2 * ng * d_state + heads_m) + d_inner * h
            if not m.get("hybrid_override_pattern"):
                total += moe_mlp if arch.num_experts else dense_mlp
        elif kind is None:
            total += 2 * h * inter  # Nemotron-H MLP block (non-gated)
        else:
            total += attn
            if m.get("hybrid_override_pattern"):
                continue
            total += moe_mlp if (arch.num_experts and i >= first_dense) else dense_mlp
    return int(total)


def _quant_bytes_per_param(method: str | None, bits: int | None) -> float | None:
    if not method:
        return None
    m = method.lower()
    if m in ("awq", "gptq", "awq_marlin", "gptq_marlin", "bitsandbytes", "compressed-tensors", "hqq"):
        b = bits or 4
        # group-128 fp16 scale (+ zero point): ~0.03 B per param
        return b / 8 + 0.03125
    if m in ("fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8", "fp_quant"):
        return 1.0
    if m in ("mxfp4", "nvfp4", "modelopt_fp4"):
        return 0.53125  # 4-bit + one 8-bit scale per 32
    return None


def weights_bytes(arch: ModelArch, *, dtype: str | None = None, quantization: str | None = None) -> int:
    """Estimated weight bytes of the whole model: :func:`param_count` × bytes per parameter.

    ``dtype`` overrides the config's ``torch_dtype`` (``--dtype``); ``quantization`` overrides
    ``quantization_config.quant_method``. Quantized linear layers: AWQ/GPTQ 4-bit ≈ 0.53 B/param
    (with scales), fp8 1 B, mxfp4 ≈ 0.53 B; embeddings and lm_head stay in the model dtype;
    for gpt-oss (mxfp4) only the experts are quantized. Prefer
    :func:`kvdoctor.sources.model_dir.weights_bytes_from_dir` when the checkpoint is local.
    """
    dt = model_dtype_bytes(dtype or arch.dtype)
    total = param_count(arch)
    q = _quant_bytes_per_param(quantization or arch.quant_method, arch.quant_bits)
    if q is None:
        return total * dt
    h = arch.hidden_size
    embed = (arch.vocab_size or 0) * h * (1 if arch.tie_word_embeddings else 2)
    body = total - embed
    method = (quantization or arch.quant_method or "").lower()
    if method == "mxfp4" and arch.num_experts:
        # only expert weights are mxfp4; attention/router stay bf16
        e_inter = arch.moe_intermediate_size or arch.intermediate_size or 4 * h
        experts = arch.num_experts * 3 * h * e_inter * arch.num_hidden_layers
        experts = min(experts, body)
        return int(embed * dt + (body - experts) * dt + experts * q)
    return int(embed * dt + body * q)


def weights_bytes_per_gpu(
    total_bytes: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> int:
    """Weights one GPU holds: ``ceil(total / (tp × pp))`` (even split; embeddings and lm_head
    are sharded by TP and sit on the first/last PP stage, so real ranks differ by a little)."""
    return cdiv(total_bytes, max(1, tensor_parallel_size) * max(1, pipeline_parallel_size))


def valid_tensor_parallel_size(arch: ModelArch, n: int) -> bool:
    """True when vLLM accepts TP ``n`` for this model: ``n`` divides ``num_attention_heads``
    ("Total number of attention heads (H) must be divisible by tensor parallel size (n)"), and
    ``num_key_value_heads`` when there are at least ``n`` of them; fewer KV heads are
    replicated, which needs ``n`` to be a multiple of them (``QKVParallelLinear``'s
    ``divide(tp_size, total_num_kv_heads)``). MLA models replicate their latent cache: only the
    attention heads count."""
    if n < 1 or (arch.num_attention_heads and arch.num_attention_heads % n):
        return False
    if arch.use_mla:
        return True
    kvh = arch.num_key_value_heads
    if kvh <= 0:
        return True
    return kvh % n == 0 if kvh >= n else n % kvh == 0


def valid_tensor_parallel_sizes(arch: ModelArch, up_to: int = 16) -> list[int]:
    """Every TP from 1 to ``up_to`` that :func:`valid_tensor_parallel_size` accepts."""
    return [n for n in range(1, up_to + 1) if valid_tensor_parallel_size(arch, n)]


#: rope types whose ``factor`` does not extend the derived max length (vLLM
#: ``_get_and_verify_max_len``: "su", "longrope", "llama3" keep max_position_embeddings).
_ROPE_TYPES_NOT_SCALING = ("su", "longrope", "llama3")


def derived_max_model_len(arch: ModelArch) -> int | None:
    """The longest ``--max-model-len`` vLLM accepts without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``
    (``config/model.py`` ``_get_and_verify_max_len``): the config's max_position_embeddings
    (or n_positions, max_seq_len, seq_length), times the ``rope_scaling`` factor for rope
    types that extend the context (linear, dynamic, yarn — yarn from
    ``original_max_position_embeddings``), unchanged for llama3 / longrope / su. None when the
    config gives no length."""
    base = arch.max_position_embeddings
    rope = arch.raw.get("rope_scaling") or arch.raw.get("rope_parameters")
    if not isinstance(rope, dict):
        return base
    rtype = str(rope.get("rope_type") or rope.get("type") or "").lower()
    factor = rope.get("factor")
    if rtype in _ROPE_TYPES_NOT_SCALING or "mrope" in rtype or not isinstance(factor, (int, float)):
        return base
    if isinstance(factor, bool) or not 1 <= factor <= 1024:
        return base
    if rtype == "yarn":
        orig = rope.get("original_max_position_embeddings")
        if isinstance(orig, int) and orig > 0:
            base = orig
    return int(base * factor) if base else None


def smallest_tensor_parallel_size(
    arch: ModelArch,
    *,
    weights_bytes: int,
    gpu_total_bytes: int,
    gpu_memory_utilization: float,
    visible_gpus: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    block_size: int | None = None,
) -> int | None:
    """The smallest TP ``N ≤ visible_gpus`` (valid per :func:`valid_tensor_parallel_size`) with
    ``weights/N + KV for one max_model_len request (null block included) + reserve ≤
    ceil(total × gmu)`` per GPU (spec/rules.md ``weights-not-sharded``). ``reserve`` covers the
    activation peak, non-torch memory and CUDA graphs (:data:`DEFAULT_ACTIVATION_RESERVE_BYTES`,
    an estimate). None when no N fits. Example: Llama-2-70B fp16 on 8 × A100-40GB at gmu 0.9 and
    max_model_len 4096 → 4."""
    budget = requested_memory_bytes(gpu_total_bytes, gpu_memory_utilization)
    for n in range(1, max(0, visible_gpus) + 1):
        if not valid_tensor_parallel_size(arch, n):
            continue
        layout = kv_layout(arch, tensor_parallel_size=n, kv_cache_dtype=kv_cache_dtype, block_size=block_size)
        need = weights_bytes_per_gpu(weights_bytes, n) + required_kv_bytes(layout, max_model_len)
        if need + activation_reserve_bytes <= budget:
            return n
    return None
