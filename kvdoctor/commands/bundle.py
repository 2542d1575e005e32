"""``kvdoctor bundle -o DIR|FILE.tar.gz``: a redacted support bundle from the current inputs.

Takes the same input flags as ``diagnose``: live on the GPU host (reads for ``--window``
seconds, runs ``nvidia-smi -q -x``, ``--query-compute-apps`` and ``ps`` where they exist), or
re-packs a bundle, single artifacts or a recording. The layout is spec/bundle.md's, with a
``manifest.json`` of what was collected, from where, and what failed and why; ``diagnose
--bundle`` reads it anywhere. Exit 0 when written, 3 when the inputs or the output cannot be
opened.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import click

from kvdoctor.commands.common import fail as _fail
from kvdoctor.inputs import input_options


@click.command("bundle")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(path_type=Path),
    help="Bundle directory, or FILE.tar.gz.",
)
@input_options
@click.option(
    "--window",
    "window_s",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds of live reading (so /metrics rates exist).",
)
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between live reads.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
def bundle_command(output: Path, window_s: float, interval_s: float, force: bool, **inputs: Any) -> None:
    """Write a support bundle (spec/bundle.md) with secrets redacted and a manifest.json.

    Live: NVML GPUs as nvidia-smi.csv, their processes, /metrics scrapes as metrics/<ts>.txt,
    the --log copied (redacted), the API servers' command lines as cmdline.txt, and the output
    of nvidia-smi -q -x, --query-compute-apps and ps where the tools exist.
    """
    from kvdoctor import bundle_writer as bw
    from kvdoctor.inputs import InputError, open_feed, options_from_kwargs
    from kvdoctor.sampler import Cycle, LiveLoop

    if output.exists() and not force and (output.is_file() or any(output.iterdir())):
        _fail(f"{output}: exists (give --force to overwrite)")
    opts = options_from_kwargs(inputs, interval_s=interval_s)
    raws: list[tuple[float, str, str]] = []
    seen: set[tuple[str, float]] = set()

    def sink(ts: float, url: str, text: str) -> None:
        if (url, ts) not in seen:
            seen.add((url, ts))
            raws.append((ts, url, text))

    try:
        feed = open_feed(opts, raw_sink=sink)
    except InputError as e:
        _fail(str(e))
        return
    try:
        loop = LiveLoop(feed, None, interval_s=interval_s)

        def on_cycle(cycle: Cycle) -> None:
            for url, (ts, text) in getattr(feed, "last_raw", {}).items():
                sink(ts, url, text)

        try:
            # The same reads as a live `diagnose --window`: at least two scrapes of a slow or
            # loaded endpoint (one scrape has no rates, and the bundle would diagnose nothing).
            loop.collect(window_s, stop=threading.Event(), on_cycle=on_cycle)
        except KeyboardInterrupt:
            pass  # Ctrl-C: bundle what was read so far
        try:
            manifest = bw.write_bundle(
                loop.timeline, output, source=feed.label, opts=opts, raw_metrics=raws, live=feed.live
            )
        except OSError as e:
            _fail(f"{output}: cannot write bundle: {e.strerror or e}")
            return
    finally:
        feed.close()
    written = [e for e in manifest.entries if e.status == "ok"]
    failed = [e for e in manifest.entries if e.status == "error"]
    msg = f"kvdoctor: wrote bundle {output} ({len(written)} file(s)"
    if failed:
        msg += f"; {len(failed)} failed: " + "; ".join(f"{e.source}: {e.detail}" for e in failed[:3])
    click.echo(msg + ")", err=True)
