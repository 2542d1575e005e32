"""Support bundles (spec/bundle.md) and single artifacts → a Timeline of facts.

A bundle is a directory, or a ``.tar.gz`` of one, holding the artifacts people paste into bug
reports. Every file is optional. Each file read (or missing, or broken) becomes a
:class:`~kvdoctor.facts.SourceStatus`; a broken file never stops the others from being used.
Nothing in a bundle is executed and nothing is fetched from the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import signal
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from kvdoctor.dcmethods import shared_methods
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
from kvdoctor.lazyre import lazy_re
from kvdoctor.redact import redact_url_credentials
from kvdoctor.sources.limits import (
    MAX_TAR_BYTES,
    MAX_TAR_MEMBER_BYTES,
    MAX_TAR_MEMBERS,
    MAX_TEXT_BYTES,
    guarded,
    load_yaml_bounded,
    read_text,
    reason_of,
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


@shared_methods
@dataclass(repr=False, eq=False)
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
    #: a bundle directory: ``--config`` must resolve inside it (set by :func:`artifacts_in_dir`)
    confine_to: Path | None = None
    #: /metrics histogram families parsed (None: ``sources.metrics.READ_HISTOGRAMS``; ``watch``
    #: passes ``DISPLAY_HISTOGRAMS`` to show TTFT and inter-token latency)
    histograms: tuple[str, ...] | None = None


@shared_methods
@dataclass(repr=False, eq=False)
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


#: the detail (and ``SourceStatus.cut``) of a source not read because the time budget for reading
#: the inputs ran out before it started
NOT_READ_OUT_OF_TIME = "not read: the time budget for reading the inputs ran out before it (--time-budget)"


def budget_spent(deadline: float | None) -> bool:
    """True once ``deadline`` (a :func:`time.monotonic` instant) has passed; never without one."""
    return deadline is not None and time.monotonic() > deadline


def _status(snap: Snapshot, kind: str, origin: str, status: str, detail: str = "", *, cut: str = "") -> None:
    # An origin may be a URL given in any spelling (ftp://user:pw@…, HTTP://…): never its password.
    origin, detail = redact_url_credentials(origin), redact_url_credentials(detail)
    snap.sources.append(SourceStatus(kind=kind, origin=origin, status=status, detail=detail, cut=cut))  # type: ignore[arg-type]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _guard(
    snap: Snapshot, kind: str, origin: str, fn: Callable[[], Any], deadline: float | None = None
) -> Any:
    """Run one source's parser; any failure becomes an "error" SourceStatus, never an exception.
    Past ``deadline`` (:func:`budget_spent`) the parser is not started: an "error" status says
    so (:data:`NOT_READ_OUT_OF_TIME`, also its ``cut``) and None is returned."""
    if budget_spent(deadline):
        _status(snap, kind, origin, "error", NOT_READ_OUT_OF_TIME, cut=NOT_READ_OUT_OF_TIME)
        return None
    try:
        return fn()
    except SourceError as e:
        _status(snap, kind, origin, "error", _one_line(e))
    except Exception as e:  # a parser bug must not take the other sources down
        # The reason only: an exception's message may quote the bytes it choked on.
        _status(snap, kind, origin, "error", f"{origin}: {reason_of(e)}")
    return None


def _read_text(path: Path) -> str:
    return read_text(path, MAX_TEXT_BYTES)


def _metrics_timestamp(path: Path) -> float | None:
    m = re.fullmatch(r"(\d{1,20}(?:\.\d{1,20})?)\.txt", path.name)
    return float(m.group(1)) if m else None


def _read(
    snap: Snapshot,
    kind: str,
    path: Path,
    parse: Callable[[Path], Any],
    describe: Callable[[Any], str],
    deadline: float | None = None,
) -> Any:
    """Parse one file; record "ok" with ``describe(result)`` or the error (or that the time
    budget ran out before it, see :func:`_guard`). Returns the result or None."""
    result = _guard(snap, kind, str(path), partial(parse, path), deadline)
    if result is not None:
        _status(snap, kind, str(path), "ok", describe(result))
    return result


def _parse_log(path: Path, deadline: float | None = None) -> VllmLog:
    from kvdoctor.sources.vllm_log import parse_log_file

    return parse_log_file(path, deadline=deadline)


def _read_log(snap: Snapshot, path: Path, deadline: float | None) -> VllmLog | None:
    """Parse a vLLM log and record its SourceStatus: "ok" with :func:`describe_log`, or "error".

    Started even past ``deadline``: :func:`~kvdoctor.sources.vllm_log.parse_log_file` then
    parses the latest run and the file's end only, and counts the other lines; what it did not
    parse (``VllmLog.cut``) is in the status's detail and ``cut``. Returns the log or None."""
    log = _guard(snap, "log", str(path), partial(_parse_log, path, deadline))
    if log is None:
        return None
    # An empty file, or one with no line vLLM writes, is no evidence of a healthy server.
    if log.line_count == 0:
        _status(snap, "log", str(path), "error", f"{path}: empty log")
        return None
    if not log.events:
        cut = f"; {log.cut}" if log.cut else ""
        why = f"{path}: no vLLM log line recognised in {log.line_count} lines{cut}"
        _status(snap, "log", str(path), "error", why, cut=log.cut)
        return None
    _status(snap, "log", str(path), "ok", describe_log(log), cut=log.cut)
    return log


