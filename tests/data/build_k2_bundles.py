#!/usr/bin/env python3
"""Writes the k2 bundles of tests/data/bundles/ (vLLM 0.34 rows of spec/vllm-0.34.md for
weights-not-sharded, sampler-warmup-oom, multimodal-profile-oom, cpu-offload-not-applied, the
new rules v1-runner-env-removed (N5) and unified-memory-gmu-unset (N6), and the fp8 KV-cache
capability kind of issue 24) from the 0.34 format strings of reference/vllm-facts.md §9, reusing
tests/data/bundles-034/build.py's helpers. Run: ``python tests/data/build_k2_bundles.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("build034", HERE / "bundles-034" / "build.py")
assert _spec is not None and _spec.loader is not None
b = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(b)

GiB, MiB = b.GiB, b.MiB
OUT = HERE / "bundles"

SUMMARY = (
    "Free memory on device (%s/%s GiB) on startup. Desired GPU memory utilization is (%s, %s GiB). Actual usage "
    "is %s GiB for consumed memory (weights + non-torch), %s GiB for peak activation, and %s GiB for CUDAGraph "
    "memory. Replace gpu_memory_utilization config with `--kv-cache-memory=%d` (%s GiB) to fit into requested "
    "memory, or `--kv-cache-memory=%d` (%s GiB) to fully utilize gpu memory. Current kv cache memory in use is "
    "%s GiB."
)
LOADING = "Model loading took %s GiB memory and 5.604417 seconds"


def g2(mib: float) -> str:
    return b.gib(mib)


def write(name: str, files: dict[str, str], expected: dict) -> None:
    d = OUT / name
    d.mkdir(exist_ok=True)
    for rel, text in files.items():
        (d / rel).write_text(text)
    (d / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


def traceback(log: b.Log, pid: int, frames: list[tuple[str, int, str, str]], error: str) -> None:
    log.add("EngineCore", pid, "EngineCore failed to start.", "ERROR", "core.py:1585")
    log.add("EngineCore", pid, "Traceback (most recent call last):", "ERROR", "core.py:1585")
    log.sec -= 1
    for path, lineno, fn, code in frames:
        log.lines.append(
            f"(EngineCore pid={pid}) ERROR 12-07 10:00:{log.sec:02d} [core.py:1585]   File"
            f' "/usr/local/lib/python3.12/dist-packages/vllm/{path}", line {lineno}, in {fn}'
        )
        log.lines.append(f"(EngineCore pid={pid}) ERROR 12-07 10:00:{log.sec:02d} [core.py:1585]     {code}")
    log.lines.append(f"(EngineCore pid={pid}) ERROR 12-07 10:00:{log.sec:02d} [core.py:1585] {error}")


def torch_oom(
    req_mib: int, total_gib: float, free_mib: float, pid: int, used_gib: float, alloc_gib: float
) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req_mib:.2f} MiB. GPU 0 has a total"
        f" capacity of {total_gib:.2f} GiB of which {free_mib:.2f} MiB is free. Including non-PyTorch memory,"
        f" this process has {used_gib:.2f} GiB memory in use. Of the allocated memory {alloc_gib:.2f} GiB is"
        " allocated by PyTorch, and 120.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated"
        " memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        "  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


# --- N6: DGX Spark (GB10), gmu unset --------------------------------------------------------------
def gb10(name: str, gmu: float | None, expected: dict) -> None:
    # MiB: T 122,570 (119.70 GiB, the host's RAM); F0 112,845 (the OS and desktop hold 9.5 GiB)
    t, f0, c, p, g, tr, gr = 122570, 112845, 15860, 1700, 576, 1700, 1900
    u = gmu if gmu is not None else 1.0
    r = -(-int(u * t * MiB) // MiB)  # ceil(u × T)
    mu = max(1024, int(0.75 * tr))
    f1 = f0 - c - g - gr  # free after warm-up (nothing committed)
    k = min(r - (t - f0) - c - g, f1 - mu) - gr
    n = (k // 64) * 8  # granules of 64 MiB = 8 blocks of 8 MiB
    pool = n * 8
    cap = c + gr + (f1 - pool - 512)
    b1 = int((r - c - p - g - 150) * MiB)
    b2 = int((f0 - c - p - g - 150) * MiB)
    args = "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct'" + (
        f", 'gpu_memory_utilization': {gmu}}}" if gmu is not None else "}"
    )
    log = b.Log("12-07")
    log.banner(3001, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct", args)
    log.engine(3100, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct", 131072)
    log.add("EngineCore", 3100, b.BACKEND, src="cuda.py:549")
    log.add("EngineCore", 3100, LOADING % g2(c - 870), src="model_runner.py:441")
    log.add("EngineCore", 3100, b.AVAILABLE % g2(r - (t - f0) - c - p), src="gpu_worker.py:795")
    log.add("EngineCore", 3100, b.GRAPHS % (9, g / 1024), src="model_runner.py:1216")
    if gmu is not None:
        log.add(
            "EngineCore",
            3100,
            b.GMU_CAP % (gmu, g2(r), g2(t - r)),
            "WARNING",
            "extensible_kv_cache.py:650",
        )
    log.add(
        "EngineCore",
        3100,
        b.AFTER_WARMUP % (g2(f1), "0.06", g2(gr), g2(tr), g2(gr), n, g2(pool), g2(r), g2(cap)),
        src="extensible_kv_cache.py:693",
    )
    log.add(
        "EngineCore",
        3100,
        SUMMARY
        % (g2(f0), g2(t), u, g2(r), g2(c), g2(p), g2(g), b1, g2(b1 / MiB), b2, g2(b2 / MiB), g2(pool)),
        src="gpu_worker.py:1153",
    )
    tokens, conc = b.cap_tokens(n, 131072, 64)
    log.add(
        "EngineCore", 3100, b.CAPACITY % ("GPU", f"{tokens:,}", "131,072", conc), src="kv_cache_utils.py:1168"
    )
    log.add("EngineCore", 3100, b.EXTENDED % (n, pool / 1024), src="extensible_kv_cache.py:536")
    log.add(
        "EngineCore",
        3100,
        "init engine (profile, create kv cache, warmup model) took 58.10 s",
        src="core.py:450",
    )
    log.add("APIServer", 3001, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
    log.add("APIServer", 3001, b.HEALTHY_TRAFFIC, src="loggers.py:336")
    smi = b.smi("NVIDIA GB10", 0, t, [(3100, "VLLM::EngineCore", 0)])
    # DGX Spark's nvidia-smi cannot split unified memory: Memory-Usage reads "Not Supported"
    smi = smi.replace(f"      0MiB / {t:>6}MiB ", "    Not Supported      ").replace(
        "      0MiB |", "  N/A   |"
    )
    cmd = "vllm serve meta-llama/Llama-3.1-8B-Instruct" + (
        f" --gpu-memory-utilization {gmu}" if gmu is not None else ""
    )
    write(
        name,
        {
            "vllm.log": log.text(),
            "cmdline.txt": cmd + "\n",
            "nvidia-smi.txt": smi,
            "config.json": json.dumps(b.LLAMA_8B, indent=1) + "\n",
        },
        expected,
    )


def runner_env_1() -> None:
    log = b.Log("12-07")
    log.banner(3201, "0.34.0", "Qwen/Qwen3-8B", "{'model_tag': 'Qwen/Qwen3-8B'}")
    log.engine(3210, "0.34.0", "Qwen/Qwen3-8B", 40960)
    log.add("APIServer", 3201, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
    write(
        "k2-v34-v2-runner-env-1-info",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Qwen/Qwen3-8B\n",
            "env.txt": "VLLM_USE_V2_MODEL_RUNNER=1\n",
        },
        {
            "fires": ["v1-runner-env-removed"],
            "max_health": "info",
            "note": "spec/vllm-0.34.md §3.5 near miss: VLLM_USE_V2_MODEL_RUNNER=1 on 0.34 is accepted (a WARNING that it"
            " is redundant): info at most, never the startup-failure finding.",
        },
    )


def cpu_offload_034() -> None:
    """--cpu-offload-gb 8 on 0.34: no offloader lines and the whole checkpoint on the GPU."""
    log = b.Log("12-07")
    log.banner(
        3301,
        "0.34.0",
        "meta-llama/Llama-3.1-8B-Instruct",
        "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct', 'max_model_len': 32768, 'cpu_offload_gb': 8.0}",
    )
    log.engine(3310, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct", 32768)
    log.add("EngineCore", 3310, b.BACKEND, src="cuda.py:549")
    log.add("EngineCore", 3310, LOADING % "14.99", src="model_runner.py:441")
    log.add("EngineCore", 3310, b.AVAILABLE % "11.47", src="gpu_worker.py:795")
    log.add("EngineCore", 3310, b.GRAPHS % (6, 0.41), src="model_runner.py:1216")
    log.add(
        "EngineCore",
        3310,
        b.AFTER_WARMUP % ("9.37", "0.06", "1.86", "1.66", "1.86", 760, "5.94", "22.05", "10.21"),
        src="extensible_kv_cache.py:693",
    )
    log.add("EngineCore", 3310, b.CAPACITY % ("GPU", "48,640", "32,768", 1.48), src="kv_cache_utils.py:1168")
    log.add("EngineCore", 3310, b.EXTENDED % (760, 5.94), src="extensible_kv_cache.py:536")
    log.add(
        "EngineCore",
        3310,
        "init engine (profile, create kv cache, warmup model) took 31.10 s",
        src="core.py:450",
    )
    log.add("APIServer", 3301, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
    log.add("APIServer", 3301, b.HEALTHY_TRAFFIC, src="loggers.py:336")
    write(
        "k2-v34-cpu-offload-no-offloader-lines",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 32768 --cpu-offload-gb 8\n",
            "nvidia-smi.txt": b.smi("NVIDIA L4", 22510, 23034, [(3310, "VLLM::EngineCore", 22498)]),
            "config.json": json.dumps(b.LLAMA_8B, indent=1) + "\n",
        },
        {
            "fires": ["cpu-offload-not-applied"],
            "not_fires": ["v1-runner-env-removed", "weights-not-sharded"],
            "max_health": "info",
            "note": "spec/vllm-0.34.md §2 cpu-offload-not-applied: --cpu-offload-gb 8 on 0.34, no 'Offloader set to'"
            " line and 'Model loading took 14.99 GiB' (the whole checkpoint). Evidence (a), the runner choice, is dead on"
            " 0.34 (one runner, it installs the offloader): info with G_needed and no flag, never"
            " VLLM_USE_V2_MODEL_RUNNER=0 (a startup ValueError on 0.34).",
        },
    )


SAMPLER_FRAMES = [
    (
        "v1/engine/core.py",
        109,
        "__init__",
        "num_gpu_blocks, num_cpu_blocks, kv_cache_config = self._initialize_kv_caches(",
    ),
    (
        "v1/worker/gpu_worker.py",
        1187,
        "compile_or_warm_up_model",
        "self.model_runner._dummy_sampler_run(hidden_states)",
    ),
    (
        "v1/worker/gpu/model_runner.py",
        902,
        "_dummy_sampler_run",
        "sampler_output = self.sampler(logits, sampling_metadata)",
    ),
    (
        "v1/sample/sampler.py",
        88,
        "forward",
        "logits = self.apply_logits_processors(logits, sampling_metadata)",
    ),
]


def sampler_034(name: str, ext: bool) -> None:
    """Qwen3-32B on one H100 on 0.34: the sampler warm-up with min(max_num_seqs, max_num_batched_tokens)
    dummy requests OOMs (no wrapper text on 0.34, only the frames)."""
    log = b.Log("12-07")
    gmu_arg = "" if ext else ", 'gpu_memory_utilization': 0.95, 'enable_extensible_kv_cache': False"
    log.banner(
        3401,
        "0.34.0",
        "Qwen/Qwen3-32B",
        "{'model_tag': 'Qwen/Qwen3-32B', 'max_model_len': 32768" + gmu_arg + "}",
    )
    log.engine(3410, "0.34.0", "Qwen/Qwen3-32B", 32768)
    log.add("EngineCore", 3410, b.BACKEND, src="cuda.py:549")
    log.add("EngineCore", 3410, LOADING % "61.03", src="model_runner.py:441")
    log.add("EngineCore", 3410, b.AVAILABLE % "12.12", src="gpu_worker.py:795")
    log.add("EngineCore", 3410, b.GRAPHS % (11, 0.88), src="model_runner.py:1216")
    traceback(log, 3410, SAMPLER_FRAMES, torch_oom(1002, 79.19, 406.0, 3410, 78.79, 76.02))
    cmd = "vllm serve Qwen/Qwen3-32B --max-model-len 32768" + (
        "" if ext else " --gpu-memory-utilization 0.95 --no-enable-extensible-kv-cache"
    )
    flags = {"--max-num-seqs": ["256"]}
    if ext:
        note = (
            "spec/vllm-0.34.md §2 sampler-warmup-oom on an extensible engine: the 0.33 wrapper text is gone, the startup"
            " torch OOM has _dummy_sampler_run frames; N = min(max_num_seqs 1024, max_num_batched_tokens 8192) = 1024;"
            " --max-num-seqs 256 and no gmu alternative (the sampler warm-up runs before the KV commit, a lower gmu"
            " frees nothing)."
        )
        not_fires = []
    else:
        note = (
            "The same OOM on 0.34 with the extensible KV cache off (--no-enable-extensible-kv-cache), gmu 0.95: the"
            " 0.33 behaviour is kept, the gmu alternative 0.92 with it."
        )
        not_fires = []
    write(
        name,
        {
            "vllm.log": log.text(),
            "cmdline.txt": cmd + "\n",
            "nvidia-smi.txt": b.smi("NVIDIA H100 80GB HBM3", 1, 81559, []),
            "config.json": json.dumps(QWEN3_32B, indent=1) + "\n",
        },
        {
            "fires": ["sampler-warmup-oom"],
            "not_fires": not_fires,
            "flags": {"sampler-warmup-oom": flags},
            "note": note,
        },
    )


QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

LOAD_FRAMES = [
    ("v1/worker/gpu/model_runner.py", 330, "load_model", "self.model = model_loader.load_model("),
    (
        "model_executor/model_loader/base_loader.py",
        56,
        "load_model",
        "self.load_weights(model, model_config)",
    ),
    ("model_executor/models/llama.py", 640, "load_weights", "return loader.load_weights(weights)"),
]


def weights_70b_034() -> None:
    """Llama-3.3-70B bf16 on one of two H100s, gmu unset (ext): the load OOMs with load_weights frames."""
    log = b.Log("12-07")
    log.banner(
        3501,
        "0.34.0",
        "meta-llama/Llama-3.3-70B-Instruct",
        "{'model_tag': 'meta-llama/Llama-3.3-70B-Instruct', 'max_model_len': 32768}",
    )
    log.engine(3510, "0.34.0", "meta-llama/Llama-3.3-70B-Instruct", 32768)
    log.add("EngineCore", 3510, b.BACKEND, src="cuda.py:549")
    log.add(
        "EngineCore",
        3510,
        "Starting to load model meta-llama/Llama-3.3-70B-Instruct...",
        src="model_runner.py:301",
    )
    traceback(log, 3510, LOAD_FRAMES, torch_oom(448, 79.19, 212.0, 3510, 78.97, 78.41))
    smi = b.smi("NVIDIA H100 80GB HBM3", 4, 81559, [])
    row = smi.splitlines()[8:12]
    gpu1 = [x.replace("|   0  ", "|   1  ").replace("00000000:19:00.0", "00000000:2A:00.0") for x in row]
    lines = smi.splitlines()
    smi = "\n".join([*lines[:12], *gpu1, *lines[12:]]) + "\n"
    write(
        "k2-v34-70b-tp1-load-oom",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve meta-llama/Llama-3.3-70B-Instruct --max-model-len 32768\n",
            "nvidia-smi.txt": smi,
            "config.json": json.dumps(LLAMA_70B, indent=1) + "\n",
        },
        {
            "fires": ["weights-not-sharded"],
            "not_fires": ["gpu-shared-with-foreign-process", "shared-gpu-gmu-unset"],
            "flags": {"weights-not-sharded": {"--tensor-parallel-size": ["2"]}},
            "note": "spec/vllm-0.34.md §2 weights-not-sharded on 0.34 (gmu unset, extensible): Llama-3.3-70B bf16"
            " (131 GiB) on one H100 beside an empty one; the load is a plain torch OOM with load_weights frames (the"
            " 0.33 'Failed to load model' wrapper is gone). Budget min(u × T, F0) − 1 GiB = 78.2 GiB; TP 2 holds"
            " 65.7 GiB of weights and one 32,768-token request per GPU. No 'lower gmu' advice (it frees nothing"
            " while loading on 0.34). The engine's own memory is never a foreign process.",
        },
    )


LLAMA_70B = {
    **b.LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}


WARMUP_MM_FRAMES = [
    (
        "v1/worker/gpu_worker.py",
        1140,
        "compile_or_warm_up_model",
        "self.model_runner.run_kv_cache_sizing_warmup()",
    ),
    ("v1/worker/gpu/warmup.py", 214, "run_kv_cache_sizing_warmup", "self._warmup_step(batch)"),
    (
        "v1/worker/gpu/warmup.py",
        171,
        "_warmup_step",
        "self.runner.execute_model(scheduler_output, dummy_run=True)",
    ),
    (
        "v1/worker/gpu/model_runner.py",
        1602,
        "execute_model",
        "mm_embeds = self.encoder_runner.execute_mm_encoder(",
    ),
    (
        "v1/worker/gpu/mm/encoder_runner.py",
        160,
        "execute_mm_encoder",
        "outputs = model.embed_multimodal(**mm_kwargs)",
    ),
    (
        "model_executor/models/qwen2_vl.py",
        1402,
        "_process_image_input",
        "image_embeds = self.visual(pixel_values, grid_thw=grid_thw)",
    ),
    (
        "model_executor/models/qwen2_vl.py",
        381,
        "forward",
        "attn_output = self.attn(q, k, v, cu_seqlens=cu_seqlens)",
    ),
]
ENCODER_BUDGET = (
    "Encoder cache will be initialized with a budget of 16384 tokens, and profiled with 1 image items of the maximum"
    " feature size."
)


def mm_warmup_034() -> None:
    """Qwen2-VL-7B on one L4 on 0.34 (gmu unset, extensible): profiling passed, the KV-sizing
    warm-up reaches an encoder batch of four worst-case images and OOMs (gpu_worker.py:1024-1027)."""
    log = b.Log("12-07")
    log.banner(
        3601,
        "0.34.0",
        "Qwen/Qwen2-VL-7B-Instruct",
        "{'model_tag': 'Qwen/Qwen2-VL-7B-Instruct', 'max_model_len': 32768, 'limit_mm_per_prompt': {'image': 4}}",
    )
    log.engine(3610, "0.34.0", "Qwen/Qwen2-VL-7B-Instruct", 32768)
    log.add("EngineCore", 3610, b.BACKEND, src="cuda.py:549")
    log.add("EngineCore", 3610, LOADING % "15.52", src="model_runner.py:441")
    log.add("EngineCore", 3610, ENCODER_BUDGET, src="encoder_runner.py:132")
    log.add("EngineCore", 3610, b.AVAILABLE % "3.86", src="gpu_worker.py:795")
    log.add("EngineCore", 3610, b.GRAPHS % (7, 0.31), src="model_runner.py:1216")
    traceback(log, 3610, WARMUP_MM_FRAMES, torch_oom(5998, 22.05, 2310.0, 3610, 19.79, 18.92))
    write(
        "k2-v34-mm-warmup-oom",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve Qwen/Qwen2-VL-7B-Instruct --max-model-len 32768 --limit-mm-per-prompt"
            " '{\"image\":4}'\n",
            "nvidia-smi.txt": b.smi("NVIDIA L4", 0, 23034, []),
        },
        {
            "fires": ["multimodal-profile-oom"],
            "not_fires": ["prefill-burst-oom", "sampler-warmup-oom", "torch-cap-oom", "long-request-spike"],
            "flags": {"multimodal-profile-oom": {"--limit-mm-per-prompt": ['{"image":1}']}},
            "note": "spec/vllm-0.34.md §2 multimodal-profile-oom: on the extensible KV cache the sizing warm-up reaches"
            " encoder batches that profiling does not (gpu_worker.py:1024-1027), so the OOM comes from warm-up frames"
            " (run_kv_cache_sizing_warmup) after graph capture, not from profile_run. Still a startup OOM of the"
            " multimodal worst case, never a run-time OOM.",
        },
    )


LLAMA_3B = {
    **b.LLAMA_8B,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
}


def fp8_preflight(name: str, gpu: str, total_mib: int, dtype: str, expected: dict) -> None:
    """A launch checked before it runs (cmdline.txt + nvidia-smi.txt, no log): the fp8 KV-cache
    forms a GPU's attention backends take (issue 24 kind 6)."""
    cmd = f"vllm serve meta-llama/Llama-3.2-3B-Instruct --max-model-len 32768 --kv-cache-dtype {dtype}"
    write(
        name,
        {
            "cmdline.txt": cmd + "\n",
            "nvidia-smi.txt": b.smi(gpu, 0, total_mib, []),
            "config.json": json.dumps(LLAMA_3B, indent=1) + "\n",
        },
        expected,
    )


