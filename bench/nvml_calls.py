#!/usr/bin/env python3
"""NVML calls per minute per GPU that kvdoctor makes at its defaults: the sidecar (one read every
5 s, ``kvdoctor sidecar --interval``) and ``kvdoctor watch`` (every 1 s), each against the
baseline of reading the running-process lists on every read (``NvmlReader(processes_s=0)``, what
kvdoctor did before), in the same run.

It drives :class:`kvdoctor.sources.nvml.NvmlReader` (the reader both faces use) on a simulated
clock over a counting fake pynvml: one served GPU whose used memory jitters by a few MiB (a
steady vLLM: its KV cache is preallocated) and steps up 2 GiB once at 317 s (a new process),
so the "at once when memory moves" path is counted too. Counts, not timings: how much each call
costs depends on the driver (the running-process query is the costly one: milliseconds under
the driver's lock, where memory info is microseconds).

usage: .venv/bin/python bench/nvml_calls.py [--minutes 10]
"""

from __future__ import annotations

import argparse
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvdoctor.sources.nvml import _FUNCTIONS, NvmlReader  # noqa: E402

MiB = 2**20
GiB = 2**30
PROCESS_CALLS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


def counting_nvml(clock: list[float], counts: Counter[str]) -> types.ModuleType:
    """A pynvml stand-in with one H100 serving vLLM; every call counted in ``counts``."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        value = 999

    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    m.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]

    def used() -> int:
        t = clock[0]
        jitter = (int(t) * 7919 % 9) * MiB  # 0..8 MiB: allocator noise, no new process
        return 70 * GiB + jitter + (2 * GiB if t >= 317 else 0)

    values: dict[str, Any] = {
        "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUUID": "GPU-00000000-0000-0000-0000-000000000000",
        "nvmlDeviceGetPciInfo": types.SimpleNamespace(busId="00000000:18:00.0"),
        "nvmlDeviceGetUtilizationRates": types.SimpleNamespace(gpu=80, memory=40),
        "nvmlDeviceGetTemperature": 55,
        "nvmlDeviceGetPowerUsage": 450_000,
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,
        "nvmlDeviceGetMigMode": [0, 0],
        "nvmlDeviceGetCurrentClocksEventReasons": 0,
        "nvmlDeviceGetTotalEccErrors": 0,
        "nvmlDeviceGetComputeRunningProcesses": [types.SimpleNamespace(pid=4242, usedGpuMemory=70 * GiB)],
        "nvmlDeviceGetGraphicsRunningProcesses": [],
        "nvmlSystemGetProcessName": "VLLM::EngineCore",
    }

    def fn(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if name == "nvmlDeviceGetMemoryInfo":
                u = used()
                return types.SimpleNamespace(total=80 * GiB, used=u, free=80 * GiB - u, reserved=0)
            if name == "nvmlDeviceGetHandleByIndex":
                return 0
            if name in values:
                return values[name]
            raise NVMLError(name)

        return call

    for name in set(_FUNCTIONS) | {"nvmlDeviceGetHandleByIndex"}:
        setattr(m, name, fn(name))
    m.nvmlInit = lambda: None  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    return m


def per_minute(interval_s: float, minutes: float, **reader_kw: Any) -> Counter[str]:
    """NVML calls per minute (one GPU) over ``minutes`` of reads every ``interval_s``."""
    clock = [0.0]
    counts: Counter[str] = Counter()
    reader = NvmlReader(counting_nvml(clock, counts), clock=lambda: clock[0], **reader_kw)
    reads = int(minutes * 60 / interval_s)
    for i in range(reads):
        clock[0] = i * interval_s
        reader.read()
    return Counter({k: round(v / minutes, 1) for k, v in counts.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    args = ap.parse_args()
    print(
        f"NVML calls per minute per GPU, {args.minutes:g} simulated minutes (used memory steps up once, at 317 s)"
    )
    print(
        f"{'face (interval)':<22} {'reader':<28} {'all calls':>9} {'memory info':>11} {'process lists':>13}"
    )
    for face, interval in (("sidecar (5 s)", 5.0), ("watch (1 s)", 1.0)):
        rows = [
            ("kvdoctor (processes_s=30)", per_minute(interval, args.minutes)),
            ("baseline (every read)", per_minute(interval, args.minutes, processes_s=0)),
        ]
        for label, c in rows:
            procs = sum(c[n] for n in PROCESS_CALLS)
            total = sum(c.values())
            print(
                f"{face:<22} {label:<28} {total:>9.1f} {c['nvmlDeviceGetMemoryInfo']:>11.1f} {procs:>13.1f}"
            )
        new, base = (sum(c[n] for n in PROCESS_CALLS) for _, c in rows)
        print(f"{face:<22} process-list calls: {base / new:.1f}x fewer than the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
