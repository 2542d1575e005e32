"""Fleet mode: the same rules per pod over what Prometheus holds, one report grouped by pod.

:func:`diagnose_fleet` evaluates each pod's Timeline (``kvdoctor.sources.prometheus``) through
the one :class:`~kvdoctor.pipeline.Pipeline` and lays the per-pod reports out as one
:class:`~kvdoctor.report.Report`: each finding's ``engine`` is ``"<pod>: <engine>"`` (``"<pod>"``
for host-level ones), engines and GPUs carry a ``pod`` key, sources name their pod. Findings
sort worst first, then by pod. It adds no diagnosis of its own.
"""

from __future__ import annotations

from kvdoctor.facts import Timeline
from kvdoctor.findings import SEVERITY_ORDER, worst_health
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import Report, _iso_utc
from kvdoctor.sources.prometheus import PodData


def pod_engine(pod: str, engine: str | None) -> str:
    """The grouped engine name: ``"ml/vllm-0: meta-llama/Llama-3.1-8B-Instruct"``."""
    return f"{pod}: {engine}" if engine else pod


def diagnose_fleet(pods: list[PodData], pipeline: Pipeline, *, now: float | None = None) -> Report:
    """One Report over every pod (see the module doc). Never raises for a pod's missing facts."""
    findings = []
    skipped = []
    sources = []
    gpus: list[dict[str, object]] = []
    engines: list[dict[str, object]] = []
    for pod in pods:
        if not pod.snapshots:
            continue
        timeline = Timeline(list(pod.snapshots), max_len=len(pod.snapshots) + 1)
        report = pipeline.evaluate(timeline, now=now)
        for f in report.findings:
            f.engine = pod_engine(pod.key, f.engine)
            findings.append(f)
        for s in report.skipped:
            s.engine = pod_engine(pod.key, s.engine)
            skipped.append(s)
        sources.extend(report.sources)
        gpus.extend({**g, "pod": pod.key} for g in report.gpus)
        engines.extend(
            {**e, "id": pod_engine(pod.key, str(e.get("id"))), "pod": pod.key} for e in report.engines
        )
    findings.sort(key=lambda f: (-SEVERITY_ORDER.get(f.severity, 0), f.engine or "", f.rule))
    return Report(
        generated_at=_iso_utc(now),
        health=worst_health(findings),
        sources=sources,
        gpus=gpus,
        engines=engines,
        findings=findings,
        skipped=sorted(skipped, key=lambda s: (s.engine or "", s.rule)),
    )