def v0_namespace_70b() -> None:
    """vLLM 0.6.3 (V0): Llama-3.1-70B on one of four A100-80GB, gmu 0.85 only in the log's
    'args: Namespace(…)' (no launch command): the load OOMs while the other GPUs are empty."""
    day = "10-14 12:00"
    lines = [
        f"INFO {day}:01 api_server.py:528] vLLM API server version 0.6.3.post1",
        f"INFO {day}:01 api_server.py:529] args: Namespace(host=None, port=8000, model='meta-llama/Llama-3.1-70B-Instruct',"
        " max_model_len=8192, gpu_memory_utilization=0.85, tensor_parallel_size=1, pipeline_parallel_size=1)",
        f"INFO {day}:02 api_server.py:179] Started engine process with PID 77",
        f"INFO {day}:08 llm_engine.py:237] Initializing an LLM engine (v0.6.3.post1) with config:"
        " model='meta-llama/Llama-3.1-70B-Instruct', dtype=torch.bfloat16, max_seq_len=8192, tensor_parallel_size=1,"
        " pipeline_parallel_size=1, enforce_eager=False, kv_cache_dtype=auto",
        f"INFO {day}:09 model_runner.py:1056] Starting to load model meta-llama/Llama-3.1-70B-Instruct...",
        "Process SpawnProcess-1:",
        "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/worker/model_runner.py", line 1058, in load_model',
        "    self.model = get_model(model_config=self.model_config,",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/loader.py", line 402, in'
        " load_model",
        "    model.load_weights(self._get_all_weights(model_config, model))",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB. GPU 0 has a total capacity of 79.25"
        " GiB of which 301.69 MiB is free. Process 77 has 78.94 GiB memory in use. Of the allocated memory 78.42 GiB is"
        " allocated by PyTorch, and 14.17 MiB is reserved by PyTorch but unallocated.",
    ]
    smi = b.smi("NVIDIA A100-SXM4-80GB", 4, 81920, [])
    rows = smi.splitlines()
    block = rows[8:12]
    extra = [
        x.replace("|   0  ", f"|   {i}  ").replace("00000000:19:00.0", f"00000000:{0x19 + i:02X}:00.0")
        for i in (1, 2, 3)
        for x in block
    ]
    smi = "\n".join([*rows[:12], *extra, *rows[12:]]) + "\n"
    write(
        "k2-v0-namespace-gmu-70b-unsharded",
        {
            "vllm.log": "\n".join(lines) + "\n",
            "nvidia-smi.txt": smi,
            "config.json": json.dumps({**LLAMA_70B, "max_position_embeddings": 131072}, indent=1) + "\n",
        },
        {
            "fires": ["weights-not-sharded"],
            "not_fires": ["gpu-shared-with-foreign-process", "orphaned-engine-processes"],
            "flags": {"weights-not-sharded": {"--tensor-parallel-size": ["4"]}},
            "note": "Issue 24 kind 3: a V0 engine (0.6.3) whose gmu 0.85 is only in 'args: Namespace(…)'. The evidence"
            " gives the gmu in effect (0.85, not the version's default 0.9); the engine's own 78.94 GiB while loading is"
            " never a foreign process.",
        },
    )


