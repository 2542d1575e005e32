"""Command-line input options → a Snapshot feed, the same for every face.

``diagnose``, ``watch``, ``sidecar``, ``record`` and ``bundle`` accept the same input flags
(:func:`input_options`): live (no input flag), ``--bundle``, ``--demo``, single artifacts
(``--nvidia-smi``, ``--log``, ``--metrics FILE|DIR|URL``, …) and ``--recording``.
:func:`open_feed` turns them into a :class:`~kvdoctor.sampler.SnapshotFeed`. Errors are
:class:`InputError` with one line a user can act on (faces map it to exit 3).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import click

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import Snapshot, SourceError, SourceStatus, Timeline

F = TypeVar("F", bound=Callable[..., Any])

#: the bundled real incident behind ``--demo`` (a copy of a case from the project's cases).
DEMO_CASE = "b26-orphaned-enginecore-workers"

#: ``--time-budget`` default, seconds: reading a bundle or files of any size ends about then (a
#: 200 MB log is read whole well within it; 1 GiB of log lines is cut to its latest run)
DEFAULT_TIME_BUDGET_S = 60.0


class InputError(Exception):
    """The inputs cannot be opened at all (exclusive options, no such bundle); one line, with
    any URL password redacted (it quotes what the user typed)."""

    def __init__(self, message: str) -> None:
        from kvdoctor.redact import redact_url_credentials

        super().__init__(redact_url_credentials(str(message)))


def demo_bundle_dir() -> Path:
    """Directory of the bundled demo incident shipped inside the package."""
    from importlib import resources  # the demo only: not imported to start

    return Path(str(resources.files("kvdoctor") / "data" / "demo" / DEMO_CASE))


@shared_methods
@dataclass(repr=False, eq=False)
class InputOptions:
    """What to read. No artifact, bundle, recording or demo → the live machine."""

    bundle: Path | None = None
    demo: bool = False
    recording: Path | None = None
    nvidia_smi: list[Path] = field(default_factory=list)
    compute_apps: Path | None = None
    #: files, ``metrics/`` directories or http(s) URLs
    metrics: list[str] = field(default_factory=list)
    log: Path | None = None
    cmdline: str | None = None
    model_config: Path | None = None
    env_file: Path | None = None
    ps_file: Path | None = None
    dmesg_file: Path | None = None
    no_nvml: bool = False
    #: seconds between live reads
    interval_s: float = 1.0
    #: per-source read timeout, seconds (live)
    timeout_s: float = 2.0
    #: /metrics (live, bundle, files): also parse the latency histograms a screen shows (TTFT,
    #: ITL; ``watch``)
    display_histograms: bool = False
    #: one diagnosis (``diagnose``), not a watch: live statuses say nothing of retrying
    one_shot: bool = False
    #: seconds for reading offline inputs (bundle, files) all together; 0: no limit
    #: (:func:`open_feed`)
    time_budget_s: float = DEFAULT_TIME_BUDGET_S

    @property
    def urls(self) -> list[str]:
        """The ``--metrics`` values that are http(s) URLs."""
        return [m for m in self.metrics if _is_url(m)]

    @property
    def has_artifacts(self) -> bool:
        """True when any single artifact (other than a URL) was given."""
        return bool(
            self.nvidia_smi
            or self.compute_apps
            or [m for m in self.metrics if not _is_url(m)]
            or self.log
            or self.cmdline
            or self.model_config
            or self.env_file
            or self.ps_file
            or self.dmesg_file
        )

    @property
    def only_log_beside_urls(self) -> bool:
        """True for ``--metrics URL … --log FILE`` and no other artifact: the URLs are sampled
        live and the log followed as it grows (``record``/``bundle`` over a duration)."""
        file_metrics = any(not _is_url(m) for m in self.metrics)
        others = (
            bool(self.nvidia_smi)
            or file_metrics
            or any(
                v is not None
                for v in (
                    self.compute_apps,
                    self.cmdline,
                    self.model_config,
                    self.env_file,
                    self.ps_file,
                    self.dmesg_file,
                )
            )
        )
        return bool(self.urls) and self.log is not None and not others

    @property
    def is_live(self) -> bool:
        """True when the machine itself is read: no bundle, demo, recording or file artifact,
        or only ``--log`` beside ``--metrics`` URLs."""
        if self.bundle or self.demo or self.recording:
            return False
        return not self.has_artifacts or self.only_log_beside_urls


def _is_url(value: str) -> bool:
    return value.lower().startswith(("http://", "https://"))


def _check_metrics(_ctx: Any, _param: Any, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--metrics``: an http(s) URL with a valid port, or anything else as a path. A URL of
    another scheme, a port out of range, or a scheme-less "host:port/…" or "//host/…" that is
    no file is a usage error in the user's words (the value quoted without its password)."""
    from urllib.parse import urlsplit

    from kvdoctor.redact import redact_url_credentials

    for value in values:
        shown = redact_url_credentials(value)[:200]
        scheme, sep, _ = value.partition("://")
        if sep and scheme and not _is_url(value):
            raise click.BadParameter(
                f"{shown}: unsupported scheme '{scheme[:20]}' (an http:// or https:// URL, a file or a directory)"
            )
        if _is_url(value):
            try:
                parts = urlsplit(value)
                port = parts.port
            except ValueError:
                raise click.BadParameter(f"{shown}: port out of range (1-65535)") from None
            if port == 0:
                raise click.BadParameter(f"{shown}: port out of range (1-65535)")
            if not parts.hostname:
                raise click.BadParameter(f"{shown}: no host in the URL")
            continue
        looks_remote = value.startswith("//") or ("@" in value and ":" in value)
        if looks_remote and not Path(value).exists():
            raise click.BadParameter(f"{shown}: no such file; a URL needs http:// or https://")
    return values