def describe_log(log: VllmLog) -> str:
    """One-line summary of a parsed log for its SourceStatus (with ``VllmLog.cut`` when the time
    budget left lines unparsed)."""
    detail = f"{log.line_count:,} lines, {len(log.events):,} events"
    detail += f", vLLM {log.vllm_version}" if log.vllm_version else ""
    return detail + (f"; {log.cut}" if log.cut else "")


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


def load_artifacts(art: Artifacts, *, label: str = "", deadline: float | None = None) -> Loaded:
    """Read single artifacts into a Timeline. Never raises for bad input: each problem becomes a
    SourceStatus (kind, origin, "error", one-line reason).

    ``deadline`` (a :func:`time.monotonic` instant; None: no limit) bounds the time spent: a
    source not started by then is "error" with :data:`NOT_READ_OUT_OF_TIME` (and that as its
    ``cut``). The log is read last (the one input that can take long) and always: past the
    deadline only its latest run and its end are parsed (:func:`_read_log`)."""
    from kvdoctor.sources import metrics as metrics_src
    from kvdoctor.sources.nvidia_smi import attach_processes, latest_gpus

    snap = Snapshot()
    configs: list[EngineConfig] = []
    scrapes: list[tuple[float | None, list[EngineMetrics]]] = []

    # GPUs: every nvidia-smi file (table, CSV, XML) fills the same Gpu facts.
    for path in art.nvidia_smi:
        moments = _guard(snap, "nvidia-smi", str(path), partial(_parse_smi, path), deadline)
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
        procs = _read(
            snap, "nvidia-smi", art.compute_apps, _parse_apps, lambda p: f"{len(p)} compute app(s)", deadline
        )
        if procs is not None:
            attach_processes(snap.gpus, procs)

    hist: dict[str, Any] = {} if art.histograms is None else {"histograms": art.histograms}
    for path in art.metrics:
        if path.is_dir():
            got = _guard(
                snap,
                "metrics",
                str(path),
                partial(metrics_src.load_metrics_dir, path, confine_to=art.confine_to, **hist),
                deadline,
            )
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
                snap,
                "metrics",
                path,
                partial(_parse_metrics_file, ts=ts, **hist),
                lambda m: f"{len(m)} engine(s)",
                deadline,
            )
            if ms is not None:
                scrapes.append((ts, ms))
    for text, ts, origin in art.metrics_texts:
        ms = _guard(
            snap, "metrics", origin, partial(metrics_src.parse_metrics, text, origin, ts, **hist), deadline
        )
        if ms is not None:
            scrapes.append((ts, ms))
            _status(snap, "metrics", origin, "ok", f"{len(ms)} engine(s)")

    if art.cmdline is not None:
        # A literal command is named "--cmdline", never echoed: it may hold an --api-key.
        is_file = len(art.cmdline) < 4096 and "\n" not in art.cmdline and Path(art.cmdline).is_file()
        origin = art.cmdline if is_file else "--cmdline"
        got = _guard(
            snap,
            "cmdline",
            origin,
            partial(_parse_cmdline, art.cmdline, art.cmdline_base, art.confine_to),
            deadline,
        )
        if got is not None:
            cfgs, origin = got
            configs.extend(cfgs)
            cut = next((str(c.args["_cut"]) for c in cfgs if c.args.get("_cut")), "")
            _status(
                snap, "cmdline", origin, "ok", f"{len(cfgs)} engine command(s)" + (f"; {cut}" if cut else "")
            )
            for cfg in cfgs:
                err = cfg.args.get("_config_error")
                if err:  # a --config refused (outside the bundle) or unreadable
                    _status(snap, "cmdline", origin, "error", str(err))

    if art.model_config is not None:
        snap.model = _read(
            snap,
            "config",
            art.model_config,
            _parse_model,
            lambda a: f"{a.model_type or 'model'}: {a.num_hidden_layers} layers",
            deadline,
        )
    if art.env is not None:
        env = _read(snap, "env", art.env, _parse_env, lambda e: f"{len(e)} variable(s)", deadline)
        snap.env = env or {}
    if art.ps is not None:
        procs = _read(snap, "processes", art.ps, _parse_ps, lambda p: f"{len(p)} process(es)", deadline)
        if procs is not None:
            snap.processes, snap.process_table_known = procs, True

    if art.dmesg is not None:
        xids = _read(
            snap, "log", art.dmesg, _parse_dmesg, lambda x: f"{len(x)} NVIDIA XID event(s)", deadline
        )
        if xids is not None:
            snap.xid_events = xids

    # Last: the other inputs are small and capped, a log can take long (and past the deadline
    # it is still read, in part), so that it never leaves them unread.
    if art.log is not None:
        snap.log = _read_log(snap, art.log, deadline)

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


