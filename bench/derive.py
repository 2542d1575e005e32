#!/usr/bin/env python3
"""derive per fresh cycle: ``build_contexts`` after one snapshot is appended to a full Timeline.

Builds, in one process, the live-like Timeline of ``bench/cycle.py`` (1 s snapshots, each with
the real 55 KB vLLM 0.33 /metrics page, counters advanced, and an 8-GPU nvidia-smi table), fills
a Timeline of ``--history`` snapshots (the sidecar's ``--history``), then times, by thread CPU
time, ``kvdoctor.derive.build_contexts`` after each further snapshot is appended (the oldest
drops): what a live cycle pays. The baseline, measured in the same process and interleaved,
evaluates the very same snapshots as a Timeline seen for the first time (a new Timeline object
per cycle: nothing worked out in earlier cycles is reused). Figures, not pass/fail.

Budget (issue #10): ≤ 0.8 ms per fresh cycle at 600 snapshots.
usage: .venv/bin/python bench/derive.py [--history 600] [--cycles 200]
last line: derive_ms_rolling=… derive_ms_first_sight=… ratio=…
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _bench_timeline(n: int):  # noqa: ANN202 - a kvdoctor.facts.Timeline
    spec = importlib.util.spec_from_file_location("bench_cycle", HERE / "cycle.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.timeline(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=600, help="snapshots held (default 600)")
    ap.add_argument("--cycles", type=int, default=200, help="fresh cycles timed (default 200)")
    args = ap.parse_args()
    from kvdoctor.derive import build_contexts
    from kvdoctor.facts import Timeline

    snaps = _bench_timeline(args.history + args.cycles).snapshots
    # The sidecar's own setting (kvdoctor.cli): a collection every 50,000 allocations.
    gc.set_threshold(50_000, *gc.get_threshold()[1:])
    live = Timeline(max_len=args.history)
    for s in snaps[: args.history]:
        live.append(s)
    build_contexts(live, [])
    clock = time.thread_time
    rolling: list[float] = []
    first: list[float] = []
    for s in snaps[args.history :]:
        live.append(s)
        t = clock()
        build_contexts(live, [])
        rolling.append(clock() - t)
        fresh = Timeline(snapshots=list(live.snapshots), max_len=args.history)
        t = clock()
        build_contexts(fresh, [])
        first.append(clock() - t)
    r, f = statistics.median(rolling) * 1e3, statistics.median(first) * 1e3
    print(f"history {args.history} snapshots, {args.cycles} fresh cycles (median of thread CPU time)")
    print(f"  build_contexts, rolling Timeline:            {r:.3f} ms")
    print(f"  build_contexts, same snapshots, first sight: {f:.3f} ms")
    print(f"derive_ms_rolling={r:.3f} derive_ms_first_sight={f:.3f} ratio={r / f:.2f}")


if __name__ == "__main__":
    main()
