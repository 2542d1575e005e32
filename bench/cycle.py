#!/usr/bin/env python3
"""One evaluation of the pipeline over a short and a long Timeline (figures, not pass/fail).

Builds, in one process, a live-like Timeline of 1 s snapshots, each holding a real 55 KB vLLM
0.33 /metrics page (tests/data/bench/vllm-0.33.0-metrics-sample.txt, parsed once; counters
advanced per snapshot) and an 8-GPU nvidia-smi table, then times ``Pipeline.evaluate`` (derive
every variable + evaluate every rule + build the report) over the newest snapshot at 60 and at
3,600 snapshots: the median of many runs after a warm-up, and their ratio (the 60-snapshot
Timeline is the baseline, measured in the same process).

Budgets (issue #6): ≤ 5 ms per evaluation, ratio ≤ 1.5 (the cost does not grow with history).
usage: .venv/bin/python bench/cycle.py [--runs N]
last line: cycle_ms_60=… cycle_ms_3600=… ratio=…
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
PAGE = DATA / "bench" / "vllm-0.33.0-metrics-sample.txt"
SMI8 = DATA / "cases" / "b01-tp1-70b-on-8x-a100-40g" / "nvidia-smi.txt"


def timeline(n: int):  # noqa: ANN201 - a kvdoctor.facts.Timeline
    from kvdoctor.facts import Snapshot, Timeline
    from kvdoctor.sources.metrics import parse_metrics
    from kvdoctor.sources.nvidia_smi import latest_gpus, parse_nvidia_smi_table

    t0 = 1_800_000_000.0
    page = parse_metrics(PAGE.read_text(), origin="bench", timestamp=t0)
    gpus = latest_gpus(parse_nvidia_smi_table(SMI8.read_text()))
    tl = Timeline(max_len=max(n, 1))
    for i in range(n):
        ts = t0 + i
        metrics = [
            dataclasses.replace(
                m,
                timestamp=ts,
                generation_tokens_total=(m.generation_tokens_total or 0) + 50.0 * i,
                prompt_tokens_total=(m.prompt_tokens_total or 0) + 400.0 * i,
                request_success_total=(m.request_success_total or 0) + 0.5 * i,
            )
            for m in page
        ]
        tl.append(
            Snapshot(timestamp=ts, gpus=[dataclasses.replace(g, timestamp=ts) for g in gpus], metrics=metrics)
        )
    return tl


def medians_ms(sizes: list[int], runs: int) -> list[float]:
    """Median ms of one evaluation per Timeline size; the sizes are measured interleaved (one
    run of each in turn), so a machine busy with other work slows them alike."""
    from kvdoctor.pipeline import Pipeline

    pipe = Pipeline.load()
    tls = [timeline(n) for n in sizes]
    for _ in range(10):
        for tl in tls:
            pipe.evaluate(tl, now=0)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(runs):
        for i, tl in enumerate(tls):
            t0 = time.perf_counter()
            pipe.evaluate(tl, now=0)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1000 for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    short, long = medians_ms([60, 3600], a.runs)
    print(f"one evaluation,    60 snapshots (8 GPUs, 55 KB /metrics each) {short:7.2f} ms   budget 5 ms")
    print(f"one evaluation, 3,600 snapshots (one hour at 1 s)              {long:7.2f} ms   budget 5 ms")
    print(f"ratio 3600/60 {long / short:.2f}   budget 1.5")
    print(f"cycle_ms_60={short:.2f} cycle_ms_3600={long:.2f} ratio={long / short:.2f}")


if __name__ == "__main__":
    main()