def _parse_metrics_file(
    path: Path, ts: float | None = None, histograms: tuple[str, ...] | None = None
) -> list[EngineMetrics]:
    from kvdoctor.sources.metrics import parse_metrics

    if histograms is not None:
        return parse_metrics(_read_text(path), origin=str(path), timestamp=ts, histograms=histograms)
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


def _parse_cmdline(
    text: str, base: Path | None, confine_to: Path | None = None
) -> tuple[list[EngineConfig], str]:
    from kvdoctor.sources.cmdline import parse_cmdline_text, update_config_from_args

    path = Path(text) if len(text) < 4096 and "\n" not in text else None
    if path is not None and path.is_file():
        if path.suffix in (".json", ".yaml", ".yml"):
            raw = _read_text(path)
            try:
                mapping = json.loads(raw) if path.suffix == ".json" else load_yaml_bounded(raw, str(path))
            except (json.JSONDecodeError, RecursionError):
                # no parser message: YAML's quotes the line it choked on
                raise SourceError(f"not valid {path.suffix[1:].upper()}", origin=str(path)) from None
            if not isinstance(mapping, dict):
                raise SourceError(
                    "engine arguments must be a mapping of flag names to values", origin=str(path)
                )
            cfg = EngineConfig()
            update_config_from_args(
                cfg, {str(k).replace("-", "_"): v for k, v in mapping.items()}, explicit=True
            )
            return [cfg], str(path)
        cfgs = parse_cmdline_text(
            _read_text(path), origin=str(path), base_dir=base or path.parent, confine_to=confine_to
        )
        return cfgs, str(path)
    return parse_cmdline_text(text, origin="--cmdline", base_dir=base), "--cmdline"


