"""``kvdoctor rules`` (the catalogue) and ``kvdoctor explain ID`` (one rule's documentation).

Both read the built-in rules (``kvdoctor.rules``) and those of the ``kvdoctor.rules``
entry-point group, or the Python rule modules of the directories given by ``--rules-dir`` /
``$KVDOCTOR_RULES_DIR`` (``os.pathsep`` separated; the files are imported: they run as Python
code). ``kvdoctor diagnose`` uses the same option through :func:`rules_dir_option` and
:func:`load_rules_or_exit`. An invalid rule is one line on stderr and exit code 3.
``kvdoctor rules --format markdown`` writes the catalogue page ``docs/rules.md``.
"""

from __future__ import annotations

import difflib
import json
import re
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
from kvdoctor.rulekit import Rule, RuleFileError, load_rules

EXIT_INVALID = 3

F = TypeVar("F", bound=Callable[..., Any])


def load_rules_or_exit(rules_dirs: tuple[Path, ...] | list[Path] | None) -> list[Rule[Any]]:
    """Load the rules for a command; on :class:`RuleFileError` print ``kvdoctor: invalid rule
    file: FILE[:LINE]: reason`` to stderr and exit with code 3 (spec/report.md)."""
    try:
        return load_rules(resolve_rules_dirs(rules_dirs))
    except RuleFileError as err:
        click.echo(f"kvdoctor: invalid rule file: {err}", err=True)
        raise click.exceptions.Exit(EXIT_INVALID) from None


def _console() -> Console:
    from kvdoctor.report import make_console

    return make_console()


def _threshold_text(rule: Rule[Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in rule.threshold_values().items())


def _explained_by(rule: Rule[Any], catalogue: list[Rule[Any]]) -> list[str]:
    return sorted(r.id for r in catalogue if rule.id in r.explains)


def catalogue_json(rules: list[Rule[Any]]) -> list[dict[str, Any]]:
    """The catalogue as JSON-ready dicts (``kvdoctor rules --format json``)."""
    return [
        {
            "id": r.id,
            "family": r.family,
            "severity": r.severity,
            "title": r.title,
            "lifecycle": r.lifecycle,
            "needs": list(r.needs),
            "needs_any": list(r.needs_any),
            "thresholds": r.threshold_values(),
            "flags": list(r.flags),
            "explains": list(r.explains),
            "explained_by": _explained_by(r, rules),
            "for_s": r.for_s,
            "clear_for_s": r.clear_for_s,
            "docs": f"kvdoctor explain {r.id}",
            "doc": r.doc or "",
        }
        for r in rules
    ]


def catalogue_markdown(rules: list[Rule[Any]]) -> str:
    """The catalogue page (``docs/rules.md``): an index table, then each rule's metadata and
    its documentation (the module docstring), families in W K L U P order."""
    fam_order = {k: i for i, k in enumerate(FAMILIES)}
    ordered = sorted(rules, key=lambda r: (fam_order.get(r.family, 99), r.id))
    out = [
        f"# kvdoctor rule catalogue ({len(ordered)} rules)",
        "",
        "Generated from the rule modules by `kvdoctor rules --format markdown > docs/rules.md` "
        "(CI checks it is current). `kvdoctor explain ID` shows one rule in the terminal.",
        "",
        "| id | family | severity | title | lifecycle |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| [`{r.id}`](#{r.id}) | {r.family} | {r.severity} | {r.title} | {r.lifecycle} |" for r in ordered
    ]
    for r in ordered:
        out += ["", f"## {r.id}", "", f"**{r.title}**", ""]
        meta = [f"family {r.family} ({FAMILIES.get(r.family, '')})", f"severity {r.severity}", r.lifecycle]
        if r.needs:
            meta.append("needs " + ", ".join(r.needs))
        if r.needs_any:
            meta.append("needs one of " + ", ".join(r.needs_any))
        out.append(" · ".join(meta))
        out.append("")
        if r.threshold_values():
            out.append(
                "Thresholds (override in the user config): "
                + ", ".join(f"`{k}` = {v}" for k, v in r.threshold_values().items())
            )
            out.append("")
        if r.flags:
            out += ["May suggest: " + ", ".join(f"`{x}`" for x in r.flags), ""]
        if r.explains:
            out += ["Root cause of: " + ", ".join(f"[`{x}`](#{x})" for x in r.explains), ""]
        causes = _explained_by(r, rules)
        if causes:
            out += ["Explained by: " + ", ".join(f"[`{x}`](#{x})" for x in causes), ""]
        if r.for_s or r.clear_for_s:
            out += [
                f"Held {r.for_s:g} s before firing, {r.clear_for_s:g} s before clearing (sidecar, watch).",
                "",
            ]
        out.append(re.sub(r"(?m)^## ", "### ", (r.doc or "").strip()))
    return "\n".join(out) + "\n"


@click.command("rules")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help="Output format.",
)
@rules_dir_option
def rules_command(fmt: str, rules_dirs: tuple[Path, ...]) -> None:
    """List the rule catalogue: id, family, default severity and title."""
    rules = load_rules_or_exit(rules_dirs)
    if fmt == "json":
        click.echo(json.dumps(catalogue_json(rules), separators=(",", ":")))
        return
    if fmt == "markdown":
        click.echo(catalogue_markdown(rules), nl=False)
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
        table.add_row(r.id, r.family, r.severity, Text(r.title))
    console.print(table)
    console.print(Text("kvdoctor explain ID shows a rule's documentation.", style="dim"))


@click.command("explain")
@click.argument("rule_id", metavar="ID")
@rules_dir_option
def explain_command(rule_id: str, rules_dirs: tuple[Path, ...]) -> None:
    """Show one rule's documentation: what, why, how to confirm, the fix, sources."""
    rules = {r.id: r for r in load_rules_or_exit(rules_dirs)}
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


def explain_renderables(rule: Rule[Any], catalogue: list[Rule[Any]] | None = None) -> list[Any]:
    """A rule's documentation as rich renderables, the text ``kvdoctor explain`` prints (and
    ``kvdoctor watch``'s finding detail shows): id and title, a table of family, severity,
    lifecycle, needs, thresholds, the flags it may suggest, the findings it explains and (given
    the ``catalogue``) those that explain it, and its module, then the rule's markdown doc."""
    head = Text(rule.id, style="bold")
    head.append(f" — {rule.title}")
    meta = Table.grid(padding=(0, 2))
    meta.add_column(style="dim")
    meta.add_column()
    meta.add_row("family", f"{rule.family} ({FAMILIES.get(rule.family, '')})")
    meta.add_row("severity", rule.severity)
    meta.add_row("lifecycle", rule.lifecycle)
    if rule.needs:
        meta.add_row("needs", ", ".join(rule.needs))
    if rule.needs_any:
        meta.add_row("needs any of", ", ".join(rule.needs_any))
    if rule.threshold_values():
        meta.add_row("thresholds", _threshold_text(rule))
    if rule.flags:
        meta.add_row("may suggest", ", ".join(rule.flags))
    if rule.explains:
        meta.add_row("root cause of", ", ".join(rule.explains))
    causes = _explained_by(rule, catalogue or [])
    if causes:
        meta.add_row("explained by", ", ".join(causes))
    if rule.for_s or rule.clear_for_s:
        meta.add_row("for / clear_for", f"{rule.for_s:g} s / {rule.clear_for_s:g} s (sidecar, watch)")
    meta.add_row("module", rule.source)
    from rich.markdown import Markdown  # only explain renders markdown (~70 ms import)

    return [head, meta, Text(""), Markdown(rule.doc or "")]
