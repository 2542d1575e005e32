"""Support bundles (spec/bundle.md) and single artifacts → a Timeline of facts.

A bundle is a directory, or a ``.tar.gz`` of one, holding the artifacts people paste into bug
reports. Every file is optional. Each file read (or missing, or broken) becomes a
:class:`~kvdoctor.facts.SourceStatus`; a broken file never stops the others from being used.
Nothing in a bundle is executed and nothing is fetched from the network.
"""

from __future__ import annotations

import json
import re
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvdoctor.facts import (
    EngineConfig,
    EngineMetrics,
    Gpu,
    Snapshot,
    SourceError,
    SourceStatus,
    Timeline,
    VllmLog,
)

#: bundle file name → source kind (spec/report.md ``sources[].kind``)
BUNDLE_FILES: dict[str, str] = {
    "cmdline.txt": "cmdline",
    "engine-args.json": "cmdline",
    "engine-args.yaml": "cmdline",
    "env.txt": "env",
    "nvidia-smi.txt": "nvidia-smi",
    "nvidia-smi.csv": "nvidia-smi",
    "nvidia-smi.xml": "nvidia-smi",
    "compute-apps.csv": "nvidia-smi",
    "vllm.log": "log",
    "metrics.txt": "metrics",
    "metrics": "metrics",
    "config.json": "config",
    "ps.txt": "processes",
    "dmesg.txt": "log",
}

#: the files a diagnosis is poorer without; reported as "missing" when absent.
CORE_FILES = ("nvidia-smi.txt", "vllm.log", "metrics.txt", "cmdline.txt", "config.json")

_MAX_TAR_BYTES = 512 * 1024 * 1024


@dataclass
class Artifacts:
    """Paths of single artifacts (``diagnose --nvidia-smi F --metrics F --log F …``).

    ``metrics`` may be a file, a ``metrics/`` directory of ``<unix-seconds>.txt`` scrapes, or an
    ``http(s)://`` URL (then fetched by the caller through ``kvdoctor.sources.metrics.scrape``).
    ``cmdline`` is a file path or a literal command string.
    """

    nvidia_smi: list[Path] = field(default_factory=list)
    compute_apps: Path | None = None
    log: Path | None = None
    metrics: list[Path] = field(default_factory=list)
    metrics_texts: list[tuple[str, float, str]] = field(default_factory=list)
    cmdline: str | None = None
    cmdline_base: Path | None = None
    model_config: Path | None = None
    env: Path | None = None
    ps: Path | None = None
    dmesg: Path | None = None


@dataclass
class Loaded:
    """What a bundle or a set of artifacts gave: the latest snapshot with everything, plus the
    earlier metrics scrapes as a Timeline (oldest first, the full snapshot last)."""

    timeline: Timeline
    configs: list[EngineConfig]

    @property
    def snapshot(self) -> Snapshot:
        """The latest (full) snapshot."""
        snap = self.timeline.latest
        assert snap is not None
        return snap


def _status(snap: Snapshot, kind: str, origin: str, status: str, detail: str = "") -> None:
    snap.sources.append(SourceStatus(kind=kind, origin=origin, status=status, detail=detail))  # type: ignore[arg-type]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _guard(snap: Snapshot, kind: str, origin: str, fn: Callable[[], Any]) -> Any:
    """Run one source's parser; any failure becomes an "error" SourceStatus, never an exception."""
    try:
        return fn()
    except SourceError as e:
        _status(snap, kind, origin, "error", _one_line(e))
    except (OSError, UnicodeError, ValueError) as e:
        _status(snap, kind, origin, "error", f"{origin}: {_one_line(e)}")
    except Exception as e:  # a parser bug must not take the other sources down
        _status(
            snap,
            kind,
            origin,
            "error",
            f"{origin}: internal error in parser: {type(e).__name__}: {_one_line(e)}",
        )
    return None


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    return data.decode("utf-8", errors="replace")


def _metrics_timestamp(path: Path) -> float | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\.txt", path.name)
    return float(m.group(1)) if m else None


def _read(
    snap: Snapshot, kind: str, path: Path, parse: Callable[[Path], Any], describe: Callable[[Any], str]
) -> Any:
    """Parse one file; record "ok" with ``describe(result)`` or the error. Returns the result or None."""
    result = _guard(snap, kind, str(path), partial(parse, path))
    if result is not None:
        _status(snap, kind, str(path), "ok", describe(result))
    return result