def _inside(root: Path, path: Path) -> bool:
    """True when ``path`` (after every symlink) is ``root`` or below it."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return False
    return resolved == root or root in resolved.parents


def _bundle_file(root: Path, name: str, refused: list[tuple[str, str]]) -> Path | None:
    """``root/name`` when it is a regular file inside the bundle; a symlink out of the bundle or
    a non-regular file (FIFO, device, directory) is refused with a reason, never opened."""
    p = root / name
    try:
        st = p.lstat()
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        if not _inside(root.resolve(), p):
            refused.append((str(p), "a symlink out of the bundle: not followed"))
            return None
        try:
            st = p.stat()
        except OSError:
            return None
    if not stat.S_ISREG(st.st_mode):
        if not stat.S_ISDIR(st.st_mode):
            refused.append((str(p), "not a regular file: not read"))
        return None
    return p


def _bundle_dir(root: Path, name: str, refused: list[tuple[str, str]]) -> Path | None:
    p = root / name
    if p.is_symlink() and not _inside(root.resolve(), p):
        refused.append((str(p), "a symlink out of the bundle: not followed"))
        return None
    return p if p.is_dir() else None


def artifacts_in_dir(root: Path, refused: list[tuple[str, str]] | None = None) -> Artifacts:
    """The artifacts a bundle directory holds (spec/bundle.md table): regular files inside the
    bundle only (symlinks may point within it, never out). ``refused`` collects (path, reason)
    for what was not used."""
    refused = refused if refused is not None else []
    art = Artifacts(confine_to=root)

    def f(name: str) -> Path | None:
        return _bundle_file(root, name, refused)

    for name in ("nvidia-smi.txt", "nvidia-smi.csv", "nvidia-smi.xml"):
        if (p := f(name)) is not None:
            art.nvidia_smi.append(p)
    art.compute_apps = f("compute-apps.csv")
    # A rotated, compressed log (logrotate's compress) when there is no plain one: parse_log_file
    # reads gzip, bounded.
    art.log = f("vllm.log") or f("vllm.log.gz")
    if (d := _bundle_dir(root, "metrics", refused)) is not None:
        art.metrics.append(d)
    if (p := f("metrics.txt")) is not None:
        art.metrics.append(p)
    for name in ("cmdline.txt", "engine-args.json", "engine-args.yaml"):
        if (p := f(name)) is not None:
            art.cmdline = str(p)
            art.cmdline_base = root
            break
    art.model_config = f("config.json")
    art.env = f("env.txt")
    art.ps = f("ps.txt")
    art.dmesg = f("dmesg.txt")
    return art


@contextlib.contextmanager
def _cleanup_on_sigterm() -> Iterator[None]:
    """While a temporary copy exists, SIGTERM unwinds like Ctrl-C does (SystemExit), so the
    ``TemporaryDirectory`` is removed; a handler someone else installed is left alone."""
    installed = False
    old: Any = None
    if threading.current_thread() is threading.main_thread():
        try:
            old = signal.getsignal(signal.SIGTERM)
            if old in (signal.SIG_DFL, None):

                def _term(signum: int, frame: Any) -> None:
                    raise SystemExit(128 + signum)

                signal.signal(signal.SIGTERM, _term)
                installed = True
        except (ValueError, OSError):
            installed = False
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, old)


@guarded("path", 0)
def load_bundle(
    path: Path, *, histograms: tuple[str, ...] | None = None, deadline: float | None = None
) -> Loaded:
    """Read a bundle directory or ``.tar.gz`` (spec/bundle.md).

    Missing core files are reported as "missing"; unreadable ones as "error" with the reason.
    ``nodes/<name>/`` sub-bundles add their GPUs with ``Gpu.node`` set. A directory bundle is
    confined: symlinks out of it, FIFOs and devices are refused with a status, never opened; a
    ``--config`` must resolve inside it. From an archive only the files kvdoctor reads are
    extracted, each with its own size cap, to a temporary directory removed afterwards (also on
    SIGINT/SIGTERM); an oversized, duplicate or unsafe member is skipped with a status.
    ``histograms``: /metrics histogram families to parse (None: the default set). ``deadline``
    (a :func:`time.monotonic` instant; None: no limit) bounds reading: every file but the logs
    is read first, a file not started by then is reported "error" (not read, and why), and the
    logs are read last, past the deadline in part (:func:`load_artifacts`). Raises
    SourceError only when ``path`` itself is neither a directory nor a readable tar archive.
    """
    path = Path(path)
    # only when asked: _load_dir keeps its (root, label) call for everything else
    kw: dict[str, Any] = {} if histograms is None else {"histograms": histograms}
    if deadline is not None:
        kw["deadline"] = deadline
    if path.is_file() and (path.name.endswith((".tar.gz", ".tgz", ".tar"))):
        import tempfile  # archives only: a bundle directory does not import it (nor shutil)

        with _cleanup_on_sigterm(), tempfile.TemporaryDirectory(prefix="kvdoctor-bundle-") as tmp:
            root, skipped = _extract_tar(path, Path(tmp))
            loaded = _load_dir(root, label=str(path), **kw)
            for origin, why in skipped:
                _status(loaded.snapshot, "bundle", origin, "error", why)
            # Origins should name the archive, never the temporary directory.
            for s in loaded.snapshot.sources:
                for prefix in (str(root), tmp):
                    s.origin = s.origin.replace(prefix, str(path))
                    s.detail = s.detail.replace(prefix, str(path))
            return loaded
    if not path.exists():
        raise SourceError("no such bundle (expected a directory or a .tar.gz)", origin=str(path))
    if not path.is_dir():
        raise SourceError("not a bundle: expected a directory or a .tar.gz", origin=str(path))
    return _load_dir(path, label=str(path), **kw)


def _wanted(parts: tuple[str, ...]) -> bool:
    """A member path (inside the bundle) kvdoctor reads: a bundle file, a metrics scrape, a
    node's sub-bundle file, or a top-level YAML/JSON a ``--config`` may name."""
    if len(parts) == 1:
        return parts[0] in BUNDLE_FILES or parts[0].endswith((".yaml", ".yml", ".json"))
    if len(parts) == 2 and parts[0] == "metrics":
        return _metrics_timestamp(Path(parts[1])) is not None
    if len(parts) >= 3 and parts[0] == "nodes" and _SAFE_NAME.fullmatch(parts[1]):
        return _wanted(parts[2:])
    return False


