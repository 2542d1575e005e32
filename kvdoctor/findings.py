"""What a rule reports: findings (a rule fired), skipped rules (an input was missing), health.

Shapes follow spec/rules.md "What every finding carries" and the ``findings``/``skipped`` arrays
of spec/report.md (schema ``kvdoctor.report/2``). Every value here is already rendered to text
by the rule engine (numbers formatted, units attached), so faces only lay them out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvdoctor.dcmethods import shared_methods

Severity = Literal["critical", "warning", "info"]
#: "unknown" when no source could be read (exit code 3, spec/report.md).
Health = Literal["ok", "info", "warning", "critical", "unknown"]
Family = Literal["W", "K", "L", "U", "P"]

#: Severity rank, worst last: sorting by ``SEVERITY_ORDER[s]`` descending puts critical first.
SEVERITY_ORDER: dict[str, int] = {"ok": 0, "info": 1, "warning": 2, "critical": 3}
SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
#: Rule families (spec/rules.md): Weights placement, KV preallocation, Long-request spikes,
#: Utilisation, Process and device health.
FAMILIES: dict[str, str] = {
    "W": "weights placement",
    "K": "KV-cache preallocation at startup",
    "L": "long-request spikes at run time",
    "U": "utilisation",
    "P": "process and device health",
}


@shared_methods
@dataclass(repr=False, eq=False)
class Evidence:
    """One fact that made a rule fire: ``fact`` (what, e.g. "KV cache capacity"), ``value``
    (rendered with its unit, e.g. "3,664 tokens") and ``source`` (where it was read: NVML field,
    nvidia-smi column, metric name, "vllm.log line 42", launch flag)."""

    fact: str
    value: str
    source: str


@dataclass(frozen=True)
class Fix:
    """One alternative fix: a complete change, applied together. ``flags``: vLLM flags as vLLM
    spells them → value as text ("" for a flag without an argument, ``--enforce-eager``);
    ``env``: environment variables → value; ``commands``: shell commands to run first
    (``kill 48211 48212``); ``why``: one line saying what it changes and what it costs."""

    flags: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    commands: tuple[str, ...] = ()
    why: str = ""

    def parts(self) -> list[str]:
        """The change as pasteable pieces: each command, ``ENV=value`` (shell-quoted), each
        ``--flag value`` (shell-quoted; a flag without a value alone)."""
        import shlex

        out = list(self.commands)
        out += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        out += [f"{k} {shlex.quote(v)}" if v != "" else k for k, v in self.flags.items()]
        return out

    def line(self) -> str:
        """The change as one line to paste: commands joined by ``&&`` then the environment and
        the flags (``kill 1 2 && --max-model-len 8192`` reads as "run, then relaunch with")."""
        cmds = " && ".join(self.commands)
        rest = " ".join(self.parts()[len(self.commands) :])
        return f"{cmds}; then relaunch with {rest}" if cmds and rest else cmds or rest

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of spec/report.md ``findings[].fixes[]``."""
        return {
            "flags": dict(self.flags),
            "env": dict(self.env),
            "commands": list(self.commands),
            "why": self.why,
        }


@shared_methods
@dataclass(repr=False, eq=False)
class Finding:
    """A rule that fired for one engine (or for the host when ``engine`` is None).

    ``fixes``: the alternatives (:class:`Fix`), the recommended one first. ``suggested_flags``
    (kept for one release, report schema 1's field): the first alternative's flags and
    environment, a vLLM flag as vLLM spells it ("--max-model-len") or an environment variable
    ("PYTORCH_CUDA_ALLOC_CONF") → its value as text ("23648"; "" for a flag without an
    argument). ``gpus`` are GPU indices.
    ``docs`` is the command that shows the rule's documentation. ``caused_by``: the rule id
    of the root-cause finding that explains this one, or None.
    """

    rule: str
    severity: Severity
    family: Family
    title: str
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    suggested_flags: dict[str, str] = field(default_factory=dict)
    fixes: list[Fix] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    engine: str | None = None
    docs: str = ""
    #: the rule id of the finding this one is a consequence of (its rule ``explains`` this
    #: one), None for a root cause; reports list consequences under their root.
    caused_by: str | None = None

    def __post_init__(self) -> None:
        if not self.docs:
            self.docs = f"kvdoctor explain {self.rule}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of spec/report.md ``findings[]`` (plus ``docs`` and ``caused_by``)."""
        return asdict(self)


@shared_methods
@dataclass(repr=False, eq=False)
class Skipped:
    """A rule that could not run because inputs it needs were absent.

    ``missing`` names the inputs ("metrics", "log", …); for a rule's ``needs_any`` group the
    entry is the alternatives joined by "|" ("log|metrics").
    """

    rule: str
    missing: list[str]
    engine: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of spec/report.md ``skipped[]`` (plus ``engine``)."""
        return asdict(self)


def worst_health(findings: Iterable[Finding]) -> Health:
    """The report's ``health``: the worst finding severity, "ok" when there is none."""
    worst: Health = "ok"
    for f in findings:
        if SEVERITY_ORDER.get(f.severity, 0) > SEVERITY_ORDER[worst]:
            worst = f.severity
    return worst


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Findings worst first, then by family (W K L U P order), rule id and engine; stable."""
    fam = {k: i for i, k in enumerate(FAMILIES)}
    return sorted(
        findings,
        key=lambda f: (-SEVERITY_ORDER.get(f.severity, 0), fam.get(f.family, 99), f.rule, f.engine or ""),
    )


def causal_order(findings: Iterable[Finding]) -> list[Finding]:
    """Root causes first, each followed by its consequences (``caused_by``), depth first; roots
    and siblings in :func:`sort_findings` order. A finding whose cause is not in the list is a
    root. Returns a new list (the findings themselves are not modified)."""
    ordered = sort_findings(findings)
    present = {f.rule for f in ordered}
    children: dict[str, list[Finding]] = {}
    roots: list[Finding] = []
    for f in ordered:
        if f.caused_by and f.caused_by in present and f.caused_by != f.rule:
            children.setdefault(f.caused_by, []).append(f)
        else:
            roots.append(f)
    out: list[Finding] = []
    placed: set[int] = set()

    def emit(f: Finding) -> None:
        if id(f) in placed:
            return
        placed.add(id(f))
        out.append(f)
        for c in children.get(f.rule, []):
            emit(c)

    for f in roots:
        emit(f)
    for f in ordered:  # anything a broken chain left out
        emit(f)
    return out


def depth_of(finding: Finding, findings: Iterable[Finding]) -> int:
    """How many causes above ``finding`` in ``findings`` (0 for a root)."""
    by_rule = {f.rule: f for f in findings}
    depth, seen, cur = 0, {finding.rule}, finding
    while cur.caused_by and cur.caused_by in by_rule and cur.caused_by not in seen:
        seen.add(cur.caused_by)
        cur = by_rule[cur.caused_by]
        depth += 1
    return depth
