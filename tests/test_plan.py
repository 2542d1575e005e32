"""``kvdoctor plan``: JSON fields match the golden rows; exit codes; catalogue; properties."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor import catalog, kvmath
from kvdoctor.plan import plan_command
from kvdoctor.sources.model_config import parse_model_config
from kvdoctor.units import GiB, MiB

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "plan" / "plan-golden-handed.json").read_text())
#: vLLM 0.34.0's own KV-cache code (shared/cases-034, default block 64 and --block-size 16)
GOLDEN_034 = json.loads((DATA / "plan" / "plan-golden-034-handed.json").read_text())


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(plan_command, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize(
    ("row", "version"),
    [(r, "0.33") for r in GOLDEN] + [(r, "0.34") for r in GOLDEN_034],
    ids=[f"0.33:{r['id']}" for r in GOLDEN] + [f"0.34:{r['id']}" for r in GOLDEN_034],
)
def test_plan_json_reproduces_golden_row(row: dict, version: str, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(row["config"]))
    args = [
        "--model-config", str(cfg), "--gpu", "H200", "--format", "json", "--no-grid",
        "--vllm-version", version,
        "--tensor-parallel-size", str(row["tensor_parallel_size"]),
        "--pipeline-parallel-size", str(row["pipeline_parallel_size"]),
        "--kv-cache-dtype", row["kv_cache_dtype"],
        "--max-model-len", str(row["max_model_len"]),
        "--max-num-batched-tokens", str(row["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes", str(row["available_kv_bytes_per_gpu"]),
    ]  # fmt: skip
    if row["block_size_flag"] is not None:
        args += ["--block-size", str(row["block_size_flag"])]
    code, out, _ = _run(*args)
    exp = row["expect"]
    assert code == (0 if exp["fits"] else 2)
    plan = json.loads(out)
    for key in (
        "page_size_bytes_per_layer",
        "bytes_per_block",
        "block_size",
        "fits",
        "num_gpu_blocks",
        "kv_cache_tokens",
    ):
        assert plan[key] == exp[key], key
    if exp["fits"]:
        assert f"{plan['max_concurrency']:.2f}" == exp["max_concurrency"]
        assert plan["log_line"] == exp["log_line"]
    else:
        assert plan["estimated_max_model_len"] == exp["estimated_max_model_len"]
        assert plan["error"] == exp["error"]
    if "resolved_max_model_len" in exp:
        assert plan["max_model_len"] == exp["resolved_max_model_len"]


def test_tutorial_case_70b_tp2_fp8_a100() -> None:
    code, out, _ = _run(
        "meta-llama/Llama-2-70b-chat-hf", "--gpu", "A100-80GB", "--tensor-parallel-size", "2",
        "--max-model-len", "2048", "--kv-cache-dtype", "fp8", "--format", "json",
        "--vllm-version", "0.33",  # the tutorial's vLLM sized by estimate (gmu 0.92)
    )  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    assert plan["kv_bytes_per_token_per_gpu"] == 80 * 1024  # 80 layers × 4 KV heads × 256 × 1 B
    assert plan["gpu"]["memory_bytes"] == 81920 * MiB
    assert 60 * GiB < plan["weights_bytes_per_gpu"] < 66 * GiB
    assert plan["fits"] and plan["kv_cache_tokens"] > 0
    assert plan["max_concurrency"] < 64  # the tutorial's "64–128" does not hold at 2048 tokens
    assert {r["tensor_parallel_size"] for r in plan["grid"]} == {1, 2, 4, 8}
    assert plan["suggested_flags"]["--max-model-len"] == "2048"


def test_text_output_and_exit_2_with_largest_length() -> None:
    code, out, err = _run(
        "meta-llama/Llama-3.1-70B", "--gpu", "H100", "-tp", "2", "--max-model-len", "131072"
    )
    assert code == 2
    assert "fits one max_model_len request" in out and "NO" in out
    assert "largest max_model_len that fits" in err


def test_suggests_fp8_when_it_makes_the_length_fit() -> None:
    code, out, _ = _run(
        "meta-llama/Llama-3.1-70B",
        "--gpu",
        "H100",
        "-tp",
        "2",
        "--max-model-len",
        "131072",
        "--format",
        "json",
    )
    plan = json.loads(out)
    assert code == 2 and not plan["fits"]
    assert 0 < int(plan["suggested_flags"]["--max-model-len"]) < 131072
    fp8 = [r for r in plan["grid"] if r["tensor_parallel_size"] == 2 and r["kv_cache_dtype"] == "fp8"][0]
    assert fp8["largest_max_model_len"] > plan["largest_max_model_len"]


def test_typical_request_and_gpu_memory() -> None:
    code, out, _ = _run(
        "Qwen/Qwen3-8B", "--gpu-memory", "24GiB", "--max-model-len", "8k", "--prompt-tokens", "1000",
        "--output-tokens", "200", "--format", "json", "--no-grid",
    )  # fmt: skip
    plan = json.loads(out)
    assert code == 0 and plan["max_model_len"] == 8000
    assert plan["gpu"]["memory_bytes"] == 24 * GiB
    assert plan["max_concurrency_typical"] > plan["max_concurrency"]
    assert int(plan["suggested_flags"]["--max-num-seqs"]) == plan["kv_cache_tokens"] // 1200


def test_auto_fit_max_model_len() -> None:
    args = (
        "meta-llama/Llama-3.1-8B",
        "--kv-cache-memory-bytes",
        "4G",
        "--max-model-len",
        "auto",
        "--format",
        "json",
    )
    code, out, _ = _run(*args, "--vllm-version", "0.33")
    plan = json.loads(out)
    assert code == 0
    # 4 GiB / 2 MiB = 2048 blocks, one is the null block → 2047 × 16 tokens
    assert plan["max_model_len"] == 2047 * 16 and plan["num_gpu_blocks"] == 2048
    # 0.34 (the default): 64-token blocks of 8 MiB → 512 blocks, 511 × 64 tokens (a multiple of 64)
    code, out, _ = _run(*args)
    plan = json.loads(out)
    assert code == 0 and plan["vllm_version"] == "0.34" and plan["block_size"] == 64
    assert plan["max_model_len"] == 511 * 64 and plan["num_gpu_blocks"] == 512
    assert plan["sizing_mode"] == "estimate"  # --kv-cache-memory-bytes turns the extensible cache off


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["no-such/model", "--gpu", "H100"], "unknown model"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "Z9000"], "unknown GPU"),
        (["meta-llama/Llama-3.1-8B"], "--gpu"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H100", "--kv-cache-dtype", "int8"], "int8_per_token_head"),
        (["meta-llama/Llama-3.1-8B", "--gpu-memory", "lots"], "size"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "0"], "max-model-len"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H100", "--kv-cache-memory-bytes", "8GiB"], "8GiB"),
    ],
)
def test_bad_input_exit_3_one_line(args: list[str], msg: str) -> None:
    code, out, err = _run(*args)
    assert code == 3 and msg in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize(
    "content",
    ["not json", "", '{"num_hidden_layers": 4}', '{"num_hidden_layers": 4, "num_attention_heads": 0}'],
)
def test_bad_config_file_exit_3(tmp_path: Path, content: str) -> None:
    f = tmp_path / "config.json"
    f.write_text(content)
    code, _, err = _run("--model-config", str(f), "--gpu", "H100")
    assert code == 3 and str(f) in err and err.count("\n") == 1


def test_model_directory_uses_safetensors_size(tmp_path: Path) -> None:
    import struct

    (tmp_path / "config.json").write_text((DATA / "models" / "llama-3.1-8b.json").read_text())
    header = json.dumps({"w": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 16060522496}}')
    code, out, _ = _run(
        str(tmp_path), "--gpu", "L40S", "--max-model-len", "8192", "--format", "json", "--no-grid"
    )
    plan = json.loads(out)
    assert code == 0 and plan["weights_bytes_total"] == 16060522496
    assert plan["weights_source"] == "safetensors metadata"


# --------------------------------------------------------------------------- catalogue


@pytest.mark.parametrize(
    ("name", "mib", "fp8"),
    [
        ("A100-80GB", 81920, False),
        ("A100-40GB", 40960, False),
        ("H100", 81559, True),
        ("H100-80GB", 81559, True),
        ("H200", 143771, True),
        ("L40S", 46068, True),
        ("A10G", 23028, False),
        ("L4", 23034, True),
        ("RTX 4090", 24564, True),
        ("V100-16GB", 16160, False),
        ("T4", 15360, False),
        ("B200", 183359, True),
        ("MI300X", 196288, True),
        ("NVIDIA A100-SXM4-80GB", 81920, False),
        ("NVIDIA A100 80GB PCIe", 81920, False),
        ("NVIDIA H800", 81559, True),
        ("NVIDIA H100 80GB HBM3", 81559, True),
        ("NVIDIA RTX 6000 Ada Generation", 49140, True),
        ("Tesla T4", 15360, False),
    ],
)
def test_gpu_catalogue(name: str, mib: int, fp8: bool) -> None:
    g = catalog.gpu(name)
    assert g.memory_bytes == mib * MiB and g.fp8 is fp8


def test_truncated_nvidia_smi_name_uses_memory() -> None:
    assert catalog.gpu("NVIDIA A100-SXM...", memory_bytes=40960 * MiB).name == "A100-40GB"
    assert catalog.gpu("NVIDIA A100-SXM...", memory_bytes=81920 * MiB).name == "A100-80GB"
    with pytest.raises(KeyError):
        catalog.gpu("Voodoo 5")


def test_gpu_memory_parse() -> None:
    assert catalog.parse_gpu_memory("80GiB") == 80 * GiB
    assert catalog.parse_gpu_memory("81920MiB") == 81920 * MiB
    assert catalog.parse_gpu_memory("24") == 24 * GiB
    with pytest.raises(ValueError):
        catalog.parse_gpu_memory("0GiB")


def test_model_catalogue_lookup() -> None:
    assert catalog.model_config("meta-llama/llama-3.1-70b") == catalog.model_config("Llama-3.1-70B")
    assert catalog.model_config("nobody/nothing") is None


# --------------------------------------------------------------------------- properties

_ARCHS = [
    parse_model_config(catalog.model_config(n) or {})
    for n in (
        "meta-llama/Llama-3.1-8B",
        "mistralai/Mistral-7B-v0.1",
        "google/gemma-3-12b-it",
        "deepseek-ai/DeepSeek-V3",
    )
]


@settings(max_examples=60, deadline=None)
@given(
    arch_i=st.integers(0, len(_ARCHS) - 1),
    tp=st.sampled_from([1, 2, 4, 8]),
    mem=st.integers(-GiB, 200 * GiB),
    extra=st.integers(0, 50 * GiB),
    mml=st.integers(1, 200_000),
    longer=st.integers(0, 100_000),
)
def test_capacity_monotone_and_non_negative(
    arch_i: int, tp: int, mem: int, extra: int, mml: int, longer: int
) -> None:
    layout = kvmath.kv_layout(_ARCHS[arch_i], tensor_parallel_size=tp, max_num_batched_tokens=8192)
    n1, n2 = kvmath.num_gpu_blocks(mem, layout), kvmath.num_gpu_blocks(mem + extra, layout)
    assert 0 <= n1 <= n2
    c1, c2 = kvmath.kv_capacity(n1, layout, mml), kvmath.kv_capacity(n2, layout, mml)
    assert 0 <= c1.kv_cache_tokens <= c2.kv_cache_tokens and 0 <= c1.max_concurrency <= c2.max_concurrency
    c_long = kvmath.kv_capacity(n2, layout, mml + longer)
    assert c_long.max_concurrency <= c2.max_concurrency
    e1 = kvmath.estimated_max_model_len(mem, layout, mml)
    assert 0 <= e1 <= kvmath.estimated_max_model_len(mem + extra, layout, mml) <= mml
    if kvmath.fits(mem, layout, mml + longer):
        assert kvmath.fits(mem, layout, mml) and kvmath.fits(mem + extra, layout, mml + longer)
    assert kvmath.fits(mem, layout, mml) == (e1 == mml)


# --------------------------------------------------------------------------- vllm-facts §2.2 (2026)

MODELS = Path(__file__).parent / "data" / "models"


def test_fp32_checkpoint_is_served_in_16_bit() -> None:
    # Gemma-2-9B ships float32 weights; --dtype auto serves them in bf16 (fp16 without bf16), so an
    # "auto" KV cache is 2 bytes per element: 8 KV heads × (256 + 256) × 2 B = 8,192 B per token
    # per layer, × 42 layers (21 sliding + 21 full) = 344,064 B per token. Only --dtype float32
    # keeps 4-byte KV.
    arch = parse_model_config((MODELS / "gemma-2-9b-fp32.json").read_text())
    assert arch.dtype == "float32"
    assert kvmath.served_dtype(arch.dtype) == "bfloat16"
    assert kvmath.served_dtype(arch.dtype, gpu=catalog.gpu("V100-16GB")) == "float16"
    assert kvmath.served_dtype(arch.dtype, "float32") == "float32"
    assert kvmath.kv_bytes_per_token(arch) == 42 * 8 * 2 * 256 * 2 == 344_064
    assert kvmath.kv_bytes_per_token(arch, dtype="float32") == 2 * 344_064
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192)
    assert layout.page_size_bytes_per_layer == 16 * 8192
    # 21 sliding + 21 full layers: two groups of 21, one pool
    assert sorted((g.kind, len(g.layers)) for g in layout.groups) == [("full", 21), ("sliding", 21)]
    assert layout.bytes_per_block == 21 * 16 * 8192 == 2_752_512
    # the input arch (a fact) is not changed
    assert arch.dtype == "float32"


def test_plan_fp32_checkpoint_weights_and_kv_in_16_bit() -> None:
    code, out, _ = _run(
        "--model-config",
        str(MODELS / "gemma-2-9b-fp32.json"),
        "--gpu",
        "L40S",
        "--max-model-len",
        "8192",
        "--format",
        "json",
        "--no-grid",
    )
    plan = json.loads(out)
    assert plan["dtype"] == "bfloat16"
    assert plan["kv_bytes_per_token_per_gpu"] == 344_064
    arch = parse_model_config((MODELS / "gemma-2-9b-fp32.json").read_text())
    assert plan["weights_bytes_total"] == kvmath.param_count(arch) * 2
    assert any("served in bfloat16" in n or "serves it in bfloat16" in n for n in plan["notes"])
    code32, out32, _ = _run(
        "--model-config",
        str(MODELS / "gemma-2-9b-fp32.json"),
        "--gpu",
        "L40S",
        "--max-model-len",
        "8192",
        "--dtype",
        "float32",
        "--format",
        "json",
        "--no-grid",
    )
    plan32 = json.loads(out32)
    assert plan32["kv_bytes_per_token_per_gpu"] == 2 * 344_064
    assert plan32["weights_bytes_total"] == 2 * plan["weights_bytes_total"]


def test_qwen3_next_full_attention_interval_align_mode() -> None:
    # full_attention_interval 4: layers 4, 8, …, 48 (1-based) are full attention (12), the other
    # 36 are Gated-DeltaNet linear attention with a per-request state of
    #   conv (4 − 1) × (2·16·128 + 32·128) × 2 B = 49,152 B + recurrent 32 × 128 × 128 × 2 B
    #   = 1,048,576 B → 1,097,728 B.
    # Attention per token per layer: 2 KV heads × (256 + 256) × 2 B = 2,048 B.
    # Prefix caching on (the default) → align mode: block = 64 × cdiv(1,097,728, 64 × 2,048) = 576,
    # 3 pages per Mamba group per request. Groups: 36 linear / 12 full → group size 12 → 3 + 1.
    arch = parse_model_config((MODELS / "qwen3-next-80b-a3b.json").read_text())
    kinds = kvmath.layer_kinds(arch)
    assert [i + 1 for i, k in enumerate(kinds) if k == "full"] == list(range(4, 49, 4))
    assert kinds.count("mamba") == 36
    assert kvmath.mamba_state_bytes(arch) == 49_152 + 1_048_576 == 1_097_728
    layout = kvmath.kv_layout(arch, max_num_batched_tokens=8192)
    assert layout.block_size == 576
    assert layout.page_size_bytes_per_layer == 576 * 2048 == 1_179_648
    assert [(g.kind, len(g.layers)) for g in layout.groups] == [("mamba", 12)] * 3 + [("full", 12)]
    assert layout.bytes_per_block == 12 * 1_179_648
    assert layout.blocks_per_request(32768) == kvmath.cdiv(32768, 576) + 3 * 3 == 66
    # prefix caching off → mode "none": 16-token alignment (cdiv(1,097,728, 16 × 2,048) = 34 → 544)
    off = kvmath.kv_layout(arch, max_num_batched_tokens=8192, enable_prefix_caching=False)
    assert off.block_size == 544
    assert off.blocks_per_request(32768) == kvmath.cdiv(32768, 544) + 3 == 64
    # TP 2: heads and states split; the 2 KV heads give 1 per rank
    tp2 = kvmath.kv_layout(arch, tensor_parallel_size=2, max_num_batched_tokens=8192)
    assert kvmath.mamba_state_bytes(arch, tensor_parallel_size=2) == 24_576 + 524_288
    assert tp2.block_size == 64 * kvmath.cdiv(24_576 + 524_288, 64 * 1024) == 576


@pytest.mark.parametrize("tp", ["3", "5", "6"])
def test_plan_refuses_tp_vllm_rejects(tp: str) -> None:
    code, _, err = _run("meta-llama/Llama-3.1-8B", "--gpu", "H100", "--tensor-parallel-size", tp)
    assert code == 3
    assert f"vLLM rejects --tensor-parallel-size {tp}" in err and "valid: 1, 2, 4, 8" in err


def test_tp_validity_replicates_kv_heads_only_by_multiples() -> None:
    arch = parse_model_config((MODELS / "qwen3-next-80b-a3b.json").read_text())  # 16 heads, 2 KV heads
    assert kvmath.valid_tensor_parallel_sizes(arch) == [1, 2, 4, 8, 16]
    odd = parse_model_config(
        {
            **json.loads((MODELS / "qwen3-next-80b-a3b.json").read_text()),
            "num_key_value_heads": 3,
            "num_attention_heads": 24,
        }
    )
    # 3 KV heads: TP 2 neither divides 3 nor is a multiple of it
    assert not kvmath.valid_tensor_parallel_size(odd, 2)
    assert kvmath.valid_tensor_parallel_size(odd, 3) and kvmath.valid_tensor_parallel_size(odd, 6)


def test_plan_refuses_max_model_len_beyond_the_model() -> None:
    code, _, err = _run("meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "200000")
    assert code == 3
    assert "vLLM rejects --max-model-len 200000" in err and "131072" in err
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in err


def test_derived_max_model_len_follows_rope_scaling() -> None:
    base = json.loads((MODELS / "qwen3-4b.json").read_text())
    yarn = {
        **base,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert kvmath.derived_max_model_len(parse_model_config(yarn)) == 131072
    llama3 = {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert kvmath.derived_max_model_len(parse_model_config(llama3)) == base["max_position_embeddings"]


def test_plan_explains_a_replaced_max_num_seqs() -> None:
    code, out, _ = _run(
        "meta-llama/Llama-3.1-8B",
        "--gpu",
        "L4",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "256",
        "--prompt-tokens",
        "4000",
        "--output-tokens",
        "1000",
        "--format",
        "json",
        "--no-grid",
    )
    plan = json.loads(out)
    chosen = int(plan["suggested_flags"]["--max-num-seqs"])
    assert chosen < 256
    assert any(n.startswith(f"--max-num-seqs {chosen} replaces --max-num-seqs 256") for n in plan["notes"])


@pytest.mark.parametrize(
    ("smi_name", "canonical", "sm"),
    [
        ("NVIDIA GeForce RTX 5090", "RTX 5090", "12.0"),
        ("NVIDIA GeForce RTX 5070 Ti", "RTX 5070 Ti", "12.0"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell", "12.0"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell", "12.0"),
        ("NVIDIA B200", "B200", "10.0"),
        ("NVIDIA GB200", "GB200", "10.0"),
        ("NVIDIA H200 NVL", "H200-NVL", "9.0"),
        ("NVIDIA L40S", "L40S", "8.9"),
    ],
)
def test_gpu_catalogue_2026_cards(smi_name: str, canonical: str, sm: str) -> None:
    g = catalog.gpu(smi_name)
    assert (g.name, g.sm) == (canonical, sm)
    # fp8 KV: native from Ada/Hopper on
    assert g.fp8


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("Meta-Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B-Instruct"),
        ("deepseek-ai/DeepSeek-R1-0528", "deepseek-ai/DeepSeek-R1"),
    ],
)
def test_model_catalogue_old_repo_ids(name: str, target: str) -> None:
    assert catalog.model_config(name) == catalog.model_config(target)


def test_model_catalogue_every_entry_sizes() -> None:
    # Every entry (2026 additions included) parses and has a KV layout at TP 1; aliases resolve.
    for name in catalog.model_names():
        arch = parse_model_config(catalog.model_config(name) or {}, origin=name)
        assert kvmath.kv_bytes_per_token(arch) > 0, name
        assert kvmath.weights_bytes(arch) > 0, name
    for old, new in catalog._aliases().items():
        assert new in catalog.model_names(), old


def test_kimi_k2_mla_is_replicated_across_tp() -> None:
    arch = parse_model_config(catalog.model_config("moonshotai/Kimi-K2-Instruct") or {})
    assert arch.use_mla
    # (kv_lora_rank 512 + qk_rope 64) × 2 B × 61 layers, the same on every TP rank
    assert kvmath.kv_bytes_per_token(arch) == 576 * 2 * 61
    assert kvmath.kv_bytes_per_token(arch, tensor_parallel_size=8) == 576 * 2 * 61


# --------------------------------------------------------------------------- vLLM 0.34


@pytest.mark.parametrize("version", ["0.35", "1.0", "main", "latest", "0.36.1"])
def test_unknown_vllm_version_is_an_error_not_the_newest(version: str) -> None:
    code, _, err = _run("meta-llama/Llama-3.1-8B", "--gpu", "H100", "--vllm-version", version)
    assert code == 3
    assert "unknown --vllm-version" in err and "0.34" in err


def test_plan_defaults_to_034_extensible_and_says_so() -> None:
    code, out, _ = _run(
        "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "32768", "--format", "json"
    )
    plan = json.loads(out)
    assert code == 0
    assert plan["vllm_version"] == "0.34" and plan["sizing_mode"] == "extensible"
    assert plan["gpu_memory_utilization"] == 1.0 and plan["block_size"] == 64
    assert plan["available_kv_source"].startswith("estimate (extensible")
    # an unset gmu is the 0.34 advice: no --gpu-memory-utilization to add, none already in effect
    assert "--gpu-memory-utilization" not in plan["suggested_flags"]
    assert any("extensible KV cache" in n for n in plan["notes"])
    # the same plan on the estimate path: gmu 0.92, fewer KV bytes
    code, out2, _ = _run(
        "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "32768", "--format", "json",
        "--no-enable-extensible-kv-cache",
    )  # fmt: skip
    est = json.loads(out2)
    assert est["sizing_mode"] == "estimate" and est["gpu_memory_utilization"] == 0.92
    assert est["available_kv_bytes_per_gpu"] < plan["available_kv_bytes_per_gpu"]
    code, out3, _ = _run(
        "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "32768", "--vllm-version", "0.33"
    )
    assert code == 0 and "0.33 / estimate" in out3


def test_plan_034_text_names_the_mode() -> None:
    code, out, _ = _run("meta-llama/Llama-3.1-8B", "--gpu", "H100", "--max-model-len", "8192")
    assert code == 0
    assert "0.34 / extensible" in out


def test_plan_034_extensible_with_kv_memory_bytes_is_vllms_startup_error() -> None:
    code, _, err = _run(
        "meta-llama/Llama-3.1-8B", "--kv-cache-memory-bytes", "4G", "--enable-extensible-kv-cache"
    )
    assert code == 3
    assert "enable_extensible_kv_cache: it sizes the KV cache from measured memory" in err


def test_plan_034_misfit_on_extensible_never_suggests_raising_gmu() -> None:
    # Llama-3.1-70B bf16 on one H100: the weights alone do not fit; gmu is already 1.0
    code, out, _ = _run(
        "meta-llama/Llama-3.1-70B", "--gpu", "H100", "--max-model-len", "8192", "--format", "json"
    )
    plan = json.loads(out)
    assert code == 2 and plan["sizing_mode"] == "extensible"
    assert "--gpu-memory-utilization" not in plan["suggested_flags"]
    assert "The extensible KV cache already takes all device memory left after" in plan["error"]
    # an explicit gmu below 1.0 on the extensible path: 1.0 is the one gmu fix
    code, out, _ = _run(
        "meta-llama/Llama-3.1-8B", "--gpu", "L4", "--max-model-len", "131072", "--format", "json",
        "--gpu-memory-utilization", "0.8",
    )  # fmt: skip
    plan = json.loads(out)
    assert code == 2
    assert plan["suggested_flags"].get("--gpu-memory-utilization") == "1.0"
    assert "within `gpu_memory_utilization`=0.8; increase it" in plan["error"]
    assert int(plan["suggested_flags"]["--max-model-len"]) % 64 == 0
