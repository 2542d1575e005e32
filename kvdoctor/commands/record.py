"""``kvdoctor record -o FILE``: write what the inputs read as a recording (JSONL of Snapshots).

Takes the same input flags as ``diagnose``. Live, it reads every ``--interval`` seconds for
``--duration`` seconds (or until Ctrl-C); a bundle, artifacts or another recording are written
once through. ``.gz`` / ``.zst`` suffixes compress. ``diagnose --recording FILE`` replays it.
Exit 0 when written, 3 when the inputs or the output cannot be opened.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import click

from kvdoctor.commands.common import fail as _fail
from kvdoctor.commands.common import open_feed_or_fail
from kvdoctor.inputs import input_options


def _on_sigterm(stop: threading.Event) -> Any:
    """SIGTERM (``kill``, a container stopping) ends the recording cleanly, like Ctrl-C.
    Returns the previous handler, or None off the main thread (no handler set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: stop.set())


@click.command("record")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Recording file: .jsonl, .jsonl.gz or .jsonl.zst.",
)
@input_options
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between live reads.",
)
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds to record live (default: until Ctrl-C).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def record_command(
    output: Path, interval_s: float, duration_s: float | None, force: bool, **inputs: Any
) -> None:
    """Record Snapshots (GPUs, processes, /metrics, log, launch configs) to a JSONL file.

    One Snapshot a line after a versioned header (kvdoctor.recording/2), appended and flushed
    line by line, so a crash loses at most the last line. Replay with
    `kvdoctor diagnose --recording FILE`.
    """
    from kvdoctor.facts import SourceError
    from kvdoctor.inputs import options_from_kwargs
    from kvdoctor.sampler import Cycle, LiveLoop
    from kvdoctor.sources.recording import RecordingWriter

    if output.exists() and not force:
        _fail(f"{output}: exists (give --force to overwrite)")
    opts = options_from_kwargs(inputs, interval_s=interval_s)
    feed = open_feed_or_fail(opts)
    stop = threading.Event()
    try:
        try:
            writer = RecordingWriter(output, interval_s=interval_s if feed.live else None, label=feed.label)
        except SourceError as e:
            _fail(str(e))
            return
        with writer:
            loop = LiveLoop(feed, None, interval_s=interval_s)

            def write(cycle: Cycle) -> None:
                writer.write(cycle.snapshot)

            previous = _on_sigterm(stop)
            try:
                loop.run(write, stop, duration_s=duration_s)
            except KeyboardInterrupt:
                stop.set()  # Ctrl-C ends a recording; what was written stays
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
    finally:
        feed.close()
    size = output.stat().st_size if output.exists() else 0
    click.echo(f"kvdoctor: recorded {writer.count} snapshot(s) to {output} ({size / 1024:.1f} KiB)", err=True)
