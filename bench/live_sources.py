#!/usr/bin/env python3
"""The live sources' per-read cost, each against its baseline in the same process (figures,
not pass/fail; tests assert behaviour).

Each pair runs alternating, read for read, with a pause between reads (``--pause``, as the
sampler's 1 s interval leaves caches cold), in thread CPU per read:

- NVML, 8 fake GPUs (bench/sidecar.py's fake pynvml, whose calls cost less than real ctypes
  ones): device handles and the slow fields (enforced power limit, MIG mode) kept, against a
  reader asking for every field on every read (a new handle each read, ``slow_s=0``);
- the process table between rescans on this host: the listing of /proc skipped while the pid
  cursor stays (``/proc/loadavg``), against listing /proc on every read;
- /metrics parsing of the bench's busy page (every counter and bucket moved each scrape): the
  last page's samples reused when the kept lines' heads are the same, against the per-line
  caches alone.

usage: .venv/bin/python bench/live_sources.py [--reads 200] [--pause 0.05]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def pair(
    reads: int, pause: float, new: Callable[[], object], base: Callable[[], object]
) -> tuple[float, float]:
    """(new, baseline) thread CPU seconds per call, alternating, each first after the pause
    every other time (the second of a pair runs warmer)."""
    cpu = time.thread_time
    spent = [0.0, 0.0]
    fns = (new, base)
    for i in range(reads):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            t = cpu()
            fns[k]()
            spent[k] += cpu() - t
        if pause:
            time.sleep(pause)
    return spent[0] / reads, spent[1] / reads


def show(label: str, new: float, base: float) -> None:
    print(
        f"  {label:<44s} {new * 1e3:7.3f} ms  baseline {base * 1e3:7.3f} ms  ({base / max(new, 1e-9):.2f}x)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=200, help="reads of each, alternating")
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between reads")
    args = ap.parse_args()

    import sidecar as bench_sidecar  # bench/sidecar.py: the fake pynvml and the busy page

    from kvdoctor.sources import metrics, nvml, processes

    print(f"live sources, thread CPU per read ({args.reads} reads each, {args.pause:g} s apart):")

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kvdoctor_bench_pynvml.py").write_text(bench_sidecar.FAKE_PYNVML)
        sys.path.insert(0, tmp)
        fake = importlib.import_module("kvdoctor_bench_pynvml")
        kept = nvml.NvmlReader(fake)
        fresh = nvml.NvmlReader(fake, slow_s=0.0)

        def fresh_read() -> object:
            fresh._handles.clear()  # a handle asked for on every read, as before
            return fresh.read()

        show("NVML, 8 GPUs (handles, slow fields kept)", *pair(args.reads, args.pause, kept.read, fresh_read))

    cursor = processes._pid_cursor
    skipping = processes.ProcessTable(young_s=0.0)
    listing = processes.ProcessTable(young_s=0.0)

    def listing_read() -> object:
        processes._pid_cursor = lambda: None  # type: ignore[assignment]
        try:
            return listing.read()
        finally:
            processes._pid_cursor = cursor  # type: ignore[assignment]

    skipping.read()
    listing.read()
    new, base = pair(args.reads, args.pause, skipping.read, listing_read)
    show("process table (listing skipped)", new, base)
    print(
        f"    listings skipped: {skipping.listings_skipped} of {args.reads} reads (pid cursor: {cursor() is not None})"
    )

    busy = bench_sidecar.BusyPage(bench_sidecar.PAGE.read_text())
    pages = [busy.render(n) for n in range(1, 2 * args.reads + 3)]
    it = iter(pages)
    state: dict[str, tuple[object, object, object]] = {}

    def parse(mode: str) -> Callable[[], object]:
        def run() -> object:
            # each mode keeps its own caches (its own last page), as one endpoint's reader would
            saved = metrics._LINE_CACHE, metrics._HEAD_CACHE, metrics._LAST_PAGE
            metrics._LINE_CACHE, metrics._HEAD_CACHE, last = state.get(mode, ({}, {}, None))  # type: ignore[assignment]
            metrics._LAST_PAGE = last if mode == "new" else None  # type: ignore[assignment]
            try:
                return metrics.parse_metrics(next(it), timestamp=1.0)
            finally:
                state[mode] = (metrics._LINE_CACHE, metrics._HEAD_CACHE, metrics._LAST_PAGE)
                metrics._LINE_CACHE, metrics._HEAD_CACHE, metrics._LAST_PAGE = saved  # type: ignore[assignment]

        return run

    show(
        "/metrics parse, busy page (last page reused)",
        *pair(args.reads, args.pause, parse("new"), parse("base")),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
