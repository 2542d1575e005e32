"""What every command's click face shares: the UNKNOWN exit, the one-line failure, ``--config``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

#: spec/report.md: nothing could be read, or the command line / a rule file / the config is invalid.
EXIT_UNKNOWN = 3
#: ``os.pathsep``-separated rule directories read instead of the shipped catalogue.
ENV_RULES_DIR = "KVDOCTOR_RULES_DIR"


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


def rules_dir_option(fn: F) -> F:
    """Click decorator adding the repeatable ``--rules-dir DIR`` option (``rules_dirs``): rule
    modules are Python code, imported and run.

    Here, not in ``kvdoctor.rules_cli``, so that ``diagnose`` does not import the rule
    catalogue's Rich tables to start (cold start, issue 8)."""
    return click.option(
        "--rules-dir",
        "rules_dirs",
        multiple=True,
        type=click.Path(path_type=Path, file_okay=False),
        help="Load rules from the Python modules in DIR (imported: they run as code, so only trust"
        " your own) instead of the shipped catalogue; repeatable. Default $KVDOCTOR_RULES_DIR.",
    )(fn)


def resolve_rules_dirs(rules_dirs: tuple[Path, ...] | list[Path] | None) -> list[Path] | None:
    """The directories to load: ``--rules-dir`` values, else ``$KVDOCTOR_RULES_DIR`` entries,
    else None (the shipped catalogue)."""
    if rules_dirs:
        return list(rules_dirs)
    env = os.environ.get(ENV_RULES_DIR)
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return None


def load_pipeline(rules_dirs: Any, config_path: Path | None) -> Any:
    """The :class:`~kvdoctor.pipeline.Pipeline` of the shipped (or ``--rules-dir``) rules and the
    user config; an invalid rule file or config is one line on stderr and exit 3."""
    from kvdoctor.pipeline import Pipeline, PipelineError

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
