#!/usr/bin/env python3
"""Writes the vLLM 0.34 test bundles of this directory from the 0.34 format strings of
reference/vllm-facts.md §9 (the message templates are copied from there verbatim, %-formatted as
vLLM's logger does) and the arithmetic of its §9.2 and spec/vllm-0.34.md §3.2 worked examples.

Run from anywhere: ``python tests/data/bundles-034/build.py``. Each bundle gets the files a
support bundle has (vllm.log, cmdline.txt, nvidia-smi.txt, optionally env.txt, config.json and
metrics/) plus ``expected_vars.json``: derive variables tests/test_vllm034.py checks, and
``expected.json`` (spec/bundle.md) with what spec/vllm-0.34.md asks of the rules.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
GiB = 2**30
MiB = 2**20

# --- vllm-facts §9 format strings (verbatim) -----------------------------------------------------
AFTER_WARMUP = (
    "Memory after warmup: %s GiB free, %s GiB committed to the KV cache, %s GiB kept for transient "
    "activations (%s GiB allocated at peak, %s GiB of torch reservation growth); %d KV cache blocks (%s GiB) "
    "fit within the requested %s GiB. Torch may reserve up to %s GiB."
)
EXTENDED = "Extended KV cache to %d blocks (%.2f GiB)."
GMU_CAP = (
    "gpu_memory_utilization=%s caps this instance at %s GiB, keeping %s GiB of free device memory out of the "
    "KV cache. The extensible KV cache is sized from the memory measured after warmup and CUDA graph capture, "
    "so vLLM's own use needs no headroom below 1.0. Leave gpu_memory_utilization unset unless it leaves room "
    "for memory vLLM does not measure: other processes sharing the GPU (including ones that allocate on it "
    "later), the CPU on a unified-memory device, weight transfer buffers for weight updates, or a KV "
    "connector's own device buffers."
)
DISABLING = (
    "Disabling the extensible KV cache: %s. The KV cache will be sized from profiling estimates instead of "
    "measured memory."
)
AVAILABLE = "Available KV cache memory: %s GiB"
BACKEND = (
    "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', "
    "'FLEX_ATTENTION']."
)
GRAPHS = "Graph capturing finished in %.0f secs, took %.2f GiB"
CAPACITY = "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
TO_SERVE = (
    "To serve at least one request with the model's max seq len (%d), (%s GiB KV cache is needed, which is "
    "larger than the available KV cache memory (%s GiB). Based on the available memory, the estimated maximum "
    "model length is %d. %s Decreasing `max_model_len` also reduces what is needed. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
H3_AFTER = (
    "The extensible KV cache already takes all device memory left after the model, its activations, CUDA "
    "graphs and warmup; decrease `max_model_len` or `max_num_seqs`, or the model needs a device with more "
    "memory. CUDA graphs take less with fewer or smaller capture sizes in the compilation config."
)
FREE_BELOW = (
    "Free memory on device %s (%s/%s GiB) on startup is less than desired GPU memory utilization (%s, %s GiB). "
    "Decrease GPU memory utilization or reduce GPU memory used by other processes."
)
V1_REMOVED = "VLLM_USE_V2_MODEL_RUNNER=%s is no longer supported: Model Runner V1 has been removed. Unset this variable."
KV_RESERVED = (
    "Initial free memory %s GiB, reserved %s GiB memory for KV Cache as specified by kv_cache_memory_bytes "
    "config and skipped memory profiling. This does not respect the gpu_memory_utilization config. Only use "
    "kv_cache_memory_bytes config when you want manual control of KV cache memory size. If OOM'ed, check the "
    "difference of initial free memory between the current run and the previous run where "
    "kv_cache_memory_bytes is suggested and update it correspondingly."
)


def gib(nbytes_or_mib: float, *, mib: bool = True) -> str:
    """vLLM's ``format_gib``: GiB rounded to 2 decimals, printed as Python prints the float."""
    x = nbytes_or_mib * MiB if mib else nbytes_or_mib
    return str(round(x / GiB, 2))


