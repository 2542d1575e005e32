#!/usr/bin/env python3
"""The sidecar under faults (issue 27 item 10): figures, not pass/fail (tests assert behaviour).

Runs ``kvdoctor sidecar`` as its own process against a local fake vLLM (the b17 storm pages,
tests/sidecar/conftest.py's FakeVllm) and a log file it follows, and goes through fault phases
(each ``--phase`` seconds; ``--log``: a log that grows is followed too, and deleted with the
endpoint down): healthy, HTTP 500, a hung endpoint, garbage, a 50 MB body, a gzip
bomb (1 GiB of zeros), the endpoint down (connection refused) with the log deleted, and healthy
again. Meanwhile it polls ``/readyz``, ``/healthz`` and ``/metrics`` every 0.25 s like a kubelet
and Prometheus would, and samples the sidecar's RSS and open file descriptors.

Prints, per phase: /readyz answers (200 share), the first 503 and the recovery time after a
healthy phase starts, non-200 /healthz or /metrics answers, and RSS / fd at the phase's end;
then the totals: crashes (the process gone), RSS growth and fd growth from the end of the first
phase to the end, and every /readyz transition with its time.

Expected: 0 crashes, /healthz and /metrics always 200, /readyz 200 in healthy phases (after at
most one interval), 503 within 10 s (3 intervals when longer) of an engine source failing for
good, RSS and fds flat.
usage: .venv/bin/python bench/soak.py [--phase 20] [--interval 1] [--log]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sidecar.conftest import FakeVllm, storm_pages  # noqa: E402

PHASES = ["ok", "500", "hang", "garbage", "huge", "gzipbomb", "down", "ok"]
LOG_LINE = "INFO 01-01 00:00:{s:02d} [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, Running: 1 reqs\n"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _get(client: httpx.Client, url: str) -> int:
    try:
        return client.get(url, timeout=5.0).status_code
    except httpx.HTTPError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", type=float, default=20.0, help="seconds per fault phase")
    ap.add_argument("--interval", type=float, default=1.0, help="the sidecar's --interval")
    ap.add_argument("--log", action="store_true", help="also --log a file that grows (deleted when down)")
    args = ap.parse_args()
    ThreadingHTTPServer.handle_error = lambda *a: None  # type: ignore[method-assign]  # clients that give up

    fake = FakeVllm(storm_pages()).start()
    fake.hang_s = 5.0
    fake.bomb()
    mport, handler = fake.server.server_address[1], fake.server.RequestHandlerClass
    servers = [fake.server]
    tmp = Path(tempfile.mkdtemp(prefix="kvdoctor-soak-"))
    log = tmp / "vllm.log"
    log.write_text(LOG_LINE.format(s=0))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "kvdoctor", "sidecar", "--listen", f"127.0.0.1:{port}",
        "--metrics", fake.url, "--no-nvml", "--interval", str(args.interval),
    ] + (["--log", str(log)] if args.log else [])  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    child = psutil.Process(proc.pid)
    client = httpx.Client()
    t_start = time.monotonic()
    transitions: list[tuple[float, int]] = []
    last_ready: int | None = None
    crashes = 0
    rows = []
    rss_first = fd_first = None
    try:
        while _get(client, base + "/healthz") != 200:
            if proc.poll() is not None:
                raise SystemExit(
                    f"sidecar did not start: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}"
                )
            time.sleep(0.2)
        for i, mode in enumerate(PHASES):
            if mode == "hang":
                fake.release.clear()
            else:
                fake.release.set()
            fake.mode = "ok" if mode == "down" else mode
            if mode == "down":
                servers[-1].shutdown()  # nothing answers: connection refused
                servers[-1].server_close()
                log.unlink(missing_ok=True)
            elif i and PHASES[i - 1] == "down":
                # the same port again (the sidecar's --metrics URL), the same handler
                server = ThreadingHTTPServer(("127.0.0.1", mport), handler)
                server.daemon_threads = True
                threading.Thread(target=server.serve_forever, daemon=True).start()
                servers.append(server)
                log.write_text(LOG_LINE.format(s=1))
            t0 = time.monotonic()
            answers: list[int] = []
            bad_other = 0
            first_503 = recovered = None
            n = 0
            while time.monotonic() - t0 < args.phase:
                if proc.poll() is not None:
                    crashes += 1
                    break
                code = _get(client, base + "/readyz")
                now = time.monotonic() - t0
                answers.append(code)
                if code != last_ready:
                    transitions.append((time.monotonic() - t_start, code))
                    last_ready = code
                if code != 200 and first_503 is None:
                    first_503 = now
                if code == 200 and recovered is None:
                    recovered = now
                n += 1
                if n % 4 == 0:
                    bad_other += _get(client, base + "/healthz") != 200
                    bad_other += _get(client, base + "/metrics") != 200
                if args.log and log.exists():
                    with log.open("a") as fh:
                        fh.write(LOG_LINE.format(s=int(now) % 60))
                time.sleep(0.25)
            if proc.poll() is not None:
                break
            mem = child.memory_info().rss >> 20
            fds = child.num_fds()
            if rss_first is None:
                rss_first, fd_first = mem, fds
            share = 100 * sum(c == 200 for c in answers) / max(1, len(answers))
            rows.append((mode, share, first_503, recovered, bad_other, mem, fds))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        fake.release.set()
        client.close()
    what = "a growing log followed beside /metrics" if args.log else "/metrics only"
    print(f"kvdoctor sidecar --interval {args.interval:g}, {args.phase:g} s per phase, {what}")
    print(
        f"{'phase':<10}{'/readyz 200':>12}{'first 503 s':>13}{'first 200 s':>13}{'non-200 other':>15}{'RSS MiB':>9}{'fds':>5}"
    )
    for mode, share, f503, rec, bad, mem, fds in rows:
        f503_s = f"{f503:.1f}" if f503 is not None else "-"
        rec_s = f"{rec:.1f}" if rec is not None else "-"
        print(f"{mode:<10}{share:>11.0f}%{f503_s:>13}{rec_s:>13}{bad:>15}{mem:>9}{fds:>5}")
    print(f"crashes: {crashes}; exit on SIGTERM: {proc.returncode}")
    if rows and rss_first is not None and fd_first is not None:
        print(
            f"RSS growth after the first phase: {rows[-1][5] - rss_first:+d} MiB; fd growth: {rows[-1][6] - fd_first:+d}"
        )
    print("/readyz transitions: " + ", ".join(f"{t:.1f}s→{c}" for t, c in transitions))
    os.system(f"rm -rf {tmp}")  # noqa: S605 - our own temporary directory


if __name__ == "__main__":
    main()
