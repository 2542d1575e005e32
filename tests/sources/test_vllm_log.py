"""vLLM log parser: every line variant of vllm-facts.md §3 and the real case logs."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from kvdoctor.facts import LogEvent, SourceError, VllmLog
from kvdoctor.sources.vllm_log import LogFollower, parse_line, parse_log, parse_log_file, redact
from kvdoctor.units import GiB, MiB

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_log"


def gib(x: float) -> int:
    return int(round(x * GiB))


def events(text: str, kind: str | None = None) -> list[LogEvent]:
    log = parse_log(text)
    return [e for e in log.events if kind is None or e.kind == kind]


def one(line: str, kind: str) -> LogEvent:
    found = events(line, kind)
    assert len(found) == 1, (kind, [e.kind for e in events(line)])
    return found[0]


def case(name: str) -> VllmLog:
    return parse_log_file(DATA / f"{name}.log")


# --------------------------------------------------------------------------- line prefix


@pytest.mark.parametrize(
    "raw, process, pid, level, time_, message",
    [
        (
            "(EngineCore pid=18489) INFO 11-29 18:04:37 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens",
            "EngineCore",
            18489,
            "INFO",
            "11-29 18:04:37",
            "CPU KV cache size: 2,097,152 tokens",
        ),
        (
            "INFO 08-26 09:13:51 api_server.py:594] args: Namespace(host=None)",
            None,
            None,
            "INFO",
            "08-26 09:13:51",
            "args: Namespace(host=None)",
        ),
        (
            "2025-07-01T09:12:43.123456789Z (Worker_TP1 pid=380) WARNING 07-01 09:12:43 [gpu_worker.py:1] hi there",
            "Worker_TP1",
            380,
            "WARNING",
            "07-01 09:12:43",
            "hi there",
        ),
        (
            "2025-07-01T09:12:43.123Z stdout F (APIServer pid=1) DEBUG 07-01 09:12:43 [v1/worker/gpu_worker.py:256] x y",
            "APIServer",
            1,
            "DEBUG",
            "07-01 09:12:43",
            "x y",
        ),
        (
            "\x1b[32m(EngineCore_DP0 pid=277)\x1b[0m \x1b[1;36mINFO\x1b[0m 09-21 08:14:20 [core.py:654] Waiting for init",
            "EngineCore_DP0",
            277,
            "INFO",
            "09-21 08:14:20",
            "Waiting for init",
        ),
        (
            "(VllmWorker-0 pid=21356) WARNING 11-29 18:06:37 [vllm.py:725] x",
            "VllmWorker-0",
            21356,
            "WARNING",
            "11-29 18:06:37",
            "x",
        ),
        (
            "INFO:     Application startup complete.",
            None,
            None,
            "INFO",
            None,
            "Application startup complete.",
        ),
        ('  File "/x.py", line 3, in f', None, None, None, None, '  File "/x.py", line 3, in f'),
        ("Loading shards: 10%\rLoading shards: 50%\r", None, None, None, None, "Loading shards: 50%"),
    ],
)
def test_parse_line_strips_prefixes(raw, process, pid, level, time_, message):
    pl = parse_line(raw)
    assert (pl.process, pl.pid, pl.level, pl.time, pl.message) == (process, pid, level, time_, message)


def test_event_keeps_process_pid_level_time_and_line():
    text = "hello\n(Worker_TP1 pid=380) INFO 02-17 06:32:44 [gpu_worker.py:298] Available KV cache memory: 41.87 GiB\n"
    ev = one(text, "available_kv_memory")
    assert (ev.line, ev.process, ev.pid, ev.level, ev.time) == (
        2,
        "Worker_TP1",
        380,
        "INFO",
        "02-17 06:32:44",
    )
    assert ev.text == "Available KV cache memory: 41.87 GiB"


def test_matches_message_not_file_line():
    # the [file.py:NNN] part changes per release and must not matter, nor be matched
    a = one("INFO 01-01 00:00:00 [whatever.py:1] Using max model len 4096", "max_model_len_used")
    b = one("INFO 01-01 00:00:00 [model.py:2152] Using max model len 4096", "max_model_len_used")
    assert a.values == b.values == {"max_model_len": 4096}
    assert events("INFO 01-01 00:00:00 [gpu_worker.py:298] unrelated text") == []


# --------------------------------------------------------------------------- version and args


@pytest.mark.parametrize(
    "line, version, gen",
    [
        ("INFO 07-01 09:12:24 [api_server.py:1287] vLLM API server version 0.9.1", "0.9.1", None),
        (
            "(APIServer pid=48011) INFO 09-05 08:00:11 [api_utils.py:347] vLLM server version 0.33.0, serving model Qwen/Q",
            "0.33.0",
            "v1",
        ),
        (
            "(EngineCore_DP0 pid=277) INFO 09-21 08:14:20 [core.py:76] Initializing a V1 LLM engine (v0.10.2) with config: model='Q'",
            "0.10.2",
            "v1",
        ),
        (
            "INFO 02-26 14:03:01 llm_engine.py:234] Initializing an LLM engine (v0.7.3) with config: model='Q', max_seq_len=4096",
            "0.7.3",
            "v0",
        ),
        (
            "(APIServer pid=1) INFO 11-27 09:41:02 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.33.0",
            "0.33.0",
            "v1",
        ),
    ],
)
def test_version_lines(line, version, gen):
    log = parse_log(line)
    assert log.vllm_version == version
    assert log.engine_generation == gen
    assert log.of("version")[0].values == {"version": version}


def test_v0_generation_from_old_engine_line_without_version():
    log = parse_log(
        "INFO 08-26 09:13:53 llm_engine.py:70] Initializing an LLM engine with config: model='m', "
        "dtype=torch.float16, max_seq_len=4096, tensor_parallel_size=1, seed=0)"
    )
    assert log.engine_generation == "v0" and log.vllm_version is None
    assert log.args["max_model_len"] == 4096 and log.args["dtype"] == "float16" and log.args["seed"] == 0


def test_non_default_args_namespace_and_engine_config_merge():
    text = "\n".join(
        [
            "INFO 04-03 07:12:40 [api_server.py:1035] args: Namespace(host=None, port=5000, model='/w/phi', "
            "served_model_name=['phi'], max_model_len=None, gpu_memory_utilization=0.9, max_num_seqs=256, "
            "api_key='sk-secret', dispatch_function=<function serve at 0x7f0e2a3c6c00>, kv_cache_dtype='auto')",
            "INFO 04-03 07:12:40 [cli_args.py:261] non-default args: {'model': '/w/phi', "
            "'gpu_memory_utilization': 0.85, 'max_num_seqs': 64}",
            "INFO 04-03 07:12:52 [core.py:54] Initializing a V1 LLM engine (v0.8.2) with config: model='/w/phi', "
            "speculative_config=None, dtype=torch.bfloat16, max_seq_len=4096, load_format=LoadFormat.AUTO, "
            "tensor_parallel_size=2, quantization=None, enforce_eager=False, kv_cache_dtype=fp8, "
            "decoding_config=DecodingConfig(guided_decoding_backend='xgrammar', reasoning_backend=None), "
            'compilation_config={"level":3,"cudagraph_capture_sizes":[4,2,1],"custom_ops":["none"],"x":null}, '
            "served_model_name=phi, enable_prefix_caching=True",
        ]
    )
    log = parse_log(text)
    a = log.args
    assert a["gpu_memory_utilization"] == 0.85  # non-default beats the Namespace default
    assert a["max_num_seqs"] == 64
    assert a["max_model_len"] == 4096  # max_seq_len → max_model_len, later line fills the None
    assert a["dtype"] == "bfloat16" and a["kv_cache_dtype"] == "fp8" and a["tensor_parallel_size"] == 2
    assert a["enforce_eager"] is False and a["enable_prefix_caching"] is True and a["quantization"] is None
    assert a["load_format"] == "LoadFormat.AUTO"
    assert a["dispatch_function"].startswith("<function serve")
    assert a["decoding_config"].startswith("DecodingConfig(")
    assert a["compilation_config"]["cudagraph_capture_sizes"] == [4, 2, 1]
    assert a["served_model_name"] == "phi"
    assert a["api_key"] == "***"
    assert sorted(a["_explicit"]) == ["gpu_memory_utilization", "max_num_seqs", "model"]
    sources = [e.values["source"] for e in log.of("args")]
    assert sources == ["namespace", "non_default", "engine_config"]
    assert "sk-secret" not in log.of("args")[0].text


def test_namespace_after_non_default_does_not_override():
    text = (
        "INFO 01-01 00:00:00 [x.py:1] non-default args: {'max_model_len': 8192}\n"
        "INFO 01-01 00:00:00 [x.py:1] args: Namespace(max_model_len=4096, block_size=16)\n"
    )
    a = parse_log(text).args
    assert a["max_model_len"] == 8192 and a["block_size"] == 16


def test_unparseable_non_default_args_keeps_the_rest():
    ev = one(
        "INFO 01-01 00:00:00 [x.py:1] non-default args: {'model': 'm', 'fn': <function f at 0x1>, "
        "'tensor_parallel_size': 4, 'hf_token': 'hf_abcdefghijklmnopqrstuvwx'}",
        "args",
    )
    assert ev.values["args"]["model"] == "m"
    assert ev.values["args"]["tensor_parallel_size"] == 4
    assert ev.values["args"]["fn"] == "<function f at 0x1>"
    assert ev.values["args"]["hf_token"] == "***"
    assert "hf_abcdefghijklmnop" not in ev.text


def test_case_args_b01_namespace_and_config():
    log = case("b01-tp1-70b-on-8x-a100-40g")
    assert log.args["model"] == "meta-llama/Llama-2-70b-hf"
    assert log.args["tensor_parallel_size"] == 1
    assert log.args["max_model_len"] == 4096  # from "max_seq_len=4096", not the Namespace None
    assert log.args["gpu_memory_utilization"] == 0.9 and log.args["swap_space"] == 4
    assert log.engine_generation == "v0"


def test_chunked_prefill_and_max_model_len():
    assert one(
        "INFO 07-01 09:12:33 [config.py:2195] Chunked prefill is enabled with max_num_batched_tokens=2048.",
        "chunked_prefill",
    ).values == {"max_num_batched_tokens": 2048}
    assert one(
        "(APIServer pid=1) INFO 09-21 08:14:13 [__init__.py:1815] Using max model len 221000",
        "max_model_len_used",
    ).values == {"max_model_len": 221000}


# --------------------------------------------------------------------------- memory lines §3.3


@pytest.mark.parametrize(
    "line, weights, seconds",
    [
        ("Model loading took 4.81 GiB memory and 8.113372 seconds", gib(4.81), 8.113372),  # 0.33
        ("Model loading took 29.0911 GiB and 41.376512 seconds", gib(29.0911), 41.376512),  # ≤0.11
        ("Model loading took 14.9889 GiB memory and 5.318212 seconds", gib(14.9889), 5.318212),  # 0.12–0.13
        ("Model loading took 7.1199 GB and 6.002815 seconds", gib(7.1199), 6.002815),  # 0.8 "GB" = GiB
        ("Loading model weights took 7.5123 GB", gib(7.5123), None),  # V0
    ],
)
def test_model_loading_variants(line, weights, seconds):
    ev = one("INFO 01-01 00:00:00 [gpu_model_runner.py:1] " + line, "model_loading")
    assert ev.values == {"weights_bytes": weights, "seconds": seconds}


def test_weights_loading_start():
    assert one(
        "INFO 01-01 00:00:00 [m.py:1] Starting to load model Qwen/Qwen3-32B...", "weights_loading_start"
    )
    assert one("INFO 01-01 00:00:00 [m.py:1] Loading model weights...", "weights_loading_start")


def test_v0_memory_profile_three_lines_with_negative_kv():
    log = case("b10-v0-negative-kv-rtx4060")
    (ev,) = log.of("memory_profile_v0")
    assert ev.line == 17
    assert ev.values == {
        "seconds": 2.89,
        "total_bytes": gib(8.00),
        "gmu": 0.70,
        "budget_bytes": gib(5.60),
        "weights_bytes": gib(5.20),
        "non_torch_bytes": gib(0.03),
        "activation_peak_bytes": gib(1.42),
        "kv_bytes": gib(-1.05),
    }
    assert log.of("v0_blocks")[0].values == {"device": "cuda", "gpu_blocks": 0, "cpu_blocks": 4681}
    assert log.of("max_concurrency")[0].values == {"max_model_len": 4096, "concurrency": 0.0}
    assert len(log.of("no_available_kv_memory")) == 1  # ERROR line + traceback repeat = one


def test_v0_memory_profile_interleaved_processes():
    log = case("b14-cudagraph-capture-oom-v100-16g")
    profiles = log.of("memory_profile_v0")
    assert [(e.process, e.values["seconds"]) for e in profiles] == [
        ("VllmWorkerProcess", 19.71),
        (None, 19.77),
    ]
    assert all(e.values["kv_bytes"] == gib(3.76) for e in profiles)
    assert log.of("v0_blocks")[0].values == {"device": "GPU", "gpu_blocks": 3852, "cpu_blocks": 4096}


def test_v06_memory_profiling_results_single_line():
    text = (
        "INFO 11-20 10:00:00 model_runner.py:1 Loading model weights took 14.9888 GB\n"
        "INFO 11-20 10:00:05 worker.py:232] Memory profiling results: duration=3.51 seconds, "
        "total_gpu_memory=79.15GiB, initial_memory_usage=15.40GiB, peak_torch_memory=16.39GiB, "
        "memory_usage_post_profile=15.49GiB, non_torch_memory=0.48GiB, kv_cache_size=54.36GiB, "
        "gpu_memory_utilization=0.90\n"
    )
    ev = one(text, "memory_profile_v0")
    v = ev.values
    assert v["total_bytes"] == gib(79.15) and v["gmu"] == 0.90 and v["kv_bytes"] == gib(54.36)
    assert v["non_torch_bytes"] == gib(0.48) and v["peak_torch_bytes"] == gib(16.39)
    assert v["seconds"] == 3.51


def test_v1_debug_memory_profile_line():
    ev = one(
        "(Worker pid=9) DEBUG 01-01 00:00:00 [gpu_worker.py:771] Memory profiling takes 4.12 seconds. Total non KV "
        "cache memory: 17.23GiB; torch peak memory increase: 1.35GiB; non-torch forward increase memory: 0.07GiB; "
        "weights memory: 15.81GiB.",
        "memory_profile_v1",
    )
    assert ev.values["seconds"] == 4.12
    assert ev.values["non_kv_bytes"] == gib(17.23)
    assert ev.values["torch_peak_increase_bytes"] == gib(1.35)
    assert ev.values["non_torch_increase_bytes"] == gib(0.07)
    assert ev.values["weights_bytes"] == gib(15.81)
    assert (
        events("DEBUG 01-01 00:00:00 [w.py:1] Memory profiling takes 4.12 seconds", "memory_profile_v1") == []
    )


def test_memory_request_debug_line():
    ev = one(
        "DEBUG 01-01 00:00:00 [gpu_worker.py:760] Initial free memory: 78.50 GiB; Requested memory: 0.900000 (util), "
        "71.27 GiB",
        "memory_request",
    )
    assert ev.values == {"initial_free_bytes": gib(78.5), "gmu": 0.9, "requested_bytes": gib(71.27)}


@pytest.mark.parametrize(
    "text, expected",
    [("5.59", gib(5.59)), ("41.8712", gib(41.8712)), ("-1.05", gib(-1.05)), ("6.01", gib(6.01))],
)
def test_available_kv_memory(text, expected):
    ev = one(
        f"(Worker_TP0 pid=1) INFO 01-01 00:00:00 [gpu_worker.py:773] Available KV cache memory: {text} GiB",
        "available_kv_memory",
    )
    assert ev.values == {"bytes": expected}


def test_available_kv_memory_one_per_worker():
    assert len(case("b23-sampler-warmup-oom-qwen3-32b").of("available_kv_memory")) == 2


def test_kv_cache_size_one_line_and_two_line_forms():
    ev_size = one(
        "INFO 11-29 18:04:37 [kv_cache_utils.py:1147] GPU KV cache size: 434,640 tokens, Maximum concurrency for "
        "8,192 tokens per request: 53.06x",
        "kv_cache_size",
    )
    assert ev_size.values == {"device": "GPU", "tokens": 434640}
    log = parse_log(
        "(EngineCore pid=18489) INFO 11-29 18:04:37 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, "
        "Maximum concurrency for 256 tokens per request: 8192.00x"
    )
    assert log.of("kv_cache_size")[0].values == {"device": "CPU", "tokens": 2097152}
    assert log.of("max_concurrency")[0].values == {"max_model_len": 256, "concurrency": 8192.0}
    log = case("b17-v1-preemption-thrash-long-prompts")  # two-line form (≤0.27)
    assert log.of("kv_cache_size")[0].values == {"device": "GPU", "tokens": 194384}
    assert log.of("max_concurrency")[0].values == {"max_model_len": 131072, "concurrency": 1.48}


def test_v0_blocks_forms():
    assert one(
        "INFO 01-11 15:02:40 llm_engine.py:275] # GPU blocks: 229, # CPU blocks: 512", "v0_blocks"
    ).values == {
        "device": "GPU",
        "gpu_blocks": 229,
        "cpu_blocks": 512,
    }
    assert one(
        "INFO 01-01 00:00:00 executor_base.py:108] # cuda blocks: 27165, # CPU blocks: 2048", "v0_blocks"
    ).values == {
        "device": "cuda",
        "gpu_blocks": 27165,
        "cpu_blocks": 2048,
    }


def test_num_gpu_blocks_override():
    log = case("real-cpu-kv-too-small")
    assert log.of("num_gpu_blocks_override")[0].values == {"computed": 16384, "override": 2}


def test_graph_capture_lines():
    assert one(
        "INFO 07-29 10:06:07 [gpu_model_runner.py:2485] Graph capturing finished in 15 secs, took 0.57 GiB",
        "graph_capture_done",
    ).values == {"seconds": 15.0, "bytes": gib(0.57)}
    assert one(
        "INFO 03-19 08:40:28 model_runner.py:867] Graph capturing finished in 6 secs.", "graph_capture_done"
    ).values == {"seconds": 6.0, "bytes": None}
    for line in (
        "Capturing cudagraphs for decoding. This may lead to unexpected consequences",
        "Capturing the model for CUDA graphs. This may lead to unexpected consequences",
        "Capturing CUDA graph shapes:  17%|█        | 6/35",
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|██| 67/67",
    ):
        assert one(line, "graph_capture_start").values == {}
    # progress-bar redraws of one capture give one start event
    assert (
        len(
            events(
                "Capturing CUDA graph shapes: 1%\nCapturing CUDA graph shapes: 50%\n", "graph_capture_start"
            )
        )
        == 1
    )


def test_cudagraph_estimate_pool_and_profiling():
    assert one(
        "INFO 01-01 00:00:00 [gpu_model_runner.py:6409] Estimated CUDA graph memory: 0.42 GiB total",
        "cudagraph_estimate",
    ).values == {"bytes": gib(0.42)}
    assert one(
        "CUDA graph pool memory: 0.31 GiB (actual), 0.42 GiB (estimated), difference: 0.11 GiB (35.5%).",
        "cudagraph_pool",
    ).values == {"actual_bytes": gib(0.31), "estimated_bytes": gib(0.42)}
    log = case("b26-orphaned-enginecore-workers")
    ev = log.of("cudagraph_profiling")[0]
    assert ev.values == {"enabled": True, "gmu": 0.8, "equivalent_gmu": 0.7791, "suggested_gmu": 0.8209}
    ev = one(
        "WARNING 01-01 00:00:00 [gpu_worker.py:804] CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). "
        "Without it, CUDA graph memory is not accounted for during KV cache allocation, which may require lowering "
        "--gpu-memory-utilization to avoid OOM. Consider re-enabling it (the default as of v0.21.0) and increasing "
        "--gpu-memory-utilization from 0.9000 to 0.9231.",
        "cudagraph_profiling",
    )
    assert ev.values == {"enabled": False, "gmu": 0.9, "equivalent_gmu": None, "suggested_gmu": 0.9231}


def test_memory_summary_new_form():
    ev = one(
        "INFO 01-01 00:00:00 [gpu_worker.py:1044] Free memory on device (78.5/79.19 GiB) on startup. Desired GPU memory "
        "utilization is (0.9, 71.27 GiB). Actual usage is 15.9 GiB for consumed memory (weights + non-torch), 1.35 "
        "GiB for peak activation, and 0.42 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
        "`--kv-cache-memory=57445382963` (53.5 GiB) to fit into requested memory, or `--kv-cache-memory=65271453491` "
        "(60.79 GiB) to fully utilize gpu memory. Current kv cache memory in use is 53.6 GiB.",
        "memory_summary",
    )
    assert ev.values == {
        "free_bytes": gib(78.5),
        "total_bytes": gib(79.19),
        "gmu": 0.9,
        "requested_bytes": gib(71.27),
        "consumed_bytes": gib(15.9),
        "weights_bytes": None,
        "activation_peak_bytes": gib(1.35),
        "non_torch_bytes": None,
        "cudagraph_bytes": gib(0.42),
        "kv_cache_memory_fit_bytes": 57445382963,
        "kv_cache_memory_full_bytes": 65271453491,
        "kv_in_use_bytes": gib(53.6),
    }


def test_memory_summary_old_form():
    ev = one(
        "INFO 01-01 00:00:00 [gpu_worker.py:276] Free memory on device (78.5/79.19 GiB) on startup. Desired GPU memory "
        "utilization is (0.9, 71.27 GiB). Actual usage is 14.99 GiB for weight, 1.35 GiB for peak activation, "
        "0.09 GiB for non-torch memory, and 0.42 GiB for CUDAGraph memory. Replace gpu_memory_utilization config "
        "with `--kv-cache-memory=57445382963` to fit into requested memory, or `--kv-cache-memory=65271453491` to "
        "fully utilize gpu memory. Current kv cache memory in use is 57940509491 bytes.",
        "memory_summary",
    )
    v = ev.values
    assert v["weights_bytes"] == gib(14.99) and v["non_torch_bytes"] == gib(0.09)
    assert v["consumed_bytes"] == gib(14.99) + gib(0.09)
    assert v["kv_cache_memory_fit_bytes"] == 57445382963 and v["kv_in_use_bytes"] == 57940509491
    assert events(ev.text, "free_memory_below_util") == []


@pytest.mark.parametrize("word", ["does", "does does"])
def test_kv_cache_memory_bytes_reserved(word):
    ev = one(
        "INFO 01-01 00:00:00 [gpu_worker.py:664] Initial free memory 78.12 GiB, reserved 40.00 GiB memory for KV Cache as "
        f"specified by kv_cache_memory_bytes config and skipped memory profiling. This {word} not respect the "
        "gpu_memory_utilization config.",
        "kv_cache_memory_bytes_reserved",
    )
    assert ev.values == {"initial_free_bytes": gib(78.12), "kv_bytes": gib(40.0)}


def test_hybrid_lines():
    assert one(
        "Setting attention block size to 528 tokens to ensure that attention page size is >= mamba page size.",
        "hybrid_block_size",
    ).values == {"block_size": 528}
    assert one(
        "Padding mamba page size by 1.52% to ensure that mamba page size and attention page size are exactly equal.",
        "mamba_padding",
    ).values == {"fraction": 0.0152}
    assert one("Add 2 padding layers, may waste at most 5.00% KV cache memory", "padding_layers").values == {
        "layers": 2,
        "waste_fraction": 0.05,
    }


# --------------------------------------------------------------------------- errors §3.5


@pytest.mark.parametrize(
    "line, device",
    [
        (
            "ValueError: Free memory on device cuda:0 (2.91/15.47 GiB) on startup is less than desired GPU memory "
            "utilization (0.8, 12.38 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            "cuda:0",
        ),
        (
            "ValueError: Free memory on device (2.91/15.47 GiB) on startup is less than desired GPU memory "
            "utilization (0.8, 12.38 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            None,
        ),
    ],
)
def test_free_memory_below_util(line, device):
    ev = one(line, "free_memory_below_util")
    assert ev.values == {
        "device": device,
        "free_bytes": gib(2.91),
        "total_bytes": gib(15.47),
        "gmu": 0.8,
        "requested_bytes": gib(12.38),
        "variant": "util",
    }


def test_free_memory_external_weights_variants():
    ev = one(
        "ValueError: Externally held weights on device cuda:0 (20.00/79.19 GiB) exceed the desired GPU memory "
        "utilization (0.2, 15.84 GiB).",
        "free_memory_below_util",
    )
    assert ev.values["variant"] == "external_weights_exceed"
    assert (
        ev.values["device"] == "cuda:0"
        and ev.values["gmu"] == 0.2
        and ev.values["requested_bytes"] == gib(15.84)
    )
    ev = one(
        "ValueError: Free memory on device cuda:1 (10.00/79.19 GiB) on startup is less than the engine's budget "
        "after excluding external process's weights (0.5, 39.6 GiB).",
        "free_memory_below_util",
    )
    assert ev.values["variant"] == "below_budget_excluding_external" and ev.values["free_bytes"] == gib(10.0)


def test_free_memory_case_b26_one_per_rank():
    evs = case("b26-orphaned-enginecore-workers").of("free_memory_below_util")
    assert [(e.process, e.values["device"]) for e in evs] == [
        ("Worker_TP0", "cuda:0"),
        ("Worker_TP1", "cuda:1"),
    ]


def test_profiling_assertion_gib_and_raw_bytes():
    ev = one(
        "AssertionError: Error in memory profiling. Initial free memory 70.12 GiB, current free memory 72.5 GiB. "
        "This happens when other processes sharing the same container release GPU memory",
        "profiling_assertion",
    )
    assert ev.values == {"initial_free_bytes": gib(70.12), "current_free_bytes": gib(72.5)}
    ev = one(
        "AssertionError: Error in memory profiling. Initial free memory 75295981568, current free memory "
        "77846118400. This happens when the GPU memory was not properly cleaned up",
        "profiling_assertion",
    )
    assert ev.values == {"initial_free_bytes": 75295981568, "current_free_bytes": 77846118400}


@pytest.mark.parametrize(
    "suffix",
    ["", " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."],
)
def test_no_available_kv_memory(suffix):
    line = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
    assert one(line + suffix, "no_available_kv_memory").values == {}


@pytest.mark.parametrize(
    "line, values",
    [
        (  # 0.10.2: "models's", 2 decimals, estimate printed
            "ValueError: To serve at least one request with the models's max seq len (221000), (10.12 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (5.59 GiB). Based on the available memory, the "
            "estimated maximum model length is 122080. Try increasing `gpu_memory_utilization` or decreasing "
            "`max_model_len` when initializing the engine.",
            (221000, gib(10.12), gib(5.59), 122080),
        ),
        (  # 0.8.x: estimate sentence never printed
            "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (12.34 GiB). Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
            (131072, gib(16.0), gib(12.34), None),
        ),
        (  # ≥0.21: "model's", 4 decimals, negative available
            "ValueError: To serve at least one request with the model's max seq len (32768), (4.0000 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (-0.5312 GiB). Try increasing "
            "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing `max_model_len`",
            (32768, gib(4.0), gib(-0.5312), None),
        ),
    ],
)
def test_max_seq_len_exceeds_kv_variants(line, values):
    ev = one(line, "max_seq_len_exceeds_kv")
    keys = ("max_model_len", "needed_bytes", "available_bytes", "estimated_max_len")
    assert tuple(ev.values[k] for k in keys) == values


def test_max_seq_len_case_real_cpu_is_deduplicated():
    log = case("real-cpu-kv-too-small")
    (ev,) = log.of("max_seq_len_exceeds_kv")  # printed by EngineCore and again in the raw traceback
    assert ev.values == {
        "max_model_len": 256,
        "needed_bytes": 0,
        "available_bytes": 0,
        "estimated_max_len": 128,
    }
    assert ev.process == "EngineCore"


def test_v0_max_seq_len():
    log = case("b06-v0-max-seq-len-3664")
    (ev,) = log.of("v0_max_seq_len_exceeds_kv")
    assert ev.values == {"max_model_len": 4096, "kv_tokens": 3664}
    assert log.of("v0_blocks")[0].values["gpu_blocks"] == 229


def test_autofit_lines():
    assert one(
        "Auto-fit max_model_len: reduced from 262144 to 172032 to fit in available GPU memory (3.01 GiB "
        "available for KV cache)",
        "autofit",
    ).values == {"from": 262144, "to": 172032}
    assert one(
        "Auto-fit max_model_len: full model context length 1048576 fits in available GPU memory", "autofit"
    ).values == {"from": 1048576, "to": 1048576}
    assert (
        one(
            "ValueError: Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single "
            "token. Try increasing `gpu_memory_utilization`.",
            "autofit_failed",
        ).values
        == {}
    )


def test_user_max_model_len_too_large():
    ev = one(
        "ValueError: User-specified max_model_len (65536) is greater than the derived max_model_len "
        "(max_position_embeddings=32768 or model_max_length=None in model's config.json). To allow overriding this "
        "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
        "user_max_model_len_too_large",
    )
    assert ev.values == {"max_model_len": 65536, "derived": 32768, "derived_key": "max_position_embeddings"}


@pytest.mark.parametrize(
    "line, length, max_len",
    [
        (
            "The decoder prompt (length 9000) is longer than the maximum model length of 8192. Make sure that",
            9000,
            8192,
        ),
        (
            "The decoder prompt (length 8192) plus the number of requested output tokens (at least 1) is longer than "
            "the maximum model length of 8192.",
            8192,
            8192,
        ),
        (
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least 5000 input "
            "tokens, which exceeds this limit even without any output tokens.",
            5000,
            4096,
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the "
            "messages, 1000 in the completion).",
            5000,
            4096,
        ),
        ("Input prompt (5000 tokens) is too long and exceeds limit of 4096", 5000, 4096),
    ],
)
def test_prompt_too_long(line, length, max_len):
    assert one(line, "prompt_too_long").values == {"length": length, "max_model_len": max_len}


@pytest.mark.parametrize(
    "line",
    [
        "pydantic_core._pydantic_core.ValidationError: x\n  Value error, Invalid kv_cache_dtype: 'int8'. Valid values "
        "are: ['auto', 'fp8', 'int8_per_token_head'] [type=value_error, input_value='int8', input_type=str]",
        "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'int8' (choose from 'auto', 'fp8', "
        "'int8_per_token_head')",
    ],
)
def test_invalid_kv_cache_dtype(line):
    ev = one(line, "invalid_kv_cache_dtype")
    assert ev.values == {"value": "int8", "valid": ["auto", "fp8", "int8_per_token_head"]}


def test_invalid_kv_cache_dtype_case():
    log = case("seed-int8-kv-dtype")
    (ev,) = log.of("invalid_kv_cache_dtype")
    assert ev.values["value"] == "int8" and "int8_per_token_head" in ev.values["valid"]
    assert len(ev.values["valid"]) == 22
    assert log.args["kv_cache_dtype"] == "int8" and log.engine_generation == "v1"


@pytest.mark.parametrize(
    "line, reason",
    [
        ("ERROR 01-01 00:00:00 [core.py:1584] EngineCore failed to start.", "EngineCore failed to start"),
        (
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            "Engine core initialization failed",
        ),
        (
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for "
            "the root cause.",
            "EngineDeadError",
        ),
        (
            "ERROR 01-01 00:00:00 [core.py:1] EngineCore encountered a fatal error.",
            "EngineCore encountered a fatal error",
        ),
    ],
)
def test_engine_failed(line, reason):
    assert one(line, "engine_failed").values == {"reason": reason}


def test_traceback_source_lines_are_not_events():
    text = (
        'Traceback (most recent call last):\n  File "/v/utils.py", line 494, in wait_for_engine_startup\n'
        '    raise RuntimeError("Engine core initialization failed. "\n'
    )
    assert events(text) == []


def test_load_model_and_sampler_warmup_oom():
    log = parse_log(
        "(Worker_TP0 pid=5) ERROR 01-01 00:00:00 [gpu_model_runner.py:5077] Failed to load model - not enough GPU memory. Try "
        "lowering --gpu-memory-utilization to free memory for weights, increasing --tensor-parallel-size, or using "
        "--quantization. (original error: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total "
        "capacity of 23.55 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 22.52 GiB "
        "memory in use. Of the allocated memory 22.08 GiB is allocated by PyTorch, and 15.50 MiB is reserved by "
        "PyTorch but unallocated.)"
    )
    assert len(log.of("load_model_oom")) == 1
    (oom,) = log.of("cuda_oom")
    assert oom.values["phase"] == "weight_loading" and oom.values["requested_bytes"] == int(round(1.96 * GiB))
    log = case("b23-sampler-warmup-oom-qwen3-32b")
    evs = log.of("sampler_warmup_oom")
    # one per rank; EngineCore's "Worker failed with error '…'" re-print is the same failure
    assert [(e.process, e.values["num_requests"]) for e in evs] == [
        ("Worker_TP0", 1024),
        ("Worker_TP1", 1024),
    ]


def test_mm_profile_warning():
    assert (
        one(
            "WARNING 01-01 00:00:00 [profiling.py:1] The sequence length used for profiling (max_num_batched_tokens / max_num_seqs = "
            "8) is too short to hold the multi-modal embeddings in the worst case (1024 tokens in total)",
            "mm_profile",
        ).values
        == {}
    )


def test_swap_space_warning():
    ev = one(
        "Possibly too large swap space. 16.00 GiB out of the 31.26 GiB total CPU memory is allocated for the swap "
        "space.",
        "swap_space_too_large",
    )
    assert ev.values == {"swap_bytes": gib(16), "cpu_total_bytes": gib(31.26), "fatal": False}


# --------------------------------------------------------------------------- CUDA OOM §3.6


def test_cuda_oom_modern_full():
    ev = one(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 0 bytes is free. Process 4242 has 30.00 GiB memory in use. Including non-PyTorch memory, "
        "this process has 49.18 GiB memory in use. 70.00 GiB allowed; Of the allocated memory 47.50 GiB is allocated "
        "by PyTorch, with 1.38 GiB allocated in private pools (e.g., CUDA Graphs), and 512.00 MiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
        "cuda_oom",
    )
    v = ev.values
    assert v["form"] == "modern" and v["gpu"] == 0
    assert v["requested_bytes"] == 20 * MiB and v["free_bytes"] == 0 and v["total_bytes"] == gib(79.19)
    assert v["other_processes"] == [{"pid": 4242, "bytes": gib(30)}]
    assert v["this_process_bytes"] == gib(49.18) and v["allowed_bytes"] == gib(70)
    assert v["allocated_by_pytorch_bytes"] == gib(47.5) and v["private_pools_bytes"] == gib(1.38)
    assert v["reserved_unallocated_bytes"] == 512 * MiB
    assert v["phase"] == "startup"


def test_cuda_oom_torch_2_1_capacty_typo():
    ev = one(
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacty of "
        "15.78 GiB of which 3.44 MiB is free. Process 1234 has 15.77 GiB memory in use. Of the allocated memory 14.56 "
        "GiB is allocated by PyTorch, and 177.38 MiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.",
        "cuda_oom",
    )
    assert ev.values["form"] == "modern" and ev.values["total_bytes"] == gib(15.78)
    assert ev.values["free_bytes"] == int(round(3.44 * MiB)) and ev.values["private_pools_bytes"] is None
    assert ev.values["reserved_unallocated_bytes"] == int(round(177.38 * MiB))


def test_cuda_oom_legacy_case_b01():
    log = case("b01-tp1-70b-on-8x-a100-40g")
    (ev,) = log.of("cuda_oom")
    v = ev.values
    assert v["form"] == "legacy" and v["gpu"] == 0
    assert v["requested_bytes"] == 896 * MiB and v["total_bytes"] == gib(39.39)
    assert v["already_allocated_bytes"] == gib(38.62) and v["reserved_total_bytes"] == gib(38.62)
    assert v["free_bytes"] == int(round(211.44 * MiB)) and v["reserved_unallocated_bytes"] == 0
    assert v["phase"] == "weight_loading"  # the traceback is in get_model / init_model


def test_cuda_oom_legacy_reserved_unallocated_is_computed():
    ev = one(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB "
        "already allocated; 3.44 MiB free; 14.72 GiB reserved in total by PyTorch) If reserved memory is >> "
        "allocated memory try setting max_split_size_mb to avoid fragmentation.",
        "cuda_oom",
    )
    assert ev.values["reserved_unallocated_bytes"] == gib(14.72) - gib(14.56)


def test_cuda_oom_capture_phase_both_ranks_b14():
    log = case("b14-cudagraph-capture-oom-v100-16g")
    evs = log.of("cuda_oom")
    # GPU 1 from the worker, GPU 0 from the driver (ERROR line + traceback repeat = one)
    assert [(e.process, e.values["gpu"]) for e in evs] == [("VllmWorkerProcess", 1), (None, 0)]
    assert all(e.values["phase"] == "cuda_graph_capture" for e in evs)
    assert evs[1].values["reserved_unallocated_bytes"] == int(round(6.18 * MiB))


def test_cuda_oom_sampler_phase_b23():
    evs = case("b23-sampler-warmup-oom-qwen3-32b").of("cuda_oom")
    assert [(e.process, e.values["gpu"], e.values["phase"]) for e in evs] == [
        ("Worker_TP0", 0, "sampler_warmup"),
        ("Worker_TP1", 1, "sampler_warmup"),
    ]


def test_cuda_oom_runtime_phase_b28():
    (ev,) = case("b28-allocator-fragmentation-16g").of("cuda_oom")
    assert ev.values["phase"] == "runtime"
    assert ev.values["requested_bytes"] == 546 * MiB
    assert ev.values["free_bytes"] == int(round(514.19 * MiB))
    assert ev.values["reserved_unallocated_bytes"] == int(round(736.86 * MiB))
    assert ev.values["other_processes"] == [{"pid": 3371, "bytes": gib(15.25)}]


OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 15.77 "
    "GiB of which 41.12 MiB is free. Including non-PyTorch memory, this process has 15.72 GiB memory in use. Of the "
    "allocated memory 14.47 GiB is allocated by PyTorch, and 6.18 MiB is reserved by PyTorch but unallocated."
)


@pytest.mark.parametrize(
    "before, phase",
    [
        ("INFO 01-01 00:00:00 [m.py:1] Starting to load model m...", "weight_loading"),
        ("INFO 01-01 00:00:00 [m.py:1] Model loading took 4.81 GiB memory and 8.1 seconds", "profile_run"),
        ("INFO 01-01 00:00:00 [m.py:1] Available KV cache memory: 6.01 GiB", "kv_cache_init"),
        ("INFO 01-01 00:00:00 [m.py:1] Capturing CUDA graph shapes: 10%", "cuda_graph_capture"),
        ("INFO:     Application startup complete.", "runtime"),
        ("INFO 01-01 00:00:00 [api_server.py:1] Starting vLLM API server on http://0.0.0.0:8000", "runtime"),
        ("INFO 01-01 00:00:00 [m.py:1] Resolved architecture: X", "startup"),
    ],
)
def test_cuda_oom_phase_from_preceding_events(before, phase):
    ev = one(f"{before}\nERROR 0 [core.py:1] {OOM}\n", "cuda_oom")
    assert ev.values["phase"] == phase


def test_cuda_oom_phase_per_process():
    text = (
        "(Worker_TP0 pid=1) INFO 01-01 00:00:00 [m.py:1] Capturing CUDA graph shapes: 10%\n"
        "(Worker_TP1 pid=2) INFO 01-01 00:00:00 [m.py:1] Model loading took 4.81 GiB memory and 8.1 seconds\n"
        f"(Worker_TP1 pid=2) ERROR 01-01 00:00:00 [m.py:1] {OOM}\n"
    )
    assert one(text, "cuda_oom").values["phase"] == "profile_run"


def test_cuda_oom_restart_resets_runtime_phase():
    text = (
        "INFO:     Application startup complete.\n"
        "INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.10.0\n"
        "INFO 01-01 00:00:00 [m.py:1] Starting to load model m...\n"
        f"ERROR 01-01 00:00:00 [m.py:1] {OOM}\n"
    )
    assert one(text, "cuda_oom").values["phase"] == "weight_loading"


def test_cuda_oom_dedup_same_block_but_separate_later_occurrence():
    text = (
        "INFO:     Application startup complete.\n"
        f"ERROR 01-01 00:00:00 [core.py:1] {OOM}\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        f"{OOM}\n"
        "INFO 01-01 00:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 1.0 "
        "tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.0%\n"
        f"ERROR 01-01 00:00:00 [core.py:1] {OOM}\n"
    )
    assert [e.line for e in events(text, "cuda_oom")] == [2, 7]


def test_cuda_oom_reprinted_by_engine_core_and_api_server_is_one_event():
    text = (
        f"(Worker_TP0 pid=7) ERROR 01-01 00:00:00 [w.py:1] {OOM}\n"
        f"(EngineCore_DP0 pid=5) ERROR 01-01 00:00:00 [core.py:1] {OOM}\n"
        f"(APIServer pid=1) ERROR 01-01 00:00:00 [async_llm.py:1] {OOM}\n"
    )
    assert [e.process for e in events(text, "cuda_oom")] == ["Worker_TP0"]


def test_cuda_oom_identical_text_on_two_workers_kept_apart():
    text = f"(Worker_TP0 pid=7) ERROR 01-01 00:00:00 [w.py:1] {OOM}\n(Worker_TP1 pid=8) ERROR 01-01 00:00:00 [w.py:1] {OOM}\n"
    assert [e.process for e in events(text, "cuda_oom")] == ["Worker_TP0", "Worker_TP1"]


def test_cuda_error_oom():
    assert one("RuntimeError: CUDA error: out of memory", "cuda_error_oom").values == {}


# --------------------------------------------------------------------------- stats §3.4


@pytest.mark.parametrize(
    "line, expected",
    [
        (  # V0 (0.8.5 and the 0.3/0.4 cases)
            "INFO 07-24 10:15:02 metrics.py:334] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
            "2351.6 tokens/s, Running: 247 reqs, Swapped: 0 reqs, Pending: 740 reqs, GPU KV cache usage: 99.7%, "
            "CPU KV cache usage: 0.0%",
            dict(
                engine=None,
                running=247,
                waiting=None,
                swapped=0,
                pending=740,
                kv_usage=0.997,
                cpu_kv_usage=0.0,
            ),
        ),
        (  # 0.9–0.11
            "(APIServer pid=48011) INFO 09-05 10:40:50 [loggers.py:118] Engine 000: Avg prompt throughput: 438.0 "
            "tokens/s, Avg generation throughput: 141.3 tokens/s, Running: 5 reqs, Waiting: 0 reqs, GPU KV cache "
            "usage: 11.2%, Prefix cache hit rate: 41.7%",
            dict(
                engine="0",
                running=5,
                waiting=0,
                kv_usage=0.112,
                prefix_cache_hit_rate=0.417,
                preemptions=None,
            ),
        ),
        (  # ≥0.12 with Deferred and Preemptions
            "Engine 001: Avg prompt throughput: 12.5 tokens/s, Avg generation throughput: 3.0 tokens/s, Running: 2 "
            "reqs, Waiting: 7 reqs, Deferred: 1 reqs, KV fetch: 0 waiting to start, 0 in progress, 0 completed "
            "waiting, Preemptions: 3, GPU KV cache usage: 98.0%, Prefix cache hit rate: 5.0%, External prefix cache "
            "hit rate: 50.0%",
            dict(engine="1", waiting=7, deferred=1, preemptions=3, kv_usage=0.98, prefix_cache_hit_rate=0.05),
        ),
        (  # aggregated
            "4 Engines Aggregated: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
            "Running: 8 reqs, Waiting: 0 reqs, GPU KV cache usage: 50.0%",
            dict(engine="aggregated", num_engines=4, running=8, kv_usage=0.5, prefix_cache_hit_rate=None),
        ),
        (  # CPU backend: "CPU KV cache usage" is the pool itself
            "Engine 000: Avg prompt throughput: 56.3 tokens/s, Avg generation throughput: 252.3 tokens/s, Running: "
            "2 reqs, Waiting: 1 reqs, CPU KV cache usage: 100.0%, Prefix cache hit rate: 0.0%",
            dict(engine="0", kv_usage=1.0, cpu_kv_usage=None, device="CPU", prompt_throughput=56.3),
        ),
        (  # 0.8 V1 without the engine prefix
            "Avg prompt throughput: 1840.3 tokens/s, Avg generation throughput: 201.7 tokens/s, Running: 6 reqs, "
            "Waiting: 0 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 18.4%",
            dict(engine=None, generation_throughput=201.7, kv_usage=0.412, prefix_cache_hit_rate=0.184),
        ),
    ],
)
def test_stats_forms(line, expected):
    ev = one(line, "stats")
    for k, v in expected.items():
        assert ev.values[k] == v, k


def test_stats_cases_count_and_generation():
    log = case("b17-v1-preemption-thrash-long-prompts")
    assert len(log.of("stats")) == 18 and log.engine_generation == "v1"
    assert max(e.values["kv_usage"] for e in log.of("stats")) == 0.999
    log = case("b20-low-util-kv-saturated-qwen2-0.5b")
    assert [e.values["pending"] for e in log.of("stats")] == [740, 748, 755, 761, 764, 768]
    assert log.engine_generation == "v0" and log.vllm_version == "0.4.2"


def test_preempted_v0():
    ev = one(
        "WARNING 01-01 00:00:00 scheduler.py:1768] Sequence group 12 is preempted by PreemptionMode.RECOMPUTE mode because there "
        "is not enough KV cache space. This can affect the end-to-end performance. Increase gpu_memory_utilization "
        "or tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=51",
        "preempted_v0",
    )
    assert ev.values == {"mode": "recompute", "total_cumulative": 51}


# --------------------------------------------------------------------------- redaction


def test_redacts_prompt_text_and_token_ids():
    text = (
        "INFO 01-01 00:00:00 [logger.py:39] Received request cmpl-1: prompt: 'my secret question, it's long', params: "
        "SamplingParams(n=1), prompt_token_ids: [1, 450, 3007], lora_request: None."
    )
    red = redact(parse_line(text).message)
    assert "secret question" not in red and "450" not in red
    assert "<redacted 29 chars>" in red and "<redacted 3 tokens>" in red
    # a truncated request line leaks nothing either
    assert "secret" not in redact("Received request x: prompt: 'my secret ques")


@pytest.mark.parametrize(
    "text, secret",
    [
        ("vllm serve m --api-key sk-abc123", "sk-abc123"),
        ("args: Namespace(api_key='sk-abc123', port=8000)", "sk-abc123"),
        ("non-default args: {'api_key': ['sk-abc123']}", "sk-abc123"),
        ("env HF_TOKEN=hf_abcdefghijklmnopqrstuv", "hf_abcdefghijklmnopqrstuv"),
        ("OPENAI_API_KEY=sk-zzz999 WANDB_KEY=qqq111", "sk-zzz999"),
        ("headers: {'Authorization': 'Bearer sk-abc123456'}", "sk-abc123456"),
    ],
)
def test_redacts_secrets(text, secret):
    red = redact(text)
    assert secret not in red and "***" in red


def test_redact_keeps_none_api_key():
    assert redact("Namespace(api_key=None, port=1)") == "Namespace(api_key=None, port=1)"


# --------------------------------------------------------------------------- files, garbage, follower


def test_every_case_log_parses(tmp_path):
    for path in sorted(DATA.glob("*.log")):
        log = parse_log_file(path)
        assert log.line_count == len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        assert log.events, path.name
        assert [e.line for e in log.events] == sorted(e.line for e in log.events)
        assert log.vllm_version or log.args.get("model"), path.name


def test_case_versions():
    expect = {
        "b05-foreign-process-blocks-startup": ("0.9.1", "v1"),
        "b08-v1-fp8-estimated-max-len-122080": ("0.10.2", "v1"),
        "b10-v0-negative-kv-rtx4060": ("0.7.3", "v0"),
        "b14-cudagraph-capture-oom-v100-16g": ("0.6.5", "v0"),
        "b21-idle-preallocation-7b": ("0.3.3", "v0"),
        "b26-orphaned-enginecore-workers": ("0.33.0", "v1"),
        "b28-allocator-fragmentation-16g": ("0.8.2", "v1"),
        "real-cpu-preemptions": ("0.32.0", "v1"),
    }
    for name, (version, gen) in expect.items():
        log = case(name)
        assert (log.vllm_version, log.engine_generation) == (version, gen), name


def test_case_b08_fp8_estimate():
    log = case("b08-v1-fp8-estimated-max-len-122080")
    (ev,) = log.of("max_seq_len_exceeds_kv")
    assert ev.values["estimated_max_len"] == 122080 and ev.values["available_bytes"] == gib(5.59)
    assert log.of("available_kv_memory")[0].values["bytes"] == gib(5.59)
    assert log.args["kv_cache_dtype"] == "fp8" and log.args["max_model_len"] == 221000
    assert log.of("model_loading")[0].values == {"weights_bytes": gib(29.0911), "seconds": 41.376512}


def test_empty_file_is_not_an_error(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_bytes(b"")
    log = parse_log_file(p)
    assert log.events == [] and log.line_count == 0 and log.origin == str(p)


@pytest.mark.parametrize("data", [b"\x00" * 4096, bytes(range(256)) * 64, os.urandom(8192)])
def test_binary_file_is_a_source_error(tmp_path, data):
    p = tmp_path / "vllm.log"
    p.write_bytes(data)
    with pytest.raises(SourceError, match="binary"):
        parse_log_file(p)


def test_missing_file_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="cannot read log"):
        parse_log_file(tmp_path / "nope.log")


def test_gzip_log(tmp_path):
    p = tmp_path / "vllm.log.gz"
    p.write_bytes(gzip.compress((DATA / "b10-v0-negative-kv-rtx4060.log").read_bytes()))
    assert parse_log_file(p).of("memory_profile_v0")
    p.write_bytes(gzip.compress(b"abc" * 100)[:20])
    with pytest.raises(SourceError):
        parse_log_file(p)


def test_garbage_and_truncated_lines_never_crash():
    lines = [
        "ValueError: To serve at least one request with the models's max seq len (",
        "Model loading took . GiB and x seconds",
        "CUDA out of memory. Tried to allocate",
        "CUDA out of memory. Tried to allocate 9e999 MiB. GPU 0 has a total capacity of 1 GiB of which 1 GiB is free.",
        "non-default args: {'model': 'm', 'x': [1, 2",
        "args: Namespace(model='m', x=(1,",
        "Initializing a V1 LLM engine (v) with config: ",
        "Free memory on device (a/b GiB) on startup",
        "Engine 000: Avg prompt throughput: nan tokens/s",
        "(Worker pid=x) INFO",
        "\udcff\x00\x01\x02 binary \ufffd junk",
        "# GPU blocks: , # CPU blocks: ",
        "the rest of the memory reserved for KV Cache is",
    ]
    log = parse_log("\n".join(lines))
    assert log.line_count == len(lines)


def test_windows_line_endings_and_no_trailing_newline():
    text = "INFO 01-01 00:00:00 [m.py:1] Using max model len 4096\r\nINFO 0 [m.py:1] Available KV cache memory: 1.00 GiB"
    log = parse_log(text)
    assert [e.kind for e in log.events] == ["max_model_len_used", "available_kv_memory"]
    assert log.line_count == 2


def test_follower_reads_only_appended_complete_lines(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_text("INFO 01-01 00:00:00 [m.py:1] Using max model len 4096\nINFO 0 [m.py:1] Available KV cache")
    f = LogFollower(p)
    assert [e.kind for e in f.poll()] == ["max_model_len_used"]
    assert f.poll() == []
    with open(p, "a") as fh:
        fh.write(" memory: 2.00 GiB\n")
    (ev,) = f.poll()
    assert ev.kind == "available_kv_memory" and ev.line == 2 and ev.values["bytes"] == 2 * GiB
    assert f.log.line_count == 2 and len(f.log.events) == 2


def test_follower_multi_line_profile_across_polls(tmp_path):
    p = tmp_path / "vllm.log"
    lines = (DATA / "b10-v0-negative-kv-rtx4060.log").read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:18]))
    f = LogFollower(p)
    assert not [e for e in f.poll() if e.kind == "memory_profile_v0"]
    with open(p, "a") as fh:
        fh.write("".join(lines[18:]))
    kinds = [e.kind for e in f.poll()]
    assert "memory_profile_v0" in kinds and "no_available_kv_memory" in kinds
    assert [(e.kind, e.line) for e in f.log.events] == [(e.kind, e.line) for e in parse_log_file(p).events]


def test_follower_truncation_and_rotation_restart(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_text(
        "INFO 01-01 00:00:00 [m.py:1] Using max model len 4096\nINFO 0 [m.py:1] Using max model len 8192\n"
    )
    f = LogFollower(p)
    assert len(f.poll()) == 2
    p.write_text(
        "INFO 01-01 00:00:00 [m.py:1] Using max model len 1024\n"
    )  # truncated and rewritten, shorter
    (ev,) = f.poll()
    assert ev.values["max_model_len"] == 1024 and ev.line == 1
    rotated = tmp_path / "vllm.log.1"
    p.rename(rotated)
    assert f.poll() == []  # file gone for a moment
    p.write_text(
        "INFO 01-01 00:00:00 [m.py:1] Using max model len 2048\nINFO 0 [m.py:1] Using max model len 4096\n"
    )
    assert [e.values["max_model_len"] for e in f.poll()] == [2048, 4096]
    assert f.log.line_count == 2


def test_follower_matches_parse_log_on_a_case(tmp_path):
    src = DATA / "b23-sampler-warmup-oom-qwen3-32b.log"
    p = tmp_path / "vllm.log"
    p.write_bytes(b"")
    f = LogFollower(p)
    got: list[LogEvent] = []
    data = src.read_bytes()
    for i in range(0, len(data), 997):  # odd chunk sizes split lines mid-way
        with open(p, "ab") as fh:
            fh.write(data[i : i + 997])
        got.extend(f.poll())
    want = parse_log_file(src).events
    assert [(e.kind, e.line) for e in got] == [(e.kind, e.line) for e in want]
    assert [e.values.get("phase") for e in got] == [e.values.get("phase") for e in want]


def test_follower_bounds_kept_events(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_text("INFO 01-01 00:00:00 [m.py:1] Using max model len 4096\n" * 30)
    f = LogFollower(p)
    f.max_events = 10
    assert len(f.poll()) == 30  # every new event is returned
    assert len(f.log.events) == 10 and f.log.events[-1].line == 30
