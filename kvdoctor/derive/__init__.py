"""Facts → the variables rules read (one context per engine), one module per family.

``derive`` sits between the facts (``kvdoctor.facts``: what the sources read) and the rules
(``rules/*.yaml``): which GPUs an engine uses, which processes on them are foreign or orphaned,
windowed rates and quantiles from the metrics timeline (``kvdoctor.timeline``), the KV capacity
(``kvdoctor.kvmath``), the salient log events. Rules only compare these and compute small
formulas; every decision (a threshold, "full", "empty", "pressure") is a rule's, overridable in
the user config.

Families run in the declared :data:`ORDER`; each declares the variables it writes (name → unit
and source) and those it reads from earlier families (``tests/test_derive.py`` fails on an
undeclared read or a variable written twice). :data:`VARIABLES` is their union: the rule loader
refuses a rule that names anything else. A value that could not be read is ``None``.

derive reads facts and vLLM knowledge only (``kvdoctor.vllm_flags``, ``kvmath``, ``catalog``,
``devices``); it imports no source module and never modifies a fact: engines are new objects,
scrapes without a timestamp are copied before one is stamped on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvdoctor import catalog
from kvdoctor.derive import (
    attribution,
    budget,
    colocation,
    config,
    container,
    dp,
    episodes,
    extensible,
    growth,
    hardware,
    log,
    longctx,
    metrics,
    model,
    offload,
    oom,
    preflight,
    pressure,
    requests,
    sleep,
    swap,
    workspace,
)
from kvdoctor.derive.base import (
    Family,
    LogRuns,
    Scope,
    Vars,
    current_run,
    log_runs,
    timeline_columns,
    visible_gpus,
)
from kvdoctor.derive.engines import (
    SampledHistory,
    build_engines,
    dp_targets,
    engine_labels,
    engine_pids_of,
    engine_runs,
    engine_series_at,
    history_positions,
    recent_count,
    separate_log_engines,
    weight_daemon_pids,
)
from kvdoctor.facts import Engine, EngineConfig, EngineMetrics, Snapshot, Timeline
from kvdoctor.timeline import MIN_RATE_SPAN_S

__all__ = [
    "FAMILIES",
    "INPUTS",
    "ORDER",
    "VARIABLES",
    "build_contexts",
    "build_engines",
    "current_run",
]

#: The families, in the order they run: a family reads only variables of families before it.
FAMILIES: tuple[Family, ...] = (
    config.FAMILY,
    container.FAMILY,
    attribution.FAMILY,
    log.FAMILY,
    model.FAMILY,
    metrics.FAMILY,
    pressure.FAMILY,
    swap.FAMILY,
    oom.FAMILY,
    requests.FAMILY,
    hardware.FAMILY,
    growth.FAMILY,
    colocation.FAMILY,
    # catalogue 2 (spec/rules-catalogue2.md): budget holds its §2 shared definitions
    budget.FAMILY,
    offload.FAMILY,
    workspace.FAMILY,
    longctx.FAMILY,
    dp.FAMILY,
    sleep.FAMILY,
    # vLLM 0.34 (spec/vllm-0.34.md §1): the sizing mode, the committed pool, the warm-up figures
    extensible.FAMILY,
    # issue 24 kind 10: what vLLM would reject in the launch command
    preflight.FAMILY,
    # issue 24: the whole recorded series (forensic episodes, the running count before the trouble)
    episodes.FAMILY,
)
ORDER: tuple[str, ...] = tuple(f.name for f in FAMILIES)

#: name → (unit, description and source): every family's ``WRITES``. The catalogue rules are
#: validated against.
VARIABLES: dict[str, str] = {name: desc for fam in FAMILIES for name, desc in fam.writes.items()}

#: every variable, None: the start of each context's variables (copied).
_BLANK: dict[str, Any] = dict.fromkeys(VARIABLES)

#: inputs a rule can need (``needs:`` in rules/*.yaml) → what provides them.
INPUTS = {
    "gpus": "nvidia-smi / NVML",
    "metrics": "vLLM /metrics",
    "timeline": f"two or more /metrics scrapes, at least {MIN_RATE_SPAN_S:g} s apart",
    "log": "vLLM log",
    "config": "launch command or the log's args",
    "model": "config.json",
    "processes": "host process table (live or ps.txt)",
}

#: Key of a context's variables listing the families that failed on this input ("growth:
#: OverflowError"); present only when one did. Not a variable: the pipeline takes it out and
#: reports it as a "derive" source error.
FAILED_KEY = "_derive_failed"

#: How a family sees the variables dict: identity here; tests wrap it to record reads/writes.
_view: Callable[[Family, Vars], Vars] = lambda _family, v: v  # noqa: E731


def build_contexts(
    timeline: Timeline, configs: list[EngineConfig], *, window_s: float = 60.0
) -> tuple[list[Engine], list[tuple[str | None, dict[str, Any], set[str]]], dict[str, dict[str, Any]]]:
    """Engines, one (engine id, variables, inputs present) per engine, and per-engine KV facts
    for the report (``num_gpu_blocks``, ``block_size``, ``capacity_tokens``, ``usage``).

    ``window_s``: seconds of the "recent" window ending at the newest snapshot; only that window
    of the Timeline (plus a bounded sample of its history) is read. A snapshot with no engine at
    all (only nvidia-smi, say) still gets one context, so GPU and process rules run. Never
    raises for missing inputs (variables are None instead) and modifies neither ``timeline``
    nor ``configs``: the returned engines are new objects.
    """
    snapshot = timeline.latest or Snapshot()
    engines = build_engines(snapshot, configs)
    columns = timeline_columns(timeline)
    count, older = recent_count(timeline.snapshots, window_s, columns)
    end = len(timeline.snapshots)
    start = end - count  # the window is the Timeline's tail (= recent_snapshots')
    # each snapshot's labels once in its life (an interned tuple: the window's are mostly one object)
    labels = sorted(set().union(*set(columns.span("engine_labels", engine_labels, start, end))))
    targets, listed = dp_targets(engines, labels)
    peers = {lab: engine_series_at(columns, start, end, lab) for lab in labels} if len(labels) > 1 else {}
    history_index = history_positions(end)
    # = bounded_history(timeline.snapshots), read on demand
    history = SampledHistory(timeline.snapshots, history_index)
    runs = log_runs(snapshot.log) if snapshot.log is not None else None
    visible = visible_gpus(snapshot)
    engine_pids = engine_pids_of(snapshot, runs.run.events if runs is not None else [])
    if runs is not None:
        engine_pids |= runs.pids_latest
    # A `vllm preload` weights daemon is part of the deployment: its pids count as the engine's
    # (never foreign), but it is no second engine (stacked / colocated checks skip it).
    daemon_pids = weight_daemon_pids(snapshot, runs.run.events if runs is not None else [], engine_pids)
    engine_pids |= daemon_pids
    contexts: list[tuple[str | None, dict[str, Any], set[str]]] = []
    kv_report: dict[str, dict[str, Any]] = {}
    out_engines: list[Engine] = []
    gpus_of: dict[str, list[int]] = {}
    log_engines = separate_log_engines(snapshot.log) if snapshot.log is not None else []
    for idx, (eng, label) in enumerate(targets):
        series = engine_series_at(columns, start, end, label) if (label is not None or idx == 0) else []
        # one log, several engines: each engine's context reads its own lines only
        eng_runs = engine_runs(runs, eng, log_engines) if runs is not None and eng is not None else runs
        scope = _scope(
            snapshot,
            eng,
            series,
            window_s,
            dp_label=label if len(labels) > 1 else None,
            older=older and bool(series),
            history=history,
            all_engines=listed,
            runs=eng_runs,
            visible=container.engine_visible(eng, visible),  # a pod's GPUs by UUID
            engine_pids=engine_pids,
            peers=peers,
            daemon_pids=daemon_pids,
        )
        scope.history_columns, scope.history_index = columns, history_index
        variables = derive_variables(scope)
        contexts.append((eng.id if eng else None, variables, _inputs(scope)))
        if eng is not None:
            kv_report[eng.id] = {
                "num_gpu_blocks": variables.get("cache_num_gpu_blocks")
                or variables.get("log_num_gpu_blocks"),
                "block_size": variables.get("block_size"),
                "capacity_tokens": variables.get("kv_capacity_tokens"),
                "usage": variables.get("kv_usage"),
                "attribution": variables.get("gpu_attribution"),
                # vLLM knowledge applied to it (derive/extensible.py): what was read or assumed
                "vllm": {
                    "version": variables.get("vllm_version"),
                    "version_known": variables.get("vllm_version_known"),
                    "defaults_version": variables.get("vllm_defaults_version"),
                    "sizing_mode": variables.get("vllm_sizing_mode"),
                    "sizing_mode_source": variables.get("vllm_sizing_mode_source"),
                    "sizing_mode_assumed": variables.get("vllm_sizing_mode_assumed"),
                    "assumption": variables.get("vllm_assumption"),
                    "gmu": variables.get("gmu_assumption"),
                    "kv_pool_bytes": variables.get("kv_pool_bytes"),
                    "kv_reservation_bytes": variables.get("kv_reservation_bytes"),
                    "torch_cap_bytes": variables.get("torch_cap_bytes"),
                },
            }
            gpus_of[eng.id] = list(variables.get("engine_gpus") or [])
    for e in listed:
        # Engine assembly returns new objects: the GPUs found are set on copies.
        out_engines.append(Engine(id=e.id, config=e.config, pid=e.pid, gpus=gpus_of.get(e.id, list(e.gpus)),
                                  metrics_url=e.metrics_url, api_server_alive=e.api_server_alive,
                                  pids=list(e.pids)))  # fmt: skip
    return out_engines, contexts, kv_report


def _scope(
    snapshot: Snapshot,
    engine: Engine | None,
    series: list[Any],
    window_s: float,
    *,
    dp_label: str | None,
    older: bool,
    history: Sequence[Snapshot],
    all_engines: list[Engine],
    runs: LogRuns | None,
    visible: list[Any],
    engine_pids: frozenset[int],
    peers: dict[str, list[Any]] | None = None,
    daemon_pids: frozenset[int] = frozenset(),
) -> Scope:
    cfg = engine.config if engine else EngineConfig()
    arch = snapshot.model
    model_source = "config.json" if arch is not None else None
    if arch is None and cfg.model:
        arch = catalog.model_arch(cfg.model)
        model_source = "catalogue" if arch is not None else None
    return Scope(
        snapshot=snapshot,
        engine=engine,
        cfg=cfg,
        series=series,
        window_s=window_s,
        dp_label=dp_label,
        older_scrapes=older,
        history=history,
        all_engines=all_engines,
        runs=runs,
        arch=arch,
        model_source=model_source,
        visible=visible,
        engine_pids=engine_pids,
        peer_series=peers or {},
        weight_daemon_pids=daemon_pids,
    )


def _spans_a_rate(series: list[EngineMetrics]) -> bool:
    """Two scrapes or more, the first and the last at least ``MIN_RATE_SPAN_S`` apart (untimed
    scrapes: two are enough)."""
    if len(series) < 2:
        return False
    first, last = series[0].timestamp, series[-1].timestamp
    return first is None or last is None or last - first >= MIN_RATE_SPAN_S


def _inputs(s: Scope) -> set[str]:
    """The inputs present for this context (rules' ``needs`` / ``needs_any``)."""
    inputs: set[str] = set()
    if s.snapshot.gpus:
        inputs.add("gpus")
    if s.series:
        inputs.add("metrics")
    if _spans_a_rate(s.series) or (s.series and s.older_scrapes):
        inputs.add("timeline")
    if s.log is not None and s.log.events:
        inputs.add("log")
    if s.engine is not None and (s.cfg.explicit or s.cfg.model or s.cfg.command):
        inputs.add("config")
    if s.arch is not None:
        inputs.add("model")
    if s.snapshot.process_table_known:
        inputs.add("processes")
    return inputs


def derive_variables(scope: Scope) -> dict[str, Any]:
    """Every family over one scope, in :data:`ORDER`: name → value (None when unknown)."""
    v: dict[str, Any] = _BLANK.copy()  # dict.fromkeys(VARIABLES): a tenth of the time
    failed: list[str] = []
    for fam in FAMILIES:
        try:
            fam.run(scope, _view(fam, v))
        except (ArithmeticError, ValueError) as e:
            # A number out of range that no parser caught (the parsers read NaN, ±Inf and
            # magnitudes past units.MAX_QUANTITY as unknown): this family's variables are
            # unknown, the families after it and every rule that does not read them still run.
            for name in fam.writes:
                v[name] = None
            failed.append(f"{fam.name}: {type(e).__name__}")
    if failed:
        v[FAILED_KEY] = failed
    return v