def _parse_log(path: Path) -> VllmLog:
    from kvdoctor.sources.vllm_log import parse_log_file

    return parse_log_file(path)


def describe_log(log: VllmLog) -> str:
    """One-line summary of a parsed log for its SourceStatus."""
    detail = f"{log.line_count} lines, {len(log.events)} events"
    return detail + (f", vLLM {log.vllm_version}" if log.vllm_version else "")


def _parse_model(path: Path) -> Any:
    from kvdoctor.sources.model_config import parse_model_config_file

    return parse_model_config_file(path)


def _parse_env(path: Path) -> dict[str, str]:
    from kvdoctor.sources.env import parse_env_text

    return parse_env_text(_read_text(path), origin=str(path))


def _parse_ps(path: Path) -> Any:
    from kvdoctor.sources.processes import parse_ps_text

    return parse_ps_text(_read_text(path), origin=str(path))


def _parse_apps(path: Path) -> Any:
    from kvdoctor.sources.nvidia_smi import parse_compute_apps_csv

    return parse_compute_apps_csv(_read_text(path), origin=str(path))


def load_artifacts(art: Artifacts, *, label: str = "") -> Loaded:
    """Read single artifacts into a Timeline. Never raises for bad input: each problem becomes a
    SourceStatus (kind, origin, "error", one-line reason)."""
    from kvdoctor.sources import metrics as metrics_src
    from kvdoctor.sources.nvidia_smi import attach_processes, latest_gpus

    snap = Snapshot()
    configs: list[EngineConfig] = []
    scrapes: list[tuple[float | None, list[EngineMetrics]]] = []

    # GPUs: every nvidia-smi file (table, CSV, XML) fills the same Gpu facts.
    for path in art.nvidia_smi:
        moments = _guard(snap, "nvidia-smi", str(path), partial(_parse_smi, path))
        if moments is None:
            continue
        got = latest_gpus(moments)
        timed = [list(m) for m in moments if m and all(g.timestamp is not None for g in m)]
        if len(timed) >= 2 and len(timed) > len(snap.gpu_series):
            # an nvidia-smi -l loop: keep the readings over time (gpu-memory-growth)
            snap.gpu_series = timed
        if got:
            snap.gpus = _merge_gpus(snap.gpus, got)
            _status(snap, "nvidia-smi", str(path), "ok", f"{len(got)} GPU(s)")
        else:
            _status(snap, "nvidia-smi", str(path), "error", f"{path}: no GPU rows found")
    if art.compute_apps is not None:
        procs = _read(snap, "nvidia-smi", art.compute_apps, _parse_apps, lambda p: f"{len(p)} compute app(s)")
        if procs is not None:
            attach_processes(snap.gpus, procs)

    if art.log is not None:
        snap.log = _read(snap, "log", art.log, _parse_log, describe_log)

    for path in art.metrics:
        if path.is_dir():
            got = _guard(snap, "metrics", str(path), partial(metrics_src.load_metrics_dir, path))
            if got is not None:
                series, errors = got
                for err in errors:
                    _status(snap, "metrics", str(path), "error", _one_line(err))
                scrapes.extend(series)
                if series:
                    _status(snap, "metrics", str(path), "ok", f"{len(series)} scrapes")
        else:
            ts = _metrics_timestamp(path)
            ms = _read(
                snap, "metrics", path, partial(_parse_metrics_file, ts=ts), lambda m: f"{len(m)} engine(s)"
            )
            if ms is not None:
                scrapes.append((ts, ms))
    for text, ts, origin in art.metrics_texts:
        ms = _guard(snap, "metrics", origin, partial(metrics_src.parse_metrics, text, origin, ts))
        if ms is not None:
            scrapes.append((ts, ms))
            _status(snap, "metrics", origin, "ok", f"{len(ms)} engine(s)")

    if art.cmdline is not None:
        # A literal command is named "--cmdline", never echoed: it may hold an --api-key.
        is_file = len(art.cmdline) < 4096 and "\n" not in art.cmdline and Path(art.cmdline).is_file()
        origin = art.cmdline if is_file else "--cmdline"
        got = _guard(snap, "cmdline", origin, partial(_parse_cmdline, art.cmdline, art.cmdline_base))
        if got is not None:
            cfgs, origin = got
            configs.extend(cfgs)
            _status(snap, "cmdline", origin, "ok", f"{len(cfgs)} engine command(s)")

    if art.model_config is not None:
        snap.model = _read(
            snap,
            "config",
            art.model_config,
            _parse_model,
            lambda a: f"{a.model_type or 'model'}: {a.num_hidden_layers} layers",
        )
    if art.env is not None:
        snap.env = _read(snap, "env", art.env, _parse_env, lambda e: f"{len(e)} variable(s)") or {}
    if art.ps is not None:
        procs = _read(snap, "processes", art.ps, _parse_ps, lambda p: f"{len(p)} process(es)")
        if procs is not None:
            snap.processes, snap.process_table_known = procs, True

    if art.dmesg is not None:
        xids = _read(snap, "log", art.dmesg, _parse_dmesg, lambda x: f"{len(x)} NVIDIA XID event(s)")
        if xids is not None:
            snap.xid_events = xids

    return _assemble(snap, scrapes, configs)