def int8_kv_034() -> None:
    """The seed int8 case (tests/data/cases/seed-int8-kv-dtype) on 0.34: KV_CACHE_DTYPES is identical to
    0.33 (config/cache.py:44-73), so the refusal and its fix are too."""
    src = HERE / "cases" / "seed-int8-kv-dtype"
    files = {n: (src / n).read_text() for n in ("cmdline.txt", "config.json", "nvidia-smi.txt", "vllm.log")}
    files["vllm.log"] = files["vllm.log"].replace("version 0.33.0", "version 0.34.0")
    write(
        "k2-v34-int8-kv-dtype",
        files,
        {
            "fires": ["invalid-kv-cache-dtype"],
            "not_fires": ["weights-not-sharded", "kv-budget-exhausted", "max-model-len-exceeds-kv-capacity"],
            "flags": {"invalid-kv-cache-dtype": {"--kv-cache-dtype": ["int8_per_token_head", "fp8_e5m2"]}},
            "note": "spec/vllm-0.34.md §2 invalid-kv-cache-dtype (unchanged on 0.34): the seed int8 case with a 0.34"
            " banner. On its two A100s (Ampere) an fp8 suggestion could only be fp8_e5m2.",
        },
    )


def main() -> None:
    gb10(
        "k2-v34-unified-gb10-gmu-unset",
        None,
        {
            "fires": ["unified-memory-gmu-unset"],
            "not_fires": ["shared-gpu-gmu-unset", "gpu-shared-with-foreign-process"],
            "flags": {"unified-memory-gmu-unset": {"--gpu-memory-utilization": ["0.90"]}},
            "note": "spec/vllm-0.34.md §3.6 (N6): DGX Spark (GB10, 119.70 GiB unified memory) on 0.34 with gmu unset:"
            " the KV cache takes all the host's available memory but μ + kept. Fix: gmu = floor_0.01((T − max(8 GiB,"
            " 0.1 T))/T) = 0.90, which still holds the weights and one 131,072-token request.",
        },
    )
    gb10(
        "k2-v34-unified-gb10-gmu-set-near-miss",
        0.85,
        {
            "fires": [],
            "not_fires": ["unified-memory-gmu-unset"],
            "note": "N6 near miss: the same DGX Spark engine with --gpu-memory-utilization 0.85 (vLLM's cap WARNING"
            " logged): the host keeps its memory.",
        },
    )
    runner_env_1()
    cpu_offload_034()
    sampler_034("k2-v34-sampler-warmup-oom-frames", ext=True)
    sampler_034("k2-v34-estimate-sampler-warmup-oom-keeps-gmu", ext=False)
    weights_70b_034()
    mm_warmup_034()
    v0_namespace_70b()
    int8_kv_034()
    fp8_preflight(
        "k2-fp8-kv-a100-e4m3-use-e5m2",
        "NVIDIA A100-SXM4-80GB",
        81920,
        "fp8",
        {
            "fires": ["invalid-kv-cache-dtype"],
            "flags": {"invalid-kv-cache-dtype": {"--kv-cache-dtype": ["fp8_e5m2"]}},
            "note": "Issue 24 kind 6: an A100 (Ampere, compute capability 8.0) takes an fp8 KV cache as fp8_e5m2;"
            " 'fp8' (e4m3) needs native fp8 (≥ 8.9). The fix is fp8_e5m2 (still half the KV bytes), not auto.",
        },
    )
    fp8_preflight(
        "k2-fp8-kv-a100-e5m2-near-miss",
        "NVIDIA A100-SXM4-80GB",
        81920,
        "fp8_e5m2",
        {
            "fires": [],
            "not_fires": ["invalid-kv-cache-dtype"],
            "note": "Issue 24 kind 6 near miss: fp8_e5m2 KV cache on an A100 is valid (Ampere converts e5m2).",
        },
    )
    fp8_preflight(
        "k2-fp8-kv-t4-refused",
        "Tesla T4",
        15360,
        "fp8_e5m2",
        {
            "fires": ["invalid-kv-cache-dtype"],
            "flags": {"invalid-kv-cache-dtype": {"--kv-cache-dtype": ["auto"]}},
            "note": "Issue 24 kind 6: a T4 (Turing, compute capability 7.5) has no fp8 KV-cache kernel in vLLM's"
            " attention backends, e5m2 included: auto.",
        },
    )


if __name__ == "__main__":
    main()
