#!/usr/bin/env python3
"""The sidecar over time: CPU per cycle and RSS (figures, not pass/fail; tests assert behaviour).

Runs ``kvdoctor sidecar --interval 1`` as its own process against a local fake vLLM serving a
real-size /metrics page (tests/data/bench/vllm-0.33.0-metrics-sample.txt, 55 KB) as a busy
engine moves it (:class:`BusyPage`: every counter and histogram grows, the gauges move;
``--steady``: unchanged but for ``vllm:num_preemptions_total``, the earlier model); the
connection kept alive between scrapes, as vLLM's uvicorn keeps it for 5 s and the sidecar
scrapes every second (``--close-per-scrape``: HTTP/1.0, a connection per scrape, the
pessimistic model of earlier runs), and 8 GPUs (a stand-in ``pynvml`` module on PYTHONPATH
answering like 8 busy H100s, each with one vLLM process, utilisation, power and temperature
moving per read), scrapes the sidecar's /metrics like
Prometheus every ``--scrape-every`` seconds (15: deploy/prometheus/scrape-config.yaml's
scrape_interval), and prints:

- CPU seconds of the sidecar process per evaluation cycle (user+sys / cycles), over the run and
  over its second half (steady state);
- RSS once the Timeline holds ``--history`` of snapshots (it fills until then, by design; a
  quarter into a run shorter than history + 60 s) and at the end, and the growth between them;
- the baseline measured in the same process: CPU of one bare scrape + parse of the same page
  (``kvdoctor.sources.metrics``), and the cycle / baseline ratio.

Budgets (issue 10): ≤ 5 ms CPU per cycle, ≤ 60 MiB RSS, no growth, after 10 minutes at 1 s.
usage: .venv/bin/python bench/sidecar.py [--duration 60|720] [--history 600]  (720: ten minutes
with the default history full, then two more to see it stay flat)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "tests" / "data" / "bench" / "vllm-0.33.0-metrics-sample.txt"
MiB = 2**20

FAKE_PYNVML = '''
"""8 H100s with one vLLM process each: a stand-in for pynvml (bench/sidecar.py)."""
import types

class NVMLError(Exception):
    pass

MiB = 2**20
nvmlMemory_v2 = 0x02000028
NVML_TEMPERATURE_GPU = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
_ns = types.SimpleNamespace

def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 8
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetName(h): return "NVIDIA H100 80GB HBM3"
def nvmlDeviceGetUUID(h): return "GPU-%08d-0000-0000-0000-000000000000" % h
def nvmlDeviceGetPciInfo(h): return _ns(busId="00000000:%02X:00.0" % (0x18 + h))
def nvmlDeviceGetMemoryInfo(h, version=None):
    return _ns(total=81559 * MiB, used=75327 * MiB, free=6232 * MiB, reserved=330 * MiB)
# A serving GPU's telemetry moves every read (--steady: it stays put); its memory does not
# (vLLM preallocates the KV cache).
_reads = [0]
_STEADY = __import__("os").environ.get("KVDOCTOR_BENCH_STEADY") == "1"
def _tick(h):
    if h == 0:
        _reads[0] += 1
    return 0 if _STEADY else _reads[0] * 7 + h
def nvmlDeviceGetUtilizationRates(h):
    t = _tick(h)
    return _ns(gpu=80 + t % 20, memory=30 + t % 17)
def nvmlDeviceGetTemperature(h, sensor): return 55 + (_reads[0] // 10 + h) % 5 * (not _STEADY)
def nvmlDeviceGetPowerUsage(h): return 450000 + (_reads[0] * 13 + h) % 200 * 1000 * (not _STEADY)
def nvmlDeviceGetEnforcedPowerLimit(h): return 700000
def nvmlDeviceGetMigMode(h): return [0, 0]
def nvmlDeviceGetCurrentClocksEventReasons(h): return 0
def nvmlDeviceGetTotalEccErrors(h, a, b): return 0
def nvmlDeviceGetComputeRunningProcesses(h): return [_ns(pid=4000 + h, usedGpuMemory=74000 * MiB)]
def nvmlDeviceGetGraphicsRunningProcesses(h): return []
def nvmlSystemGetProcessName(pid): return b"VLLM::Worker_TP%d" % (pid - 4000)
'''

BREAKDOWN = '''
"""kvdoctor with each part of a sidecar cycle timed in thread CPU (bench/sidecar.py --breakdown):
SIGUSR1 zeroes the sums, SIGUSR2 writes them as JSON to $KVDOCTOR_BENCH_BREAKDOWN."""
import json, os, signal, sys, time
from collections import Counter

cpu, calls = Counter(), Counter()


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu[label] += time.thread_time() - t0
            calls[label] += 1

    setattr(owner, name, wrapper)


import kvdoctor.derive as derive
import kvdoctor.pipeline as pipeline
import kvdoctor.report as report
import kvdoctor.rulekit as rules
import kvdoctor.sampler as sampler
import kvdoctor.sidecar.server as server

timed(pipeline.Pipeline, "evaluate", "evaluate")
timed(derive, "build_contexts", "evaluate / derive")
timed(derive, "derive_variables", "evaluate / derive / families")
timed(rules, "evaluate", "evaluate / rules")
timed(report, "build_report", "evaluate / report")
timed(sampler.LiveFeed, "next", "read / the loop thread's share")
timed(sampler.MetricsSource, "read", "read / metrics scrape + parse")
timed(sampler.NvmlSource, "read", "read / NVML")
timed(sampler.ProcessSource, "read", "read / process table")
timed(server.Sidecar, "on_cycle", "on_cycle")
timed(server.Sidecar, "metrics_page", "its own /metrics page")
signal.signal(signal.SIGUSR1, lambda *_: (cpu.clear(), calls.clear()))


def dump(*_):
    with open(os.environ["KVDOCTOR_BENCH_BREAKDOWN"], "w") as f:
        json.dump({"cpu": cpu, "calls": calls}, f)


signal.signal(signal.SIGUSR2, dump)
from kvdoctor.cli import main

sys.argv[0] = "kvdoctor"
sys.exit(main())
'''

_PREEMPT = re.compile(r"^(vllm:num_preemptions_total\{[^}]*\}) ([0-9.e+]+)$", re.M)
_SAMPLE = re.compile(r"^(vllm:[a-z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$")
_LE = re.compile(r',?le="[^"]*"')
#: gauges a serving engine moves every scrape: name → value at scrape n
_GAUGES = {
    "vllm:num_requests_running": lambda n: 24 + (n * 7) % 13,
    "vllm:num_requests_waiting": lambda n: (n * 3) % 5,
    "vllm:kv_cache_usage_perc": lambda n: 0.55 + (n * 37) % 40 / 100,
}


class BusyPage:
    """The page as a serving engine's /metrics moves it: every vLLM counter and histogram
    grows by a step that varies from scrape to scrape (so rates and quantiles over a window
    change too), bucket steps growing with ``le`` (cumulative buckets stay monotone), and the
    running / waiting / KV-usage gauges move. ``render(n)``: the page at scrape n (n rising)."""

    def __init__(self, page: str) -> None:
        self.lines: list[tuple[str, float, float] | str] = []
        groups: dict[str, int] = {}
        for line in page.splitlines():
            m = _SAMPLE.match(line)
            name = m.group(1) if m else ""
            if m and name in _GAUGES:
                self.lines.append((f"{name}{m.group(2) or ''}", float("nan"), 0.0))
                continue
            grows = (
                m and not name.endswith("_created") and name.endswith(("_total", "_bucket", "_count", "_sum"))
            )
            if not grows:
                self.lines.append(line)
                continue
            weight = 1.0
            if name.endswith("_bucket"):
                group = name + _LE.sub("", m.group(2) or "")
                i = groups[group] = groups.get(group, -1) + 1
                weight = min(1.0, (i + 1) / 6)  # non-decreasing with le
            elif name.endswith("_sum"):
                weight = 40.0
            self.lines.append((f"{name}{m.group(2) or ''}", float(m.group(3)), weight))
        self.cum = 0.0
        self.n = 0
        self.rng = random.Random(1)  # not periodic: a window's rate differs from the last one's

    def render(self, n: int) -> str:
        while self.n < n:
            self.n += 1
            self.cum += self.rng.randint(1, 5)  # this scrape's step
        out = []
        for item in self.lines:
            if isinstance(item, str):
                out.append(item)
            elif item[1] != item[1]:  # a gauge
                out.append(f"{item[0]} {_GAUGES[item[0].split('{')[0]](n)}")
            else:
                out.append(f"{item[0]} {item[1] + int(self.cum * item[2])}")
        return "\n".join(out) + "\n"


class FakeVllm:
    """Serves the page as a busy engine moves it (:class:`BusyPage`); ``steady``: as recorded,
    but for the preemption counter, which each scrape adds 1 to (the earlier bench's model).
    ``keep_alive``: HTTP/1.1 with TCP_NODELAY, as uvicorn's asyncio sockets (without NODELAY
    the page's second write waits for the delayed ACK of the first, ~40 ms a scrape: the
    stalls earlier keep-alive runs saw); else HTTP/1.0, one connection per scrape."""

    def __init__(self, keep_alive: bool = True, steady: bool = False) -> None:
        self.page = PAGE.read_text()
        busy = None if steady else BusyPage(self.page)
        self.n = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
            disable_nagle_algorithm = keep_alive

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                fake.n += 1
                if busy is not None:
                    body = busy.render(fake.n).encode()
                else:
                    body = _PREEMPT.sub(
                        lambda m: f"{m.group(1)} {float(m.group(2)) + fake.n}", fake.page
                    ).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the sidecar gave up on a slow answer (its --timeout): fine

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True  # kept connections end with the bench
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"


def baseline(url: str, runs: int = 50) -> float:
    """CPU seconds of one bare scrape + parse of the page, in this process (median-ish mean)."""
    from kvdoctor.sources.metrics import ScrapeClient, parse_metrics, scrape

    client = ScrapeClient()  # one client, as the sampler keeps
    try:
        for _ in range(5):
            parse_metrics(scrape(url, timeout=10.0, client=client)[0])
        t0 = time.process_time()
        for _ in range(runs):
            text, ts = scrape(url, timeout=10.0, client=client)
            parse_metrics(text, timestamp=ts)
    finally:
        client.close()
    return (time.process_time() - t0) / runs


def parse_figures(runs: int = 50) -> tuple[float, float, float]:
    """CPU s per page of (kvdoctor's parse with every kept line new, prometheus_client's text
    parser over the same lines, kvdoctor's parse of a page seen before), in this process."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvdoctor.sources import metrics as m

    text = PAGE.read_text()
    lines = [ln.rstrip() for ln in m._filter_re(tuple(sorted(m.READ_HISTOGRAMS))).findall("\n" + text)]
    pages = [text.replace("\n", f" {i}\n") for i in range(runs)]  # a timestamp: every line new
    t0 = time.process_time()
    for page in pages:
        m.parse_metrics(page)
    fresh = (time.process_time() - t0) / runs
    joined = [" \n".join(lines).replace(" \n", f" {i}\n") for i in range(runs)]
    t0 = time.process_time()
    for page in joined:
        list(text_string_to_metric_families(page))
    library = (time.process_time() - t0) / runs
    t0 = time.process_time()
    for _ in range(runs):
        m.parse_metrics(text)
    seen = (time.process_time() - t0) / runs
    return fresh, library, seen


def own_share(url: str, runs: int = 30) -> tuple[float, float, float]:
    """(CPU s of one read + evaluation, of the evaluation alone, of the sidecar's own work per
    cycle: transitions, then the memory breakdown, rates and /metrics text that the cycle's
    first scrape makes), in this process, over a Timeline of 60 snapshots (the rules' 60 s
    window at 1 s). Each evaluation is of a Timeline that just gained a snapshot (a fresh
    cycle, as the sidecar's): evaluating one Timeline again would mostly replay the pipeline's
    kept rule results. The read + evaluation figure includes the fake vLLM's threads (this
    process serves it); the other two are this thread's CPU only."""
    import io

    from kvdoctor.inputs import InputOptions, open_feed
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sidecar.server import Sidecar

    feed = open_feed(InputOptions(metrics=[url], no_nvml=True))
    sc = Sidecar(feed, Pipeline.load(), interval_s=1.0, out=io.StringIO())
    cycles = [sc.loop.step() for _ in range(60)]
    t0 = time.process_time()
    for _ in range(runs):
        cycles.append(sc.loop.step())
    step = (time.process_time() - t0) / runs
    evaluate = own = 0.0
    for _ in range(runs):
        cycle = sc.loop.step(evaluate=False)
        assert cycle is not None
        t0 = time.thread_time()
        cycle.report = sc.pipeline.evaluate(sc.loop.timeline)
        t1 = time.thread_time()
        sc.on_cycle(cycle)
        sc.metrics_page()
        evaluate, own = evaluate + t1 - t0, own + time.thread_time() - t1
    feed.close()
    return step, evaluate / runs, own / runs


def evaluations(base: str, retries: int = 0) -> float:
    """kvdoctor_evaluations_total from the sidecar's /metrics (5 s timeout, ``retries`` more)."""
    for attempt in range(retries + 1):
        try:
            text = httpx.get(base + "/metrics", timeout=5).text
            break
        except httpx.HTTPError:
            if attempt == retries:
                raise
    m = re.search(r"^kvdoctor_evaluations_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--duration", type=float, default=60.0, help="seconds to run (600 for the issue's figure)"
    )
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--history", type=float, default=600.0, help="the sidecar's --history, seconds")
    ap.add_argument(
        "--close-per-scrape",
        action="store_true",
        help="the fake vLLM answers HTTP/1.0, a connection per scrape (pessimistic; vLLM keeps "
        "connections alive)",
    )
    ap.add_argument(
        "--pod",
        action="store_true",
        help="run the sidecar in a PID namespace of its own (unshare; root), like a pod that sees a "
        "handful of processes rather than the whole host's",
    )
    ap.add_argument(
        "--steady",
        action="store_true",
        help="a page and GPUs that do not move between reads but for the preemption counter (the "
        "earlier bench's model; what every cache sees at its best): the default is a busy engine",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also print each part's thread CPU per cycle (the sidecar run under timing wrappers)",
    )
    ap.add_argument(
        "--scrape-every",
        type=float,
        default=15.0,
        help="seconds between the bench's scrapes of the sidecar's /metrics, as Prometheus's (15: the "
        "scrape_interval of deploy/prometheus/scrape-config.yaml; earlier runs used 5)",
    )
    args = ap.parse_args()

    fake = FakeVllm(keep_alive=not args.close_per_scrape, steady=args.steady)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "pynvml.py").write_text(FAKE_PYNVML)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, str(ROOT)]))
        env["KVDOCTOR_BENCH_STEADY"] = "1" if args.steady else "0"  # the fake pynvml's telemetry
        entry = ["-m", "kvdoctor"]
        if args.breakdown:
            Path(tmp, "timed_kvdoctor.py").write_text(BREAKDOWN)
            entry = [str(Path(tmp, "timed_kvdoctor.py"))]
            env["KVDOCTOR_BENCH_BREAKDOWN"] = str(Path(tmp, "breakdown.json"))
        cmd = [
            sys.executable,
            *entry,
            "sidecar",
            "--metrics",
            fake.url,
            "--listen",
            f"127.0.0.1:{port}",
        ]
        cmd += ["--interval", str(args.interval), "--history", str(args.history)]
        if args.pod:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
        parts: dict[str, float] | None = None
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ps = psutil.Process(proc.pid)
            if args.pod:  # measure the sidecar, not unshare
                deadline = time.monotonic() + 10
                while not ps.children() and time.monotonic() < deadline:
                    time.sleep(0.05)
                ps = ps.children()[0]
            deadline = time.monotonic() + 120  # a loaded host starts slowly
            while time.monotonic() < deadline:
                try:
                    if evaluations(base) >= 2:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                proc.terminate()  # before reading its stderr, which ends only with it
                _out, err = proc.communicate(timeout=10)
                print("sidecar did not start:", err.decode(errors="replace")[-2000:] if err else "")
                return 1
            c0, n0, t0 = sum(ps.cpu_times()[:2]), evaluations(base), time.monotonic()
            if args.breakdown:
                ps.send_signal(signal.SIGUSR1)  # the parts summed from here, as the figure is
            # Growth is read from when the Timeline holds --history of snapshots (it fills
            # until then, by design) when the run is long enough, else from a quarter of it.
            full = args.duration >= args.history + 60
            ref_s = args.history + 10 if full else args.duration / 4
            rss_q = None
            half = None
            slow = 0
            while (elapsed := time.monotonic() - t0) < args.duration:
                time.sleep(args.scrape_every)
                try:
                    evaluations(base)  # scraped like Prometheus would
                except httpx.HTTPError:
                    slow += 1  # a scrape past 5 s (a loaded host): counted, the run goes on
                if rss_q is None and elapsed >= ref_s:
                    rss_q = ps.memory_info().rss
                if half is None and elapsed >= args.duration / 2:
                    half = (sum(ps.cpu_times()[:2]), evaluations(base, retries=3))
            c1, n1 = sum(ps.cpu_times()[:2]), evaluations(base, retries=3)
            rss_end = ps.memory_info().rss
            if args.breakdown:
                parts = _breakdown(ps, Path(tmp, "breakdown.json"))
        finally:
            target = ps if args.pod else proc
            target.terminate()  # the sidecar itself: unshare does not pass SIGTERM on
            proc.wait(timeout=10)
    per_cycle = (c1 - c0) / max(1.0, n1 - n0)
    steady = (c1 - half[0]) / max(1.0, n1 - half[1]) if half else per_cycle
    base_cpu = baseline(fake.url)
    step_cpu, eval_cpu, own_cpu = own_share(fake.url)
    fresh_cpu, lib_cpu, seen_cpu = parse_figures()
    rss_q = rss_q or rss_end
    where = (
        "own PID namespace (pod-like)" if args.pod else f"host PID namespace, {len(psutil.pids())} processes"
    )
    conn = "a connection per scrape" if args.close_per_scrape else "kept alive"
    conn += ", steady" if args.steady else ", busy engine"
    print(
        f"sidecar, {args.duration:.0f} s at {args.interval:g} s interval, 55 KB /metrics page ({conn}), "
        f"8 GPUs, {where}"
    )
    print(
        f"  cycles                     {n1 - n0:.0f}   (its /metrics scraped every {args.scrape_every:g} s; "
        f"scrapes past 5 s: {slow})"
    )
    print(
        f"  CPU per cycle              {per_cycle * 1e3:.2f} ms   (second half {steady * 1e3:.2f} ms; budget 5 ms)"
    )
    where_ref = f"{ref_s:.0f} s, history full" if full else f"{ref_s:.0f} s, history still filling"
    print(f"  RSS at {where_ref:<27s} {rss_q / MiB:.1f} MiB")
    print(f"  RSS at the end             {rss_end / MiB:.1f} MiB   (budget 60 MiB)")
    print(f"  RSS growth since then      {(rss_end - rss_q) / MiB:+.1f} MiB")
    print(f"  baseline: scrape + parse   {base_cpu * 1e3:.2f} ms CPU (same page, this process)")
    print(f"  ratio cycle / baseline     {per_cycle / base_cpu:.1f}x")
    print(
        f"  parse, every line new      {fresh_cpu * 1e3:.2f} ms CPU (prometheus_client on those lines "
        f"{lib_cpu * 1e3:.2f} ms, {lib_cpu / fresh_cpu:.1f}x); a page seen before {seen_cpu * 1e3:.2f} ms"
    )
    print(
        f"  in-process: read+evaluate  {step_cpu * 1e3:.2f} ms CPU per cycle (psutil table of this host included)"
    )
    print(
        f"  in-process: evaluate only  {eval_cpu * 1e3:.2f} ms CPU per fresh cycle (derive + rules + report)"
    )
    print(
        f"  in-process: sidecar's own  {own_cpu * 1e3:.2f} ms CPU per cycle (transitions; breakdown, rates, "
        "/metrics text once)"
    )
    print(
        f"  load average (1, 5 min)    {os.getloadavg()[0]:.1f}, {os.getloadavg()[1]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"  host processes (the in-process figures' psutil scan sees them): {len(psutil.pids())}")
    if args.breakdown and parts is not None:
        cycles = max(1.0, n1 - n0)
        print("  breakdown, thread CPU per cycle over the same cycles (the timing wrappers add a little):")
        for label, sec in sorted(parts.items()):
            print(f"    {label:<34s} {sec / cycles * 1e3:6.2f} ms")
        timed = sum(v for k, v in parts.items() if not k.startswith("evaluate /"))  # no part twice
        print(f"    {'rest (threads, HTTP server, GC)':<34s} {(c1 - c0 - timed) / cycles * 1e3:6.2f} ms")
    return 0


def _breakdown(ps: psutil.Process, path: Path) -> dict[str, float] | None:
    """The wrapped sidecar's sums (SIGUSR2 writes them), seconds by part; None if it did not answer."""
    ps.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            return dict(json.loads(path.read_text())["cpu"])
        except (OSError, ValueError):
            time.sleep(0.1)
    return None


if __name__ == "__main__":
    sys.exit(main())
