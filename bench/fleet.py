#!/usr/bin/env python3
"""A fleet in a real Prometheus: ``kvdoctor diagnose --prometheus`` over N pods, timed.

Writes a test fleet as OpenMetrics (:func:`write_fleet`), backfills it into a TSDB with
``promtool tsdb create-blocks-from openmetrics`` (Debian's prometheus package), starts that
Prometheus on a loopback port, and runs ``kvdoctor diagnose --prometheus URL --since 15m`` as a
user does (a subprocess), printing its wall time and peak memory (the child's max RSS), and the
pods in trouble it reports.

The fleet (``--pods``, default 500; 15 minutes, a sample every 15 s): each pod serves
meta-llama/Llama-3.1-8B-Instruct on one H100, with

- vLLM's series: the families kvdoctor reads plus two latency histograms (time to first token,
  end-to-end), labels and starting values from a real vLLM 0.33.0 page
  (tests/data/metrics/vllm-0.33.0-sample.txt), counters growing, gauges per pod kind;
- DCGM exporter series as dcgm-exporter 4.x exports them scraped without honorLabels
  (``exported_namespace``/``exported_pod``; FB in MiB, GPU_UTIL in %);
- the kvdoctor sidecar's build info and GPU memory total.

Pod kinds (every 25th pod of each, the rest healthy): ``storm`` (30 preemptions a minute with the
KV cache full), ``idle`` (the GPU's memory held, no request for the whole window), ``kvsat``
(KV cache full, GPU 25 % busy), ``growth`` (GPU memory rising 6 GiB over the window).

Baseline, in the same run: the same command with every pod's series in one range query (as
kvdoctor did before it asked for 50 pods at a time).

usage: .venv/bin/python bench/fleet.py [--pods 500] [--keep DIR] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "tests" / "data" / "metrics" / "vllm-0.33.0-sample.txt"
MiB = 2**20
GiB = 2**30
KINDS = ("storm", "idle", "kvsat", "growth")
#: vLLM families written besides the ones kvdoctor reads (a real page has more of these).
EXTRA_FAMILIES = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
TOTAL_MIB = 81559  # H100 80GB HBM3 memory.total
_LINE = re.compile(r"^(vllm:[a-zA-Z0-9_:]+)(\{[^}]*\})? (\S+)$")


def pod_kind(i: int) -> str:
    """The kind of pod ``i``: one of :data:`KINDS` for i % 25 in 1..4, else "healthy"."""
    k = i % 25
    return KINDS[k - 1] if 1 <= k <= len(KINDS) else "healthy"


def _template() -> list[tuple[str, str, float]]:
    """(name, labels inside the braces, value) of the real page's lines the fleet keeps."""
    from kvdoctor.sources.metrics import _INFO, _SCALAR_NAMES, _SLEEP, READ_HISTOGRAMS

    keep_hist = tuple(READ_HISTOGRAMS) + EXTRA_FAMILIES
    out = []
    for line in PAGE.read_text().splitlines():
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        name = m.group(1)
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if name in _SCALAR_NAMES or name in (_INFO, _SLEEP) or base in keep_hist:
            out.append((name, (m.group(2) or "{}")[1:-1], float(m.group(3))))
    names = {n for n, _, _ in out}
    for must in ("vllm:num_preemptions_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_running"):
        if must not in names:
            out.append((must, 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"', 0.0))
    return out


def _vllm_value(name: str, v0: float, kind: str, t: float) -> float:
    """The value of a vLLM series of a ``kind`` pod ``t`` seconds into the window."""
    counter = name.endswith(("_total", "_count", "_sum", "_bucket"))
    if name == "vllm:num_preemptions_total":
        return v0 + (t * 0.5 if kind == "storm" else 0.0)  # 30 a minute
    if counter:
        return v0 if kind == "idle" else v0 * (1 + t / 3600.0)
    gauges = {
        "healthy": {"vllm:kv_cache_usage_perc": 0.35, "vllm:num_requests_running": 8, "vllm:num_requests_waiting": 0},
        "storm": {"vllm:kv_cache_usage_perc": 0.97, "vllm:num_requests_running": 48, "vllm:num_requests_waiting": 12},
        "idle": {"vllm:kv_cache_usage_perc": 0.0, "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0},
        "kvsat": {"vllm:kv_cache_usage_perc": 0.96, "vllm:num_requests_running": 64, "vllm:num_requests_waiting": 20},
        "growth": {"vllm:kv_cache_usage_perc": 0.4, "vllm:num_requests_running": 8, "vllm:num_requests_waiting": 0},
    }  # fmt: skip
    return float(gauges[kind].get(name, v0))


def _dcgm(kind: str, t: float, span: float) -> dict[str, float]:
    used = {"idle": 0.93, "growth": 0.74}.get(kind, 0.92) * TOTAL_MIB
    if kind == "growth":
        used += 6 * 1024 * (t / span)
    util = {"idle": 0.0, "kvsat": 25.0}.get(kind, 85.0)
    return {
        "DCGM_FI_DEV_FB_USED": round(used),
        "DCGM_FI_DEV_FB_FREE": TOTAL_MIB - round(used) - 559,
        "DCGM_FI_DEV_FB_RESERVED": 559,
        "DCGM_FI_DEV_GPU_UTIL": util,
    }


def fleet_lines(pods: int, minutes: float, end: float, step: float = 15.0) -> Iterator[str]:
    """The fleet as OpenMetrics text lines (no TYPE lines: every family "unknown"), each family's
    series together and each series' samples in time order, then ``# EOF``."""
    span = minutes * 60.0
    times = [end - span + i * step for i in range(int(span / step) + 1)]
    template = _template()
    ids = [(i, f"ml-{i % 5}", f"vllm-{i:04d}", pod_kind(i)) for i in range(pods)]
    by_name: dict[str, list[tuple[str, float]]] = {}
    for name, labels, v0 in template:
        by_name.setdefault(name, []).append((labels, v0))
    for name, series in by_name.items():
        for _i, ns, pod, kind in ids:
            for labels, v0 in series:
                lab = f'{labels},namespace="{ns}",pod="{pod}"'.lstrip(",")
                for t in times:
                    yield f"{name}{{{lab}}} {_vllm_value(name, v0, kind, t - times[0]):.6g} {t:.3f}"
    for field in (
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_GPU_UTIL",
    ):
        for i, ns, pod, kind in ids:
            lab = (
                f'gpu="0",UUID="GPU-{i:08d}-0000-0000-0000-000000000000",device="nvidia0",'
                f'modelName="NVIDIA H100 80GB HBM3",hostname="node-{i // 8}",namespace="gpu-operator",'
                f'pod="nvidia-dcgm-exporter-{i // 8}",exported_namespace="{ns}",exported_pod="{pod}",'
                f'container="vllm"'
            )
            for t in times:
                yield f"{field}{{{lab}}} {_dcgm(kind, t - times[0], span)[field]:g} {t:.3f}"
    for _i, ns, pod, _kind in ids:
        for t in times:
            yield f'kvdoctor_build_info{{version="0.1.0",namespace="{ns}",pod="{pod}"}} 1 {t:.3f}'
    yield "# EOF"


def write_fleet(path: Path, pods: int, minutes: float = 15.0, end: float | None = None) -> int:
    """Write the fleet's OpenMetrics to ``path``; returns the number of samples."""
    end = time.time() - 30.0 if end is None else end
    n = 0
    with path.open("w") as f:
        for line in fleet_lines(pods, minutes, end):
            f.write(line + "\n")
            n += 1
    return n - 1


def backfill(openmetrics: Path, tsdb: Path) -> None:
    """``promtool tsdb create-blocks-from openmetrics`` (raises CalledProcessError)."""
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(openmetrics), str(tsdb)],
        check=True,
        capture_output=True,
        text=True,
    )


def start_prometheus(tsdb: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A Prometheus serving ``tsdb`` on 127.0.0.1:``port`` (no scrape jobs); waits until ready."""
    import httpx

    (workdir / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={tsdb}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=30d",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((workdir / "prometheus.log").read_text()[-2000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("prometheus did not get ready in 60 s")


_RUN = (
    "import atexit, resource, runpy, sys\n"
    "def _done(r=resource):\n"
    "    u = r.getrusage(r.RUSAGE_SELF)\n"
    "    sys.stderr.write('\\nmaxrss_kb=%d cpu_s=%.3f\\n' % (u.ru_maxrss, u.ru_utime + u.ru_stime))\n"
    "atexit.register(_done)\n"
    "batch = sys.argv.pop(1)\n"
    "if batch != 'default':\n"
    "    import kvdoctor.sources.prometheus as p; p.POD_BATCH = int(batch)\n"
    "sys.argv = ['kvdoctor'] + sys.argv[1:]\n"
    "runpy.run_module('kvdoctor', run_name='__main__')\n"
)


def diagnose(
    url: str, since: str = "15m", pod_batch: int | None = None
) -> tuple[float, float, int, dict[str, Any] | None, str]:
    """``kvdoctor diagnose --prometheus URL --since SINCE --format json`` as a subprocess
    (``pod_batch``: its POD_BATCH, else the default): (wall seconds, its CPU seconds and peak RSS
    in bytes (its own getrusage, written at exit), the JSON report or None, stderr)."""
    t0 = time.perf_counter()
    batch = "default" if pod_batch is None else str(pod_batch)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN,
            batch,
            "diagnose",
            "--prometheus",
            url,
            "--since",
            since,
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    m = re.search(r"maxrss_kb=(\d+) cpu_s=([0-9.]+)", r.stderr)
    peak = int(m.group(1)) * 1024 if m else 0
    cpu = float(m.group(2)) if m else 0.0
    try:
        report = json.loads(r.stdout)
    except ValueError:
        report = None
    return wall, cpu, peak, report, r.stderr.replace(m.group(0), "").strip() if m else r.stderr.strip()


def pods_in_trouble(report: dict[str, Any]) -> dict[str, list[str]]:
    """pod → rule ids of its findings, in the report's order (root cause first)."""
    out: dict[str, list[str]] = {}
    for f in report.get("findings", []):
        pod = str(f.get("engine", "")).split(":", 1)[0]
        out.setdefault(pod, []).append(f["rule"])
    return out


def _free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--keep", type=Path, help="keep the OpenMetrics and TSDB in this directory")
    ap.add_argument(
        "--no-baseline", dest="baseline", action="store_false", help="skip the one-query baseline run"
    )
    args = ap.parse_args()
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        print("needs promtool and prometheus (apt-get install prometheus)", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvdoctor-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = write_fleet(work / "fleet.om", args.pods, args.minutes)
    t1 = time.perf_counter()
    backfill(work / "fleet.om", work / "tsdb")
    t2 = time.perf_counter()
    print(f"fleet: {args.pods} pods, {args.minutes:g} min, {samples:,} samples "
          f"({(work / 'fleet.om').stat().st_size / MiB:.0f} MiB OpenMetrics) written in {t1 - t0:.1f} s, "
          f"backfilled by promtool in {t2 - t1:.1f} s")  # fmt: skip
    port = _free_port()
    prom = start_prometheus(work / "tsdb", port, work)
    url, since = f"http://127.0.0.1:{port}", f"{args.minutes:g}m"
    try:
        wall, cpu, peak, report, err = diagnose(url, since)
        base = diagnose(url, since, pod_batch=10**9) if args.baseline else None
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    from kvdoctor.sources.prometheus import POD_BATCH

    print(
        f"diagnose --prometheus ({POD_BATCH} pods a query): {wall:.1f} s wall, {cpu:.1f} s CPU "
        f"({cpu / args.pods * 1000:.0f} ms per pod), peak memory {peak / MiB:.0f} MiB (Prometheus' own CPU "
        f"not counted; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )
    if base is not None:
        b_wall, b_cpu, b_peak, b_report, b_err = base
        verdict = (
            f"{b_wall:.1f} s wall, {b_cpu:.1f} s CPU, peak memory {b_peak / MiB:.0f} MiB "
            f"(x{b_peak / max(peak, 1):.1f} the memory)"
            if b_report is not None
            else f"failed after {b_wall:.1f} s, peak memory {b_peak / MiB:.0f} MiB: {b_err.splitlines()[-1][:200]}"
        )
        print(f"baseline, every pod in one query: {verdict}")
    if report is None:
        print(f"no report: {err[-500:]}")
        return 1
    trouble = pods_in_trouble(report)
    expected = {f"ml-{i % 5}/vllm-{i:04d}": pod_kind(i) for i in range(args.pods) if pod_kind(i) != "healthy"}
    print(f"pods in trouble: {len(trouble)} (the fleet has {len(expected)} non-healthy pods), worst first:")
    for pod, rules in list(trouble.items())[:8]:
        print(f"  {pod} ({expected.get(pod, 'healthy')}): {', '.join(rules)}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
