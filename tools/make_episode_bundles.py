"""Write the issue-24 kind-2 bundles (history vs now) of tests/data/bundles:

- ``e24-storm-ended-mid-bundle``: vLLM 0.33 on one L40S; 20 scrapes 15 s apart; a preemption
  storm in scrapes 5-10 (the counter +6 a scrape, KV 98-100 %, 10+ waiting) that ended 2.5 min
  before the bundle was taken: preemption-storm fires as history (info) and says when.
- ``e24-idle-engine-old-burst-in-log``: the same engine idle in every scrape (0 running, 0
  waiting, KV 0 %, counter flat) while the log's stats lines show an earlier burst (40 waiting
  at 99 % KV): no present-tense warning (max-num-seqs-exceeds-kv, preemption-storm silent).

    python tools/make_episode_bundles.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tests" / "data" / "bundles"
BASE = ROOT / "r23-max-num-seqs-512-preempting-l40s"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
T0 = 1773310800  # 2026-03-12 10:20:00 UTC
HEADER_LINES = 16  # r23's log up to "Application startup complete."


def scrape(running: int, waiting: int, kv: float, preemptions: int, prompt: int, gen: int) -> str:
    lab = f'engine="0",model_name="{MODEL}"'
    return "\n".join(
        [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            'gpu_memory_utilization="0.9",is_attention_free="False",kv_cache_max_concurrency="11.95",'
            'kv_cache_memory_bytes="None",kv_cache_size_tokens="195776",num_cpu_blocks="None",'
            'num_gpu_blocks="12236",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",'
            'sliding_window="None"} 1.0',
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {running}.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {waiting}.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{lab}}} {preemptions}.0",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {prompt}.0",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {gen}.0",
            "",
        ]
    )


def stats(t: int, running: int, waiting: int, pre: int, kv: float, prompt: float, gen: float) -> str:
    hh, mm, ss = (t - T0 + 10 * 3600 + 20 * 60) // 3600 % 24, (t - T0 + 20 * 60) // 60 % 60, (t - T0) % 60
    return (
        f"(APIServer pid=1) INFO 03-12 {hh:02d}:{mm:02d}:{ss:02d} [loggers.py:335] Engine 000: Avg prompt"
        f" throughput: {prompt:.1f} tokens/s, Avg generation throughput: {gen:.1f} tokens/s, Running:"
        f" {running} reqs, Waiting: {waiting} reqs, Preemptions: {pre}, GPU KV cache usage: {kv * 100:.1f}%,"
        " Prefix cache hit rate: 12.0%"
    )


def start(name: str) -> tuple[Path, list[str]]:
    out = ROOT / name
    if out.exists():
        shutil.rmtree(out)
    (out / "metrics").mkdir(parents=True)
    for f in ("cmdline.txt", "nvidia-smi.txt"):
        shutil.copy(BASE / f, out / f)
    # vLLM's default max_num_seqs: the limit is not the user's
    (out / "cmdline.txt").write_text(
        f"vllm serve {MODEL} --max-model-len 16384 --gpu-memory-utilization 0.9\n"
    )
    head = (BASE / "vllm.log").read_text().splitlines()[:HEADER_LINES]
    head = [ln.replace(", 'max_num_seqs': 512", "") for ln in head]
    return out, head


def storm() -> None:
    out, log = start("e24-storm-ended-mid-bundle")
    pre, prompt, gen = 120, 9_000_000, 2_000_000
    for i in range(20):
        t = T0 + 15 * i
        if 5 <= i <= 10:
            running, waiting, kv = 178, 12 + i, 0.98 + 0.002 * (i - 5)
            pre += 6
            dpre = 6
        else:
            running, waiting, kv = (120 if i < 5 else 110), 0, (0.61 if i < 5 else 0.55)
            dpre = 0
        prompt += 60_000
        gen += 42_000
        (out / "metrics" / f"{t}.txt").write_text(scrape(running, waiting, kv, pre, prompt, gen))
        log.append(stats(t, running, waiting, dpre, kv, 4000.0, 2800.0))
    (out / "vllm.log").write_text("\n".join(log) + "\n")
    (out / "expected.json").write_text(
        json.dumps(
            {
                "fires": ["preemption-storm"],
                "not_fires": ["max-num-seqs-exceeds-kv", "swap-preemption-stall"],
                "flags": {},
                "note": "Issue 24 kind 2 (forensic): vLLM 0.33, Llama-3.1-8B on one L40S (195,776 KV tokens), 20 scrapes"
                " 15 s apart. Scrapes 5-10 (10:21:15-10:22:30 UTC) are a preemption storm: the counter rises 6 a"
                " scrape (36 in 90 s, 24/min) at 98-100 % KV with 17-22 waiting; then 135 s of calm (KV 55 %,"
                " nothing waiting, counter flat) before the bundle was taken. The 60 s window alone shows no"
                " storm; the whole series does: preemption-storm fires as info, past tense, with when.",
            },
            indent=2,
        )
        + "\n"
    )


def idle() -> None:
    out, log = start("e24-idle-engine-old-burst-in-log")
    # an earlier burst, two hours before: stats lines with a queue at a full cache
    for i in range(6):
        log.append(stats(T0 - 7200 + 10 * i, 180, 40, 0, 0.99, 4300.0, 2700.0))
    log.append(stats(T0 - 7140, 0, 0, 0, 0.0, 0.0, 0.0))
    for i in range(8):
        t = T0 + 15 * i
        (out / "metrics" / f"{t}.txt").write_text(scrape(0, 0, 0.0, 120, 9_000_000, 2_000_000))
    (out / "vllm.log").write_text("\n".join(log) + "\n")
    (out / "expected.json").write_text(
        json.dumps(
            {
                "fires": [],
                "not_fires": ["max-num-seqs-exceeds-kv", "preemption-storm", "long-request-spike"],
                "flags": {},
                "note": "Issue 24 kind 2 (near miss): the engine of e24-storm-ended-mid-bundle idle in every scrape (0"
                " running, 0 waiting, KV 0 %, preemption counter flat at 120), while the log holds stats lines of"
                " a burst two hours earlier (40 waiting at 99 % KV). Those lines are history: no present-tense"
                " 'requests wait while the KV cache is 0% full' warning.",
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    storm()
    idle()
