"""Write a support bundle (spec/bundle.md) from any input: live, a bundle, artifacts, a recording.

What the inputs gave as files (a bundle's files, ``--log F``, ``--metrics DIR``, …) is copied
under its bundle name; what was read live or replayed is rendered back into the formats
kvdoctor reads: GPUs (NVML) as an ``nvidia-smi --query-gpu`` CSV with a ``timestamp`` column
(one row per GPU per read, like ``nvidia-smi -l``), their processes as ``compute-apps.csv``,
/metrics scrapes as ``metrics/<unix-seconds>.txt`` (the page text as it came when known),
launch commands as ``cmdline.txt``, the model's ``config.json``, ``env.txt``, ``ps.txt`` and
``dmesg.txt``. On a live host ``nvidia-smi -q -x``, ``--query-compute-apps`` and ``ps`` are run
where the tools exist. Every text passes through redaction (``kvdoctor.redact``; prompt text
in logs through ``kvdoctor.sources.vllm_log.redact``). ``manifest.json`` says what was written,
from where, and what failed and why. Nothing here decides a diagnosis.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvdoctor.facts import EngineMetrics, Gpu, GpuProcess, HostProcess, Snapshot, Timeline, VllmLog

MANIFEST_SCHEMA = "kvdoctor.bundle-manifest/1"
#: a copied file larger than this is cut (a log keeps its head and tail)
MAX_FILE_BYTES = 64 * 1024 * 1024
_LOG_HEAD_BYTES = 8 * 1024 * 1024
#: seconds a live tool (nvidia-smi, ps) may run
TOOL_TIMEOUT_S = 15.0


@dataclass
class ManifestEntry:
    """One line of ``manifest.json``: ``file`` in the bundle, its ``kind`` (spec/report.md
    source kinds), ``source`` (where it came from: a path, a URL, "NVML", a command),
    ``status`` ok|missing|error and a one-line ``detail``; ``bytes`` written."""

    file: str
    kind: str
    source: str
    status: str
    detail: str = ""
    bytes: int = 0


@dataclass
class Manifest:
    """What a bundle holds (``manifest.json``)."""

    input: str
    entries: list[ManifestEntry] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    def add(self, file: str, kind: str, source: str, status: str, detail: str = "", size: int = 0) -> None:
        """Record one file (or one failure); a URL password in its source or detail (``--metrics
        http://user:pw@…``) is redacted."""
        from kvdoctor.redact import redact_url_credentials

        source, detail = redact_url_credentials(source), redact_url_credentials(detail)
        self.entries.append(ManifestEntry(file, kind, source, status, detail, size))

    def has(self, file: str) -> bool:
        """True when ``file`` was written."""
        return any(e.file == file and e.status == "ok" for e in self.entries)

    def to_json(self) -> str:
        """The manifest as JSON text."""
        from kvdoctor import __version__

        return json.dumps(
            {
                "schema": MANIFEST_SCHEMA,
                "created": self.created,
                "kvdoctor": __version__,
                "host": socket.gethostname(),
                "input": self.input,
                "redacted": True,
                "files": [asdict(e) for e in self.entries],
            },
            indent=2,
        )


# --------------------------------------------------------------------------- redaction


def redact_log_text(text: str) -> str:
    """A vLLM log with secrets, prompt and model output text redacted, line by line (a prompt
    logged with raw newlines: its next lines too)."""
    from kvdoctor.sources.vllm_log import redact_lines

    return "".join(redact_lines(text.splitlines(keepends=True)))


def redact_env_text(text: str) -> str:
    """``KEY=VALUE`` lines with secret variables' values replaced by ``***``."""
    from kvdoctor.redact import MARK, is_secret_env_name, redact_text

    out = []
    for line in text.splitlines(keepends=True):
        body = line.strip()
        key, sep, value = body.removeprefix("export ").partition("=")
        if sep and is_secret_env_name(key.strip()) and value.strip():
            nl = "\n" if line.endswith("\n") else ""
            out.append(f"{key.strip()}={MARK}{nl}")
        else:
            out.append(redact_text(line))
    return "".join(out)


def _redact_plain(text: str) -> str:
    from kvdoctor.redact import redact_text

    return redact_text(text)


def _keep(text: str) -> str:
    """Every other file (metrics pages, nvidia-smi, config.json): shapes kept, URL passwords
    (a ``model_name`` label that is a URL with credentials) redacted."""
    from kvdoctor.redact import redact_url_credentials

    return redact_url_credentials(text)


#: bundle file name → how its text is redacted
_REDACTORS = {
    "vllm.log": redact_log_text,
    "env.txt": redact_env_text,
    "cmdline.txt": _redact_plain,
    "engine-args.json": _redact_plain,
    "engine-args.yaml": _redact_plain,
    "ps.txt": _redact_plain,
    "dmesg.txt": _redact_plain,
}


# --------------------------------------------------------------------------- rendering facts


def _mib(v: int | None) -> str:
    return "[N/A]" if v is None else str(int(round(v / 2**20)))


def _pct(v: float | None) -> str:
    return "[N/A]" if v is None else f"{v * 100:g}"


def _num(v: float | None) -> str:
    return "[N/A]" if v is None else f"{v:g}"


def _ts(v: float | None) -> str:
    if v is None:
        return "[N/A]"
    return datetime.fromtimestamp(v, tz=timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def render_gpu_csv(moments: list[list[Gpu]]) -> str:
    """GPU readings as ``nvidia-smi --query-gpu=timestamp,index,… --format=csv`` (MiB, %, UTC
    timestamps: the ``-l`` loop shape ``sources.nvidia_smi.parse_query_gpu_csv`` reads)."""
    reasons = sorted({r for m in moments for g in m for r in g.clock_event_reasons})
    header = [
        "timestamp",
        "index",
        "name",
        "uuid",
        "pci.bus_id",
        "memory.total [MiB]",
        "memory.used [MiB]",
        "utilization.gpu [%]",
        "utilization.memory [%]",
        "temperature.gpu",
        "power.draw [W]",
        "power.limit [W]",
        "mig.mode.current",
        "ecc.errors.uncorrected.volatile.total",
        *[f"clocks_event_reasons.{r}" for r in reasons],
    ]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for moment in moments:
        for g in moment:
            mig = "[N/A]" if g.mig_enabled is None else ("Enabled" if g.mig_enabled else "Disabled")
            w.writerow(
                [
                    _ts(g.timestamp),
                    g.index,
                    g.name or "[N/A]",
                    g.uuid or "[N/A]",
                    g.bus_id or "[N/A]",
                    _mib(g.memory_total_bytes),
                    _mib(g.memory_used_bytes),
                    _pct(g.utilization_gpu),
                    _pct(g.utilization_memory),
                    _num(g.temperature_c),
                    _num(g.power_w),
                    _num(g.power_limit_w),
                    mig,
                    "[N/A]" if g.ecc_uncorrectable is None else g.ecc_uncorrectable,
                    *["Active" if r in g.clock_event_reasons else "Not Active" for r in reasons],
                ]
            )
    return buf.getvalue()


def render_compute_apps_csv(gpus: list[Gpu]) -> str | None:
    """The GPUs' processes as ``nvidia-smi --query-compute-apps=gpu_uuid,gpu_bus_id,pid,
    process_name,used_memory --format=csv``; None when no GPU has any."""
    rows: list[tuple[Gpu, GpuProcess]] = [(g, p) for g in gpus for p in g.processes]
    if not rows:
        return None
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["gpu_uuid", "gpu_bus_id", "pid", "process_name", "used_memory [MiB]"])
    for g, p in rows:
        w.writerow(
            [
                p.gpu_uuid or g.uuid or "[N/A]",
                p.gpu_bus_id or g.bus_id or "[N/A]",
                p.pid,
                p.name or "[N/A]",
                _mib(p.used_bytes),
            ]
        )
    return buf.getvalue()


def _labels(em: EngineMetrics, extra: dict[str, str] | None = None) -> str:
    lab: dict[str, str] = {}
    if em.engine is not None:
        lab["engine"] = em.engine
    if em.model_name is not None:
        lab["model_name"] = em.model_name
    lab.update(extra or {})
    if not lab:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in lab.items())
    return "{" + body + "}"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _le(v: float) -> str:
    return "+Inf" if math.isinf(v) else repr(float(v))


