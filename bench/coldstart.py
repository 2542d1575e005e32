#!/usr/bin/env python3
"""Cold start of ``kvdoctor diagnose --bundle CASE`` against ``nvitop --help`` (issue 8, class
10), on the same machine in one run. Figures, not pass/fail.

nvitop lives in the bench's own venv (``bench/.venv-nvitop``, gitignored), made on first use
with ``pip install nvitop``. Each command runs N times after one warm-up (the OS file cache
warm for both); the median wall time is printed with the ratio kvdoctor / nvitop.

Same footing for both: pip byte-compiles an installed package (nvitop's ``.pyc`` files exist),
so kvdoctor's sources are byte-compiled first too (``compileall``; an editable install under
PYTHONDONTWRITEBYTECODE would otherwise compile every module on every run). The first run is
printed apart. A development checkout is an editable install,
whose import hook site loads at every start (~30 ms); the line "as a regular install" runs the
same code and packages with that hook left out (nvitop's venv interpreter, kvdoctor and its
dependencies on PYTHONPATH), as a ``pip install kvdoctor`` would start.

Budget (issue 23): the ratio ≤ 1.25.
usage: .venv/bin/python bench/coldstart.py [--runs N] [--case DIR]
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv-nvitop"
CASE = ROOT / "tests" / "data" / "bundles" / "r01-healthy-busy-tp2-h100"


def nvitop() -> Path:
    exe = VENV / "bin" / "nvitop"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "nvitop"], check=True)
    return exe


def wall(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds: the child's user + sys) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=False, env=env)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_wall(cmd: list[str], runs: int, env: dict[str, str] | None = None) -> list[tuple[float, float]]:
    wall(cmd, env)  # warm-up
    return [wall(cmd, env) for _ in range(runs)]


def _med(samples: list[tuple[float, float]], i: int) -> float:
    return statistics.median(s[i] for s in samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--case", type=Path, default=CASE)
    args = ap.parse_args()
    kvdoctor = Path(sys.executable).parent / "kvdoctor"
    nv = nvitop()
    compileall.compile_dir(str(ROOT / "kvdoctor"), quiet=1)
    compileall.compile_dir(str(ROOT / "rules"), quiet=1)
    env = dict(os.environ)
    cmd = [str(kvdoctor), "diagnose", "--bundle", str(args.case), "--format", "json"]
    first = wall(cmd, env)[0]
    base = _med(median_wall([sys.executable, "-c", "pass"], args.runs), 0)
    # a regular install: the wheel's files (kvdoctor and its kvdoctor.rules package) in a
    # directory of their own, byte-compiled as pip does, with kvdoctor's dependencies beside them
    installed = tempfile.TemporaryDirectory(prefix="kvdoctor-bench-install-")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", installed.name, str(ROOT)],
        check=True,
        capture_output=True,
    )
    compileall.compile_dir(installed.name, quiet=1)
    # -P: the source tree in the working directory must not shadow the installed package
    plain = [str(VENV / "bin" / "python"), "-P", "-c", "from kvdoctor.cli import main; main()", *cmd[1:]]
    plain_env = {**env, "PYTHONPATH": os.pathsep.join([installed.name, sysconfig.get_paths()["purelib"]])}
    check = subprocess.run(plain, env=plain_env, capture_output=True, text=True)
    assert check.returncode in (0, 1, 2) and check.stdout.startswith("{"), check.stderr
    # interleave the three so load on a shared machine hits them alike
    k_s: list[tuple[float, float]] = []
    p_s: list[tuple[float, float]] = []
    n_s: list[tuple[float, float]] = []
    for _ in range(3):
        n_s += median_wall([str(nv), "--help"], max(1, args.runs // 3))
        k_s += median_wall(cmd, max(1, args.runs // 3), env)
        p_s += median_wall(plain, max(1, args.runs // 3), plain_env)
    n, k, p = _med(n_s, 0), _med(k_s, 0), _med(p_s, 0)
    nc, kc, pc = _med(n_s, 1), _med(k_s, 1), _med(p_s, 1)
    case = args.case.name
    print(f"python -c pass:                      {base * 1000:7.0f} ms")
    print(f"nvitop --help:                       {n * 1000:7.0f} ms   (baseline; CPU {nc * 1000:.0f} ms)")
    print(
        f"kvdoctor diagnose, first run (cold file cache): {first * 1000:7.0f} ms   {first / n:4.2f}x nvitop"
    )
    print(
        f"kvdoctor diagnose --bundle {case} (editable install): {k * 1000:7.0f} ms   {k / n:4.2f}x nvitop"
        f"   (CPU {kc * 1000:.0f} ms, {kc / nc:4.2f}x)"
    )
    print(
        f"kvdoctor diagnose --bundle {case} (as a regular install): {p * 1000:7.0f} ms   {p / n:4.2f}x nvitop"
        f"   (CPU {pc * 1000:.0f} ms, {pc / nc:4.2f}x)"
    )
    print(
        f"budget (issue 23): ratio <= 1.25: editable {'met' if k <= 1.25 * n else 'NOT met'}, "
        f"regular {'met' if p <= 1.25 * n else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