def _parse_dmesg(path: Path) -> list[dict[str, Any]]:
    from kvdoctor.sources.dmesg import parse_dmesg_file

    return parse_dmesg_file(path)


def _assemble(
    snap: Snapshot, scrapes: list[tuple[float | None, list[EngineMetrics]]], configs: list[EngineConfig]
) -> Loaded:
    """Order scrapes by time; earlier scrapes become metrics-only snapshots before the full one."""
    ordered = sorted(scrapes, key=lambda s: (s[0] is None, s[0] or 0.0))
    timeline = Timeline()
    for ts, ms in ordered[:-1]:
        timeline.append(Snapshot(timestamp=ts, metrics=ms))
    if ordered:
        snap.timestamp, snap.metrics = ordered[-1][0], ordered[-1][1]
    # The snapshot carries its engine configs (a recording replays on its own); the same list.
    snap.configs = configs
    timeline.append(snap)
    return Loaded(timeline=timeline, configs=configs)


def _parse_metrics_file(path: Path, ts: float | None = None) -> list[EngineMetrics]:
    from kvdoctor.sources.metrics import parse_metrics

    return parse_metrics(_read_text(path), origin=str(path), timestamp=ts)


def _parse_smi(path: Path) -> list[list[Gpu]]:
    from kvdoctor.sources.nvidia_smi import parse_nvidia_smi_file

    return parse_nvidia_smi_file(path)


def _merge_gpus(a: list[Gpu], b: list[Gpu]) -> list[Gpu]:
    """Combine GPU readings from several files (table + CSV + XML): same index/node → fill gaps."""
    if not a:
        return list(b)
    by_key = {(g.node, g.index): g for g in a}
    for g in b:
        old = by_key.get((g.node, g.index))
        if old is None:
            a.append(g)
            continue
        for name, value in vars(g).items():
            if getattr(old, name) in (None, [], "") and value not in (None, [], ""):
                setattr(old, name, value)
    return a


def _parse_cmdline(text: str, base: Path | None) -> tuple[list[EngineConfig], str]:
    from kvdoctor.sources.cmdline import parse_cmdline_text, update_config_from_args

    path = Path(text) if len(text) < 4096 and "\n" not in text else None
    if path is not None and path.is_file():
        if path.suffix in (".json", ".yaml", ".yml"):
            raw = _read_text(path)
            import yaml

            try:
                mapping = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
            except (json.JSONDecodeError, yaml.YAMLError) as e:
                raise SourceError(
                    f"not valid {path.suffix[1:].upper()}: {_one_line(e)}", origin=str(path)
                ) from e
            if not isinstance(mapping, dict):
                raise SourceError(
                    "engine arguments must be a mapping of flag names to values", origin=str(path)
                )
            cfg = EngineConfig()
            update_config_from_args(
                cfg, {str(k).replace("-", "_"): v for k, v in mapping.items()}, explicit=True
            )
            return [cfg], str(path)
        return parse_cmdline_text(_read_text(path), origin=str(path), base_dir=base or path.parent), str(path)
    return parse_cmdline_text(text, origin="--cmdline", base_dir=base), "--cmdline"


