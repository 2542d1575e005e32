"""Launch-command parsing (sources/cmdline.py) and the vLLM flag table (vllm_flags.py),
against every case's cmdline.txt and vllm-facts.md §4."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.facts import EngineConfig, SourceError
from kvdoctor.sources.cmdline import (
    locate_vllm_args,
    parse_argv,
    parse_cmdline_file,
    parse_cmdline_text,
    update_config_from_args,
)
from kvdoctor.units import GiB
from kvdoctor.vllm_flags import (
    FLAGS,
    FlagError,
    apply_defaults,
    default_gpu_memory_utilization,
    flag_available,
    lookup_option,
    nearest_valid_kv_cache_dtype,
    parse_human_int,
    parse_version,
    unavailable_flags,
    valid_kv_cache_dtypes,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "cmdline"


def one(text: str, **kw: object) -> EngineConfig:
    cfgs = parse_cmdline_text(text, origin="cmdline.txt", **kw)  # type: ignore[arg-type]
    assert len(cfgs) == 1
    return cfgs[0]


# --------------------------------------------------------------------------- real cases

# case file → expected (model, served_model_name, tp, gmu or None (unset), max_model_len, kv_cache_dtype, port)
CASES = {
    "b01-tp1-70b-on-8x-a100-40g": ("meta-llama/Llama-2-70b-hf", None, 1, None, None, "auto", None),
    "b05-foreign-process-blocks-startup": ("Qwen/Qwen2.5-7B-Instruct", None, 1, 0.95, 8192, "auto", None),
    "b06-v0-max-seq-len-3664": (
        "/models/chinese-alpaca-2-7b",
        "chinese-alpaca-2",
        1,
        None,
        None,
        "auto",
        8000,
    ),
    "b08-v1-fp8-estimated-max-len-122080": (
        "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
        None,
        1,
        0.95,
        221000,
        "fp8",
        None,
    ),
    "b10-v0-negative-kv-rtx4060": ("Qwen/Qwen2.5-7B-Instruct-AWQ", None, 1, 0.7, 4096, "auto", None),
    "b14-cudagraph-capture-oom-v100-16g": (
        "meta-llama/Llama-3.1-8B-Instruct",
        None,
        2,
        0.9,
        40000,
        "auto",
        None,
    ),
    "b17-v1-preemption-thrash-long-prompts": (
        "meta-llama/Llama-3.1-8B-Instruct",
        None,
        1,
        None,
        None,
        "auto",
        None,
    ),
    "b20-low-util-kv-saturated-qwen2-0.5b": (
        "/models/qwen2-0.5b-instruct",
        "qwen2-0.5b",
        1,
        None,
        None,
        "auto",
        8000,
    ),
    "b21-idle-preallocation-7b": ("meta-llama/Llama-2-7b-chat-hf", None, 1, None, None, "auto", 8000),
    "b23-sampler-warmup-oom-qwen3-32b": ("Qwen/Qwen3-32B", None, 2, 0.95, None, "auto", 8200),
    "b26-orphaned-enginecore-workers": ("Qwen/Qwen2.5-14B-Instruct-AWQ", None, 2, 0.8, 8192, "auto", 8000),
    "b28-allocator-fragmentation-16g": (
        "/workspace/weights/phi-3-mini-4k-instruct",
        "phi-3-mini-4k-instruct",
        1,
        0.9,
        4096,
        "auto",
        5000,
    ),
    "real-cpu-kv-too-small": ("/models/tinyllama", None, 1, None, 256, "auto", 8011),
    "real-cpu-preemptions": ("/models/tinyllama", None, 1, None, 256, "auto", 8011),
    "seed-int8-kv-dtype": ("meta-llama/Llama-2-70b-chat-hf", None, 2, 0.9, None, "int8", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_case_cmdlines(case: str) -> None:
    model, served, tp, gmu, mml, kvd, port = CASES[case]
    cfg = one((DATA / f"{case}.txt").read_text())
    assert cfg.model == model
    assert cfg.served_model_name == served
    assert cfg.tensor_parallel_size == tp
    if gmu is None:
        assert "gpu_memory_utilization" not in cfg.explicit
    else:
        assert cfg.gpu_memory_utilization == gmu
        assert "gpu_memory_utilization" in cfg.explicit
    assert cfg.max_model_len == mml
    assert cfg.kv_cache_dtype == kvd
    assert cfg.port == port
    assert "model" in cfg.explicit
    assert cfg.command and ("vllm" in cfg.command)


def test_case_specific_flags() -> None:
    b17 = one((DATA / "b17-v1-preemption-thrash-long-prompts.txt").read_text())
    assert b17.enable_prefix_caching is False and "enable_prefix_caching" in b17.explicit
    seed = one((DATA / "seed-int8-kv-dtype.txt").read_text())
    assert (seed.max_num_seqs, seed.max_num_batched_tokens, seed.enable_prefix_caching) == (128, 8192, True)
    cpu = one((DATA / "real-cpu-preemptions.txt").read_text())
    assert (cpu.num_gpu_blocks_override, cpu.dtype, cpu.host) == (4, "float32", "127.0.0.1")
    b23 = one((DATA / "b23-sampler-warmup-oom-qwen3-32b.txt").read_text())
    assert b23.args["disable_uvicorn_access_log"] is True  # --flag=value and a switch after it


# --------------------------------------------------------------------------- shapes


def test_docker_run_with_continuations_and_secrets() -> None:
    cfg = one((DATA / "docker-run.txt").read_text())
    assert cfg.model == "mistralai/Mistral-7B-v0.1"
    assert cfg.tensor_parallel_size == 2  # -tp alias
    assert cfg.max_model_len == 16000  # --max_model_len 16k: underscores and human-readable
    assert cfg.kv_cache_memory_bytes == 8 * GiB  # --kv-cache-memory= abbreviation, 8G binary
    assert cfg.args["api_key"] == "***"
    assert cfg.args["_env"] == {"HUGGING_FACE_HUB_TOKEN": "***"}
    assert "sk-live" not in (cfg.command or "") and "hf_AbCd" not in (cfg.command or "")
    assert cfg.command and cfg.command.startswith("docker run")
    assert {"tensor_parallel_size", "max_model_len", "kv_cache_memory_bytes", "model"} <= cfg.explicit


def test_multi_engine_file() -> None:
    first, second = parse_cmdline_text((DATA / "multi-engine.txt").read_text(), origin="multi")
    assert first.model == "Qwen/Qwen2.5-7B-Instruct" and first.port == 8001
    assert first.served_model_name == "small" and first.args["served_model_name"] == ["small", "other-name"]
    assert first.gpu_memory_utilization == 0.45
    assert first.args["_env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert second.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert second.gpu_memory_utilization == 0.45  # --device-memory-utilization alias
    assert second.max_model_len == -1  # auto-fit
    assert second.enforce_eager is False and "enforce_eager" in second.explicit
    assert second.enable_chunked_prefill is False  # --disable-chunked-prefill
    assert second.args["limit_mm_per_prompt"] == {"image": 2}
    # unknown flags kept generically: value-taking or switch by the next token
    assert second.args["some_new_flag"] == "7"
    assert second.args["another_switch"] is True


def test_config_file_resolved_and_cli_wins() -> None:
    cfg = one((DATA / "with-config.txt").read_text(), base_dir=DATA)
    assert cfg.model == "meta-llama/Llama-3.1-70B-Instruct"
    assert cfg.tensor_parallel_size == 4
    assert cfg.max_model_len == 32768
    assert cfg.max_num_seqs == 64  # CLI beats the file's 256
    assert cfg.gpu_memory_utilization == 0.88
    assert cfg.enable_prefix_caching is False
    assert cfg.kv_cache_dtype == "fp8"
    assert cfg.args["api_key"] == "***"
    assert {"tensor_parallel_size", "max_model_len", "kv_cache_dtype"} <= cfg.explicit
    assert "_config_error" not in cfg.args


def test_config_file_missing_is_recorded_not_fatal(tmp_path: Path) -> None:
    cfg = one("vllm serve --config engine.yaml --max-num-seqs 64")
    assert "relative path" in cfg.args["_config_error"]
    assert cfg.max_num_seqs == 64
    cfg = one("vllm serve m --config nope.yaml", base_dir=tmp_path)
    assert "nope.yaml" in cfg.args["_config_error"]
    (tmp_path / "bad.yaml").write_text("- just\n- a list\n")
    cfg = one("vllm serve m --config bad.yaml", base_dir=tmp_path)
    assert "mapping" in cfg.args["_config_error"]


def test_positional_model_beats_config(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("model: from-file\nmax-model-len: 1K\n")
    cfg = one("vllm serve from-cli --config c.yaml", base_dir=tmp_path)
    assert cfg.model == "from-cli"
    assert cfg.max_model_len == 1024


def test_proc_cmdline_nul_dump() -> None:
    cfg = one((DATA / "proc-cmdline.bin").read_text())
    assert cfg.model == "/models/qwen3-4b"
    assert cfg.max_num_batched_tokens == 2048
    assert cfg.swap_space_gib == 8.0
    assert cfg.args["api_key"] == "***"
    assert "topsecret" not in (cfg.command or "")


def test_file_reader(tmp_path: Path) -> None:
    cfgs = parse_cmdline_file(DATA / "with-config.txt")
    assert cfgs[0].tensor_parallel_size == 4  # --config resolved next to the file
    bad = tmp_path / "cmdline.txt"
    bad.write_bytes(b"vllm serve \xff\xfe model")
    with pytest.raises(SourceError, match="not UTF-8"):
        parse_cmdline_file(bad)
    with pytest.raises(SourceError, match="cannot read"):
        parse_cmdline_file(tmp_path / "absent.txt")


@pytest.mark.parametrize(
    "line,model",
    [
        ("vllm serve org/m", "org/m"),
        ("/opt/venv/bin/vllm serve org/m --port 1", "org/m"),
        ("python -m vllm.entrypoints.openai.api_server --model org/m", "org/m"),
        ("python3 -m vllm.entrypoints.api_server --model org/m", "org/m"),
        ("env HF_HOME=/x nohup python3 -u -m vllm.entrypoints.openai.api_server --model org/m", "org/m"),
        ("bash -c 'exec vllm serve org/m --port 9'", "org/m"),
        (
            "python /usr/lib/python3/site-packages/vllm/entrypoints/openai/api_server.py --model org/m",
            "org/m",
        ),
        ("podman run --rm -it -p 8000:8000 --name v docker.io/vllm/vllm-openai:latest org/m", "org/m"),
        ("docker run -d myregistry/custom:1 vllm serve org/m", "org/m"),
        ("--model org/m --max-model-len 1024", "org/m"),
    ],
)
def test_command_shapes(line: str, model: str) -> None:
    assert one(line).model == model


def test_shell_prompt_redirections_and_api_key_list() -> None:
    cfg = one("$ CUDA_VISIBLE_DEVICES=0 nohup vllm serve org/m --api-key k1 k2 --port 9 > vllm.log 2>&1 &")
    assert (cfg.model, cfg.port) == ("org/m", 9)
    assert cfg.args["api_key"] == "***"
    assert "_positional" not in cfg.args
    assert "k1" not in (cfg.command or "") and "k2" not in (cfg.command or "")


def test_env_prefix_recorded_redacted() -> None:
    cfg = one("HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345 CUDA_VISIBLE_DEVICES=1,2 vllm serve m -tp 2")
    assert cfg.args["_env"] == {"HF_TOKEN": "***", "CUDA_VISIBLE_DEVICES": "1,2"}
    assert "hf_AbCd" not in (cfg.command or "")


def test_comments_and_non_vllm_lines_skipped() -> None:
    text = "# header\n\nexport FOO=1\nvllm serve m --max-num-seqs 8  # trailing comment\n"
    cfg = one(text)
    assert cfg.max_num_seqs == 8


def test_flag_forms() -> None:
    cfg = one(
        "vllm serve m --max_num_seqs=12 --kv-cache-memory 1.5g --enable-prefix --enforce-eager "
        "--block-size 32 -pp 2 -dp=3 --quantization awq --cpu-offload-gb 4 --task embed "
        "--num-gpu-blocks-override 100 --max-num-batched-tokens 8k --host :: -O3"
    )
    assert cfg.max_num_seqs == 12
    assert cfg.kv_cache_memory_bytes == 1_500_000_000
    assert cfg.enable_prefix_caching is True
    assert cfg.enforce_eager is True
    assert (cfg.block_size, cfg.pipeline_parallel_size, cfg.data_parallel_size) == (32, 2, 3)
    assert (cfg.quantization, cfg.cpu_offload_gb, cfg.task) == ("awq", 4.0, "embed")
    assert (cfg.num_gpu_blocks_override, cfg.max_num_batched_tokens, cfg.host) == (100, 8000, "::")
    assert cfg.args["compilation_config"] == 3
    assert one("vllm serve m --runner pooling").task == "pooling"
    assert one("vllm serve m --max-model-len -1").max_model_len == -1


def test_ambiguous_abbreviation_is_an_error() -> None:
    with pytest.raises(SourceError, match="ambiguous option: --kv-cache") as ei:
        parse_cmdline_text("# c\nvllm serve m --kv-cache 8G", origin="cmdline.txt")
    assert ei.value.line == 2 and ei.value.origin == "cmdline.txt"


@pytest.mark.parametrize(
    "line,match",
    [
        ("vllm serve m --kv-cache-memory-bytes 8GiB", "kv-cache-memory-bytes"),
        ("vllm serve m --max-model-len 1.5K", "decimals"),
        ("vllm serve m --tensor-parallel-size two", "tensor-parallel-size"),
        ("vllm serve m --gpu-memory-utilization", "needs a value"),
        ("vllm serve m --enforce-eager=maybe", "true/false"),
    ],
)
def test_bad_values(line: str, match: str) -> None:
    with pytest.raises(SourceError, match=match) as ei:
        parse_cmdline_text(line, origin="cmdline.txt")
    assert ei.value.line == 1


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("   \n# only a comment\n", "no vLLM command"),
        ("echo hello\nls -la\n", "no vLLM command"),
        ('vllm serve m --served-model-name "unterminated\n', "cannot split"),
        ("vllm serve m\x01\x02\x03", "binary"),
        ("\x7fELF\x02\x01\x01\x00\x00\x00", "binary"),
        ("ls\x00-la\x00", "not a vLLM launch"),
        ("vllm serve \ufffd\ufffd", "binary"),
    ],
)
def test_garbage_raises_source_error(text: str, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        parse_cmdline_text(text, origin="cmdline.txt")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_any_text_gives_configs_or_source_error(text: str) -> None:
    try:
        cfgs = parse_cmdline_text(text, origin="fuzz")
    except SourceError as e:
        assert str(e).startswith("fuzz") and "\n" not in str(e)
    else:
        assert all(isinstance(c, EngineConfig) for c in cfgs)


def test_unbalanced_quote_reports_its_line() -> None:
    with pytest.raises(SourceError) as ei:
        parse_cmdline_text("# one\nvllm serve ok\nvllm serve 'bad\n", origin="c.txt")
    assert ei.value.line == 3
    assert str(ei.value).startswith("c.txt:3: ")


def test_parse_argv_live() -> None:
    argv = [
        "/usr/bin/python3",
        "/usr/local/bin/vllm",
        "serve",
        "org/m",
        "--port",
        "9000",
        "--api-key",
        "s3cr3t",
    ]
    cfg = parse_argv(argv, origin="pid 42")
    assert (cfg.model, cfg.port) == ("org/m", 9000)
    assert cfg.args["api_key"] == "***" and "s3cr3t" not in (cfg.command or "")
    assert shlex.split(cfg.command or "")[-1] == "***"
    with pytest.raises(SourceError, match="not a vLLM launch"):
        parse_argv(["VLLM::EngineCore_DP0"], origin="pid 43")


def test_locate_vllm_args_none_for_other_commands() -> None:
    assert locate_vllm_args(["sleep", "10"]) is None
    assert locate_vllm_args(["docker", "run", "-d", "redis"]) is None
    assert locate_vllm_args(["docker", "run", "-e"]) is None


# --------------------------------------------------------------------------- args dicts from logs


def test_update_from_non_default_args_b08() -> None:
    # vllm.log of b08: non-default args line
    args = {
        "model_tag": "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
        "host": "0.0.0.0",
        "model": "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
        "max_model_len": 221000,
        "gpu_memory_utilization": 0.95,
        "kv_cache_dtype": "fp8",
    }
    cfg = update_config_from_args(EngineConfig(), args, explicit=True)
    assert (cfg.model, cfg.max_model_len, cfg.gpu_memory_utilization, cfg.kv_cache_dtype) == (
        "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
        221000,
        0.95,
        "fp8",
    )
    assert cfg.explicit == {"model", "host", "max_model_len", "gpu_memory_utilization", "kv_cache_dtype"}
    assert "model_tag" not in cfg.args


def test_update_from_namespace_does_not_clear_and_not_explicit() -> None:
    cfg = one("vllm serve m --max-model-len 4096 --api-key k")
    # b28-style Namespace: None means default, must not wipe what the command set
    ns = {
        "host": None,
        "port": 5000,
        "served_model_name": ["phi-3-mini-4k-instruct"],
        "max_model_len": None,
        "swap_space": 4,
        "enable_prefix_caching": None,
        "api_key": "leaked-in-log",
        "max_num_seqs": None,
    }
    before = set(cfg.explicit)
    update_config_from_args(cfg, ns, explicit=False)
    assert cfg.max_model_len == 4096
    assert cfg.served_model_name == "phi-3-mini-4k-instruct"
    assert cfg.swap_space_gib == 4.0 and cfg.port == 5000
    assert cfg.explicit == before
    assert cfg.args["api_key"] == "***"


def test_update_tolerates_bad_values_and_model_tag_alone() -> None:
    cfg = update_config_from_args(
        EngineConfig(), {"model_tag": "org/m", "max_model_len": "lots", "max-num-seqs": "16"}, explicit=True
    )
    assert cfg.model == "org/m"
    assert cfg.max_model_len is None and cfg.args["max_model_len"] == "lots"
    assert cfg.max_num_seqs == 16


# --------------------------------------------------------------------------- vllm_flags


@pytest.mark.parametrize(
    "version,gmu",
    [("0.4.2", 0.9), ("0.10.2", 0.9), ("0.19.0", 0.9), ("0.20.0", 0.92), ("0.33.0", 0.92), (None, 0.92)],
)
def test_default_gmu(version: str | None, gmu: float) -> None:
    assert default_gpu_memory_utilization(version) == gmu


def test_apply_defaults_by_version() -> None:
    old = apply_defaults(EngineConfig(model="m"), "0.4.2")
    assert (old.gpu_memory_utilization, old.swap_space_gib, old.block_size) == (0.9, 4.0, 16)
    assert (old.enable_prefix_caching, old.max_num_seqs, old.port, old.vllm_version) == (
        False,
        256,
        8000,
        "0.4.2",
    )
    new = apply_defaults(EngineConfig(model="m"), "0.33.0")
    assert (new.gpu_memory_utilization, new.swap_space_gib) == (0.92, None)
    assert (new.enable_prefix_caching, new.enable_chunked_prefill, new.max_num_seqs) == (True, True, None)
    assert apply_defaults(EngineConfig(task="embed"), None).enable_prefix_caching is False
    # explicit values survive, and the input is not modified
    cfg = one("vllm serve m --gpu-memory-utilization 0.5 --no-enable-prefix-caching --swap-space 2")
    out = apply_defaults(cfg, "0.10.0")
    assert (out.gpu_memory_utilization, out.enable_prefix_caching, out.swap_space_gib) == (0.5, False, 2.0)
    untouched = EngineConfig()
    apply_defaults(untouched, "0.4.2")
    assert untouched.block_size is None and untouched.gpu_memory_utilization == 0.92


def test_flag_availability() -> None:
    assert flag_available("swap_space", "0.17.0") and not flag_available("swap_space", "0.18.0")
    assert not flag_available("max_num_partial_prefills", "0.27.0")
    assert flag_available("max_num_partial_prefills", "0.26.0")
    assert not flag_available("calculate_kv_scales", "0.28")
    assert not flag_available("kv_cache_memory_bytes", "0.10.1.1")
    assert flag_available("kv_cache_memory_bytes", "0.10.2")
    cfg = one("vllm serve m --swap-space 4 --max-num-seqs 8")
    assert unavailable_flags(cfg, "0.33.0") == ["--swap-space"]
    assert unavailable_flags(cfg, "0.17.0") == []


@pytest.mark.parametrize(
    "text,value",
    [
        ("0.10.1.1", (0, 10, 1, 1)),
        ("v0.9.1", (0, 9, 1)),
        ("0.11.0rc1", (0, 11, 0)),
        ("0.6.3.post1", (0, 6, 3)),
    ],
)
def test_parse_version(text: str, value: tuple[int, ...]) -> None:
    assert parse_version(text) == value


def test_parse_version_unknown() -> None:
    assert parse_version(None) is None and parse_version("dev") is None


@pytest.mark.parametrize(
    "text,value",
    [
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("8G", 8 * GiB),
        ("8g", 8 * 10**9),
        ("1.5g", 1_500_000_000),
        ("4096", 4096),
    ],
)
def test_human_int(text: str, value: int) -> None:
    assert parse_human_int(text) == value


@pytest.mark.parametrize("text", ["8GiB", "1.5K", "abc", ""])
def test_human_int_rejects(text: str) -> None:
    with pytest.raises(FlagError):
        parse_human_int(text)


def test_lookup_options() -> None:
    assert lookup_option("-tp")[0].dest == "tensor_parallel_size"  # type: ignore[index]
    assert lookup_option("-asc")[0].dest == "api_server_count"  # type: ignore[index]
    assert lookup_option("--no-enforce-eager") == (lookup_option("--enforce-eager")[0], False)  # type: ignore[index]
    assert lookup_option("--disable-prefix-caching")[1] is False  # type: ignore[index]
    assert lookup_option("--max_model_len")[0].dest == "max_model_len"  # type: ignore[index]
    assert lookup_option("--not-a-vllm-flag") is None
    assert len({f.dest for f in FLAGS}) == len(FLAGS)


def test_valid_kv_cache_dtypes_by_version() -> None:
    assert valid_kv_cache_dtypes("0.9.2") == ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    assert "fp8_inc" in valid_kv_cache_dtypes("0.10.2") and "bfloat16" not in valid_kv_cache_dtypes("0.10.2")
    assert "bfloat16" in valid_kv_cache_dtypes("0.11.0")
    assert "float16" not in valid_kv_cache_dtypes("0.16.0") and "float16" in valid_kv_cache_dtypes("0.18.0")
    v20 = valid_kv_cache_dtypes("0.20.0")
    assert "int8_per_token_head" in v20 and "int4_per_token_head" not in v20
    assert "nvfp4_ds_mla" in valid_kv_cache_dtypes("0.30.0")
    current = valid_kv_cache_dtypes(None)
    # the exact 0.33 KV_CACHE_DTYPES list of vllm-facts §4.1
    assert set(current) == set(
        "auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, fp8_inc, fp8_ds_mla, nvfp4_ds_mla, turboquant_k8v4, "
        "turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc, octave_k3v4, octave_k3v3, "
        "octave_k3v3_compact, ultraquant_4bit, int4_per_token_head, int8_per_token_head, "
        "fp8_per_token_head, nvfp4, nvfp4_4over6".split(", ")
    )
    assert all("int8" != v for v in current)


@pytest.mark.parametrize(
    "value,version,expected",
    [
        ("int8", "0.33.0", "int8_per_token_head"),
        ("int8", "0.20.0", "int8_per_token_head"),
        ("int8", "0.19.0", "fp8"),
        ("int8", "0.9.1", "fp8"),
        ("fp16", "0.33.0", "float16"),
        ("fp16", "0.11.0", "auto"),
        ("bf16", "0.11.0", "bfloat16"),
        ("fp8e4m3", None, "fp8_e4m3"),
        ("FP8-E5M2", None, "fp8_e5m2"),
        ("int8", None, "fp8"),  # unknown version: the value valid in every version
        ("fp16", None, "auto"),
        ("fp8", "0.8.5", "fp8"),
        ("int4", "0.33.0", "int4_per_token_head"),
        ("int4", "0.21.0", "int8_per_token_head"),
        ("nvfp4", "0.10.0", "fp8"),
        ("fp8_e4m", "0.33.0", "fp8_e4m3"),
        ("banana", "0.33.0", "auto"),
    ],
)
def test_nearest_kv_cache_dtype(value: str, version: str | None, expected: str) -> None:
    assert nearest_valid_kv_cache_dtype(value, version) == expected
    assert expected in valid_kv_cache_dtypes(version)
