#!/usr/bin/env python3
"""Logs of any size (issue 8, class 9): a 200 MB vLLM log, diagnosed, against plain line
iteration; and its peak RSS. Figures, not pass/fail.

The log is made here, deterministically: a real startup (a case's log), then hours of serving —
request lines (``Received request``, ``Added request``, uvicorn access lines), a stats line
every ten seconds with preemptions now and then, a restart halfway and a runtime CUDA OOM near
the end — until it reaches the size asked (default 200 MB, about 2 M lines).

Prints, in one run (the same machine state for all):
- plain Python ``for line in open(f)`` over the file (the baseline, best of 3);
- ``parse_log_file`` in-process (the log parser alone);
- ``kvdoctor diagnose --log FILE --format json`` in a child process: wall time and the child's
  peak RSS (getrusage), and both ratios to the baseline.

Also the CPU seconds of both (the child's user+sys from getrusage against the iteration's
process time): on a shared, loaded machine wall times swing with the load, CPU times much less.
``--ids`` writes request lines with ``prompt_token_ids: [...]`` lists (each one an event) instead
of vLLM's ``prompt_token_ids: None``.

Budgets (issue 8): diagnose ≤ 10× the baseline, peak RSS ≤ 200 MB.
``--no-request-log --engines 8``: a data-parallel server without request logging (access lines
and eight stats lines every ten seconds).
usage: .venv/bin/python bench/logsize.py [--mb 200] [--keep PATH] [--log PATH] [--ids]
       [--no-request-log] [--engines N]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ROOT / "tests" / "data" / "vllm_log" / "b17-v1-preemption-thrash-long-prompts.log"


def make_log(
    path: Path, mb: int, seed: int = 8, ids: bool = False, request_log: bool = True, engines: int = 1
) -> int:
    """Write a ~``mb`` MB log to ``path``; returns its line count. ``ids``: request lines carry
    a token-id list (20-400 ids) instead of ``prompt_token_ids: None``. ``request_log=False``:
    no request-log lines (vLLM's default since ``--enable-log-requests``), access lines only.
    ``engines``: data-parallel engines, each with its own stats line every ten seconds."""
    rng = random.Random(seed)
    startup = [ln for ln in STARTUP.read_text().splitlines() if "Engine 000" not in ln][:120]
    target = mb * 1_000_000
    size = 0
    lines = 0
    t = 0
    restarted = False
    with open(path, "w", encoding="utf-8") as out:

        def w(line: str) -> None:
            nonlocal size, lines
            out.write(line + "\n")
            size += len(line) + 1
            lines += 1

        for ln in startup:
            w(ln)
        while size < target:
            t += 1
            hh, mm, ss = (t // 3600) % 24, (t // 60) % 60, t % 60
            ts = f"07-01 {hh:02d}:{mm:02d}:{ss:02d}"
            for _ in range(rng.randint(2, 4)):
                rid = f"cmpl-{rng.getrandbits(64):016x}"
                tok = "None"
                if ids:
                    tok = (
                        "["
                        + ", ".join(str(rng.randint(1, 128000)) for _ in range(rng.randint(20, 400)))
                        + "]"
                    )
                if request_log:
                    w(
                        f"(APIServer pid=1) INFO {ts} [logger.py:43] Received request {rid}: prompt: 'Summarise the following document, focusing on the main claims', params: SamplingParams(n=1, temperature=0.7, max_tokens=512), prompt_token_ids: {tok}, lora_request: None."
                    )
                    w(f"(APIServer pid=1) INFO {ts} [engine.py:317] Added request {rid}.")
                w(
                    f'(APIServer pid=1) INFO:     10.0.{rng.randint(0, 255)}.{rng.randint(1, 254)}:{rng.randint(30000, 60000)} - "POST /v1/completions HTTP/1.1" 200 OK'
                )
            for engine in range(engines if t % 10 == 0 else 0):
                pre = rng.choice((0, 0, 0, 0, 3, 12))
                w(
                    f"(APIServer pid=1) INFO {ts} [loggers.py:123] Engine {engine:03d}: Avg prompt throughput: {rng.uniform(500, 9000):.1f} tokens/s, Avg generation throughput: {rng.uniform(100, 900):.1f} tokens/s, Running: {rng.randint(5, 64)} reqs, Waiting: {rng.randint(0, 30)} reqs, GPU KV cache usage: {rng.uniform(60, 99.9):.1f}%, Prefix cache hit rate: {rng.uniform(0, 60):.1f}%, Preemptions: {pre}"
                )
            if not restarted and size > target // 2:
                restarted = True
                for ln in startup:
                    w(ln)
            if size > target * 0.97 and t % 1000 == 0:
                w(
                    f"(EngineCore_DP0 pid=277) ERROR {ts} [core.py:700] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.20 GiB is free."
                )
    return lines


def plain_iteration(path: Path) -> tuple[float, float]:
    """Best of 3: (wall seconds, CPU seconds) of ``for line in open(path)``."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        with open(path, encoding="utf-8", errors="replace") as fh:
            for _line in fh:
                pass
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    ap.add_argument("--log", type=Path, default=None, help="measure this existing log (made by --keep)")
    ap.add_argument("--ids", action="store_true", help="request lines with prompt_token_ids lists")
    ap.add_argument("--no-request-log", action="store_true", help="access lines only (vLLM's default)")
    ap.add_argument("--engines", type=int, default=1, help="data-parallel engines (a stats line each)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="kvdoctor-bench-")
    if args.log is not None:
        path = args.log
        n = sum(1 for _ in open(path, "rb"))
        print(f"log: {path.stat().st_size / 1e6:.0f} MB, {n:,} lines (given)")
    else:
        path = args.keep or Path(tmp.name) / "vllm.log"
        t0 = time.perf_counter()
        n = make_log(path, args.mb, ids=args.ids, request_log=not args.no_request_log, engines=args.engines)
        print(
            f"log: {path.stat().st_size / 1e6:.0f} MB, {n:,} lines (made in {time.perf_counter() - t0:.1f} s)"
        )

    base, base_cpu = plain_iteration(path)
    print(f"plain line iteration:         {base:7.2f} s   (baseline; CPU {base_cpu:.2f} s)")

    sys.path.insert(0, str(ROOT))
    from kvdoctor.sources.vllm_log import parse_log_file

    t0, c0 = time.perf_counter(), time.process_time()
    log = parse_log_file(path, progress=False)
    parse_s, parse_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"parse_log_file:               {parse_s:7.2f} s   {parse_s / base:5.1f}x   "
        f"(CPU {parse_cpu:.2f} s, {parse_cpu / base_cpu:.1f}x; {len(log.events):,} events kept)"
    )
    del log

    kvdoctor = [sys.executable, "-c", "from kvdoctor.cli import main; main()"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [*kvdoctor, "diagnose", "--log", str(path), "--format", "json"],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rss = max(after.ru_maxrss, before.ru_maxrss) / 1024
    print(
        f"kvdoctor diagnose --log FILE: {wall:7.2f} s   {wall / base:5.1f}x   "
        f"(CPU {cpu:.2f} s, {cpu / base_cpu:.1f}x)   exit {r.returncode}"
    )
    print(f"peak RSS of diagnose:         {rss:7.0f} MB  (budget 200 MB)")
    print(
        f"budget: diagnose <= 10x baseline: {'met' if wall <= 10 * base else 'NOT met'} "
        f"(CPU: {'met' if cpu <= 10 * base_cpu else 'NOT met'}); "
        f"RSS <= 200 MB: {'met' if rss <= 200 else 'NOT met'}"
    )
    if r.returncode not in (0, 1, 2, 3) or r.stderr.strip():
        print("diagnose stderr:", r.stderr.decode(errors="replace").strip().splitlines()[-1:])


if __name__ == "__main__":
    main()
