"""What a rule reports: findings (a rule fired), skipped rules (an input was missing), health.

Shapes follow spec/rules.md "What every finding carries" and the ``findings``/``skipped`` arrays
of spec/report.md (schema ``kvdoctor.report/1``). Every value here is already rendered to text
by the rule engine (numbers formatted, units attached), so faces only lay them out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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


@dataclass
class Evidence:
    """One fact that made a rule fire: ``fact`` (what, e.g. "KV cache capacity"), ``value``
    (rendered with its unit, e.g. "3,664 tokens") and ``source`` (where it was read: NVML field,
    nvidia-smi column, metric name, "vllm.log line 42", launch flag)."""

    fact: str
    value: str
    source: str


@dataclass
class Finding:
    """A rule that fired for one engine (or for the host when ``engine`` is None).

    ``suggested_flags`` maps a vLLM flag as vLLM spells it ("--max-model-len") or an environment
    variable ("PYTORCH_CUDA_ALLOC_CONF") to its computed value as text ("23648"); an empty value
    means a flag that takes no argument ("--enforce-eager"). ``gpus`` are GPU indices.
    ``docs`` is the command that shows the rule's documentation.
    """

    rule: str
    severity: Severity
    family: Family
    title: str
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    suggested_flags: dict[str, str] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)
    engine: str | None = None
    docs: str = ""

    def __post_init__(self) -> None:
        if not self.docs:
            self.docs = f"kvdoctor explain {self.rule}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of spec/report.md ``findings[]`` (plus ``docs``)."""
        return asdict(self)


@dataclass
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
