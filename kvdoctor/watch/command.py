"""The ``kvdoctor watch`` click command. Textual is imported only when the command runs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import click

from kvdoctor.commands.common import config_option, load_pipeline, open_feed_or_fail
from kvdoctor.commands.common import fail as _fail
from kvdoctor.inputs import input_options
from kvdoctor.rules_cli import rules_dir_option

#: the bundled recording ``watch --demo`` replays (tools/make_watch_demo.py makes it).
DEMO_RECORDING = "watch-demo.jsonl.gz"
#: where the demo starts: late enough that history fills the sparklines, before the incident.
DEMO_START = 45


def demo_recording_path() -> Path:
    """Path of the bundled demo recording inside the installed package."""
    return Path(str(resources.files("kvdoctor") / "data" / "demo" / DEMO_RECORDING))


@click.command("watch")
@input_options
@click.option(
    "--interval",
    "interval_s",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between live reads (+/- change it while watching).",
)
@config_option
@rules_dir_option
def watch_command(
    interval_s: float, config_path: Path | None, rules_dirs: tuple[Path, ...], **inputs: Any
) -> None:
    """Live TUI: where each GPU's memory went, what each engine does, findings with their fix.

    With no input option it reads the live machine (the same discovery as diagnose); --bundle
    or single artifacts show that one state; --recording FILE replays (space, ←/→, [/]);
    --demo replays a bundled incident on any machine. Keys: ? help, t processes, b bundle
    (the same as `kvdoctor bundle` from these inputs), q quit.
    """
    from kvdoctor.inputs import options_from_kwargs

    if interval_s <= 0:
        _fail("--interval must be a positive number of seconds")
    opts = options_from_kwargs(inputs, interval_s=interval_s)
    start_at = None
    label = None
    if opts.demo:
        if opts.bundle or opts.recording or opts.has_artifacts:
            _fail("--demo cannot be combined with other inputs")
        opts.demo, opts.recording = False, demo_recording_path()
        start_at, label = DEMO_START, "demo"
    opts.display_histograms = True  # the engine panel shows TTFT and ITL
    pipeline = load_pipeline(rules_dirs, config_path)
    feed = open_feed_or_fail(opts)
    if label:
        feed.label = label
    from kvdoctor.watch.app import WatchApp

    app = WatchApp(feed, pipeline, interval_s=interval_s, start_at=start_at, opts=opts)
    app.run()
    if app.exit_message:
        click.echo(app.exit_message, err=True)