def _check_bundle(_ctx: Any, _param: Any, value: Path | None) -> Path | None:
    """``--bundle``: a directory or .tar.gz on this machine; a URL is said to be one."""
    if value is not None and "://" in str(value).replace(":/", "://", 1) and not value.exists():
        from kvdoctor.redact import redact_url_credentials

        shown = redact_url_credentials(str(value))[:200]
        raise click.BadParameter(f"{shown}: a URL; give a bundle directory or .tar.gz on this machine")
    return value


_OPTION_NAMES = {f.name for f in fields(InputOptions)}


def input_options(fn: F) -> F:
    """Click decorator adding every input flag; the command receives them as keyword arguments
    that :func:`options_from_kwargs` turns back into :class:`InputOptions`."""
    opts = [
        click.option(
            "--bundle",
            "bundle",
            type=click.Path(path_type=Path),
            callback=_check_bundle,
            help="Support bundle directory or .tar.gz (docs/spec/bundle.md).",
        ),
        click.option("--demo", is_flag=True, help="Use a bundled real incident (no GPU needed)."),
        click.option(
            "--recording",
            "recording",
            type=click.Path(path_type=Path),
            help="Replay a recording made by `kvdoctor record` (.jsonl, .jsonl.gz, .jsonl.zst).",
        ),
        click.option(
            "--nvidia-smi",
            "nvidia_smi",
            multiple=True,
            type=click.Path(path_type=Path),
            help="nvidia-smi table, --query-gpu CSV or -q -x XML file.",
        ),
        click.option(
            "--compute-apps",
            type=click.Path(path_type=Path),
            help="nvidia-smi --query-compute-apps CSV file.",
        ),
        click.option(
            "--metrics",
            "metrics",
            multiple=True,
            callback=_check_metrics,
            help="vLLM /metrics: a file, a metrics/ directory of <unix-seconds>.txt scrapes, or a URL.",
        ),
        click.option("--log", "log", type=click.Path(path_type=Path), help="vLLM log file."),
        click.option("--cmdline", help="The launch command (a string or a file)."),
        click.option("--model-config", type=click.Path(path_type=Path), help="The model's config.json."),
        click.option(
            "--env", "env_file", type=click.Path(path_type=Path), help="env.txt with KEY=VALUE lines."
        ),
        click.option(
            "--ps",
            "ps_file",
            type=click.Path(path_type=Path),
            help="ps -eo pid,ppid,pcpu,rss,etime,comm,args output.",
        ),
        click.option(
            "--dmesg",
            "dmesg_file",
            type=click.Path(path_type=Path),
            help="Kernel log (dmesg / journalctl -k) with NVIDIA XID errors.",
        ),
        click.option("--no-nvml", is_flag=True, help="Do not read NVML (live mode)."),
        click.option(
            "--timeout",
            "timeout_s",
            type=click.FloatRange(min=0.05),
            default=2.0,
            show_default=True,
            help="Per-source read timeout in seconds (live): a slower source is an error for that read.",
        ),
        click.option(
            "--time-budget",
            "time_budget_s",
            type=click.FloatRange(min=0),
            default=DEFAULT_TIME_BUDGET_S,
            show_default=True,
            help="Seconds for reading a bundle or files (not live reads) all together; 0: no limit. "
            "Past it a vLLM log's latest run and last 32 MiB are still parsed, its other lines "
            "only counted, and files not yet read are reported as not read: the report says what "
            "was cut.",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def options_from_kwargs(kwargs: dict[str, Any], **extra: Any) -> InputOptions:
    """Pop the input flags out of a click command's ``kwargs`` into :class:`InputOptions`
    (``extra`` sets further fields, e.g. ``interval_s``)."""
    values: dict[str, Any] = {}
    for name in list(kwargs):
        if name in _OPTION_NAMES:
            values[name] = kwargs.pop(name)
    for list_name in ("nvidia_smi", "metrics"):
        if list_name in values:
            values[list_name] = list(values[list_name] or [])
    values.update(extra)
    return InputOptions(**values)


def open_feed(opts: InputOptions, *, raw_sink: Callable[[float, str, str], None] | None = None) -> Any:
    """The feed for ``opts`` (a :class:`~kvdoctor.sampler.SnapshotFeed`).

    Bundle / demo / artifacts / recording are read now into a finite feed; live (no input, or
    ``--metrics URL`` with at most ``--log``) returns a :class:`~kvdoctor.sampler.LiveFeed`
    that reads the machine on each ``next()`` (the URLs scraped, the log followed); a URL among
    other file artifacts is scraped once. Artifacts
    given beside a bundle are merged in (:func:`merge_timelines`); beside a recording they are
    refused. ``raw_sink(unix_seconds, url, page_text)`` receives the text of each ``--metrics
    URL`` scraped while opening offline inputs (``kvdoctor bundle`` keeps it; live feeds keep
    theirs in ``LiveFeed.last_raw``). Offline inputs are read within ``opts.time_budget_s``
    seconds (0: no limit) from here: one deadline for the bundle and every file beside it
    (``sources.bundle.load_bundle``); what it cut is in the sources' statuses. A recording is
    replayed as it streams, and live reads have their own ``timeout_s``: neither is budgeted.
    Raises :class:`InputError` for inputs that cannot be opened at all (one line, no input
    bytes)."""
    from kvdoctor.feeds import TimelineFeed  # not kvdoctor.sampler: an offline run needs none of it

    chosen = [
        n
        for n, on in (("--bundle", opts.bundle), ("--demo", opts.demo), ("--recording", opts.recording))
        if on
    ]
    if len(chosen) > 1:
        raise InputError(f"{' and '.join(chosen)} are exclusive")
    if opts.recording is not None and (opts.has_artifacts or opts.urls):
        # A recording replays on its own; an artifact beside it would be silently unused.
        raise InputError("--recording replays on its own: give other artifacts without it")
    # One deadline for everything read offline below (bundle, artifacts beside it, a URL among them).
    deadline = time.monotonic() + opts.time_budget_s if opts.time_budget_s > 0 else None
    try:
        if opts.recording is not None:
            from kvdoctor.sources.recording import open_recording

            return open_recording(opts.recording)
        if opts.bundle is not None or opts.demo:
            timeline = _load_bundle(opts, raw_sink, deadline)
            return TimelineFeed(timeline.snapshots, label=_bundle_label(opts))
        if opts.has_artifacts and not opts.is_live:
            timeline = _load_artifacts(opts, raw_sink, deadline)
            return TimelineFeed(timeline.snapshots, label="artifacts")
    except SourceError as e:
        raise InputError(str(e).splitlines()[0] if str(e) else "cannot read input") from None
    from kvdoctor.sampler import LiveFeed, LiveOptions

    live = LiveOptions(
        metrics_urls=opts.urls,
        log_path=opts.log,
        interval_s=opts.interval_s,
        timeout_s=opts.timeout_s,
        use_nvml=not opts.no_nvml,
        one_shot=opts.one_shot,
    )
    live.histograms = _histograms(opts)
    return LiveFeed(live)


def _histograms(opts: InputOptions) -> tuple[str, ...] | None:
    """The /metrics histogram families to parse: the display set for ``watch`` (TTFT, ITL),
    else None (the default set the rules read)."""
    if not opts.display_histograms:
        return None
    from kvdoctor.sources.metrics import DISPLAY_HISTOGRAMS

    return DISPLAY_HISTOGRAMS


def _bundle_label(opts: InputOptions) -> str:
    return f"demo:{DEMO_CASE}" if opts.demo else f"bundle {opts.bundle}"


def _load_bundle(
    opts: InputOptions,
    raw_sink: Callable[[float, str, str], None] | None = None,
    deadline: float | None = None,
) -> Timeline:
    from kvdoctor.sources.bundle import load_bundle

    path = demo_bundle_dir() if opts.demo else opts.bundle
    assert path is not None
    timeline = load_bundle(path, histograms=_histograms(opts), deadline=deadline).timeline
    if opts.demo:
        _relabel(timeline, str(path), f"demo:{DEMO_CASE}")
    if opts.has_artifacts or opts.urls:
        # Artifacts given beside the bundle are merged in, never dropped.
        timeline = merge_timelines(timeline, _load_artifacts(opts, raw_sink, deadline))
    return timeline


#: Snapshot fields an artifact given beside a bundle replaces (the bundle's own file is unused)
_REPLACED: dict[str, tuple[str, ...]] = {
    "log": ("vllm.log",),
    "model": ("config.json",),
    "configs": ("cmdline.txt", "engine-args.json", "engine-args.yaml"),
    "xid_events": ("dmesg.txt",),
    "gpu_series": (),
}


def merge_timelines(base: Timeline, extra: Timeline) -> Timeline:
    """A bundle's Timeline with single artifacts given beside it (``--bundle B --log F``).

    Both are shaped like ``sources.bundle``'s: metrics-only Snapshots of earlier scrapes, then
    one full Snapshot. Scrapes of both are merged in time order; in the full Snapshot an
    artifact's log, model config, launch command, XID events, GPU loop and process table
    replace the bundle's (the bundle file's status says it was not used), its GPUs replace those
    of the same (node, index) and are added otherwise, its env variables override. Sources of
    both are listed. New Snapshots are built; neither input is changed."""
    from dataclasses import replace

    b_full, e_full = base.latest or Snapshot(), extra.latest or Snapshot()
    scrapes = [(s.timestamp, s.metrics) for s in base.snapshots[:-1]]
    scrapes += [(s.timestamp, s.metrics) for s in extra.snapshots[:-1]]
    for full in (b_full, e_full):
        if full.metrics:
            scrapes.append((full.timestamp, full.metrics))
    scrapes.sort(key=lambda sc: (sc[0] is None, sc[0] or 0.0))
    changes: dict[str, object] = {}
    unused: list[str] = []  # bundle files whose facts an artifact replaced
    for name, files in _REPLACED.items():
        value = getattr(e_full, name)
        if value:
            changes[name] = value
            if getattr(b_full, name):
                unused.extend(files)
    if e_full.process_table_known:
        changes["processes"], changes["process_table_known"] = e_full.processes, True
        unused.append("ps.txt")
    if e_full.gpus:
        by_key = {(g.node, g.index): g for g in e_full.gpus}
        gpus = [by_key.pop((g.node, g.index), g) for g in b_full.gpus]
        changes["gpus"] = gpus + list(by_key.values())
    if e_full.env:
        changes["env"] = {**b_full.env, **e_full.env}
    sources = [
        replace(s, detail=f"{s.detail} (not used: the one given beside the bundle is)")
        if s.status == "ok" and unused and s.origin.endswith(tuple(unused))
        else s
        for s in b_full.sources
    ]
    changes["sources"] = sources + list(e_full.sources)
    if scrapes:
        changes["timestamp"], changes["metrics"] = scrapes[-1]
    full = replace(b_full, **changes)  # type: ignore[arg-type]
    out = Timeline(max_len=max(base.max_len, extra.max_len))
    for ts, ms in scrapes[:-1]:
        out.append(Snapshot(timestamp=ts, metrics=ms))
    out.append(full)
    return out


def _relabel(timeline: Timeline, prefix: str, label: str) -> None:
    """Show the bundled demo's files as demo:CASE/FILE rather than a site-packages path."""
    for snap in timeline.snapshots:
        for s in snap.sources:
            s.origin = s.origin.replace(prefix, label)
            s.detail = s.detail.replace(prefix, label)


def _load_artifacts(
    opts: InputOptions,
    raw_sink: Callable[[float, str, str], None] | None = None,
    deadline: float | None = None,
) -> Timeline:
    from kvdoctor.sources.bundle import NOT_READ_OUT_OF_TIME, Artifacts, budget_spent, load_artifacts

    art = Artifacts(
        nvidia_smi=list(opts.nvidia_smi),
        compute_apps=opts.compute_apps,
        log=opts.log,
        metrics=[Path(m) for m in opts.metrics if not _is_url(m)],
        cmdline=opts.cmdline,
        model_config=opts.model_config,
        env=opts.env_file,
        ps=opts.ps_file,
        dmesg=opts.dmesg_file,
        histograms=_histograms(opts),
    )
    errors: list[SourceStatus] = []
    for url in opts.urls:
        # A URL among offline artifacts is scraped once.
        from kvdoctor.sources.metrics import scrape

        if budget_spent(deadline):
            errors.append(
                SourceStatus("metrics", url, "error", NOT_READ_OUT_OF_TIME, cut=NOT_READ_OUT_OF_TIME)
            )
            continue
        try:
            text, ts = scrape(url, timeout=opts.timeout_s)
            art.metrics_texts.append((text, ts, url))
            if raw_sink is not None:
                raw_sink(ts, url, text)
        except SourceError as e:
            errors.append(SourceStatus("metrics", url, "error", str(e).splitlines()[0]))
    timeline = load_artifacts(art, deadline=deadline).timeline
    if timeline.latest is not None:
        timeline.latest.sources.extend(errors)
    return timeline
