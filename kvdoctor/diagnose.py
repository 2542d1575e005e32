"""``kvdoctor diagnose``: read sources, run the rules, print findings with computed fixes.

Exit codes (spec/report.md): 0 ok/info, 1 warning, 2 critical, 3 no source could be read, or the
command line / a rule file / the user config is invalid. Never prints a traceback to a user.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kvdoctor.cli import silence_stdout
from kvdoctor.commands.common import config_option, load_pipeline, open_feed_or_fail, rules_dir_option
from kvdoctor.commands.common import fail as _fail
from kvdoctor.inputs import DEMO_CASE, demo_bundle_dir, input_options

__all__ = ["DEMO_CASE", "demo_bundle_dir", "diagnose_command"]


@click.command("diagnose")
@input_options
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
    help="Seconds of live sampling (default 5; rates need scrapes 1 s apart) / analysis window for recordings (default 60).",
)
@click.option(
    "--interval",
    "interval_s",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between live samples.",
)
@config_option
@rules_dir_option
@click.option(
    "--prometheus",
    "prometheus_url",
    metavar="URL",
    help="Fleet mode: diagnose every vLLM pod a Prometheus server scrapes (PromQL over its HTTP API).",
)
@click.option("--since", "since", default="15m", show_default=True, help="Fleet mode: window to read.")
@click.option("--selector", "selector", help="Fleet mode: label matchers, e.g. '{namespace=\"ml\"}'.")
def diagnose_command(
    fmt: str | None,
    window_s: float | None,
    interval_s: float,
    config_path: Path | None,
    rules_dirs: tuple[Path, ...],
    prometheus_url: str | None = None,
    since: str = "15m",
    selector: str | None = None,
    **inputs: Any,
) -> None:
    """Find why a vLLM GPU is out of memory or idle, and the flag that fixes it.

    With no input option it reads the live machine: NVML, vLLM processes (psutil), their /metrics
    (sampled for --window seconds so rates exist) and --log if given. Otherwise it reads a
    --bundle, a --recording or single artifacts. Exit: 0 ok, 1 warning, 2 critical, 3 nothing
    readable.
    """
    from kvdoctor.inputs import options_from_kwargs

    opts = options_from_kwargs(inputs, interval_s=interval_s, one_shot=True)
    pipeline = load_pipeline(rules_dirs, config_path)
    if prometheus_url is not None:
        _diagnose_fleet(pipeline, opts, prometheus_url, since, selector, fmt)
        return
    feed = open_feed_or_fail(opts)
    try:
        if feed.live:
            from kvdoctor.sampler import LiveLoop

            loop = LiveLoop(feed, pipeline, interval_s=interval_s)
            timeline = loop.collect(5.0 if window_s is None else window_s)
        else:
            # a bundle, artifacts or a recording: read to its end, as LiveLoop.collect reads a
            # finite feed, without importing the live machinery (cold start, issue 8)
            from kvdoctor.feeds import read_to_end

            timeline = read_to_end(feed)
    finally:
        feed.close()
    # Live windows are short; the rules still read a 60 s "recent" window at least.
    pipeline.window_s = 60.0 if window_s is None or not feed.live else max(window_s, 60.0)
    report = pipeline.evaluate(timeline)
    from kvdoctor.report import exit_code

    code = exit_code(report)
    try:
        _emit(report, fmt)
        sys.stdout.flush()
    except BrokenPipeError:
        # `kvdoctor diagnose | head` closed early: the diagnosis still decides the exit code
        # (a probe must not read CRITICAL as WARNING or OK).
        silence_stdout()
    raise click.exceptions.Exit(code)


def _diagnose_fleet(
    pipeline: Any, opts: Any, url: str, since: str, selector: str | None, fmt: str | None
) -> None:
    """``--prometheus``: every pod's series from Prometheus, the same rules per pod, one report
    grouped by pod (kvdoctor.fleet)."""
    from kvdoctor.facts import SourceError
    from kvdoctor.fleet import diagnose_fleet
    from kvdoctor.report import exit_code
    from kvdoctor.sources.prometheus import iter_fleet, parse_duration

    if not opts.is_live or opts.urls or opts.log:
        _fail("--prometheus reads the fleet's Prometheus: give no other input option")
    try:
        since_s = parse_duration(since)
    except ValueError as e:
        _fail(f"--since: {e}")
        return
    pipeline.window_s = max(since_s, 60.0)
    try:  # pods a batch at a time: each evaluated and let go before the next batch is read
        pods = iter_fleet(url, since_s=since_s, selector=selector, timeout_s=max(opts.timeout_s, 10.0))
        report = diagnose_fleet(pods, pipeline)
    except SourceError as e:
        _fail(str(e).splitlines()[0])
        return
    if not report.sources:
        _fail(
            f"no vLLM series in Prometheus over the last {since}" + (f" for {selector}" if selector else "")
        )
    _emit(report, fmt)
    raise click.exceptions.Exit(exit_code(report))


def _emit(report: Any, fmt: str | None) -> None:
    from kvdoctor.report import render_json, render_markdown, render_text

    if fmt == "json":
        sys.stdout.write(render_json(report) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(report) + "\n")
    else:
        from kvdoctor.report import make_console

        render_text(report, make_console())
