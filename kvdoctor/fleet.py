"""Fleet mode: the same rules per pod over what Prometheus holds, one report grouped by pod.

:func:`diagnose_fleet` evaluates each pod's Timeline (``kvdoctor.sources.prometheus``) through
the one :class:`~kvdoctor.pipeline.Pipeline` and lays the per-pod reports out as one
:class:`~kvdoctor.report.Report`: each finding's ``engine`` is ``"<pod>: <engine>"`` (``"<pod>"``
for host-level ones), engines and GPUs carry a ``pod`` key. Sources are summed up per kind and
origin (``metrics prometheus URL: ok — 500 pods``); a pod whose source is not ok keeps its own
line (the first :data:`MAX_POD_SOURCE_LINES`), so a fleet's report is not one line per pod. Pods in
trouble come worst first (their worst finding's severity, then the pod), each pod's findings in
its own report's order: root cause first, its consequences after it. It adds no diagnosis of
its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvdoctor.facts import SourceStatus, Timeline
from kvdoctor.findings import SEVERITY_ORDER, Finding, worst_health
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import Report, _iso_utc
from kvdoctor.sources.prometheus import PodData

#: pods whose source that is not ok is listed on its own (the rest are counted in one line).
MAX_POD_SOURCE_LINES = 20


def fleet_sources(statuses: list[SourceStatus]) -> list[SourceStatus]:
    """The per-pod statuses summed up: one line per (kind, origin without the pod, status)
    counting the pods; statuses other than ok listed first, each on its own line, at most
    :data:`MAX_POD_SOURCE_LINES` of them."""
    groups: dict[tuple[str, str, str], list[SourceStatus]] = {}
    for st in statuses:
        base = st.origin.split(" pod ", 1)[0].rstrip(",")
        groups.setdefault((st.kind, base, st.status), []).append(st)
    own = [st for st in statuses if st.status != "ok"][:MAX_POD_SOURCE_LINES]
    summary = [
        SourceStatus(kind, base, status, f"{len(items)} pod(s)")  # type: ignore[arg-type]
        for (kind, base, status), items in groups.items()
    ]
    return own + summary


def pod_engine(pod: str, engine: str | None) -> str:
    """The grouped engine name: ``"ml/vllm-0: meta-llama/Llama-3.1-8B-Instruct"``."""
    return f"{pod}: {engine}" if engine else pod


def diagnose_fleet(pods: Iterable[PodData], pipeline: Pipeline, *, now: float | None = None) -> Report:
    """One Report over every pod (see the module doc), evaluated as ``pods`` yields them (each
    pod's snapshots let go once evaluated: :func:`~kvdoctor.sources.prometheus.iter_fleet`
    then holds one batch at a time). Never raises for a pod's missing facts (a SourceError
    from ``pods`` goes through)."""
    per_pod: list[tuple[int, str, list[Finding]]] = []
    skipped = []
    sources = []
    gpus: list[dict[str, object]] = []
    engines: list[dict[str, object]] = []
    for pod in pods:
        if not pod.snapshots:
            continue
        timeline = Timeline(list(pod.snapshots), max_len=len(pod.snapshots) + 1)
        pod.snapshots = []
        report = pipeline.evaluate(timeline, now=now)
        del timeline
        for f in report.findings:
            f.engine = pod_engine(pod.key, f.engine)
        if report.findings:
            worst = max(SEVERITY_ORDER.get(f.severity, 0) for f in report.findings)
            per_pod.append((worst, pod.key, list(report.findings)))
        for s in report.skipped:
            s.engine = pod_engine(pod.key, s.engine)
            skipped.append(s)
        sources.extend(report.sources)
        gpus.extend({**g, "pod": pod.key} for g in report.gpus)
        engines.extend(
            {**e, "id": pod_engine(pod.key, str(e.get("id"))), "pod": pod.key} for e in report.engines
        )
    per_pod.sort(key=lambda p: (-p[0], p[1]))
    findings = [f for _, _, pod_findings in per_pod for f in pod_findings]
    return Report(
        generated_at=_iso_utc(now),
        health=worst_health(findings),
        sources=fleet_sources(sources),
        gpus=gpus,
        engines=engines,
        findings=findings,
        skipped=sorted(skipped, key=lambda s: (s.engine or "", s.rule)),
    )
