"""The kvdoctor Grafana dashboard, built with grafana-foundation-sdk (Grafana's own typed
builders): deploy/helm/kvdoctor/files/kvdoctor-dashboard.json, written by deploy/generate.py.

Panels (variables: ``namespace`` multi, ``pod`` one pod for the per-GPU panels, ``uuid`` its
GPUs, repeated):

- findings: active kvdoctor findings by severity (stat), by pod and rule with their severity
  (table), and the flags they suggest with values (table);
- GPU memory of each of the pod's GPUs stacked by part (weights, kv_cache, activation_and_graphs,
  engine, other_engines, foreign, unlisted, free), and its utilisation;
- vLLM's own series: KV cache usage (0..1, ``vllm:kv_cache_usage_perc``) and preemptions per
  second (``rate(vllm:num_preemptions_total)``) by pod and engine;
- source health: each kvdoctor source up or down, and the seconds since the last evaluation.

Datasource: the ``DS_PROMETHEUS`` input (``__inputs``, filled in by Grafana's import), which is
also a datasource variable of the same name, so the JSON works as well when Grafana's sidecar
provisions it from the ConfigMap (provisioning does not fill ``__inputs``).
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common as gcommon
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

UID = "kvdoctor-fleet"
DS = DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
NS = 'namespace=~"$namespace"'
POD = f'{NS},pod=~"$pod"'
GPU = f'{POD},uuid=~"$uuid"'
FINDING = "max by (namespace, pod, model_name, engine, rule, severity, family) (kvdoctor_finding{%s})"
INPUTS = [
    {
        "name": "DS_PROMETHEUS",
        "label": "Prometheus",
        "description": "The Prometheus that scrapes the kvdoctor sidecars and vLLM",
        "type": "datasource",
        "pluginId": "prometheus",
        "pluginName": "Prometheus",
    }
]


def _q(expr: str, legend: str = "", *, instant: bool = False, ref: str = "A") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    q = q.instant().format(PromQueryFormat.TABLE) if instant else q.range()
    return q.legend_format(legend) if legend else q


def _var(name: str, label: str, query: str, *, multi: bool, include_all: bool) -> gd.QueryVariable:
    v = (
        gd.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DS)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(1)
    )
    if multi:
        v = v.multi(True)
    if include_all:
        v = v.include_all(True).all_value(".*")
    return v


def build() -> dict[str, Any]:
    """The dashboard as the JSON object Grafana imports (with ``__inputs``)."""
    findings_by_severity = (
        stat.Panel()
        .title("Active findings by severity")
        .description("kvdoctor findings that held their rule's for: (kvdoctor_finding == 1), per severity.")
        .datasource(DS)
        .with_target(_q(f"count by (severity) ({FINDING % NS})", "{{severity}}"))
        .span(6)
        .height(6)
    )
    findings = (
        table.Panel()
        .title("Active findings by pod")
        .description("One row per pod, engine and rule; the runbook is docs/runbooks/RULE.md.")
        .datasource(DS)
        .with_target(_q(FINDING % NS, instant=True))
        .span(10)
        .height(6)
    )
    fixes = (
        table.Panel()
        .title("Suggested flags")
        .description("The vLLM flag (or environment variable) and value each active finding suggests.")
        .datasource(DS)
        .with_target(
            _q(
                "max by (namespace, pod, model_name, engine, rule, flag, value) "
                f"(kvdoctor_suggested_flag_info{{{NS}}})",
                instant=True,
            )
        )
        .span(8)
        .height(6)
    )
    memory = (
        timeseries.Panel()
        .title("GPU $uuid memory by part ($pod)")
        .description(
            "kvdoctor's breakdown of the GPU's memory (NVML used/total, vLLM's KV cache and "
            "weights): what holds it, stacked to the GPU's total."
        )
        .datasource(DS)
        .with_target(_q(f"sum by (part) (kvdoctor_gpu_memory_bytes{{{GPU}}})", "{{part}}"))
        .unit("bytes")
        .stacking(gcommon.StackingConfig().mode(common.StackingMode.NORMAL))
        .fill_opacity(60)
        .repeat("uuid")
        .repeat_direction("h")
        .span(12)
        .height(8)
    )
    util = (
        timeseries.Panel()
        .title("GPU utilisation ($pod)")
        .datasource(DS)
        .with_target(_q(f"max by (gpu, uuid) (kvdoctor_gpu_utilization_ratio{{{POD}}})", "GPU {{gpu}}"))
        .unit("percentunit")
        .min(0)
        .max(1)
        .span(12)
        .height(8)
    )
    kv = (
        timeseries.Panel()
        .title("KV cache usage (vLLM)")
        .description("vllm:kv_cache_usage_perc: a fraction 0..1 despite its name.")
        .datasource(DS)
        .with_target(
            _q(
                f"max by (namespace, pod, model_name, engine) (vllm:kv_cache_usage_perc{{{NS}}})",
                "{{pod}} {{model_name}} engine {{engine}}",
            )
        )
        .unit("percentunit")
        .min(0)
        .max(1)
        .span(12)
        .height(8)
    )
    preempt = (
        timeseries.Panel()
        .title("Preemptions per second (vLLM)")
        .description(
            "rate(vllm:num_preemptions_total): requests evicted and recomputed because the KV "
            "cache is full. More KV room per request helps; a lower --gpu-memory-utilization does not."
        )
        .datasource(DS)
        .with_target(
            _q(
                "sum by (namespace, pod, model_name, engine) "
                f"(rate(vllm:num_preemptions_total{{{NS}}}[$__rate_interval]))",
                "{{pod}} {{model_name}} engine {{engine}}",
            )
        )
        .unit("reqps")
        .span(12)
        .height(8)
    )
    sources = (
        timeseries.Panel()
        .title("kvdoctor sources up")
        .description("1 when the source's last read succeeded (NVML, vLLM /metrics, its log, processes).")
        .datasource(DS)
        .with_target(
            _q(f"min by (namespace, pod, source) (kvdoctor_source_up{{{NS}}})", "{{pod}} {{source}}")
        )
        .min(0)
        .max(1)
        .span(12)
        .height(8)
    )
    staleness = (
        timeseries.Panel()
        .title("Seconds since the last evaluation")
        .description(
            "A sidecar that answers but stopped evaluating grows here (alert KvdoctorEvaluationStale)."
        )
        .datasource(DS)
        .with_target(
            _q(
                f"time() - max by (namespace, pod) (kvdoctor_last_evaluation_timestamp_seconds{{{NS}}})",
                "{{pod}}",
            )
        )
        .unit("s")
        .span(12)
        .height(8)
    )
    ds_var = gd.DatasourceVariable("DS_PROMETHEUS").label("Prometheus").type("prometheus")
    board = (
        gd.Dashboard("kvdoctor: vLLM GPU memory and findings")
        .uid(UID)
        .tags(["kvdoctor", "vllm", "gpu"])
        .description("kvdoctor sidecar findings, GPU memory breakdown and vLLM KV cache health.")
        .time("now-1h", "now")
        .refresh("30s")
        .with_variable(ds_var)
        .with_variable(
            _var(
                "namespace",
                "Namespace",
                "label_values(kvdoctor_build_info, namespace)",
                multi=True,
                include_all=True,
            )
        )
        .with_variable(
            _var(
                "pod",
                "Pod",
                f"label_values(kvdoctor_build_info{{{NS}}}, pod)",
                multi=False,
                include_all=False,
            )
        )
        .with_variable(
            _var(
                "uuid",
                "GPU",
                f"label_values(kvdoctor_gpu_memory_total_bytes{{{POD}}}, uuid)",
                multi=True,
                include_all=True,
            )
        )
        .with_row(gd.Row("Findings"))
        .with_panel(findings_by_severity)
        .with_panel(findings)
        .with_panel(fixes)
        .with_row(gd.Row("GPU memory ($pod)"))
        .with_panel(memory)
        .with_panel(util)
        .with_row(gd.Row("vLLM KV cache"))
        .with_panel(kv)
        .with_panel(preempt)
        .with_row(gd.Row("kvdoctor health"))
        .with_panel(sources)
        .with_panel(staleness)
    )
    out: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for i, panel in enumerate(out["panels"], 1):  # Grafana wants unique panel ids
        panel["id"] = i
    return {"__inputs": INPUTS, **out}


def dashboard_json() -> str:
    """:func:`build` as the text of files/kvdoctor-dashboard.json."""
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target of a dashboard JSON object."""
    return [
        (p.get("title", ""), t["expr"])
        for p in board.get("panels", [])
        for t in p.get("targets", [])
        if t.get("expr")
    ]
