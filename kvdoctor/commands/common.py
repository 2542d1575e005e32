"""What every command's click face shares: the UNKNOWN exit, the one-line failure, ``--config``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

#: spec/report.md: nothing could be read, or the command line / a rule file / the config is invalid.
EXIT_UNKNOWN = 3


def fail(message: str) -> NoReturn:
    """Print ``kvdoctor: MESSAGE`` (one line, no input bytes: callers pass their own words) on
    stderr and exit 3."""
    click.echo(f"kvdoctor: {message}", err=True)
    raise click.exceptions.Exit(EXIT_UNKNOWN)


def config_option(fn: F) -> F:
    """Click decorator adding ``--config FILE`` (``config_path``): the user config of thresholds
    and disabled rules (``kvdoctor.userconfig``)."""
    return click.option(
        "--config",
        "config_path",
        type=click.Path(path_type=Path),
        help="User config (thresholds, disabled rules); default $KVDOCTOR_CONFIG or ~/.config/kvdoctor/config.yaml.",
    )(fn)