def cap_tokens(n: int, mml: int, block: int) -> tuple[int, float]:
    conc = n / -(-mml // block)
    return int(conc * mml), conc


class Log:
    def __init__(self, day: str) -> None:
        self.day = day
        self.lines: list[str] = []
        self.sec = 0

    def add(self, proc: str, pid: int, msg: str, level: str = "INFO", src: str = "x.py:1") -> None:
        self.sec += 1
        t = f"{self.day} 10:{self.sec // 60:02d}:{self.sec % 60:02d}"
        self.lines.append(f"({proc} pid={pid}) {level} {t} [{src}] {msg}")

    def raw(self, text: str) -> None:
        self.lines.extend(text.splitlines())

    def banner(self, api: int, version: str, model: str, args: str) -> None:
        self.add("APIServer", api, f"vLLM API server version {version}", src="api_server.py:1")
        self.add("APIServer", api, f"non-default args: {args}", src="startup.py:96")

    def engine(self, core: int, version: str, model: str, mml: int, extra: str = "") -> None:
        self.add(
            "EngineCore",
            core,
            f"Initializing a V1 LLM engine (v{version}) with config: model='{model}', dtype=torch.bfloat16, "
            f"max_seq_len={mml}, tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=False, "
            f"kv_cache_dtype=auto{extra}",
            src="core.py:153",
        )

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def smi(name: str, used_mib: int, total_mib: int, procs: list[tuple[int, str, int]]) -> str:
    rows = "\n".join(
        f"|    0   N/A  N/A         {pid:8d}      C   {n:<34}{u:>7}MiB |" for pid, n, u in procs
    ) or ("|  No running processes found                                                             |")
    return f"""Mon Dec  7 10:30:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.82.09              Driver Version: 580.82.09      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  {name:<32}On  |   00000000:19:00.0 Off |                    0 |
| N/A   33C    P0             72W /  700W | {used_mib:>7}MiB / {total_mib:>6}MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+

+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
{rows}
+-----------------------------------------------------------------------------------------+
"""


LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA_70B_FP8 = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}
HEALTHY_TRAFFIC = (
    "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
    "Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%"
)


