"""``kvdoctor diagnose``: read sources, run the rules, print findings with computed fixes.

Exit codes (spec/report.md): 0 ok/info, 1 warning, 2 critical, 3 no source could be read, or the
command line / a rule file / the user config is invalid. Never prints a traceback to a user.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any

import click

from kvdoctor.rules_cli import load_rules_or_exit, rules_dir_option, variable_catalogue

EXIT_UNKNOWN = 3
#: the bundled real incident behind ``--demo`` (a copy of a case from the project's cases).
DEMO_CASE = "b26-orphaned-enginecore-workers"


def demo_bundle_dir() -> Path:
    """Directory of the bundled demo incident shipped inside the package."""
    return Path(str(resources.files("kvdoctor") / "data" / "demo" / DEMO_CASE))


def _fail(message: str) -> None:
    click.echo(f"kvdoctor: {message}", err=True)
    raise click.exceptions.Exit(EXIT_UNKNOWN)


def run_diagnosis(
    timeline: Any,
    configs: list[Any],
    *,
    rules: list[Any],
    window_s: float = 60.0,
) -> Any:
    """Facts → contexts → findings → Report. ``timeline``: kvdoctor.facts.Timeline."""
    from kvdoctor.derive import build_contexts
    from kvdoctor.report import build_report
    from kvdoctor.rules_engine import RuleContext, evaluate

    _engines, contexts, kv = build_contexts(timeline, configs, window_s=window_s)
    ctxs = [RuleContext(engine=eid, variables=v, inputs=inputs) for eid, v, inputs in contexts]
    result = evaluate(rules, ctxs)
    # A GPU-level fact (two engines stacked on GPU 0) reads the same from every engine's
    # context: report it once.
    seen: set[tuple[str, str, tuple[tuple[str, str], ...]]] = set()
    findings = []
    for f in result.findings:
        key = (f.rule, f.summary, tuple(sorted(f.suggested_flags.items())))
        if key not in seen:
            seen.add(key)
            findings.append(f)
    snapshot = timeline.latest
    return build_report(snapshot, findings, result.skipped, engine_kv=kv)


@click.command("diagnose")
@click.option(
    "--bundle",
    "bundle",
    type=click.Path(path_type=Path),
    help="Support bundle directory or .tar.gz (docs/spec/bundle.md).",
)
@click.option("--demo", is_flag=True, help="Diagnose a bundled real incident (no GPU needed).")
@click.option(
    "--nvidia-smi",
    "nvidia_smi",
    multiple=True,
    type=click.Path(path_type=Path),
    help="nvidia-smi table, --query-gpu CSV or -q -x XML file.",
)
@click.option(
    "--compute-apps", type=click.Path(path_type=Path), help="nvidia-smi --query-compute-apps CSV file."
)
@click.option(
    "--metrics",
    "metrics",
    multiple=True,
    help="vLLM /metrics: a file, a metrics/ directory of <unix-seconds>.txt scrapes, or a URL.",
)
@click.option("--log", "log", type=click.Path(path_type=Path), help="vLLM log file.")
@click.option("--cmdline", help="The launch command (a string or a file).")
@click.option("--model-config", type=click.Path(path_type=Path), help="The model's config.json.")
@click.option("--env", "env_file", type=click.Path(path_type=Path), help="env.txt with KEY=VALUE lines.")
@click.option(
    "--ps",
    "ps_file",
    type=click.Path(path_type=Path),
    help="ps -eo pid,ppid,pcpu,rss,etime,comm,args output.",
)
@click.option(
    "--dmesg",
    "dmesg_file",
    type=click.Path(path_type=Path),
    help="Kernel log (dmesg / journalctl -k) with NVIDIA XID errors.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"], case_sensitive=False),
    default=None,
    help="Output format (default: text).",
)
@click.option(
    "--window",
    "window_s",
    type=float,
    default=None,
    help="Seconds of live sampling (default 5) / analysis window for recordings (default 60).",
)
@click.option(
    "--interval",
    "interval_s",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between live samples.",
)
@click.option("--no-nvml", is_flag=True, help="Do not read NVML (live mode).")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    help="User config (thresholds, disabled rules); default $KVDOCTOR_CONFIG or ~/.config/kvdoctor/config.yaml.",
)
@rules_dir_option
def diagnose_command(
    bundle: Path | None,
    demo: bool,
    nvidia_smi: tuple[Path, ...],
    compute_apps: Path | None,
    metrics: tuple[str, ...],
    log: Path | None,
    cmdline: str | None,
    model_config: Path | None,
    env_file: Path | None,
    ps_file: Path | None,
    dmesg_file: Path | None,
    fmt: str | None,
    window_s: float | None,
    interval_s: float,
    no_nvml: bool,
    config_path: Path | None,
    rules_dirs: tuple[Path, ...],
) -> None:
    """Find why a vLLM GPU is out of memory or idle, and the flag that fixes it.

    With no input option it reads the live machine: NVML, vLLM processes (psutil), their /metrics
    (sampled for --window seconds so rates exist) and --log if given. Otherwise it reads a
    --bundle or single artifacts. Exit: 0 ok, 1 warning, 2 critical, 3 nothing readable.
    """
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.bundle import Artifacts, load_artifacts, load_bundle
    from kvdoctor.userconfig import UserConfigError, apply_user_config, load_user_config

    rules = load_rules_or_exit(rules_dirs, known_names=variable_catalogue())
    try:
        user = load_user_config(config_path, rules)
    except UserConfigError as e:
        _fail(f"invalid config: {e}")
        return
    rules = apply_user_config(rules, user)

    urls = [m for m in metrics if m.startswith(("http://", "https://"))]
    files = [
        nvidia_smi,
        compute_apps,
        [m for m in metrics if m not in urls],
        cmdline,
        model_config,
        env_file,
        ps_file,
        dmesg_file,
    ]
    if bundle is not None and demo:
        _fail("--bundle and --demo are exclusive")
    if demo:
        bundle = demo_bundle_dir()

    try:
        if bundle is not None:
            loaded = load_bundle(bundle)
            timeline, configs = loaded.timeline, loaded.configs
            if demo:
                _relabel(timeline, str(bundle), f"demo:{DEMO_CASE}")
        elif any(files):
            # Offline artifacts; a URL among them is scraped once.
            art = Artifacts(
                nvidia_smi=list(nvidia_smi),
                compute_apps=compute_apps,
                log=log,
                metrics=[Path(m) for m in metrics if m not in urls],
                cmdline=cmdline,
                model_config=model_config,
                env=env_file,
                ps=ps_file,
                dmesg=dmesg_file,
            )
            errors = []
            for url in urls:
                text_ts, err = _scrape_once(url)
                if text_ts is not None:
                    art.metrics_texts.append((text_ts[0], text_ts[1], url))
                else:
                    errors.append((url, err))
            loaded = load_artifacts(art)
            timeline, configs = loaded.timeline, loaded.configs
            _add_errors(timeline, errors)
        else:
            # Live: NVML, psutil, the given (or discovered) /metrics URLs sampled over a window.
            timeline, configs = _live(urls, log, window_s, interval_s, no_nvml)
    except SourceError as e:
        _fail(str(e))
        return

    report = run_diagnosis(
        timeline,
        configs,
        rules=rules,
        window_s=60.0 if window_s is None or bundle is not None else max(window_s, 60.0),
    )
    _emit(report, fmt)
    from kvdoctor.report import exit_code

    raise click.exceptions.Exit(exit_code(report))


def _relabel(timeline: Any, prefix: str, label: str) -> None:
    """Show the bundled demo's files as demo:CASE/FILE rather than a site-packages path."""
    for s in timeline.latest.sources:
        s.origin = s.origin.replace(prefix, label)
        s.detail = s.detail.replace(prefix, label)


def _scrape_once(url: str) -> tuple[tuple[str, float] | None, str]:
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.metrics import scrape

    try:
        return scrape(url), ""
    except SourceError as e:
        return None, str(e).splitlines()[0]


def _add_errors(timeline: Any, errors: list[tuple[str, str]]) -> None:
    from kvdoctor.facts import SourceStatus

    for url, err in errors:
        timeline.latest.sources.append(SourceStatus("metrics", url, "error", err))


def _live(
    urls: list[str], log: Path | None, window_s: float | None, interval_s: float, no_nvml: bool
) -> tuple[Any, list[Any]]:
    from kvdoctor.collect import LiveOptions, collect_live

    opts = LiveOptions(
        metrics_urls=urls,
        log_path=log,
        window_s=5.0 if window_s is None else window_s,
        interval_s=interval_s,
        use_nvml=not no_nvml,
    )
    return collect_live(opts)


def _emit(report: Any, fmt: str | None) -> None:
    from kvdoctor.report import render_json, render_markdown, render_text

    if fmt == "json":
        sys.stdout.write(render_json(report) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(report) + "\n")
    else:
        from kvdoctor.report import make_console

        render_text(report, make_console())
