#!/usr/bin/env python3
"""A day of recording replayed end to end (figures, not pass/fail; tests assert behaviour).

Generates (in a child process, so its memory is not counted) a 24 h recording at 1 Hz of a
node with 8 GPUs: 86,400 Snapshots, each with 8 NVML-shaped GPUs (memory, utilisation,
processes), one vLLM engine's /metrics (counters moving, histogram buckets filling; parsed
from a real vLLM 0.33 page), the engine's launch config and model config (unchanged: written
once), a log that grows by a stats line every 10 s. Written with ``RecordingWriter`` as
``kvdoctor record`` does (.jsonl.gz).

Then, in this process, replays it as ``diagnose --recording`` does: the recording streamed
through :class:`kvdoctor.sampler.LiveLoop` into its bounded Timeline (``--max-len`` Snapshots,
default 3600 = the last hour; Snapshot lines before those are read but not decoded, state
lines are), the pipeline evaluated once over the window at the end. Budget (issue #6): ≤ 10 s
and bounded memory (peak RSS of this process, the generator excluded). ``--full`` also plays
every Snapshot through the loop, evaluating every ``--stride`` (``watch --recording``'s cost).

Baseline, measured in the same process: reading and ``json.loads`` of every line (the floor
any replay pays); the replay's ratio to it is printed.

usage: .venv/bin/python bench/replay.py [--hours 24] [--max-len 3600] [--full [--stride 300]] [--keep FILE [--reuse]]
Last line: ``replay_s=… size_mb=… peak_mb=…``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data"
PAGE = DATA / "bench" / "vllm-0.33.0-metrics-sample.txt"
SMI8 = DATA / "cases" / "b01-tp1-70b-on-8x-a100-40g" / "nvidia-smi.txt"
MODEL = DATA / "cases" / "b01-tp1-70b-on-8x-a100-40g" / "config.json"


def generate(path: Path, seconds: int) -> None:
    """Write ``seconds`` Snapshots at 1 Hz (see the module docstring)."""
    from kvdoctor.facts import GpuProcess, LogEvent, Snapshot, SourceStatus, VllmLog
    from kvdoctor.sources.cmdline import parse_cmdline_text
    from kvdoctor.sources.metrics import parse_metrics
    from kvdoctor.sources.model_config import parse_model_config_file
    from kvdoctor.sources.nvidia_smi import latest_gpus, parse_nvidia_smi_file
    from kvdoctor.sources.recording import RecordingWriter

    gpus0 = latest_gpus(parse_nvidia_smi_file(SMI8))
    em0 = parse_metrics(PAGE.read_text(), origin="http://127.0.0.1:8000/metrics")[0]
    model = parse_model_config_file(MODEL)
    configs = parse_cmdline_text(
        "vllm serve meta-llama/Llama-2-70b-hf --tensor-parallel-size 8 --max-model-len 4096",
        origin="cmdline",
    )
    t0 = 1_750_000_000.0
    events: list[LogEvent] = []
    log = VllmLog(origin="/var/log/vllm.log", events=[], vllm_version="0.33.0", engine_generation="v1")
    procs = [GpuProcess(pid=4000 + i, name="VLLM::Worker", used_bytes=36 * 2**30, type="C") for i in range(8)]
    with RecordingWriter(path, interval_s=1.0, label="live", flush_each=False) as w:
        for i in range(seconds):
            ts = t0 + i
            if i % 10 == 0:
                ev = LogEvent(
                    kind="stats",
                    line=len(events) + 40,
                    values={"kv_cache_usage": 0.3 + 0.2 * ((i // 10) % 5) / 5, "running": 12, "waiting": 0},
                    text="Engine 000: Avg prompt throughput: 812.3 tokens/s, Running: 12 reqs",
                    process="APIServer",
                    level="INFO",
                )
                events = [*events, ev]
                log = replace(log, events=events, line_count=len(events) + 40)
            gpus = [
                replace(
                    g,
                    memory_used_bytes=37 * 2**30 + (i % 97) * 2**20,
                    memory_total_bytes=80 * 2**30,
                    utilization_gpu=0.5 + 0.4 * ((i + g.index) % 10) / 10,
                    timestamp=ts,
                    processes=[replace(procs[g.index], gpu_uuid=g.uuid)],
                )
                for g in gpus0
            ]
            hists = {
                name: replace(
                    h,
                    buckets=[(le, c + i * (k + 1) // 4) for k, (le, c) in enumerate(h.buckets)],
                    count=h.count + i * len(h.buckets) // 4,
                    sum=h.sum + i * 100.0,
                )
                for name, h in em0.histograms.items()
            }
            em = replace(
                em0,
                timestamp=ts,
                num_requests_running=float(12 + i % 3),
                prompt_tokens_total=(em0.prompt_tokens_total or 0) + 812.0 * i,
                generation_tokens_total=(em0.generation_tokens_total or 0) + 950.0 * i,
                request_success_total=(em0.request_success_total or 0) + i // 2,
                kv_cache_usage=0.3 + 0.2 * ((i // 10) % 5) / 5,
                histograms=hists,
            )
            sources = [
                SourceStatus("nvml", "NVML", "ok", "8 GPU(s)", duration_s=0.004, last_success=ts),
                SourceStatus("metrics", em0_url(), "ok", "1 engine(s)", duration_s=0.01, last_success=ts),
                SourceStatus("log", log.origin, "ok", "x lines", duration_s=0.001, last_success=ts),
            ]
            w.write(
                Snapshot(
                    timestamp=ts,
                    gpus=gpus,
                    metrics=[em],
                    log=log,
                    model=model,
                    configs=configs,
                    sources=sources,
                )
            )


def em0_url() -> str:
    return "http://127.0.0.1:8000/metrics"


def baseline(path: Path) -> float:
    """Seconds to read and json-decode every line (the floor of any replay)."""
    t0 = time.perf_counter()
    with gzip.open(path, "rb") as fh:
        for line in fh:
            json.loads(line)
    return time.perf_counter() - t0


def replay(path: Path, max_len: int) -> tuple[float, int, list[str]]:
    """``diagnose --recording``: every line read through the LiveLoop into its bounded
    Timeline (the last ``max_len`` Snapshots decoded, the others passed over), the pipeline
    evaluated over the window at the end. Returns (seconds, snapshots in the file, rules)."""
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sampler import LiveLoop
    from kvdoctor.sources.recording import open_recording

    pipeline = Pipeline.load()
    t0, c0 = time.perf_counter(), time.process_time()
    feed = open_recording(path)
    loop = LiveLoop(feed, pipeline, max_len=max_len)
    timeline = loop.collect(0.0)
    report = pipeline.evaluate(timeline)
    feed.close()
    took = time.perf_counter() - t0
    global REPLAY_CPU_S
    REPLAY_CPU_S = time.process_time() - c0
    return took, feed.position, sorted({f.rule for f in report.findings})


#: CPU seconds of the last :func:`replay` (wall time grows when the machine is shared)
REPLAY_CPU_S = 0.0


def replay_full(path: Path, stride: int, max_len: int) -> tuple[float, int, int]:
    """``watch --recording`` played through: every Snapshot decoded and appended, the
    pipeline evaluated every ``stride`` Snapshots. Returns (seconds, snapshots, evaluations)."""
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sampler import Cycle, LiveLoop
    from kvdoctor.sources.recording import open_recording

    pipeline = Pipeline.load()
    t0 = time.perf_counter()
    feed = open_recording(path)
    loop = LiveLoop(feed, pipeline, max_len=max_len)
    counts = {"n": 0, "evals": 0}

    def on_cycle(c: Cycle) -> None:
        counts["n"] += 1
        counts["evals"] += c.report is not None

    loop.run(on_cycle, threading.Event(), evaluate_every=stride)
    feed.close()
    return time.perf_counter() - t0, counts["n"], counts["evals"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--stride", type=int, default=300, help="--full: evaluate every N snapshots")
    ap.add_argument("--full", action="store_true", help="also play every Snapshot through (slow)")
    ap.add_argument("--max-len", type=int, default=3600, help="Timeline bound (snapshots)")
    ap.add_argument("--keep", type=Path, help="write the recording here and keep it")
    ap.add_argument("--reuse", action="store_true", help="with --keep: replay that file if it exists")
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    seconds = int(args.hours * 3600)
    if args.generate is not None:
        generate(args.generate, seconds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "day.jsonl.gz"
        t0 = time.perf_counter()
        if not (args.keep and args.keep.exists() and args.reuse):
            subprocess.run(
                [sys.executable, __file__, "--hours", str(args.hours), "--generate", str(path)], check=True
            )
        gen_s = time.perf_counter() - t0
        size_mb = path.stat().st_size / 2**20
        base_s = baseline(path)
        took, n, rules = replay(path, args.max_len)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        full = replay_full(path, args.stride, args.max_len) if args.full else None
    print(f"generated {n} snapshots (8 GPUs, 1 engine) in {gen_s:.1f} s: {size_mb:.1f} MiB gzip")
    print(f"baseline (read + json.loads every line): {base_s:.2f} s")
    print(
        f"diagnose --recording (every line read, the last {args.max_len} decoded, one evaluation): "
        f"{took:.2f} s; budget 10 s"
    )
    print(f"ratio replay/baseline: {took / base_s:.2f}x; final findings: {', '.join(rules) or 'none'}")
    print(f"replay CPU time: {REPLAY_CPU_S:.2f} s (wall time is longer when the machine is shared)")
    if full is not None:
        f_s, f_n, f_e = full
        print(f"played through (every Snapshot decoded, {f_e} evaluations): {f_s:.2f} s, {f_n / f_s:,.0f}/s")
    print(f"replay_s={took:.2f} size_mb={size_mb:.1f} peak_mb={peak_mb:.0f}")


if __name__ == "__main__":
    main()