def write(name: str, files: dict[str, str], expected_vars: dict, expected: dict) -> None:
    d = HERE / name
    d.mkdir(exist_ok=True)
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (d / "expected_vars.json").write_text(json.dumps(expected_vars, indent=1) + "\n")
    (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def gmu09_cap_warning() -> None:
    """§9.2's engine (Llama-3.1-8B, one H100) with an explicit --gpu-memory-utilization 0.9."""
    # MiB: T 81,090; F0 80,530; C 16,000; P 1,400; graphs 576; other growth 150; Tr 1,700; Gr 1,900
    r = 72981  # ceil(0.9 × T)
    a = r - 16000 - 1400  # 55,581: the reservation
    k = (r - 16726) - 1900  # 54,355 (R − U is the smaller bound)
    n = (k // 64) * 8  # 849 granule steps of 64 MiB (32 layers × 2 MiB) → 6,792 blocks of 8 MiB
    pool = n * 8  # 54,336 MiB
    left = 63740 - (pool - 64) - 512  # 8,956
    cap = 16100 + left
    tokens, conc = cap_tokens(n, 131072, 64)
    log = Log("12-07")
    log.banner(2041, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct",
               "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct', 'gpu_memory_utilization': 0.9}")  # fmt: skip
    log.engine(2187, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct", 131072)
    log.add("EngineCore", 2187, BACKEND, src="cuda.py:549")
    log.add(
        "EngineCore",
        2187,
        "Model loading took 14.99 GiB memory and 5.604417 seconds",
        src="model_runner.py:441",
    )
    log.add("EngineCore", 2187, AVAILABLE % gib(a), src="gpu_worker.py:795")
    log.add("EngineCore", 2187, GRAPHS % (9, 576 / 1024), src="model_runner.py:1216")
    log.add(
        "EngineCore", 2187, GMU_CAP % ("0.9", gib(r), gib(60629 - k)), "WARNING", "extensible_kv_cache.py:650"
    )
    log.add("EngineCore", 2187,
            AFTER_WARMUP % (gib(63740), gib(64), gib(1900), gib(1700), gib(1900), n, gib(pool), gib(r), gib(cap)),
            src="extensible_kv_cache.py:693")  # fmt: skip
    log.add(
        "EngineCore",
        2187,
        CAPACITY % ("GPU", f"{tokens:,}", f"{131072:,}", conc),
        src="kv_cache_utils.py:1168",
    )
    log.add("EngineCore", 2187, EXTENDED % (n, pool / 1024), src="extensible_kv_cache.py:536")
    log.add(
        "EngineCore",
        2187,
        "init engine (profile, create kv cache, warmup model) took 50.62 s",
        src="core.py:450",
    )
    log.add("APIServer", 2041, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
    log.add("APIServer", 2041, HEALTHY_TRAFFIC, src="loggers.py:336")
    free = 63804 - pool  # Hd − pool
    used = 81559 - free
    write(
        "v34-ext-gmu09-explicit-cap-warning",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve meta-llama/Llama-3.1-8B-Instruct --gpu-memory-utilization 0.9\n",
            "nvidia-smi.txt": smi(
                "NVIDIA H100 80GB HBM3", used, 81559, [(2187, "VLLM::EngineCore", used - 12)]
            ),
            "config.json": json.dumps(LLAMA_8B, indent=1) + "\n",
        },
        {
            "vllm_v34": True,
            "vllm_sizing_mode": "extensible",
            "vllm_sizing_mode_assumed": False,
            "gmu": 0.9,
            "gmu_explicit": True,
            "gmu_resolved": 0.9,
            "block_size": 64,
            "gmu_cap_warning": True,
            "gmu_cap_withheld_bytes": round(round((60629 - k) / 1024, 2) * GiB),
            "kv_pool_blocks": n,
            "kv_block_bytes": 8 * MiB,
            "kv_reservation_bytes": round(round(a / 1024, 2) * GiB),
            "kv_memory_for_pool_bytes": n * 8 * MiB,
            "warmup_blocks_per_rank": [n],
            "max_model_len_fit_pool": 131072,
            "kv_hint": None,
            "block_size_16_valid": True,
        },
        {
            "fires": [],
            "not_fires": [
                "gpu-shared-with-foreign-process",
                "kv-budget-exhausted",
                "cuda-graph-capture-oom",
                "max-model-len-exceeds-kv-capacity",
                "graphs-warmup-left-no-kv",
                "shared-gpu-gmu-unset",
            ],
            "flags": {},
            "max_health": "info",
            "note": (
                "vLLM 0.34 extensible, explicit gmu 0.9 on one H100 with nothing else on the GPU (vllm-facts §9.2 "
                f"last row): R = 72,981 MiB, K = 54,355 -> {n} blocks, vLLM's WARNING 'caps this instance at "
                f"{gib(r)} GiB, keeping {gib(60629 - k)} GiB … out of the KV cache'. Serving, idle. At most info: "
                "the gmu withholds KV memory but nothing fails (a rule may say so as info)."
            ),
        },
    )


def after_warmup_no_kv_70b() -> None:
    """spec/vllm-0.34.md §3.2 worked example: Llama-3.3-70B FP8 on one H100, --max-model-len 32768."""
    # MiB: T 81,090; F0 80,530; C 68,500; P 2,000; G 1,800; X 200; Tr 2,400; Gr 2,600; b = 20
    a = 81090 - 68500 - 2000  # 10,590
    n = 280
    f1 = 80530 - 68500 - 1800 - 200 - 160  # 9,870 (min commit 8 blocks = 160 MiB)
    reserved = 70300
    left = f1 - (n * 20 - 160) - 512
    cap = reserved + left
    log = Log("12-07")
    log.banner(1, "0.34.0", "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
               "{'model': 'RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic', 'max_model_len': 32768}")  # fmt: skip
    log.engine(88, "0.34.0", "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 32768, ", quantization=fp8")
    log.add(
        "EngineCore", 88, "Model loading took 67.72 GiB memory and 41.2 seconds", src="model_runner.py:441"
    )
    log.add("EngineCore", 88, AVAILABLE % gib(a), src="gpu_worker.py:795")
    log.add("EngineCore", 88, GRAPHS % (14, 1800 / 1024), src="model_runner.py:1216")
    log.add("EngineCore", 88,
            AFTER_WARMUP % (gib(f1), gib(160), gib(2600), gib(2400), gib(2600), n, gib(n * 20), gib(81090), gib(cap)),
            src="extensible_kv_cache.py:693")  # fmt: skip
    err = TO_SERVE % (32768, "10.0", gib((n - 1) * 20), (n - 1) * 64, H3_AFTER)
    log.add("EngineCore", 88, "EngineCore failed to start.", "ERROR", "core.py:1757")
    log.add("EngineCore", 88, "Traceback (most recent call last):", "ERROR", "core.py:1757")
    log.add("EngineCore", 88, '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_planning.py", line 1849, in shrink_kv_cache_configs', "ERROR", "core.py:1757")  # fmt: skip
    log.add("EngineCore", 88, f"ValueError: {err}", "ERROR", "core.py:1757")
    log.raw(f"ValueError: {err}")  # the API server re-raises it without a prefix
    log.raw(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
    )
    write(
        "v34-ext-70b-fp8-after-warmup-no-kv",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic --max-model-len 32768\n",
            "nvidia-smi.txt": smi("NVIDIA H100 80GB HBM3", 0, 81559, []),
            "config.json": json.dumps(LLAMA_70B_FP8, indent=1) + "\n",
        },
        {
            "vllm_v34": True,
            "vllm_sizing_mode": "extensible",
            "gmu": 1.0,
            "gmu_explicit": False,
            "block_size": 64,
            "kv_block_bytes": 20 * MiB,
            "kv_pool_blocks": n,
            "kv_hint": "H3",
            "kv_hint_error": "max_seq_len_exceeds_kv",
            "kv_error_after_warmup": True,
            "max_model_len_fit_pool": (n - 1) * 64,
            "mml_error_estimate": (n - 1) * 64,
            "kv_shortfall_bytes": 4660 * MiB,  # spec §3.2: S = 10,240 − 5,580 MiB
            "sampler_warmup_requests": 1024,  # min(max_num_seqs 1024 on an H100, 8192)
            "graph_capture_bytes": round(round(1800 / 1024, 2) * GiB),
            "warmup_margin_bytes": int(0.75 * round(round(2400 / 1024, 2) * GiB)),
        },
        {
            "fires": ["max-model-len-exceeds-kv-capacity", "graphs-warmup-left-no-kv"],
            "not_fires": [
                "kv-budget-exhausted",
                "cuda-graph-capture-oom",
                "gpu-shared-with-foreign-process",
                "shared-gpu-gmu-unset",
                "weights-not-sharded",
            ],
            "flags": {"max-model-len-exceeds-kv-capacity": {"--max-model-len": [16384, (n - 1) * 64]}},
            "note": (
                "spec/vllm-0.34.md §3.2 worked example: A = 10,590 MiB passes the pre-warm-up fit, the after-warm-up "
                f"pool is {n} blocks of 20 MiB; (N - 1) x 20 = 5,580 MiB < 10,240 needed; vLLM estimates "
                f"{(n - 1) * 64} (a multiple of 64). H3 after warm-up. No other process on the GPU."
            ),
        },
    )


def fallback_disabled_free_below() -> None:
    """0.34 whose VMM probe failed (WSL2): run-time fallback, then the 0.33 startup refusal."""
    log = Log("12-07")
    log.banner(1, "0.34.0", "Qwen/Qwen3-8B", "{'model': 'Qwen/Qwen3-8B'}")
    log.engine(140, "0.34.0", "Qwen/Qwen3-8B", 40960)
    log.add("EngineCore", 140, DISABLING % "cuMemCreate failed: CUDA_ERROR_NOT_SUPPORTED (operation not supported)",
            "WARNING", "abstract.py:175")  # fmt: skip
    log.add("EngineCore", 140, f"ValueError: {FREE_BELOW % ('cuda:0', '20.1', '23.99', '0.92', '22.07')}", "ERROR", "core.py:1757")  # fmt: skip
    write(
        "v34-fallback-disabled-free-below-util",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve Qwen/Qwen3-8B\n",
        },
        {
            "vllm_v34": True,
            "vllm_sizing_mode": "estimate",
            "vllm_sizing_mode_assumed": False,
            "extensible_disabled_reason": "cuMemCreate failed: CUDA_ERROR_NOT_SUPPORTED (operation not supported)",
            "gmu": 0.92,
            "gmu_explicit": False,
            "block_size": 64,
            "free_below_util": True,
            "fbu_gmu": 0.92,
            "kv_pool_bytes": None,
            "kv_reservation_bytes": None,
            "torch_cap_bytes": None,
        },
        {
            "fires": [],
            "not_fires": ["shared-gpu-gmu-unset", "graphs-warmup-left-no-kv", "torch-cap-oom"],
            "flags": {},
            "note": (
                "vLLM 0.34 that fell back from the extensible KV cache at run time ('Disabling the extensible KV "
                "cache: …'): the 0.33 rules apply, with gmu 0.92 resolved, and the startup refusal comes back "
                "(vllm-facts §9.1)."
            ),
        },
    )


def v1_runner_removed() -> None:
    log = Log("12-07")
    log.banner(1, "0.34.0", "Qwen/Qwen3-8B", "{'model': 'Qwen/Qwen3-8B', 'cpu_offload_gb': 10.0}")
    log.add("APIServer", 1, f"ValueError: {V1_REMOVED % '0'}", "ERROR", "interface.py:1480")
    write(
        "v34-v1-runner-env-removed",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "VLLM_USE_V2_MODEL_RUNNER=0 vllm serve Qwen/Qwen3-8B --cpu-offload-gb 10\n",
            "env.txt": "VLLM_USE_V2_MODEL_RUNNER=0\n",
        },
        {"vllm_v34": True, "v1_runner_env": "0", "v1_runner_removed_line": 3},
        {
            "fires": ["v1-runner-env-removed"],
            "not_fires": [],
            "flags": {},
            "note": "0.22-0.27 advice to force the V1 runner for --cpu-offload-gb is a startup ValueError on 0.34 (vllm-facts §9.4).",
        },
    )


def kv_cache_memory_bytes_estimate() -> None:
    log = Log("12-07")
    log.banner(2041, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct",
               "{'model': 'meta-llama/Llama-3.1-8B-Instruct', 'kv_cache_memory_bytes': 65435336704}")  # fmt: skip
    log.engine(2187, "0.34.0", "meta-llama/Llama-3.1-8B-Instruct", 131072)
    log.add(
        "EngineCore",
        2187,
        "Model loading took 14.99 GiB memory and 5.604417 seconds",
        src="model_runner.py:441",
    )
    log.add("EngineCore", 2187, KV_RESERVED % ("78.64", "60.94"), src="gpu_worker.py:695")
    n = 65435336704 // (8 * MiB)  # 7,800 blocks of 8 MiB
    tokens, conc = cap_tokens(n, 131072, 64)
    log.add(
        "EngineCore",
        2187,
        CAPACITY % ("GPU", f"{tokens:,}", f"{131072:,}", conc),
        src="kv_cache_utils.py:1168",
    )
    log.add(
        "EngineCore",
        2187,
        "init engine (profile, create kv cache, warmup model) took 31.2 s",
        src="core.py:450",
    )
    write(
        "v34-kv-cache-memory-bytes-estimate",
        {
            "vllm.log": log.text(),
            "cmdline.txt": "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-memory-bytes 65435336704\n",
            "config.json": json.dumps(LLAMA_8B, indent=1) + "\n",
        },
        {
            "vllm_v34": True,
            "vllm_sizing_mode": "estimate",
            "vllm_sizing_mode_source": "--kv-cache-memory-bytes overrides measured sizing",
            "gmu": 0.92,
            "block_size": 64,
            "kv_cache_memory_disables_extensible": True,
            "kv_reservation_bytes": None,
        },
        {
            "fires": ["vllm-kv-memory-suggestion-wrong"],
            "not_fires": [],
            "flags": {},
            "note": (
                "vLLM's own 0.34 suggestion (B2 of the §9.2 engine, 60.94 GiB) applied as --kv-cache-memory-bytes: "
                "it turned the extensible KV cache off (budget 0.92, startup check back, torch uncapped) and "
                "keeps 1,404 MiB for a measured 1,900 MiB transient (vllm-facts §9.6)."
            ),
        },
    )


def label_only_metrics() -> None:
    """Only a /metrics scrape: 0.34 told by the enable_extensible_kv_cache label alone."""
    page = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="64",cache_dtype="auto",enable_extensible_kv_cache="True",engine="0",gpu_memory_utilization="None",kv_cache_memory_bytes="None",num_gpu_blocks="7576"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.9
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
"""
    write(
        "v34-label-only-metrics",
        {"metrics/1796000000.txt": page, "config.json": json.dumps(LLAMA_8B, indent=1) + "\n"},
        {
            "vllm_v34": True,
            "vllm_version_known": False,
            "vllm_sizing_mode": "extensible",
            "vllm_sizing_mode_assumed": True,
            "extensible_configured": True,
            "gmu": 1.0,
            "gmu_explicit": False,
            "block_size": 64,
            "block_size_source": "cache_config_info",
            "kv_pool_blocks": 7576,
            "kv_pool_bytes": 7576 * 8 * MiB,
            "kv_padding_tokens_per_request": 31.5,
        },
        {
            "fires": [],
            "not_fires": ["gpu-shared-with-foreign-process"],
            "flags": {},
            "note": "label-only 0.34 engine",
        },
    )


if __name__ == "__main__":
    gmu09_cap_warning()
    after_warmup_no_kv_70b()
    fallback_disabled_free_below()
    v1_runner_removed()
    kv_cache_memory_bytes_estimate()
    label_only_metrics()
    print("written:", ", ".join(sorted(p.name for p in HERE.iterdir() if p.is_dir())))
