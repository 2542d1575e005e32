"""Write the N4 ``torch-cap-oom`` bundles of tests/data/bundles (spec/vllm-0.34.md §3.4), from
vllm-facts §9's format strings and the F§9.2 engine (Llama-3.1-8B on one H100, gmu unset,
extensible KV cache: 7576 blocks of 64 tokens, 59.19 GiB committed, torch cap L = 18.34 GiB):

- ``v34-torch-cap-oom-prefill``: a run-time OOM whose text carries ``18.34 GiB allowed;`` while
  3.02 GiB are free, during a prefill-heavy step: fires (Δ = 17.60 + 0.40 + 1.50 − 18.34 =
  1.16 GiB → --max-num-batched-tokens 4096, or --gpu-memory-utilization 0.97).
- ``v34-torch-cap-oom-fragmentation-near-miss``: the same OOM, but the 0.25 GiB allocation fits
  the 0.40 GiB reserved-but-unallocated pool: allocator-fragmentation's, not this rule's.
- ``v34-estimate-runtime-oom-near-miss``: the same engine with ``--no-enable-extensible-kv-cache``
  (non-extensible: no torch cap) and an OOM without the allowed part: not this rule.

    python tools/make_torch_cap_bundles.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = ROOT / "bundles"
BASE = ROOT / "bundles-034" / "v34-ext-gmu09-explicit-cap-warning"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
A = "(APIServer pid=2041)"
E = "(EngineCore pid=2187)"


def log(extensible: bool, alloc: str, allowed: bool, attention: bool = False) -> str:
    lines = [
        f"{A} INFO 12-07 10:00:01 [api_server.py:1] vLLM API server version 0.34.0",
        f"{A} INFO 12-07 10:00:02 [startup.py:96] non-default args: {{'model_tag': '{MODEL}'"
        + ("" if extensible else ", 'enable_extensible_kv_cache': False")
        + "}",
        f"{E} INFO 12-07 10:00:03 [core.py:153] Initializing a V1 LLM engine (v0.34.0) with config: model='{MODEL}',"
        " dtype=torch.bfloat16, max_seq_len=131072, tensor_parallel_size=1, pipeline_parallel_size=1,"
        " enforce_eager=False, kv_cache_dtype=auto",
        f"{E} INFO 12-07 10:00:04 [cuda.py:549] Using FLASH_ATTN attention backend out of potential backends:"
        " ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].",
        f"{E} INFO 12-07 10:00:05 [model_runner.py:441] Model loading took 14.99 GiB memory and 5.604417 seconds",
    ]
    if extensible:
        lines += [
            f"{E} INFO 12-07 10:00:06 [gpu_worker.py:795] Available KV cache memory: 62.84 GiB",
            f"{E} INFO 12-07 10:00:07 [model_runner.py:1216] Graph capturing finished in 9 secs, took 0.56 GiB",
            f"{E} INFO 12-07 10:00:09 [extensible_kv_cache.py:693] Memory after warmup: 62.25 GiB free, 0.06 GiB"
            " committed to the KV cache, 1.86 GiB kept for transient activations (1.66 GiB allocated at peak,"
            " 1.86 GiB of torch reservation growth); 7576 KV cache blocks (59.19 GiB) fit within the requested"
            " 79.19 GiB. Torch may reserve up to 18.34 GiB.",
            f"{E} INFO 12-07 10:00:10 [kv_cache_utils.py:1168] GPU KV cache size: 484,800 tokens, Maximum"
            " concurrency for 131,072 tokens per request: 3.70x",
            f"{E} INFO 12-07 10:00:11 [extensible_kv_cache.py:536] Extended KV cache to 7576 blocks (59.19 GiB).",
        ]
        free, inuse = "3.02 GiB", "76.10 GiB"
    else:
        lines += [
            f"{E} WARNING 12-07 10:00:05 [extensible_kv_cache.py:214] Disabling the extensible KV cache:"
            " --no-enable-extensible-kv-cache was given.",
            f"{E} INFO 12-07 10:00:06 [gpu_worker.py:795] Available KV cache memory: 54.28 GiB",
            f"{E} INFO 12-07 10:00:07 [kv_cache_utils.py:1168] GPU KV cache size: 444,608 tokens, Maximum"
            " concurrency for 131,072 tokens per request: 3.39x",
            f"{E} INFO 12-07 10:00:08 [model_runner.py:1216] Graph capturing finished in 9 secs, took 0.56 GiB",
        ]
        free, inuse = "0.31 GiB", "78.80 GiB"
    lines += [
        f"{E} INFO 12-07 10:00:12 [core.py:450] init engine (profile, create kv cache, warmup model) took 50.62 s",
        f"{A} INFO 12-07 10:00:13 [entry.py:139] Starting vLLM server on http://0.0.0.0:8000",
        f"{A} INFO 12-07 10:30:14 [loggers.py:336] Engine 000: Avg prompt throughput: 21480.0 tokens/s, Avg"
        " generation throughput: 610.2 tokens/s, Running: 24 reqs, Waiting: 6 reqs, GPU KV cache usage: 41.0%,"
        " Prefix cache hit rate: 3.0%",
        f"{E} ERROR 12-07 10:30:19 [core.py:1102] EngineCore encountered a fatal error.",
        f"{E} ERROR 12-07 10:30:19 [core.py:1102] Traceback (most recent call last):",
        f'{E} ERROR 12-07 10:30:19 [core.py:1102]   File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu/model_runner.py", line 1488, in execute_model',
        f"{E} ERROR 12-07 10:30:19 [core.py:1102]     hidden_states = self.model(",
    ]
    if attention:
        lines += [
            f'{E} ERROR 12-07 10:30:19 [core.py:1102]   File "/usr/local/lib/python3.12/dist-packages/vllm/v1/attention/backends/flash_attn.py", line 702, in forward',
            f"{E} ERROR 12-07 10:30:19 [core.py:1102]     flash_attn_varlen_func(",
        ]
    else:
        lines += [
            f'{E} ERROR 12-07 10:30:19 [core.py:1102]   File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/layers/activation.py", line 98, in forward_cuda',
            f"{E} ERROR 12-07 10:30:19 [core.py:1102]     out = torch.empty(output_shape, dtype=x.dtype, device=x.device)",
        ]
    lines += [
        f"{E} ERROR 12-07 10:30:19 [core.py:1102] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
        f" {alloc}. GPU 0 has a total capacity of 79.19 GiB of which {free} is free. Including non-PyTorch memory,"
        f" this process has {inuse} memory in use. "
        + ("18.34 GiB allowed; " if allowed else "")
        + "Of the allocated memory 17.60 GiB is allocated by PyTorch, and 0.40 GiB is reserved by PyTorch but"
        " unallocated. If reserved but unallocated memory is large try setting"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory"
        " Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
        f"{A} ERROR 12-07 10:30:19 [async_llm.py:541] EngineDeadError: EngineCore encountered an issue. See stack"
        " trace (above) for the root cause.",
    ]
    return "\n".join(lines) + "\n"


def write(name: str, cmd: str, text: str, expected: dict[str, object]) -> None:
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in ("config.json", "nvidia-smi.txt"):
        shutil.copy(BASE / f, out / f)
    (out / "cmdline.txt").write_text(cmd + "\n")
    (out / "vllm.log").write_text(text)
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


def main() -> None:
    write(
        "v34-torch-cap-oom-prefill",
        f"vllm serve {MODEL}",
        log(True, "1.50 GiB", True),
        {
            "fires": ["torch-cap-oom"],
            "not_fires": ["allocator-fragmentation", "shared-gpu-gmu-unset"],
            "flags": {
                "torch-cap-oom": {
                    "--max-num-batched-tokens": [4096, 4096],
                }
            },
            "note": "spec/vllm-0.34.md N4: the F§9.2 engine (Llama-3.1-8B, one H100, gmu unset, extensible: 7576"
            " blocks, L = 18.34 GiB) OOMs 30 min into serving a prefill-heavy step (21k prompt tokens/s): 'Tried to"
            " allocate 1.50 GiB … of which 3.02 GiB is free … 18.34 GiB allowed; … 17.60 GiB is allocated by"
            " PyTorch, and 0.40 GiB is reserved … but unallocated'. Δ = 17.60 + 0.40 + 1.50 − 18.34 = 1.16 GiB;"
            " --max-num-batched-tokens 8192 → 4096, or gmu floor_0.01((79.19 − 1.16 − 0.5)/79.19) = 0.97.",
        },
    )
    write(
        "v34-long-context-prefill-oom-at-cap",
        f"vllm serve {MODEL}",
        log(True, "1.50 GiB", True, attention=True),
        {
            "fires": ["long-context-prefill-oom", "torch-cap-oom"],
            "not_fires": ["allocator-fragmentation"],
            "flags": {"long-context-prefill-oom": {"--max-num-batched-tokens": [4096, 4096]}},
            "note": "spec/vllm-0.34.md long-context-prefill-oom row: the OOM of v34-torch-cap-oom-prefill, but in"
            " flash-attention during chunked prefill of a long context (max_model_len 131,072 ≥ 4 × 8192, log only:"
            " assumed). On the extensible cache P + A − B ≤ 0 (B = T), so E = 17.60 + 0.40 + 1.50 − 18.34 ="
            " 1.16 GiB past the torch cap; long-context-prefill-oom is the root cause and explains torch-cap-oom.",
        },
    )
    write(
        "v34-torch-cap-oom-fragmentation-near-miss",
        f"vllm serve {MODEL}",
        log(True, "256.00 MiB", True),
        {
            "fires": [],
            "not_fires": ["torch-cap-oom"],
            "flags": {},
            "note": "Near miss of v34-torch-cap-oom-prefill: the failed 0.25 GiB allocation fits the 0.40 GiB"
            " reserved-but-unallocated pool, so it is fragmentation (spec N4: 'not claimed … by"
            " allocator-fragmentation (A ≤ R_unalloc)'), not the cap.",
        },
    )
    write(
        "v34-estimate-runtime-oom-near-miss",
        f"vllm serve {MODEL} --no-enable-extensible-kv-cache",
        log(False, "1.50 GiB", False),
        {
            "fires": [],
            "not_fires": ["torch-cap-oom"],
            "flags": {},
            "note": "Near miss of v34-torch-cap-oom-prefill: vLLM 0.34 with --no-enable-extensible-kv-cache ('Disabling"
            " the extensible KV cache: …'): no torch cap, and the OOM has no allowed part. Not torch-cap-oom.",
        },
    )


if __name__ == "__main__":
    main()
