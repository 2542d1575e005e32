"""config.json parsing: every shipped config parses; variants; bad input is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor import catalog
from kvdoctor.facts import SourceError
from kvdoctor.sources.model_config import parse_model_config, parse_model_config_file
from kvdoctor.sources.model_dir import hf_cache_dir, safetensors_bytes, weights_bytes_from_dir

MODELS = Path(__file__).parent.parent / "data" / "models"


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_config_parses(path: Path) -> None:
    arch = parse_model_config_file(path)
    assert arch.num_hidden_layers > 0 and arch.num_attention_heads > 0
    assert 0 < arch.num_key_value_heads <= arch.num_attention_heads
    assert arch.head_dim > 0
    assert arch.raw["model_type"] == arch.model_type


@pytest.mark.parametrize("name", catalog.model_names())
def test_every_catalogue_model_parses(name: str) -> None:
    cfg = catalog.model_config(name)
    assert cfg is not None
    assert parse_model_config(cfg).num_hidden_layers > 0


def test_llama_defaults() -> None:
    arch = parse_model_config_file(MODELS / "case-b21-idle-preallocation-7b.json")
    assert (arch.num_key_value_heads, arch.head_dim, arch.dtype) == (32, 128, "float16")
    assert arch.sliding_window is None and not arch.use_mla


def test_kv_heads_default_to_attention_heads() -> None:
    arch = parse_model_config({"num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768})
    assert arch.num_key_value_heads == 12 and arch.head_dim == 64


def test_qwen2_window_unused_mistral_window_used() -> None:
    qwen2 = parse_model_config_file(MODELS / "case-b20-low-util-kv-saturated-qwen2-0.5b.json")
    assert qwen2.raw["sliding_window"] == 32768 and qwen2.sliding_window is None
    mistral = parse_model_config_file(MODELS / "mistral-7b-v0.1.json")
    assert mistral.sliding_window == 4096


def test_explicit_head_dim_and_dtype_key() -> None:
    assert parse_model_config_file(MODELS / "qwen3-4b.json").head_dim == 128
    tiny = parse_model_config_file(MODELS / "case-real-cpu-kv-too-small.json")
    assert tiny.dtype == "float32" and tiny.head_dim == 32


def test_quantization_and_moe() -> None:
    arch = parse_model_config_file(MODELS / "case-b08-v1-fp8-estimated-max-len-122080.json")
    assert arch.quant_method == "fp8"
    assert arch.num_experts == 128 and arch.num_experts_per_tok == 8 and arch.moe_intermediate_size == 768
    gptq = parse_model_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "hidden_size": 64,
            "quantization_config": {"quant_method": "GPTQ", "bits": 4},
        }
    )
    assert (gptq.quant_method, gptq.quant_bits) == ("gptq", 4)


def test_mla_deepseek() -> None:
    arch = parse_model_config(catalog.model_config("deepseek-ai/DeepSeek-V3") or {})
    assert arch.use_mla and arch.kv_lora_rank == 512 and arch.qk_rope_head_dim == 64
    assert arch.num_experts == 256


def test_gemma_layer_types_from_pattern() -> None:
    g2 = parse_model_config(catalog.model_config("google/gemma-2-9b-it") or {})
    assert g2.layer_types is not None and g2.layer_types[:2] == ["sliding_attention", "full_attention"]
    g3 = parse_model_config(catalog.model_config("google/gemma-3-27b-it") or {})
    assert g3.model_type == "gemma3_text" and g3.dtype == "bfloat16"  # outer dtype kept
    assert (
        g3.layer_types is not None
        and g3.layer_types[5] == "full_attention"
        and g3.layer_types[4] == "sliding_attention"
    )
    oss = parse_model_config(catalog.model_config("openai/gpt-oss-20b") or {})
    assert oss.sliding_window == 128 and oss.layer_types is not None and len(oss.layer_types) == 24


def test_multimodal_llm_config_flattened() -> None:
    arch = parse_model_config(
        {
            "model_type": "internvl_chat",
            "torch_dtype": "bfloat16",
            "llm_config": {
                "model_type": "qwen2",
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "hidden_size": 3584,
            },
        }
    )
    assert (arch.model_type, arch.num_hidden_layers, arch.num_key_value_heads, arch.dtype) == (
        "qwen2",
        28,
        4,
        "bfloat16",
    )


def test_hybrid_mamba_pattern() -> None:
    arch = parse_model_config(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "hidden_size": 512,
            "hybrid_override_pattern": "M-M*",
            "mamba_num_heads": 8,
        }
    )
    assert arch.layer_types == ["mamba", "mlp", "mamba", "full_attention"]
    assert arch.mamba["mamba_num_heads"] == 8


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\x00\xff\xfe binary", "UTF-8"),
        ('{"num_hidden_layers": 2', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_attention_heads": 8}', "no num_hidden_layers"),
        ('{"num_hidden_layers": 2}', "no num_attention_heads"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 8}', "must be positive"),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 0, "hidden_size": 8}',
            "must be positive",
        ),
        ('{"num_hidden_layers": 2, "num_attention_heads": 4}', "neither head_dim nor hidden_size"),
    ],
)
def test_bad_configs_are_one_line_errors(data: str | bytes, match: str) -> None:
    with pytest.raises(SourceError, match=match) as ei:
        parse_model_config(data, origin="cfg.json")
    assert "\n" not in str(ei.value) and str(ei.value).startswith("cfg.json")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read"):
        parse_model_config_file(tmp_path / "nope.json")


def _write_safetensors(path: Path, sizes: list[int]) -> None:
    import json
    import struct

    header, off = {}, 0
    for i, n in enumerate(sizes):
        header[f"t{i}"] = {"dtype": "BF16", "shape": [n // 2], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * off)


def test_weights_from_safetensors_headers_and_index(tmp_path: Path) -> None:
    _write_safetensors(tmp_path / "model-00001.safetensors", [100, 300])
    _write_safetensors(tmp_path / "model-00002.safetensors", [600])
    assert safetensors_bytes(tmp_path / "model-00001.safetensors") == 400
    assert weights_bytes_from_dir(tmp_path) == 1000
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {"total_size": 12345}, "weight_map": {}}'
    )
    assert weights_bytes_from_dir(tmp_path) == 12345
    assert weights_bytes_from_dir(tmp_path / "missing") is None


@pytest.mark.parametrize("blob", [b"", b"\x01\x02", b"\xff" * 16, b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}"])
def test_garbage_safetensors_is_a_source_error(tmp_path: Path, blob: bytes) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(blob)
    with pytest.raises(SourceError):
        safetensors_bytes(f)


def test_hf_cache_lookup(tmp_path: Path) -> None:
    snap = tmp_path / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert hf_cache_dir("org/m", tmp_path) == snap
    assert hf_cache_dir("org/other", tmp_path) is None