_COUNTERS = (
    ("num_preemptions_total", "vllm:num_preemptions_total"),
    ("prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("generation_tokens_total", "vllm:generation_tokens_total"),
    ("request_success_total", "vllm:request_success_total"),
    ("prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    ("prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    ("spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
)


def render_metrics_text(metrics: list[EngineMetrics]) -> str:
    """EngineMetrics back as a Prometheus text page with vLLM's names (vllm-facts.md §1), one
    that ``sources.metrics.parse_metrics`` reads back to the same values: used when the page
    text itself is not at hand (a recording)."""
    out: list[str] = []
    for em in metrics:
        if not em.stats_enabled:
            out.append('http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1')
            continue
        lab = _labels(em)
        if em.kv_cache_usage is not None:
            name = "vllm:kv_cache_usage_perc" if em.engine_generation == "v1" else "vllm:gpu_cache_usage_perc"
            out.append(f"{name}{lab} {em.kv_cache_usage!r}")
        for attr, name in (
            ("num_requests_running", "vllm:num_requests_running"),
            ("num_requests_waiting", "vllm:num_requests_waiting"),
            ("num_requests_swapped", "vllm:num_requests_swapped"),
        ):
            v = getattr(em, attr)
            if v is not None:
                out.append(f"{name}{lab} {float(v)!r}")
        for attr, name in _COUNTERS:
            v = getattr(em, attr)
            if v is not None:
                out.append(f"{name}{lab} {float(v)!r}")
        for base, h in em.histograms.items():
            if (
                base == "vllm:inter_token_latency_seconds"
                and "vllm:time_per_output_token_seconds" in em.histograms
            ):
                continue  # the reader fills it from the old name
            for le, count in h.buckets:
                out.append(f"{base}_bucket{_labels(em, {'le': _le(le)})} {float(count)!r}")
            out.append(f"{base}_count{lab} {float(h.count)!r}")
            out.append(f"{base}_sum{lab} {float(h.sum)!r}")
        for state, v in em.sleep_state.items():
            out.append(f"vllm:engine_sleep_state{_labels(em, {'sleep_state': state})} {float(v)!r}")
        if em.cache_config:
            # vLLM labels it with the engine and the config only (no model_name)
            info = {"engine": em.engine} if em.engine is not None else {}
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in {**info, **em.cache_config}.items())
            out.append(f"vllm:cache_config_info{{{body}}} 1.0")
    return "\n".join(out) + "\n"


def render_ps_text(procs: list[HostProcess]) -> str:
    """Host processes as ``ps -eo pid,ppid,pcpu,rss,etime,comm,args`` (rss KiB; etime from
    ``create_time``)."""
    from kvdoctor.redact import redact_argv

    now = time.time()
    lines = ["    PID    PPID %CPU   RSS     ELAPSED COMMAND         COMMAND"]
    for p in procs:
        etime = "00:00"
        if p.create_time:
            secs = max(0, int(now - p.create_time))
            d, rem = divmod(secs, 86400)
            h, rem = divmod(rem, 3600)
            m, s = divmod(rem, 60)
            etime = (f"{d}-" if d else "") + (f"{h:02d}:" if h or d else "") + f"{m:02d}:{s:02d}"
        args = " ".join(redact_argv(p.cmdline)) if p.cmdline else p.name
        lines.append(
            f"{p.pid:>7} {p.ppid if p.ppid is not None else 0:>7} "
            f"{(p.cpu_percent or 0.0):>4.1f} {(p.rss_bytes or 0) // 1024:>5} {etime:>11} "
            f"{(p.name or '?')[:15]:<15} {args}"
        )
    return "\n".join(lines) + "\n"


def render_log_text(log: VllmLog) -> str:
    """A parsed log's events back as vLLM log lines (``(PROCESS pid=N) LEVEL MM-DD HH:MM:SS
    [file:line] message``, vllm-facts.md §3.1), one per source line, in file order: for a
    recording, which keeps the events and not the lines. Lines that were no event (most of a
    traceback) are not there."""
    out: list[str] = []
    seen: set[int] = set()
    for e in sorted(log.events, key=lambda ev: ev.line):
        if e.line in seen or not e.text:
            continue
        seen.add(e.line)
        prefix = f"({e.process} pid={e.pid}) " if e.process and e.pid is not None else ""
        head = f"{e.level} {e.time} [kvdoctor-bundle:{e.line}] " if e.level and e.time else ""
        out.append(f"{prefix}{head}{e.text}")
    return "\n".join(out) + ("\n" if out else "")


def render_cmdline_text(snap: Snapshot) -> str | None:
    """Launch commands, one per line (redacted): the API servers' command lines when the
    process table is known, else each engine config's ``command``; None when there is none."""
    import shlex

    from kvdoctor.redact import redact_argv

    cmds = [
        shlex.join(redact_argv(p.cmdline))
        for p in snap.processes
        if p.vllm_role == "api_server" and p.cmdline
    ]
    if not cmds:
        cmds = [c.command for c in snap.configs if c.command]
    if not cmds:
        return None
    return _redact_plain("\n".join(cmds) + "\n")


# --------------------------------------------------------------------------- writing


def _write(root: Path, manifest: Manifest, name: str, kind: str, source: str, text: str) -> None:
    data = _REDACTORS.get(Path(name).name, _keep)(text).encode("utf-8")
    target = root / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    manifest.add(name, kind, source, "ok", "", len(data))


def _read_bounded(path: Path, *, log: bool = False) -> tuple[str, str]:
    """The file's text (bytes decoded as UTF-8, bad bytes replaced) and a note when cut."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size <= MAX_FILE_BYTES:
            return fh.read().decode("utf-8", errors="replace"), ""
        if not log:
            raise ValueError(f"larger than {MAX_FILE_BYTES // 2**20} MiB")
        head = fh.read(_LOG_HEAD_BYTES)
        fh.seek(size - (MAX_FILE_BYTES - _LOG_HEAD_BYTES))
        tail = fh.read()
    # whole lines only; the startup lines (version, args, KV cache size) are in the head
    head = head[: head.rfind(b"\n") + 1]
    tail = tail[tail.find(b"\n") + 1 :]
    note = f"cut to the first {_LOG_HEAD_BYTES // 2**20} MiB and the last {(MAX_FILE_BYTES - _LOG_HEAD_BYTES) // 2**20} MiB"
    return (head + tail).decode("utf-8", errors="replace"), note


def _copy(root: Path, manifest: Manifest, src: Path, name: str, kind: str) -> None:
    """Copy one input file under its bundle name, redacted; failures go into the manifest."""
    if manifest.has(name):
        return  # an artifact given beside the bundle came first and wins
    try:
        text, note = _read_bounded(src, log=name == "vllm.log")
    except (OSError, ValueError) as e:
        manifest.add(name, kind, str(src), "error", f"{src}: {getattr(e, 'strerror', None) or e}")
        return
    _write(root, manifest, name, kind, str(src), text)
    if note:
        manifest.entries[-1].detail = note


def _smi_name(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".csv": "nvidia-smi.csv", ".xml": "nvidia-smi.xml"}.get(suffix, "nvidia-smi.txt")


def copy_inputs(root: Path, manifest: Manifest, opts: Any) -> None:
    """Copy the file inputs of ``opts`` (:class:`~kvdoctor.inputs.InputOptions`): single
    artifacts first (they win over a bundle's own files, as in ``diagnose``), then the
    bundle's files (a ``.tar.gz`` is unpacked, with ``sources.bundle``'s safe extractor)."""
    from kvdoctor.sources.bundle import BUNDLE_FILES

    for p in opts.nvidia_smi:
        _copy(root, manifest, Path(p), _smi_name(Path(p)), "nvidia-smi")
    if opts.compute_apps:
        _copy(root, manifest, opts.compute_apps, "compute-apps.csv", "nvidia-smi")
    if opts.log:
        _copy(root, manifest, opts.log, "vllm.log", "log")
    for m in opts.metrics:
        if m.lower().startswith(("http://", "https://")):
            continue
        mp = Path(m)
        if mp.is_dir():
            for f in sorted(mp.glob("*.txt")):
                _copy(root, manifest, f, f"metrics/{f.name}", "metrics")
        elif mp.name[:1].isdigit() and mp.suffix == ".txt":
            _copy(root, manifest, mp, f"metrics/{mp.name}", "metrics")
        else:
            _copy(root, manifest, mp, "metrics.txt", "metrics")
    if opts.cmdline:
        cp = Path(opts.cmdline) if len(opts.cmdline) < 4096 and "\n" not in opts.cmdline else None
        if cp is not None and cp.is_file():
            name = {".json": "engine-args.json", ".yaml": "engine-args.yaml", ".yml": "engine-args.yaml"}.get(
                cp.suffix.lower(), "cmdline.txt"
            )
            _copy(root, manifest, cp, name, "cmdline")
        else:
            _write(root, manifest, "cmdline.txt", "cmdline", "--cmdline", opts.cmdline + "\n")
    if opts.model_config:
        _copy(root, manifest, opts.model_config, "config.json", "config")
    if opts.env_file:
        _copy(root, manifest, opts.env_file, "env.txt", "env")
    if opts.ps_file:
        _copy(root, manifest, opts.ps_file, "ps.txt", "processes")
    if opts.dmesg_file:
        _copy(root, manifest, opts.dmesg_file, "dmesg.txt", "log")
    bundle = _bundle_dir(opts)
    if bundle is None:
        return
    with tempfile.TemporaryDirectory(prefix="kvdoctor-repack-") as tmp:
        src = bundle
        if bundle.is_file():
            from kvdoctor.sources.bundle import _extract_tar

            src, _skipped = _extract_tar(bundle, Path(tmp))
        for path in sorted(src.rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            rel = path.relative_to(src)
            parts = rel.parts
            known = parts[-1] in BUNDLE_FILES or (len(parts) >= 2 and parts[-2] == "metrics")
            if not known or rel.name == "manifest.json":
                continue
            kind = BUNDLE_FILES.get(parts[-1], "metrics")
            if len(parts) >= 2 and parts[-2] == "metrics":
                kind = "metrics"
            _copy(root, manifest, path, rel.as_posix(), kind)


def _bundle_dir(opts: Any) -> Path | None:
    if opts.demo:
        from kvdoctor.inputs import demo_bundle_dir

        return demo_bundle_dir()
    return Path(opts.bundle) if opts.bundle is not None else None


def render_facts(
    root: Path,
    manifest: Manifest,
    timeline: Timeline,
    raw_metrics: list[tuple[float, str, str]],
    source: str,
) -> None:
    """Render what the inputs read (live or replayed) into bundle files not copied already.

    ``raw_metrics``: (unix seconds, URL, page text) of each scrape, written as they came; the
    first endpoint's scrapes go to ``metrics/`` (a bundle holds one endpoint's series), others
    to ``metrics-2/`` … and are listed as such in the manifest."""
    latest = timeline.latest or Snapshot()
    if not any(manifest.has(n) for n in ("nvidia-smi.txt", "nvidia-smi.csv", "nvidia-smi.xml")):
        moments = timeline.gpu_moments() or ([latest.gpus] if latest.gpus else [])
        if moments:
            _write(root, manifest, "nvidia-smi.csv", "nvidia-smi", source, render_gpu_csv(moments))
    if not manifest.has("compute-apps.csv"):
        apps = render_compute_apps_csv(latest.gpus)
        if apps is not None:
            _write(root, manifest, "compute-apps.csv", "nvidia-smi", source, apps)
    have_metrics = any(e.file.startswith("metrics") and e.status == "ok" for e in manifest.entries)
    if not have_metrics:
        if raw_metrics:
            urls: list[str] = []
            for ts, url, text in raw_metrics:
                if url not in urls:
                    urls.append(url)
                folder = "metrics" if url == urls[0] else f"metrics-{urls.index(url) + 1}"
                _write(root, manifest, f"{folder}/{ts:.3f}.txt", "metrics", url, text)
                if folder != "metrics":
                    manifest.entries[-1].detail = "another endpoint: not read by diagnose --bundle"
        else:
            for snap in timeline.snapshots:
                if snap.metrics and snap.timestamp is not None:
                    name = f"metrics/{snap.timestamp:.3f}.txt"
                    _write(root, manifest, name, "metrics", source, render_metrics_text(snap.metrics))
                    manifest.entries[-1].detail = "rendered from the parsed scrape"
    if not any(manifest.has(n) for n in ("cmdline.txt", "engine-args.json", "engine-args.yaml")):
        # The newest snapshot that knew the launch commands: on a loaded host the latest
        # process-table read may have timed out, and the engine's flags would be lost.
        cmd = next(
            (c for snap in reversed(timeline.snapshots) if (c := render_cmdline_text(snap)) is not None),
            None,
        )
        if cmd is not None:
            _write(root, manifest, "cmdline.txt", "cmdline", source, cmd)
    if not manifest.has("config.json") and latest.model is not None and latest.model.raw:
        _write(root, manifest, "config.json", "config", source, json.dumps(latest.model.raw, indent=2) + "\n")
    if not manifest.has("env.txt") and latest.env:
        from kvdoctor.redact import redact_env

        env = redact_env(latest.env)
        _write(root, manifest, "env.txt", "env", source, "".join(f"{k}={v}\n" for k, v in env.items()))
    if not manifest.has("ps.txt") and latest.process_table_known and latest.processes:
        _write(root, manifest, "ps.txt", "processes", source, render_ps_text(latest.processes))
    if not manifest.has("dmesg.txt") and latest.xid_events:
        text = "".join(f"{e.get('message', '')}\n" for e in latest.xid_events)
        _write(root, manifest, "dmesg.txt", "log", source, text)
    if not manifest.has("vllm.log"):
        if latest.log is not None and latest.log.events:
            _write(root, manifest, "vllm.log", "log", source, render_log_text(latest.log))
            manifest.entries[
                -1
            ].detail = f"rendered from {len(latest.log.events)} parsed event(s); lines that were no event are not kept"
        else:
            manifest.add("vllm.log", "log", source, "missing", "no log given (--log FILE)")


#: live tools: bundle file → (kind, argv)
LIVE_TOOLS: dict[str, tuple[str, list[str]]] = {
    "nvidia-smi.xml": ("nvidia-smi", ["nvidia-smi", "-q", "-x"]),
    "compute-apps.csv": (
        "nvidia-smi",
        [
            "nvidia-smi",
            "--query-compute-apps=gpu_uuid,gpu_bus_id,pid,process_name,used_memory",
            "--format=csv",
        ],
    ),
    "ps.txt": ("processes", ["ps", "-eo", "pid,ppid,pcpu,rss,etime,comm,args"]),
}


def run_tools(root: Path, manifest: Manifest, *, timeout_s: float = TOOL_TIMEOUT_S) -> None:
    """On a live host: run ``nvidia-smi -q -x``, ``nvidia-smi --query-compute-apps`` and
    ``ps`` where they exist (PATH), each bounded by ``timeout_s`` and 64 MiB of output; a tool
    that is absent or fails is recorded in the manifest with why."""
    for name, (kind, argv) in LIVE_TOOLS.items():
        cmd = " ".join(argv)
        exe = shutil.which(argv[0])
        if exe is None:
            manifest.add(name, kind, cmd, "missing", f"{argv[0]} not found on PATH")
            continue
        try:
            proc = subprocess.run(
                [exe, *argv[1:]],
                capture_output=True,
                timeout=timeout_s,
                check=False,
                env={**os.environ, "LC_ALL": "C"},
            )
        except subprocess.TimeoutExpired:
            manifest.add(name, kind, cmd, "error", f"timed out after {timeout_s:g}s")
            continue
        except OSError as e:
            manifest.add(name, kind, cmd, "error", f"cannot run: {e.strerror or e}")
            continue
        if proc.returncode != 0:
            first = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip().splitlines()
            reason = first[0][:200] if first else ""
            manifest.add(name, kind, cmd, "error", f"exit {proc.returncode}: {reason}".rstrip(": "))
            continue
        text = proc.stdout[:MAX_FILE_BYTES].decode("utf-8", errors="replace")
        # a tool's reading replaces one rendered from the same facts
        manifest.entries = [e for e in manifest.entries if e.file != name]
        _write(root, manifest, name, kind, cmd, text)


def finish(root: Path, manifest: Manifest, out: Path) -> Path:
    """Write ``manifest.json`` and move the staged bundle to ``out`` (a directory, or a
    ``.tar.gz`` / ``.tgz`` holding one top-level directory). Returns ``out``."""
    (root / "manifest.json").write_text(manifest.to_json() + "\n", encoding="utf-8")
    if out.name.endswith((".tar.gz", ".tgz")):
        top = out.name.removesuffix(".tar.gz").removesuffix(".tgz") or "bundle"
        tmp = out.with_name(out.name + ".part")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(root, arcname=top)
        os.replace(tmp, out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        for item in root.iterdir():
            target = out / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            shutil.move(str(item), str(target))
    return out


def write_bundle(
    timeline: Timeline,
    out: Path,
    *,
    source: str,
    opts: Any = None,
    raw_metrics: list[tuple[float, str, str]] | None = None,
    live: bool = False,
) -> Manifest:
    """Write a whole support bundle from what was read: the given input files copied (``opts``,
    :class:`kvdoctor.inputs.InputOptions`, redacted), the Timeline's facts rendered for what no
    file gave (``raw_metrics`` as in :func:`render_facts`), on a ``live`` host the tools of
    :data:`LIVE_TOOLS`, the latest sources' errors (and sources missing with a reason, such as
    NVML on a host without the driver), and ``manifest.json``; then moved to
    ``out`` (directory or ``.tar.gz``). Used by ``kvdoctor bundle`` and watch's ``b`` key.
    Returns the manifest. Raises OSError when ``out`` cannot be written."""
    manifest = Manifest(input=_redact_url(source))
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bundle-out-") as tmp:
        root = Path(tmp) / "bundle"
        root.mkdir()
        if opts is not None:
            copy_inputs(root, manifest, opts)
        render_facts(root, manifest, timeline, list(raw_metrics or []), source)
        if live:
            run_tools(root, manifest)
        latest = timeline.latest
        for st in latest.sources if latest is not None else []:
            if st.cut and not st.origin.lower().startswith(("http://", "https://")):
                continue  # only parsing was cut (--time-budget): the file was copied whole
            if st.status == "error" or (live and st.status == "missing"):
                # what failed, and what this host cannot have (no NVIDIA driver), and why
                manifest.add("", st.kind, st.origin, st.status, st.detail)
        finish(root, manifest, out)
    return manifest


def _redact_url(text: str) -> str:
    from kvdoctor.redact import redact_url_credentials

    return redact_url_credentials(text)
