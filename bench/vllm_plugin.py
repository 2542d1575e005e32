#!/usr/bin/env python3
"""Cost of kvdoctor's in-process stat logger inside a vLLM engine (figures, not pass/fail).

vLLM calls ``record()`` once per engine step on its output-handling thread, so what it adds per
step is what matters; the rule evaluation runs every ``KVDOCTOR_VLLM_INTERVAL`` seconds. Prints,
in one process so the machine's state is shared:

- baseline: a Python call of the same signature that does nothing (median ns per call);
- ``record()`` between samples (fold the step's stats in), and with a Snapshot taken;
- one evaluation of the rules after one minute and after one hour of Snapshots at 1 s (the
  Doctor evaluates the last two windows only, so the cost should not grow with the run).

usage: .venv/bin/python bench/vllm_plugin.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdoctor.integrations import vllm as integ  # noqa: E402


def _config() -> Any:
    cache = SimpleNamespace(
        block_size=16, gpu_memory_utilization=0.9, cache_dtype="auto", num_gpu_blocks=20000
    )
    cache.metrics_info = lambda: {
        "block_size": "16",
        "num_gpu_blocks": "20000",
        "gpu_memory_utilization": "0.9",
    }
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", served_model_name="m", max_model_len=8192, dtype="bfloat16"),
        cache_config=cache,
        scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def _stats(i: int) -> tuple[Any, Any]:
    sched = SimpleNamespace(
        kv_cache_usage=0.5 + (i % 50) / 100,
        num_running_reqs=64,
        num_waiting_reqs=i % 7,
        prefix_cache_stats=SimpleNamespace(queries=128, hits=32),
    )
    fin = [SimpleNamespace(num_prompt_tokens=512, num_generation_tokens=256)] if i % 10 == 0 else []
    it = SimpleNamespace(
        num_preempted_reqs=i % 3 == 0, num_prompt_tokens=512, num_generation_tokens=64, finished_requests=fin
    )
    return sched, it


def per_call_ns(fn: Any, steps: int) -> float:
    args = [_stats(i) for i in range(steps)]
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for s, it in args:
            fn(s, it)
        runs.append((time.perf_counter_ns() - t0) / steps)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ns = ap.parse_args()

    def baseline(s: Any, it: Any, mm: Any = None, engine_idx: int = 0) -> None:
        return None

    integ.logger.disabled = True  # the transitions are not what is measured
    plugin = integ.KvdoctorStatLogger(_config(), 0)
    plugin.eval_interval_s = float("inf")  # measure the per-step path alone
    plugin.log_engine_initialized()
    base = per_call_ns(baseline, ns.steps)
    fold = per_call_ns(plugin.record, ns.steps)
    plugin.sample_interval_s = 0.0  # a Snapshot on every call
    sampled = per_call_ns(plugin.record, ns.steps // 10)
    print(f"baseline call            {base:10.0f} ns/step")
    print(f"record() (fold stats)    {fold:10.0f} ns/step  ({fold / base:.1f}x baseline)")
    print(f"record() + Snapshot      {sampled:10.0f} ns/step  ({sampled / base:.1f}x baseline)")

    assert plugin.doctor is not None
    for length in (60, 3600):
        doctor = integ.Doctor(plugin.doctor.config, max_len=length, pipeline=plugin.doctor.pipeline)
        acc = integ.StatsAccumulator("0", "m", 8192)
        for i in range(length):
            acc.record(*_stats(i))
            doctor.add([acc.metrics(1_800_000_000.0 + i)], 1_800_000_000.0 + i)
        doctor.evaluate()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            doctor.evaluate()
            times.append(time.perf_counter() - t0)
        print(f"evaluate after {length:5d} s of snapshots {statistics.median(times) * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
