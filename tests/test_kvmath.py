"""kvmath against vLLM's own numbers (vllm-facts.md §2) and the cases calculators get wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoctor import catalog, kvmath
from kvdoctor.facts import ModelArch
from kvdoctor.sources.model_config import parse_model_config, parse_model_config_file
from kvdoctor.units import GiB, KiB, MiB

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "plan" / "plan-golden-handed.json").read_text())
GOLDEN_034 = json.loads((DATA / "plan" / "plan-golden-034-handed.json").read_text())


def _cat(name: str) -> ModelArch:
    cfg = catalog.model_config(name)
    assert cfg is not None, name
    return parse_model_config(cfg)


def _layout_for(row: dict) -> tuple[ModelArch, kvmath.KvLayout]:
    arch = parse_model_config(row["config"])
    layout = kvmath.kv_layout(
        arch,
        tensor_parallel_size=row["tensor_parallel_size"],
        pipeline_parallel_size=row["pipeline_parallel_size"],
        kv_cache_dtype=row["kv_cache_dtype"],
        block_size=row["block_size_flag"],
        gpu=catalog.gpu("H200"),
        max_num_batched_tokens=row["max_num_batched_tokens"],
    )
    return arch, layout


@pytest.mark.parametrize("row", GOLDEN, ids=[r["id"] for r in GOLDEN])
def test_golden_rows_match_vllm(row: dict) -> None:
    arch, layout = _layout_for(row)
    exp = row["expect"]
    avail = row["available_kv_bytes_per_gpu"]
    assert layout.page_size_bytes_per_layer == exp["page_size_bytes_per_layer"]
    assert layout.bytes_per_block == exp["bytes_per_block"]
    assert layout.block_size == exp["block_size"]
    assert layout.max_in_flight_tokens == row["details"]["max_in_flight_tokens"]
    if "bytes_per_block_per_pp_stage" in exp:
        assert layout.bytes_per_block_per_stage == exp["bytes_per_block_per_pp_stage"]
    mml = row["max_model_len"]
    if mml == -1:  # auto-fit over the model's derived length
        mml = kvmath.estimated_max_model_len(avail, layout, arch.max_position_embeddings or 0)
        assert mml == exp["resolved_max_model_len"]
    assert kvmath.fits(avail, layout, mml) is exp["fits"]
    if exp["fits"]:
        cap = kvmath.kv_capacity(kvmath.num_gpu_blocks(avail, layout), layout, mml)
        assert cap.num_gpu_blocks == exp["num_gpu_blocks"]
        assert cap.kv_cache_tokens == exp["kv_cache_tokens"]
        assert f"{cap.max_concurrency:.2f}" == exp["max_concurrency"]
        assert cap.blocks_per_request == exp["blocks_per_request"]
        assert cap.log_line() == exp["log_line"]
        assert kvmath.vllm_fit_error(avail, layout, mml) is None
    else:
        assert kvmath.estimated_max_model_len(avail, layout, mml) == exp["estimated_max_model_len"]
        assert kvmath.vllm_fit_error(avail, layout, mml) == exp["error"]


@pytest.mark.parametrize("row", GOLDEN_034, ids=[r["id"] for r in GOLDEN_034])
def test_golden_rows_match_vllm_034(row: dict) -> None:
    # vLLM 0.34.0 with --kv-cache-memory-bytes (the estimate path): block 64 by default, the
    # H1 hint and the new "Decreasing `max_model_len` …" tail in the fit error
    arch = parse_model_config(row["config"])
    layout = kvmath.kv_layout(
        arch,
        tensor_parallel_size=row["tensor_parallel_size"],
        pipeline_parallel_size=row["pipeline_parallel_size"],
        kv_cache_dtype=row["kv_cache_dtype"],
        block_size=row["block_size_flag"],
        gpu=catalog.gpu("H200"),
        max_num_batched_tokens=row["max_num_batched_tokens"],
        vllm_version="0.34.0",
    )
    exp = row["expect"]
    avail = row["available_kv_bytes_per_gpu"]
    assert layout.block_size == exp["block_size"]
    assert layout.page_size_bytes_per_layer == exp["page_size_bytes_per_layer"]
    assert layout.bytes_per_block == exp["bytes_per_block"]
    assert layout.max_in_flight_tokens == row["details"]["max_in_flight_tokens"]
    if "bytes_per_block_per_pp_stage" in exp:
        assert layout.bytes_per_block_per_stage == exp["bytes_per_block_per_pp_stage"]
    mml = row["max_model_len"]
    if mml == -1:
        mml = kvmath.estimated_max_model_len(avail, layout, kvmath.derived_max_model_len(arch) or 0)
        assert mml == exp["resolved_max_model_len"]
        assert mml % exp["block_size"] == 0
    assert kvmath.fits(avail, layout, mml) is exp["fits"]
    err = kvmath.vllm_fit_error(avail, layout, mml, vllm_version="0.34.0", mode="estimate")
    if exp["fits"]:
        cap = kvmath.kv_capacity(kvmath.num_gpu_blocks(avail, layout), layout, mml)
        assert (cap.num_gpu_blocks, cap.kv_cache_tokens) == (exp["num_gpu_blocks"], exp["kv_cache_tokens"])
        assert f"{cap.max_concurrency:.2f}" == exp["max_concurrency"]
        assert cap.blocks_per_request == exp["blocks_per_request"]
        assert cap.log_line() == exp["log_line"]
        assert err is None
    else:
        assert kvmath.estimated_max_model_len(avail, layout, mml) == exp["estimated_max_model_len"]
        assert err == exp["error"]


def test_034_fit_error_hints_by_mode() -> None:
    arch = parse_model_config_file(DATA / "models" / "qwen3-4b.json")
    layout = kvmath.kv_layout(arch, vllm_version="0.34")
    assert layout.block_size == 64
    small = 10 * layout.bytes_per_block
    h3 = kvmath.vllm_fit_error(small, layout, 32768, vllm_version="0.34")
    assert (
        h3 is not None
        and "The extensible KV cache already takes all device memory left after the model, its activations, CUDA graphs and warmup"
        in h3
    )
    assert h3.endswith(
        "Decreasing `max_model_len` also reduces what is needed. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    h2 = kvmath.vllm_fit_error(small, layout, 32768, vllm_version="0.34", gpu_memory_utilization=0.9)
    assert (
        h2 is not None
        and "within `gpu_memory_utilization`=0.9; increase it (with the extensible KV cache it defaults to 1.0)"
        in h2
    )
    none = kvmath.vllm_fit_error(0, layout, 32768, vllm_version="0.34", after_warmup=False)
    assert none == (
        "No available memory for the cache blocks. The extensible KV cache already takes all device memory left "
        "after the model and its activations; decrease `max_model_len` or `max_num_seqs`, or the model needs a "
        "device with more memory. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    # 0.33 and an unknown version keep the 0.33 text
    for v in ("0.33", None):
        assert "or decreasing `max_model_len` when initializing the engine" in (
            kvmath.vllm_fit_error(small, kvmath.kv_layout(arch), 32768, vllm_version=v) or ""
        )


def test_034_default_block_size_is_64_mla_too() -> None:
    dsv2 = (
        _cat("deepseek-ai/DeepSeek-V2-Lite") if catalog.model_config("deepseek-ai/DeepSeek-V2-Lite") else None
    )
    h100 = catalog.gpu("H100")
    arch = parse_model_config_file(DATA / "models" / "qwen3-4b.json")
    assert kvmath.default_block_size(arch, gpu=h100) == 16
    assert kvmath.default_block_size(arch, gpu=h100, vllm_version="0.34.1") == 64
    assert kvmath.default_block_size(arch, gpu=h100, vllm_version="0.35") == 16  # unknown: 0.33 assumed
    if dsv2 is not None:
        assert kvmath.default_block_size(dsv2, gpu=h100) == 16  # bf16 MLA on Hopper before 0.34
        assert kvmath.default_block_size(dsv2, gpu=h100, vllm_version="0.34") == 64


def test_extensible_estimate_reproduces_the_facts_example_within_a_granule() -> None:
    # vllm-facts §9.2: T 81,090 MiB, U = C + graphs + other growth 16,726 MiB, kept 1,900 MiB
    # (Tr 1,700 → μ 1,275), F0 80,530 → K = min(64,364, 62,529) − 1,900 = 60,629 MiB
    o = kvmath.OverheadEstimate(non_torch=0, activation_peak=1900 * MiB, cudagraph=576 * MiB + 150 * MiB)
    k = kvmath.estimate_extensible_kv_bytes(81090 * MiB, 1.0, 16000 * MiB, o, context_bytes=560 * MiB)
    # μ here is 0.75 × kept (1,425) rather than 0.75 × Tr (1,275): 150 MiB lower
    assert k == (80530 - 16726 - 1425 - 1900) * MiB
    capped = kvmath.estimate_extensible_kv_bytes(81090 * MiB, 0.9, 16000 * MiB, o, context_bytes=560 * MiB)
    assert capped == kvmath.requested_memory_bytes(81090 * MiB, 0.9) - 16726 * MiB - 1900 * MiB


def test_llama2_7b_is_mha_512kib_per_token() -> None:
    assert kvmath.kv_bytes_per_token(_cat("meta-llama/Llama-2-7b-hf")) == 512 * KiB


def test_qwen3_4b_uses_explicit_head_dim() -> None:
    arch = parse_model_config_file(DATA / "models" / "qwen3-4b.json")
    assert arch.head_dim == 128 and arch.hidden_size // arch.num_attention_heads == 80
    assert kvmath.kv_bytes_per_token(arch) == 144 * KiB


@pytest.mark.parametrize(("tp", "kib"), [(1, 320), (2, 160), (4, 80), (8, 40), (16, 40)])
def test_llama31_70b_per_gpu_replicates_kv_heads_beyond_tp8(tp: int, kib: int) -> None:
    arch = parse_model_config_file(DATA / "models" / "llama-3.1-70b.json")
    assert kvmath.kv_bytes_per_token(arch, tensor_parallel_size=tp) == kib * KiB


def test_pp_splits_layers_per_stage() -> None:
    arch = parse_model_config_file(DATA / "models" / "llama-3.1-70b.json")
    assert kvmath.kv_bytes_per_token(arch, pipeline_parallel_size=2) == 160 * KiB
    assert kvmath.pp_layer_ranges(81, 2) == [(0, 41), (41, 81)]
    assert kvmath.pp_layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_deepseek_v3_mla_not_split_by_tp() -> None:
    arch = _cat("deepseek-ai/DeepSeek-V3")
    assert arch.use_mla
    per_tok = 61 * (512 + 64) * 2
    for tp in (1, 8, 16):
        assert kvmath.kv_bytes_per_token(arch, tensor_parallel_size=tp) == per_tok
    naive = 2 * 61 * 128 * 128 * 2  # all heads, K and V: what calculators print
    assert naive / per_tok > 25
    # §2.2 verified page sizes at block 64: bf16 73,728 B, fp8_ds_mla 41,984 B
    assert kvmath.kv_layout(arch, block_size=64).page_size_bytes_per_layer == 73728
    assert (
        kvmath.kv_layout(arch, block_size=64, kv_cache_dtype="fp8_ds_mla").page_size_bytes_per_layer == 41984
    )


def test_mla_default_block_size_on_hopper() -> None:
    arch = _cat("deepseek-ai/DeepSeek-V3")
    h200 = catalog.gpu("H200")
    assert kvmath.kv_layout(arch, gpu=h200).block_size == 16
    assert kvmath.kv_layout(arch, gpu=h200, kv_cache_dtype="fp8").block_size == 64
    assert kvmath.kv_layout(arch, gpu=h200, block_size=32).block_size == 32
    assert kvmath.kv_layout(_cat("meta-llama/Llama-3.1-8B"), gpu=h200).block_size == 16


def test_mistral_sliding_window_caps_blocks_with_in_flight_term() -> None:
    arch = parse_model_config_file(DATA / "models" / "mistral-7b-v0.1.json")
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192)
    assert layout.groups[0].kind == "sliding"
    # min(4095 + 16384, L) tokens, +1 block (§2.2)
    assert layout.blocks_per_request(4096) == 257
    assert layout.blocks_per_request(32768) == 1281
    assert layout.blocks_per_request(131072) == 1281
    # §2.2 verified: SWA 4096, block 16, len 8192, batched 8192 (V1 runner, 2 batches) → 513
    v1 = kvmath.kv_layout(arch, max_num_batched_tokens=8192, async_scheduling=False)
    assert v1.max_in_flight_tokens == 8192
    assert v1.blocks_per_request(8192) == 513


def test_hybrid_kv_manager_disabled_allocates_full_attention() -> None:
    arch = parse_model_config_file(DATA / "models" / "mistral-7b-v0.1.json")
    layout = kvmath.kv_layout(arch, disable_hybrid_kv_cache_manager=True)
    assert layout.blocks_per_request(32768) == 2048


def test_gemma3_groups_sliding_and_full_layers() -> None:
    arch = _cat("google/gemma-3-27b-it")  # multimodal config: text_config flattened
    assert arch.num_hidden_layers == 62 and arch.sliding_window == 1024
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192)
    kinds = [(g.kind, len(g.layers)) for g in layout.groups]
    assert ("full", 10) in kinds and sum(n for k, n in kinds if k == "sliding") == 52
    assert len(kinds) == 7  # 52 sliding split into 6 groups of ≤10, 1 full group
    assert layout.bytes_per_block == 10 * layout.page_size_bytes_per_layer
    # each sliding group: cdiv(min(1023 + 16384, L), 16) + 1 blocks; full: cdiv(L, 16)
    assert layout.blocks_per_request(32768) == 2048 + 6 * (1088 + 1)


def test_gpt_oss_alternating_layers_form_two_equal_groups() -> None:
    layout = kvmath.kv_layout(_cat("openai/gpt-oss-120b"))
    assert [(g.kind, len(g.layers)) for g in layout.groups] == [("sliding", 18), ("full", 18)]


HYBRID = {
    # A Nemotron-H-style Mamba2 hybrid (illustrative numbers): 4 attention, 8 mamba, 4 MLP blocks.
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "num_hidden_layers": 16,
    "hybrid_override_pattern": "M-M*M-M*M-M*M-M*",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "vocab_size": 131072,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_hybrid_mamba_aligns_attention_block_to_state_page() -> None:
    arch = parse_model_config(HYBRID)
    kinds = kvmath.layer_kinds(arch)
    assert kinds.count("mamba") == 8 and kinds.count("full") == 4 and kinds.count(None) == 4
    state = kvmath.mamba_state_bytes(arch)
    assert state == 3 * (128 * 64 + 2 * 8 * 128) * 2 + 128 * 64 * 128 * 2  # conv + ssm
    # prefix caching off → mamba_cache_mode "none": 16-token alignment, 1 page per mamba group
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192, enable_prefix_caching=False)
    p1 = 8 * 2 * 128 * 2
    assert layout.block_size == 16 * kvmath.cdiv(state, 16 * p1) == 528
    assert layout.page_size_bytes_per_layer == 528 * p1 >= state
    assert any("Setting attention block size to 528 tokens" in n for n in layout.notes)
    # 4 full layers → group size 4; 8 mamba layers → 2 groups; one pool
    assert [(g.kind, len(g.layers)) for g in layout.groups] == [("mamba", 4), ("mamba", 4), ("full", 4)]
    assert layout.bytes_per_block == 4 * layout.page_size_bytes_per_layer
    assert layout.blocks_per_request(8192) == kvmath.cdiv(8192, 528) + 2
    # fp32 ssm state doubles the ssm part and the block grows accordingly
    big = kvmath.kv_layout(
        parse_model_config({**HYBRID, "mamba_ssm_cache_dtype": "float32"}), mamba_cache_mode="none"
    )
    assert big.block_size == 1040
    # KV per token counts only attention layers
    assert kvmath.kv_bytes_per_token(arch) == 4 * p1


def test_hybrid_mamba_align_mode_is_the_default() -> None:
    # vllm-facts §2.2: `vllm serve` turns prefix caching on, which puts hybrid models in "align"
    # mode: attention blocks are multiples of 64 tokens, each request holds 2 + 1 pages per group.
    arch = parse_model_config(HYBRID)
    state = kvmath.mamba_state_bytes(arch)
    p1 = 8 * 2 * 128 * 2
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192)
    assert layout.block_size == 64 * kvmath.cdiv(state, 64 * p1) == 576
    assert layout.block_size % 64 == 0
    assert layout.blocks_per_request(8192) == kvmath.cdiv(8192, 576) + 2 * 3
    explicit = kvmath.kv_layout(arch, max_num_batched_tokens=8192, enable_prefix_caching=True)
    assert explicit.block_size == 576 and explicit.blocks_per_request(8192) == layout.blocks_per_request(8192)


def test_kv_cache_dtype_bytes_and_scales() -> None:
    assert kvmath.kv_cache_dtype_bytes("auto", "bfloat16") == 2
    assert kvmath.kv_cache_dtype_bytes("auto", "float32") == 4
    assert kvmath.kv_cache_dtype_bytes("fp8", "bfloat16") == 1
    assert kvmath.kv_cache_dtype_bytes("fp8_e5m2", None) == 1
    assert kvmath.kv_cache_dtype_bytes("int4_per_token_head", "bfloat16") == 0.5
    assert kvmath.kv_scale_overhead_bytes("int8_per_token_head") == 8
    assert kvmath.kv_scale_overhead_bytes("fp8") == 0
    with pytest.raises(ValueError, match="int8_per_token_head"):
        kvmath.kv_cache_dtype_bytes("int8", "float16")
    arch = _cat("meta-llama/Llama-3.1-8B")
    # (128 + 128) × 1 B + 8 B scales, × 8 heads, × 32 layers
    assert kvmath.kv_bytes_per_token(arch, kv_cache_dtype="int8_per_token_head") == 32 * 8 * 264
    assert kvmath.kv_bytes_per_token(arch, kv_cache_dtype="int4_per_token_head") == 32 * 8 * 136


def test_facts_example_concurrency() -> None:
    # §2.4: 27,165 blocks, block 16, max_model_len 8192 → 434,640 tokens, 53.06x; 8000 → 54.33x
    layout = kvmath.kv_layout(_cat("meta-llama/Llama-3.1-8B"))
    cap = kvmath.kv_capacity(27165, layout, 8192)
    assert (
        cap.log_line()
        == "GPU KV cache size: 434,640 tokens, Maximum concurrency for 8,192 tokens per request: 53.06x"
    )
    cap = kvmath.kv_capacity(27165, layout, 8000)
    assert f"{cap.max_concurrency:.2f}" == "54.33" and cap.kv_cache_tokens == 434640


def test_capacity_version_history() -> None:
    layout = kvmath.kv_layout(_cat("meta-llama/Llama-3.1-8B"))
    old = kvmath.kv_capacity(1000, layout, 3000, vllm_version="0.8.5")
    assert old.kv_cache_tokens == 16000 and old.max_concurrency == pytest.approx(16000 / 3000)
    mid = kvmath.kv_capacity(1000, layout, 3000, vllm_version="0.10.2")
    assert mid.kv_cache_tokens == 16000 and mid.max_concurrency == pytest.approx(1000 / 188)
    new = kvmath.kv_capacity(1000, layout, 3000)
    assert new.kv_cache_tokens == int(1000 / 188 * 3000)


def test_num_blocks_and_null_block() -> None:
    layout = kvmath.kv_layout(_cat("meta-llama/Llama-3.1-8B"))  # 2 MiB per block
    assert kvmath.num_gpu_blocks(0, layout) == 0
    assert kvmath.num_gpu_blocks(-5 * GiB, layout) == 0
    assert kvmath.num_gpu_blocks(257 * 2 * MiB + 1, layout) == 257
    assert kvmath.fits(257 * 2 * MiB, layout, 4096)  # 256 + null block
    assert not kvmath.fits(256 * 2 * MiB, layout, 4096)
    assert kvmath.estimated_max_model_len(256 * 2 * MiB, layout, 4096) == 255 * 16
    assert kvmath.estimated_max_model_len(2 * MiB, layout, 4096) == 0
    assert kvmath.required_kv_bytes(layout, 4096) == 257 * 2 * MiB
    assert "No available memory" in (kvmath.vllm_fit_error(2 * MiB, layout, 16) or "")


def test_small_helpers() -> None:
    assert kvmath.max_model_len_for_tokens(23650, 16) == 23648
    assert kvmath.max_model_len_for_tokens(-3, 16) == 0
    assert kvmath.max_num_seqs_for(86416, 2048) == 42
    with pytest.raises(ValueError):
        kvmath.max_num_seqs_for(100, 0)
    assert kvmath.gmu_for_bytes(int(0.851 * 80 * GiB), 80 * GiB) == 0.86
    assert kvmath.gmu_for_bytes(int(0.85 * 80 * GiB), 80 * GiB) == 0.85
    assert kvmath.gmu_fitting(int(31.44 * GiB), int(47.38 * GiB)) == 0.66
    assert kvmath.gmu_fitting(GiB, 10 * GiB, margin_bytes=2 * GiB) == 0.0
    assert kvmath.default_gpu_memory_utilization("0.19.1") == 0.9
    assert kvmath.default_gpu_memory_utilization(None) == 0.92
    assert kvmath.max_concurrent_batches(1) == 2 and kvmath.max_concurrent_batches(2) == 3
    assert kvmath.max_concurrent_batches(2, use_v2_model_runner=False) == 2
    assert kvmath.max_concurrent_batches(2, async_scheduling=False) == 2
    assert kvmath.default_max_num_batched_tokens(catalog.gpu("H200")) == 8192
    assert kvmath.default_max_num_batched_tokens(catalog.gpu("A100-80GB")) == 2048
    assert kvmath.default_max_num_batched_tokens(catalog.gpu("B200")) == 16384


def test_weights_estimates() -> None:
    b01 = parse_model_config_file(DATA / "models" / "case-b01-tp1-70b-on-8x-a100-40g.json")
    assert kvmath.param_count(b01) == pytest.approx(68.98e9, rel=0.005)
    assert kvmath.weights_bytes(b01) == 2 * kvmath.param_count(b01)
    assert kvmath.weights_bytes_per_gpu(kvmath.weights_bytes(b01), 4) == kvmath.cdiv(
        kvmath.weights_bytes(b01), 4
    )
    l8 = _cat("meta-llama/Llama-3.1-8B")
    assert kvmath.param_count(l8) == pytest.approx(8.03e9, rel=0.005)
    awq = kvmath.weights_bytes(l8, quantization="awq")
    fp8 = kvmath.weights_bytes(l8, quantization="fp8")
    assert awq < fp8 < kvmath.weights_bytes(l8)
    # body 1 B, embeddings + lm_head bf16: 9.08 GB, the size of the public FP8 checkpoints
    assert fp8 == pytest.approx(9.08e9, rel=0.01)
    assert kvmath.param_count(_cat("deepseek-ai/DeepSeek-V3")) == pytest.approx(671e9, rel=0.01)
    assert kvmath.param_count(_cat("mistralai/Mixtral-8x7B-v0.1")) == pytest.approx(46.7e9, rel=0.01)
    assert kvmath.param_count(_cat("openai/gpt-oss-120b")) == pytest.approx(117e9, rel=0.02)


def test_smallest_tp_for_llama2_70b_on_a100_40g() -> None:
    arch = parse_model_config_file(DATA / "models" / "case-b01-tp1-70b-on-8x-a100-40g.json")
    w = kvmath.weights_bytes(arch)
    kw = dict(weights_bytes=w, gpu_total_bytes=40960 * MiB, gpu_memory_utilization=0.9, max_model_len=4096)
    assert kvmath.smallest_tensor_parallel_size(arch, visible_gpus=8, **kw) == 4
    assert kvmath.smallest_tensor_parallel_size(arch, visible_gpus=2, **kw) is None
    assert kvmath.valid_tensor_parallel_size(arch, 8)
    assert not kvmath.valid_tensor_parallel_size(arch, 3)
    assert kvmath.valid_tensor_parallel_size(arch, 16)  # 8 KV heads replicated at 16
    assert not kvmath.valid_tensor_parallel_size(_cat("Qwen/Qwen2.5-7B-Instruct"), 8)  # 28 heads


def test_estimated_available_memory() -> None:
    arch = _cat("meta-llama/Llama-3.1-8B")
    o = kvmath.estimate_overheads(arch, max_num_batched_tokens=8192)
    assert o.total == o.non_torch + o.activation_peak + o.cudagraph
    assert 0 < o.total < 4 * GiB
    assert kvmath.estimate_overheads(arch, enforce_eager=True).cudagraph == 0
    assert kvmath.estimate_overheads(arch, vllm_version="0.10.2").cudagraph == 0
    avail = kvmath.estimate_available_kv_bytes(80 * GiB, 0.9, 15 * GiB, o)
    assert avail == kvmath.requested_memory_bytes(80 * GiB, 0.9) - 15 * GiB - o.total


def test_bad_inputs_raise() -> None:
    arch = _cat("meta-llama/Llama-3.1-8B")
    with pytest.raises(ValueError):
        kvmath.kv_layout(arch, tensor_parallel_size=0)
    with pytest.raises(ValueError):
        kvmath.kv_layout(arch, block_size=0)
    with pytest.raises(ValueError):
        kvmath.kv_capacity(10, kvmath.kv_layout(arch), 0)
    with pytest.raises(ValueError):
        kvmath.pp_layer_ranges(32, 2, [10, 10])