_SAFE_NAME = lazy_re(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _extract_tar(path: Path, dest: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Extract the files kvdoctor reads from a bundle archive (regular files only; no links, no
    absolute or parent paths), streaming each with its own cap. Returns (bundle root, skipped
    members as (origin, reason)). Raises SourceError when the archive cannot be read at all."""
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    total = 0
    count = 0
    import tarfile  # only for an archive bundle: not imported to start

    try:
        with tarfile.open(path, "r:*") as tar:
            while True:
                member = tar.next()
                if member is None:
                    break
                count += 1
                if count > MAX_TAR_MEMBERS:
                    skipped.append((str(path), f"more than {MAX_TAR_MEMBERS} members: the rest skipped"))
                    break
                name = member.name.lstrip("./") if member.name.startswith("./") else member.name
                parts = tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))
                if not parts or name.startswith("/") or ".." in parts:
                    continue
                inner = (
                    parts if _wanted(parts) else parts[1:] if len(parts) > 1 and _wanted(parts[1:]) else None
                )
                if inner is None or not all(_SAFE_NAME.fullmatch(p) for p in parts):
                    continue  # not a file kvdoctor reads: never written to disk
                origin = f"{path}:{'/'.join(parts)}"
                if member.isdir():
                    continue  # structure (metrics/, nodes/x/): its files come as members
                if not member.isfile():
                    skipped.append((origin, "not a regular file in the archive: skipped"))
                    continue
                key = "/".join(parts)
                if key in seen:
                    skipped.append((origin, "appears twice in the archive: the first copy is used"))
                    continue
                if member.size > MAX_TAR_MEMBER_BYTES or total + member.size > MAX_TAR_BYTES:
                    skipped.append((origin, "larger than the archive member limit: skipped"))
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                target = dest.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                written = 0
                with src, open(target, "xb") as out:
                    while chunk := src.read(1 << 20):
                        written += len(chunk)
                        if written > MAX_TAR_MEMBER_BYTES:
                            break
                        out.write(chunk)
                if written > MAX_TAR_MEMBER_BYTES:
                    target.unlink()
                    skipped.append((origin, "larger than the archive member limit: skipped"))
                    continue
                seen.add(key)
                total += written
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        if not seen:
            raise SourceError(_archive_error(path, e), origin=str(path)) from None
        skipped.append((str(path), "archive truncated or corrupt after the files read"))
    return _bundle_root(dest), skipped


def _bundle_root(dest: Path) -> Path:
    """Where the bundle is in an extracted archive: the top level when it holds bundle files,
    else the one top-level directory holding the most (``tar czf x.tgz b notes.yaml`` wraps the
    bundle ``b/`` beside a file of its own)."""

    def score(d: Path) -> int:
        return sum((d / n).exists() for n in BUNDLE_FILES) + (d / "metrics").is_dir() + (d / "nodes").is_dir()

    if score(dest):
        return dest
    dirs = [p for p in dest.iterdir() if p.is_dir() and p.name not in ("metrics", "nodes")]
    best = max(dirs, key=score, default=None)
    if best is not None and (score(best) or len(dirs) == 1):
        return best
    return dest


def _archive_error(path: Path, exc: BaseException) -> str:
    """A reason in the user's words for an archive that cannot be opened at all."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(262)
    except OSError as e:
        return f"cannot read archive ({e.strerror or type(e).__name__})"
    if head[:2] == b"\x1f\x8b":
        if isinstance(exc, (EOFError, zlib.error)) or "compressed" in str(exc).lower():
            return "corrupt or truncated gzip data: not a readable .tar.gz"
        return "gzip data, but not a tar archive inside"
    if head[257:262] == b"ustar":
        return "a tar archive cut short or corrupt"
    return "not a gzip/tar archive (expected a bundle directory or a .tar.gz)"


def _load_dir(
    root: Path, *, label: str, histograms: tuple[str, ...] | None = None, deadline: float | None = None
) -> Loaded:
    refused: list[tuple[str, str]] = []
    art = artifacts_in_dir(root, refused)
    art.histograms = histograms
    # Every node's small files first, the logs last (the bundle's, then each node's): a log can
    # take long, and past the deadline it is still read in part; a file after it would not be.
    log_path, art.log = art.log, None
    node_logs: list[tuple[str, Path]] = []
    loaded = load_artifacts(art, label=label, deadline=deadline)
    snap = loaded.snapshot
    for origin, why in refused:
        _status(snap, "bundle", origin, "error", why)
    for name in CORE_FILES:
        present = (root / name).exists() or (name == "metrics.txt" and (root / "metrics").is_dir())
        if name == "cmdline.txt" and art.cmdline is not None:
            present = True
        if name == "nvidia-smi.txt" and art.nvidia_smi:
            present = True
        if name == "vllm.log" and log_path is not None:
            present = True
        if not present:
            _status(snap, BUNDLE_FILES[name], str(root / name), "missing", f"{name} not in bundle")
    nodes = _bundle_dir(root, "nodes", refused)
    if nodes is not None:
        real_root = root.resolve()
        # A top-level ps.txt applies to all nodes (bundle.md); without one, a pid missing from
        # the tables means a dead process only when every node listing GPUs had its own table.
        top_known = snap.process_table_known
        tables_known = [not snap.gpus]
        for node_dir in sorted(p for p in nodes.iterdir() if p.is_dir()):
            if not _inside(real_root, node_dir):
                _status(snap, "bundle", str(node_dir), "error", "a symlink out of the bundle: not followed")
                continue
            node_refused: list[tuple[str, str]] = []
            node_art = artifacts_in_dir(node_dir, node_refused)
            node_art.confine_to = root
            if node_art.log is not None:
                node_logs.append((node_dir.name, node_art.log))
                node_art.log = None
            sub = load_artifacts(node_art, label=str(node_dir), deadline=deadline)
            sub_snap = sub.snapshot
            for origin, why in node_refused:
                _status(sub_snap, "bundle", origin, "error", why)
            _merge_node(snap, sub_snap, node_dir.name, tables_known)
            loaded.configs.extend(sub.configs)
        snap.process_table_known = top_known or (all(tables_known) and bool(snap.processes))
    if log_path is not None:
        snap.log = _read_log(snap, log_path, deadline)
    for node, path in node_logs:
        node_log = _read_log(snap, path, deadline)
        if snap.log is None and node_log is not None:
            snap.log = node_log
        elif snap.log is not None and node_log is not None:
            _add_node_worker_figures(snap.log, node_log, node)
    return loaded


#: per-worker figures a node's own log adds to the bundle's log (the ranks of that node).
_NODE_LOG_KINDS = ("available_kv_memory", "model_loading")


def _add_node_worker_figures(log: VllmLog, node_log: VllmLog, node: str) -> None:
    """A ``nodes/<node>/vllm.log`` beside the bundle's own log: its workers' per-rank figures
    ("Available KV cache memory", "Model loading took") of its latest start join the bundle's log
    as events of that host (``LogEvent.host``; a line's own Ray ``ip=`` kept), so that ranks on
    every node can be compared. The rest of that log is not merged (one log's runs and phases)."""
    events = node_log.events
    starts = [
        i for i, e in enumerate(events) if e.kind == "args" and e.values.get("source") == "engine_config"
    ]
    tail = events[starts[-1] :] if starts else events
    # Line numbers of another file mean nothing here: the figures sit at the end of the bundle's
    # log, in its latest run (an earlier run's pids would read as orphans).
    last = max([log.line_count or 0] + [e.line for e in log.events[-1:]])
    for e in tail:
        if e.kind in _NODE_LOG_KINDS and e.pid is not None:
            log.events.append(dataclasses.replace(e, values=dict(e.values), host=e.host or node, line=last))


def _merge_node(snap: Snapshot, sub: Snapshot, node: str, tables_known: list[bool]) -> None:
    """Add a ``nodes/<node>/`` sub-bundle's facts to the bundle's snapshot (while it is being
    built): its GPUs (and ``nvidia-smi -l`` moments) with ``Gpu.node`` set, its host processes,
    its kernel XID events (each with ``"node"``), its source statuses. Moments are merged by
    position (the k-th reading of every node in the k-th moment; each GPU keeps its own time)."""
    for g in sub.gpus:
        g.node = node
    for moment in sub.gpu_series:
        for g in moment:
            g.node = node
    snap.gpus.extend(sub.gpus)
    if sub.gpu_series:
        if not snap.gpu_series and snap.gpus[: len(snap.gpus) - len(sub.gpus)]:
            snap.gpu_series = [list(snap.gpus[: len(snap.gpus) - len(sub.gpus)])]
        for k, moment in enumerate(sub.gpu_series):
            if k < len(snap.gpu_series):
                snap.gpu_series[k] = snap.gpu_series[k] + list(moment)
            else:
                snap.gpu_series.append(list(moment))
    elif snap.gpu_series and sub.gpus:
        snap.gpu_series[-1] = snap.gpu_series[-1] + list(sub.gpus)
    snap.processes.extend(sub.processes)
    tables_known.append(sub.process_table_known or not sub.gpus)
    snap.xid_events.extend({**x, "node": node} for x in sub.xid_events)
    snap.sources.extend(sub.sources)
