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


def load_pipeline(rules_dirs: Any, config_path: Path | None) -> Any:
    """The :class:`~kvdoctor.pipeline.Pipeline` of the shipped (or ``--rules-dir``) rules and the
    user config; an invalid rule file or config is one line on stderr and exit 3."""
    from kvdoctor.pipeline import Pipeline, PipelineError
    from kvdoctor.rules_cli import resolve_rules_dirs

    try:
        return Pipeline.load(resolve_rules_dirs(rules_dirs), config_path)
    except PipelineError as e:
        fail(str(e))


def open_feed_or_fail(opts: Any, **kwargs: Any) -> Any:
    """``kvdoctor.inputs.open_feed(opts, **kwargs)``; inputs that cannot be opened at all are one
    line on stderr and exit 3."""
    from kvdoctor.inputs import InputError, open_feed

    try:
        return open_feed(opts, **kwargs)
    except InputError as e:
        fail(str(e))
