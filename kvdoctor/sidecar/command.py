"""``kvdoctor sidecar``: the click command (flags → feed + pipeline → :class:`Sidecar`).

Exit codes: 0 after SIGTERM/SIGINT; 3 when it cannot start (bad flags, rules, input, or the
--listen address is taken). A source failing later never ends it.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import click

from kvdoctor.commands.common import config_option, load_pipeline, open_feed_or_fail
from kvdoctor.commands.common import fail as _fail
from kvdoctor.inputs import input_options
from kvdoctor.rules_cli import rules_dir_option


@click.command("sidecar")
@input_options
@click.option(
    "--listen",
    default="127.0.0.1:8479",
    show_default=True,
    help="HOST:PORT to serve /metrics, /healthz, /readyz, /findings on (a pod sets 0.0.0.0:8479).",
)
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.05),
    default=5.0,
    show_default=True,
    help="Seconds between evaluation cycles.",
)
@click.option(
    "--history",
    "history_s",
    type=click.FloatRange(min=1.0),
    default=600.0,
    show_default=True,
    help="Seconds of snapshots kept for the rules (bounds memory).",
)
@config_option
@rules_dir_option
def sidecar_command(
    listen: str,
    interval_s: float,
    history_s: float,
    config_path: Path | None,
    rules_dirs: tuple[Path, ...],
    **inputs: Any,
) -> None:
    """Serve kvdoctor's findings as Prometheus metrics, next to a vLLM server.

    Evaluates every --interval over the live machine (or a --bundle / --recording, for tests and
    demos) and serves /metrics, /healthz, /readyz, /findings and / on --listen. Logs finding
    transitions (fired / resolved) as JSON lines on stdout, each with the pod's namespace and
    name when POD_NAMESPACE / POD_NAME are set (the downward API). Stops cleanly on SIGTERM/SIGINT.
    """
    from kvdoctor.inputs import options_from_kwargs
    from kvdoctor.sidecar.server import Sidecar, parse_listen, pod_identity, serve

    try:
        parse_listen(listen)
    except ValueError as e:
        _fail(str(e))
    opts = options_from_kwargs(inputs, interval_s=interval_s)
    pipeline = load_pipeline(rules_dirs, config_path)
    feed = open_feed_or_fail(opts)
    max_len = max(2, math.ceil(history_s / interval_s))
    sidecar = Sidecar(
        feed,
        pipeline,
        interval_s=interval_s,
        listen=listen,
        max_len=max_len,
        identity=pod_identity(dict(os.environ)),
    )
    try:
        serve(sidecar)
    except OSError as e:
        feed.close()
        _fail(f"cannot listen on {listen}: {e.strerror or e}")
    if sidecar.busy:
        # A read still hangs (up to --timeout): everything is flushed and closed, so leave now
        # rather than let interpreter shutdown wait on it (exit within 2 s of SIGTERM).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
