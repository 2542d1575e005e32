"""``kvdoctor rules`` (the catalogue) and ``kvdoctor explain ID`` (one rule's documentation).

Both read the rules from :func:`kvdoctor.rules_engine.default_rules_dir`, or from the
directories of the hidden ``--rules-dir`` option / ``$KVDOCTOR_RULES_DIR`` (``os.pathsep``
separated); ``kvdoctor diagnose`` uses the same option through :func:`rules_dir_option` and
:func:`load_rules_or_exit`. An invalid rule file is one line on stderr and exit code 3.
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvdoctor.commands.common import ENV_RULES_DIR, resolve_rules_dirs, rules_dir_option  # noqa: F401 - re-exported
from kvdoctor.findings import FAMILIES
from kvdoctor.rules_engine import Rule, RuleFileError, load_rules

EXIT_INVALID = 3

F = TypeVar("F", bound=Callable[..., Any])


def variable_catalogue() -> set[str] | None:
    """Names of the variables rules may read (``kvdoctor.derive.VARIABLES``), importing derive
    lazily (which also registers its expression functions); None when derive is unavailable."""
    try:
        derive = importlib.import_module("kvdoctor.derive")
    except ImportError:
        return None
    variables = getattr(derive, "VARIABLES", None)
    return set(variables) if variables is not None else None


def load_rules_or_exit(
    rules_dirs: tuple[Path, ...] | list[Path] | None, known_names: set[str] | None = None
) -> list[Rule]:
    """Load the rules for a command; on :class:`RuleFileError` print ``kvdoctor: FILE:LINE:
    reason`` to stderr and exit with code 3 (spec/report.md)."""
    try:
        return load_rules(resolve_rules_dirs(rules_dirs), known_names=known_names)
    except RuleFileError as err:
        click.echo(f"kvdoctor: invalid rule file: {err}", err=True)
        raise click.exceptions.Exit(EXIT_INVALID) from None


def _console() -> Console:
    from kvdoctor.report import make_console

    return make_console()


def _threshold_text(rule: Rule) -> str:
    return ", ".join(f"{k}={v}" for k, v in rule.thresholds.items())


@click.command("rules")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format.",
)
@rules_dir_option
def rules_command(fmt: str, rules_dirs: tuple[Path, ...]) -> None:
    """List the rule catalogue: id, family, default severity and title."""
    rules = load_rules_or_exit(rules_dirs, variable_catalogue())
    if fmt == "json":
        click.echo(
            json.dumps(
                [
                    {
                        "id": r.id,
                        "family": r.family,
                        "severity": r.severity,
                        "title": r.title.source,
                        "needs": list(r.needs),
                        "needs_any": list(r.needs_any),
                        "thresholds": r.thresholds,
                        "explains": list(r.explains),
                        "for_s": r.for_s,
                        "clear_for_s": r.clear_for_s,
                        "docs": f"kvdoctor explain {r.id}",
                    }
                    for r in rules
                ],
                separators=(",", ":"),
            )
        )
        return
    console = _console()
    if not rules:
        console.print("No rules found.")
        return
    fam_order = {k: i for i, k in enumerate(FAMILIES)}
    table = Table(title=f"kvdoctor rules ({len(rules)})", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True)
    table.add_column("family")
    table.add_column("severity")
    table.add_column("title")
    for r in sorted(rules, key=lambda r: (fam_order.get(r.family, 99), r.id)):
        table.add_row(r.id, r.family, r.severity, Text(r.title.source))
    console.print(table)
    console.print(Text("kvdoctor explain ID shows a rule's documentation.", style="dim"))


@click.command("explain")
@click.argument("rule_id", metavar="ID")
@rules_dir_option
def explain_command(rule_id: str, rules_dirs: tuple[Path, ...]) -> None:
    """Show one rule's documentation: what, why, how to confirm, the fix, sources."""
    rules = {r.id: r for r in load_rules_or_exit(rules_dirs, variable_catalogue())}
    rule_id = rule_id.strip().lower()  # ids are lowercase slugs; PREEMPTION-STORM is the same rule
    rule = rules.get(rule_id)
    if rule is None:
        close = difflib.get_close_matches(rule_id, list(rules), n=3, cutoff=0.5)
        hint = f" (did you mean: {', '.join(close)}?)" if close else " (kvdoctor rules lists them)"
        click.echo(f"kvdoctor: unknown rule '{rule_id}'{hint}", err=True)
        raise click.exceptions.Exit(EXIT_INVALID)
    console = _console()
    for part in explain_renderables(rule, list(rules.values())):
        console.print(part)


def explain_renderables(rule: Rule, catalogue: list[Rule] | None = None) -> list[Any]:
    """A rule's documentation as rich renderables, the text ``kvdoctor explain`` prints (and
    ``kvdoctor watch``'s finding detail shows): id and title, a table of family, severity, needs,
    thresholds, fixes, the findings it explains and (given the ``catalogue``) those that explain
    it, and file, then the rule's markdown ``doc``."""
    head = Text(rule.id, style="bold")
    head.append(f" — {rule.title.source}")
    meta = Table.grid(padding=(0, 2))
    meta.add_column(style="dim")
    meta.add_column()
    meta.add_row("family", f"{rule.family} ({FAMILIES.get(rule.family, '')})")
    meta.add_row("severity", rule.severity + (" (varies: see severity_if)" if rule.severity_if else ""))
    if rule.needs:
        meta.add_row("needs", ", ".join(rule.needs))
    if rule.needs_any:
        meta.add_row("needs any of", ", ".join(rule.needs_any))
    if rule.thresholds:
        meta.add_row("thresholds", _threshold_text(rule))
    if rule.fix:
        meta.add_row("fixes", ", ".join(k for k, _ in rule.fix))
    if rule.explains:
        meta.add_row("root cause of", ", ".join(rule.explains))
    causes = sorted(r.id for r in catalogue or [] if rule.id in r.explains)
    if causes:
        meta.add_row("explained by", ", ".join(causes))
    if rule.for_s or rule.clear_for_s:
        meta.add_row("for / clear_for", f"{rule.for_s:g} s / {rule.clear_for_s:g} s (sidecar, watch)")
    meta.add_row("file", rule.path)
    from rich.markdown import Markdown  # only explain renders markdown (~70 ms import)

    return [head, meta, Text(""), Markdown(rule.doc)]
