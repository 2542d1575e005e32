#!/usr/bin/env python3
"""Cold-start and evaluation timings (figures, not pass/fail; tests assert behaviour).

Prints, in one run so the machine's state is shared:
- cold start of `python -c pass` (the baseline), `kvdoctor --help` and
  `kvdoctor diagnose --bundle <case> --format json`, median of N runs, and their ratio to the baseline;
- one full evaluation in-process: parse a 55 KB real vLLM 0.33 /metrics page + an 8-GPU nvidia-smi
  table + the pipeline (derive the variables, evaluate every rule, build the report; median of
  many runs, after a warm-up).

Budgets (issue #2): `--help` ≤ 0.15 s, one evaluation ≤ 5 ms.
usage: .venv/bin/python bench/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CASE = DATA / "cases" / "b20-low-util-kv-saturated-qwen2-0.5b"
PAGE = DATA / "bench" / "vllm-0.33.0-metrics-sample.txt"
SMI8 = DATA / "cases" / "b01-tp1-70b-on-8x-a100-40g" / "nvidia-smi.txt"


def cold(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def evaluation(runs: int) -> float:
    from kvdoctor.facts import Snapshot, Timeline
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.metrics import parse_metrics
    from kvdoctor.sources.nvidia_smi import latest_gpus, parse_nvidia_smi_table

    pipeline = Pipeline.load()
    page = PAGE.read_text()
    smi = SMI8.read_text()

    def once() -> None:
        snap = Snapshot(timestamp=time.time())
        snap.metrics = parse_metrics(page, origin="bench", timestamp=snap.timestamp)
        snap.gpus = latest_gpus(parse_nvidia_smi_table(smi))
        tl = Timeline()
        tl.append(snap)
        pipeline.evaluate(tl, now=0)

    for _ in range(20):
        once()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    py = sys.executable
    kvd = str(Path(py).parent / "kvdoctor")
    base = cold([py, "-c", "pass"], a.runs)
    helps = cold([kvd, "--help"], a.runs)
    diag = cold([kvd, "diagnose", "--bundle", str(CASE), "--format", "json"], a.runs)
    ev = evaluation(max(50, a.runs * 20))
    print(f"python -c pass                 {base * 1000:8.1f} ms   (baseline)")
    print(
        f"kvdoctor --help                {helps * 1000:8.1f} ms   ×{helps / base:.1f} baseline   budget 150 ms"
    )
    print(f"kvdoctor diagnose --bundle b20 {diag * 1000:8.1f} ms   ×{diag / base:.1f} baseline")
    print(f"one evaluation (55 KB /metrics + 8 GPUs + all rules) {ev * 1000:6.2f} ms   budget 5 ms")


if __name__ == "__main__":
    main()