def artifacts_in_dir(root: Path) -> Artifacts:
    """The artifacts a bundle directory holds (spec/bundle.md table)."""
    art = Artifacts()
    for name in ("nvidia-smi.txt", "nvidia-smi.csv", "nvidia-smi.xml"):
        if (root / name).is_file():
            art.nvidia_smi.append(root / name)
    if (root / "compute-apps.csv").is_file():
        art.compute_apps = root / "compute-apps.csv"
    if (root / "vllm.log").is_file():
        art.log = root / "vllm.log"
    elif (root / "vllm.log.gz").is_file():
        # A rotated, compressed log (logrotate's compress): parse_log_file reads gzip, bounded.
        art.log = root / "vllm.log.gz"
    if (root / "metrics").is_dir():
        art.metrics.append(root / "metrics")
    if (root / "metrics.txt").is_file():
        art.metrics.append(root / "metrics.txt")
    for name in ("cmdline.txt", "engine-args.json", "engine-args.yaml"):
        if (root / name).is_file():
            art.cmdline = str(root / name)
            art.cmdline_base = root
            break
    if (root / "config.json").is_file():
        art.model_config = root / "config.json"
    if (root / "env.txt").is_file():
        art.env = root / "env.txt"
    if (root / "ps.txt").is_file():
        art.ps = root / "ps.txt"
    if (root / "dmesg.txt").is_file():
        art.dmesg = root / "dmesg.txt"
    return art


def load_bundle(path: Path) -> Loaded:
    """Read a bundle directory or ``.tar.gz`` (spec/bundle.md).

    Missing core files are reported as "missing"; unreadable ones as "error" with the reason.
    ``nodes/<name>/`` sub-bundles add their GPUs with ``Gpu.node`` set. Raises SourceError only
    when ``path`` itself is neither a directory nor a readable tar archive.
    """
    if path.is_file() and (path.name.endswith((".tar.gz", ".tgz", ".tar"))):
        with tempfile.TemporaryDirectory(prefix="kvdoctor-bundle-") as tmp:
            root = _extract_tar(path, Path(tmp))
            loaded = _load_dir(root, label=str(path))
            # Origins should name the archive, not the temporary directory.
            for s in loaded.snapshot.sources:
                s.origin = s.origin.replace(str(root), str(path))
                s.detail = s.detail.replace(str(root), str(path))
            return loaded
    if not path.exists():
        raise SourceError("no such bundle (expected a directory or a .tar.gz)", origin=str(path))
    if not path.is_dir():
        raise SourceError("not a bundle: expected a directory or a .tar.gz", origin=str(path))
    return _load_dir(path, label=str(path))


def _extract_tar(path: Path, dest: Path) -> Path:
    """Extract regular files only (no links, no absolute or parent paths), size-capped."""
    try:
        with tarfile.open(path, "r:*") as tar:
            total = 0
            for member in tar.getmembers():
                name = member.name
                if not member.isfile() or name.startswith("/") or ".." in Path(name).parts:
                    continue
                total += member.size
                if total > _MAX_TAR_BYTES:
                    raise SourceError("archive larger than 512 MiB", origin=str(path))
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    continue
                with src, open(target, "wb") as out:
                    out.write(src.read())
    except (tarfile.TarError, EOFError, OSError) as e:
        raise SourceError(f"cannot read archive: {_one_line(e)}", origin=str(path)) from e
    # A tarball usually wraps one top-level directory.
    entries = [p for p in dest.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return dest


def _load_dir(root: Path, *, label: str) -> Loaded:
    art = artifacts_in_dir(root)
    loaded = load_artifacts(art, label=label)
    snap = loaded.snapshot
    for name in CORE_FILES:
        present = (root / name).exists() or (name == "metrics.txt" and (root / "metrics").is_dir())
        if name == "cmdline.txt" and art.cmdline is not None:
            present = True
        if name == "nvidia-smi.txt" and art.nvidia_smi:
            present = True
        if name == "vllm.log" and art.log is not None:
            present = True
        if not present:
            _status(snap, BUNDLE_FILES[name], str(root / name), "missing", f"{name} not in bundle")
    nodes = root / "nodes"
    if nodes.is_dir():
        for node_dir in sorted(p for p in nodes.iterdir() if p.is_dir()):
            sub = load_artifacts(artifacts_in_dir(node_dir), label=str(node_dir))
            sub_snap = sub.snapshot
            for g in sub_snap.gpus:
                g.node = node_dir.name
            snap.gpus.extend(sub_snap.gpus)
            snap.sources.extend(sub_snap.sources)
            if snap.log is None and sub_snap.log is not None:
                snap.log = sub_snap.log
            loaded.configs.extend(sub.configs)
    return loaded
