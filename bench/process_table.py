#!/usr/bin/env python3
"""The live sampler's process-table rescan on this host (figures, not pass/fail).

A ``ProcessTable`` rescans the host every ``rescan_s`` (60 s) and when NVML's GPU pids change.
Prints, on this host's real /proc (psutil):

- the baseline measured in the same process: a full walk, ``psutil.process_iter`` reading
  name, ppid, cmdline and create_time of every process (what every rescan cost before);
- a rescan of a table that has read the host once (:meth:`ProcessTable._rescan`: new, python
  and vLLM processes read in full, the others checked with one stat read, kernel threads for
  pid reuse only), and the ratio;
- a read between rescans (``psutil.pids()`` plus the vLLM processes' counters);
- how many processes, kernel threads and python processes the host has (the ratio depends
  on them: a GPU node with hundreds of CPUs has thousands of kernel threads).

usage: .venv/bin/python bench/process_table.py [--runs 20]
"""

from __future__ import annotations

import argparse
import time

import psutil

from kvdoctor.sources.processes import _ATTRS, ProcessTable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs of each (median printed)")
    args = ap.parse_args()
    cpu = time.thread_time

    def median(fn: object) -> float:
        times = []
        for _ in range(args.runs):
            t = cpu()
            fn()  # type: ignore[operator]
            times.append(cpu() - t)
        return sorted(times)[len(times) // 2]

    def walk() -> None:
        for proc in psutil.process_iter(_ATTRS, ad_value=None):
            _ = proc.info

    table = ProcessTable()
    table.read()
    entries = list(table._entries.values())
    kernel = sum(e.info.get("ppid") == 2 for e in entries)
    python = sum(e.python for e in entries)
    full = median(walk)
    rescan = median(lambda: table._rescan(time.monotonic()))
    between = median(table.read)
    print(f"host: {len(entries)} processes, {kernel} kernel threads, {python} python processes")
    print(f"  baseline: full walk (process_iter)   {full * 1e3:7.2f} ms CPU")
    print(f"  rescan of a table that read the host {rescan * 1e3:7.2f} ms CPU   ({full / rescan:.1f}x less)")
    print(f"  read between rescans                 {between * 1e3:7.2f} ms CPU")
    print(f"  per 1 s cycle at rescan_s={table.rescan_s:g}: {rescan / table.rescan_s * 1e3:.3f} ms "
          f"(was {full / table.rescan_s * 1e3:.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
