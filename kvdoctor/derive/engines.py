"""Engine assembly and the slices of a Timeline one evaluation reads.

Engines come from the launch commands (``Snapshot.configs``), the log's args and the
``vllm:cache_config_info`` labels, with vLLM's defaults for the version: always new objects, the
facts they come from are left as they are. The Timeline is read only within the window (found
from the newest snapshot backwards) and through a bounded sample of its history, so the cost of
one evaluation does not grow with the Timeline's length.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import operator
from collections.abc import Sequence
from typing import Any, TypeVar, overload

from kvdoctor.derive.base import Columns, LogRuns, LogView, log_runs
from kvdoctor.facts import (
    Engine,
    EngineConfig,
    EngineMetrics,
    HistogramData,
    LogEngine,
    LogEvent,
    Snapshot,
    VllmLog,
)
from kvdoctor.timeline import Series, histogram_step_ok, sourced_series
from kvdoctor.vllm_defaults import FIRST_EXTENSIBLE_VERSION as V034_TEXT
from kvdoctor.vllm_defaults import ModeDecision, decide_sizing_mode, is_v034
from kvdoctor.vllm_flags import apply_defaults, update_config_from_args

_T = TypeVar("_T")

#: the most snapshots of history read for trends (GPU memory growth): evenly spaced.
MAX_HISTORY_POINTS = 60


def engine_pids_of(snapshot: Snapshot, log_events: Sequence[LogEvent]) -> frozenset[int]:
    """The engine's pids from every source a bundle offers: the process table (vLLM roles, a
    process whose command line launches vLLM, and its descendants), and the log's own lines
    (``engine_pid`` events: "Started engine process with PID N", uvicorn's server pid,
    application lines; the raising pid of a ``cuda_oom`` it names). ``log_events``: the latest
    run's events (the process prefixes' pids are added by the caller)."""
    pids = {p.pid for p in snapshot.processes if p.vllm_role is not None or p.launches_vllm}
    by_parent: dict[int, list[int]] = {}
    for p in snapshot.processes:
        if p.ppid is not None:
            by_parent.setdefault(p.ppid, []).append(p.pid)
    todo = list(pids)
    while todo and len(pids) < 10_000:
        for child in by_parent.get(todo.pop(), []):
            if child not in pids:
                pids.add(child)
                todo.append(child)
    for e in log_events:
        if e.kind == "engine_pid" and isinstance(e.values.get("pid"), int):
            pids.add(e.values["pid"])
        elif e.kind == "cuda_oom" and isinstance(e.values.get("engine_pid"), int):
            pids.add(e.values["engine_pid"])
    return frozenset(pids)


#: a weights daemon's own context and allocator slack beyond the weights vLLM reports as
#: "Externally held weights" (CUDA context ≈ 0.3-0.6 GiB).
_DAEMON_SLACK_BYTES = 3 * 2**29


def weight_daemon_pids(
    snapshot: Snapshot, log_events: Sequence[LogEvent], engine_pids: frozenset[int]
) -> frozenset[int]:
    """Pids of a ``vllm preload`` weights daemon: a process holding the deployment's weights in
    GPU memory for its engines, part of the deployment and never a foreign process or a second
    engine. From the process table (``HostProcess.vllm_role`` "weight_daemon"), the GPU
    process name (nvidia-smi / NVML, "vllm preload …"), and the log's "Externally held weights
    … (X GiB)" lines (``external_weights`` events): a GPU process that is no engine pid and
    holds X GiB plus at most a context's slack is the daemon."""
    pids = {p.pid for p in snapshot.processes if p.vllm_role == "weight_daemon"}
    held = [
        int(e.values["bytes"])
        for e in log_events
        if e.kind == "external_weights" and isinstance(e.values.get("bytes"), int) and e.values["bytes"] > 0
    ]
    for g in snapshot.gpus:
        for p in g.processes:
            if _preload_name(p.name):
                pids.add(p.pid)
            elif held and p.pid not in engine_pids and p.used_bytes is not None:
                if any(b <= p.used_bytes <= b + _DAEMON_SLACK_BYTES for b in held):
                    pids.add(p.pid)
    return frozenset(pids)


def _preload_name(name: str | None) -> bool:
    """A GPU process name (NVML / nvidia-smi) with both "preload" and "vllm" in it, any case."""
    low = (name or "").lower()
    return "preload" in low and "vllm" in low


def _own_copy(cfg: EngineConfig) -> EngineConfig:
    return dataclasses.replace(cfg, explicit=set(cfg.explicit), args=dict(cfg.args))


def build_engines(snapshot: Snapshot, configs: list[EngineConfig]) -> list[Engine]:
    """Engines from launch commands, the log's args and /metrics (cache_config_info).

    One engine per launch command; with no command, one engine per engine of a log that holds
    several (``VllmLog.engines``: each with its own args and pids), else one engine built from
    the log or metrics. Fields the user set on the command line win; the engine's own log args
    fill the rest (a launch command is matched to a log engine by model, else by position); then
    ``vllm:cache_config_info`` labels; then vLLM's defaults for the detected version. Returns
    new :class:`Engine` objects with configs of their own: ``configs`` and ``snapshot`` are not
    modified.

    Answers are reused while the inputs are the same (a live Timeline asks every cycle):
    ``configs`` and the log the same objects (the log with as many events: :func:`base.log_runs`
    keys on the same), the newest scrape's ``cache_config`` and the first one's model name
    equal. The engines are new objects on every call; their configs are shared with the calls
    that reused them (facts: never modified).
    """
    log = snapshot.log
    metrics = snapshot.metrics
    key = (
        log,
        len(log.events) if log is not None else -1,
        metrics[-1].cache_config if metrics else None,
        metrics[0].model_name if metrics else None,
    )
    hit = _ENGINES_MEMO.get(len(configs))
    if (
        hit is not None
        and hit[0][0] is key[0]
        and hit[0][1:] == key[1:]
        and all(map(operator.is_, hit[1], configs))
    ):
        return [Engine(id=e.id, config=e.config, pids=list(e.pids)) for e in hit[2]]
    engines = _build_engines(snapshot, configs)
    if len(_ENGINES_MEMO) > 8:
        _ENGINES_MEMO.clear()
    # the memo's own Engine objects: the caller may change the lists of those it was given
    _ENGINES_MEMO[len(configs)] = (
        key,
        tuple(configs),
        tuple(Engine(id=e.id, config=e.config, pids=list(e.pids)) for e in engines),
    )
    return engines


#: number of launch configs → (key, configs, engines) of the last :func:`build_engines` call.
_ENGINES_MEMO: dict[int, tuple[tuple[Any, ...], tuple[EngineConfig, ...], tuple[Engine, ...]]] = {}


def _build_engines(snapshot: Snapshot, configs: list[EngineConfig]) -> list[Engine]:
    """:func:`build_engines` worked out."""
    log = snapshot.log
    version = log.vllm_version if log else None
    cfgs = [_own_copy(c) for c in configs]
    log_engines = separate_log_engines(log) if log is not None else []
    if not cfgs and len(log_engines) >= 2:
        cfgs = [EngineConfig() for _ in log_engines]
        own: list[LogEngine | None] = list(log_engines)
    else:
        own = _match_log_engines(cfgs, log_engines)
    if not cfgs and (log is not None and (log.args or log.events) or snapshot.metrics):
        cfgs, own = [EngineConfig()], [None]
    engines: list[Engine] = []
    for i, cfg in enumerate(cfgs):
        le = own[i]
        if le is not None:
            _fill_from_log_args(cfg, le.args)
        elif log is not None and log.args and i == 0:
            _fill_from_log_args(cfg, log.args)
        if snapshot.metrics and i == 0:
            _fill_from_cache_config(cfg, snapshot.metrics[-1].cache_config)
        if log is not None and i == 0 and cfg.block_size is None:
            # No --block-size, no cache_config_info: the log's own KV lines tell the real one
            # (CPU builds default to 128, hybrid models enlarge it); vLLM's 16 is only a guess.
            cfg.block_size = block_size_from_log(log, cfg.max_model_len, version)
        if version and not cfg.vllm_version:
            cfg.vllm_version = version
        # vLLM 0.34's defaults depend on how the engine sized its KV cache (vllm_defaults)
        decision = sizing_decision(
            cfg,
            log_runs(log).run if log is not None else None,
            snapshot.metrics[-1].cache_config if snapshot.metrics and i == 0 else None,
        )
        if decision is not None and not is_v034(cfg.vllm_version):
            # no version, but 0.34's own cache_config_info label: 0.34's defaults, version kept unknown
            cfg = dataclasses.replace(
                apply_defaults(cfg, V034_TEXT, decision.mode), vllm_version=cfg.vllm_version
            )
        else:
            cfg = apply_defaults(cfg, cfg.vllm_version, decision.mode if decision is not None else None)
        engine_name = (
            cfg.served_model_name
            or cfg.model
            or (snapshot.metrics[0].model_name if snapshot.metrics else None)
        )
        engines.append(
            Engine(
                id=str(engine_name) if engine_name else f"engine{i}",
                config=cfg,
                pids=list(le.pids) if le is not None else [],
            )
        )
    return engines


def sizing_decision(
    cfg: EngineConfig, run: LogView | None, cache_config: dict[str, str] | None
) -> ModeDecision | None:
    """How a vLLM ≥ 0.34 engine sized its KV cache (spec/vllm-0.34.md §1), None for an engine not
    known to be 0.34 (:func:`kvdoctor.vllm_defaults.decide_sizing_mode`). Evidence: the log's
    ``memory_after_warmup`` / ``kv_extended`` events (ran extensible) or ``extensible_disabled``
    (fell back, or off for want of an IMEX channel); the launch flags (``cfg.args`` and the
    fields ``kv_cache_memory_bytes`` / ``num_gpu_blocks_override``); a CPU engine ("CPU KV
    cache size"); the ``cache_config_info{enable_extensible_kv_cache}`` label."""
    version = cfg.vllm_version or (run.vllm_version if run is not None else None)
    ran = None
    disabled = None
    platform = None
    if run is not None:
        ran = bool(run.of("memory_after_warmup") or run.of("kv_extended")) or None
        off = run.last("extensible_disabled")
        if off is not None:
            disabled = str(off.values.get("reason") or "")
        size = run.last("kv_cache_size")
        if size is not None and str(size.values.get("device") or "").upper() == "CPU":
            platform = "cpu"
    args = dict(cfg.args)
    if cfg.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    if cfg.num_gpu_blocks_override is not None:
        args["num_gpu_blocks_override"] = cfg.num_gpu_blocks_override
    label = (cache_config or {}).get("enable_extensible_kv_cache")
    return decide_sizing_mode(
        version,
        log_ran_extensible=ran,
        log_disabled_reason=disabled,
        args=args,
        label=label,
        platform=platform,
    )


def separate_log_engines(log: VllmLog) -> list[LogEngine]:
    """The engines of a log that are servers of their own: those of its latest run (a restarted
    server's earlier engine-initialisation line is the same server; ``base.log_runs`` tells a
    restart from a second server), and none when they are one server's data-parallel engines
    (``data_parallel_size`` > 1: one engine per ``engine`` label, ``dp_targets``). [] when fewer
    than two remain."""
    starts = log_runs(log).starts
    first = starts[-1] if len(starts) > 1 else 0
    out = [le for le in log.engines if le.init_line >= first]
    if any(_int(le.args.get("data_parallel_size")) > 1 for le in out):
        return []
    return out if len(out) >= 2 else []


def _int(x: Any) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return 1


def engine_runs(runs: LogRuns, engine: Engine, log_engines: Sequence[LogEngine]) -> LogRuns:
    """The log as one engine of several sees it: its own events (its pids' lines, and unprefixed
    lines after its engine-initialisation line and before the next engine's), and the lines
    before the first engine's that belong to no engine. Another engine's OOM or failed startup
    is not this engine's. ``runs`` unchanged when the engine has no pids of its own or the log
    holds one engine; never modifies ``runs``."""
    if not engine.pids or len(log_engines) < 2:
        return runs
    own = frozenset(engine.pids)
    mine = next((le for le in log_engines if own & set(le.pids)), None)
    if mine is None:
        return runs
    others = frozenset(p for le in log_engines if le is not mine for p in le.pids)
    inits = sorted(le.init_line for le in log_engines)
    first = inits[0]
    nxt = min((x for x in inits if x > mine.init_line), default=None)

    def keep(e: LogEvent) -> bool:
        if e.pid is not None and e.pid in own:
            return True
        if e.pid is not None and e.pid in others:
            return False
        if e.kind == "args" and e.values.get("source") != "engine_config":
            # an unprefixed "non-default args" line precedes its own engine's init line
            owner = min((x for x in inits if x > e.line), default=inits[-1])
            return owner == mine.init_line
        if e.line < first:
            return True  # the log's preamble belongs to no engine
        return e.line >= mine.init_line and (nxt is None or e.line < nxt)

    full = [e for e in runs.full.events if keep(e)]
    run = [e for e in runs.run.events if keep(e)]
    log = runs.full.log
    return LogRuns(LogView(log, full), LogView(log, run), runs.starts, runs.pids_latest, runs.pids_earlier)


def _match_log_engines(cfgs: list[EngineConfig], log_engines: list[LogEngine]) -> list[LogEngine | None]:
    """The log engine of each launch command: the one serving the same model (only one such),
    else the one at the same position when the counts agree, else None."""
    if len(log_engines) < 2:
        return [None] * len(cfgs)
    out: list[LogEngine | None] = []
    used: set[int] = set()
    for c in cfgs:
        names = {n for n in (c.model, c.served_model_name) if n}
        same = [le for le in log_engines if le.args.get("model") in names and le.index not in used]
        pick = same[0] if len(same) == 1 else None
        if pick is not None:
            used.add(pick.index)
        out.append(pick)
    if len(cfgs) == len(log_engines):
        for i, le in enumerate(log_engines):
            if out[i] is None and le.index not in used:
                out[i] = le
                used.add(le.index)
    return out


#: block sizes vLLM accepts for full attention (CacheConfig's BlockSize choices).
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


def block_size_from_log(log: VllmLog, max_model_len: int | None, version: str | None) -> int | None:
    """Tokens per KV block as the log of the latest run shows it, or None when it does not.

    In order: "Setting attention block size to N tokens" (hybrid alignment); on 0.34 "Setting kv
    cache block size to N for … backend(s)"; else the block size that makes the engine's own KV
    lines agree: the number of blocks ("Overriding num_gpu_blocks=… with num_gpu_blocks_override=N",
    V1; "# GPU blocks: N", V0; 0.34's "Extended KV cache to N blocks") against "<dev>
    KV cache size: T tokens" (vllm-facts §2.4: T = N × B before 0.21; T = int(N / cdiv(L, B) × L)
    from 0.21, L = max_model_len). Only a single answer is taken (several block sizes can give
    the same T when L is not a multiple of them); None otherwise.
    """
    from kvdoctor.derive.base import log_runs

    run = log_runs(log).run
    hybrid = run.last("hybrid_block_size")
    if hybrid is not None and isinstance(hybrid.values.get("block_size"), int):
        return int(hybrid.values["block_size"])
    if is_v034(version):
        # 0.34: a backend whose preference differs from the default 64 says so (CUTLASS MLA: 128)
        pref = run.last("backend_block_size")
        if pref is not None and isinstance(pref.values.get("block_size"), int):
            return int(pref.values["block_size"])
    size = run.last("kv_cache_size")
    tokens = size.values.get("tokens") if size is not None else None
    override, v0 = run.last("num_gpu_blocks_override"), run.last("v0_blocks")
    extended = [
        int(e.values["blocks"]) for e in run.of("kv_extended") if isinstance(e.values.get("blocks"), int)
    ]
    blocks = (
        override.values.get("override")
        if override is not None
        else (v0.values.get("gpu_blocks") if v0 is not None else (min(extended) if extended else None))
    )
    if not isinstance(tokens, int) or not isinstance(blocks, int) or tokens <= 0 or blocks <= 0:
        return None
    if max_model_len is None:
        ev = run.last("max_model_len_used")
        max_model_len = ev.values.get("max_model_len") if ev is not None else None
    mml = int(max_model_len) if isinstance(max_model_len, int) and max_model_len > 0 else None
    new_formula = _at_least(version, (0, 21))
    fits = set()
    for b in _BLOCK_SIZES:
        old_ok = new_formula is not True and blocks * b == tokens
        # 0.21+: max_concurrency = blocks / cdiv(L, B); tokens = int(max_concurrency × L)
        new_ok = new_formula is not False and mml is not None and int(blocks / -(-mml // b) * mml) == tokens
        if old_ok or new_ok:
            fits.add(b)
    return fits.pop() if len(fits) == 1 else None


def _at_least(version: str | None, floor: tuple[int, int]) -> bool | None:
    """Whether ``version`` ("0.32.0", "0.11.2rc1") is at least ``floor``; None when unknown."""
    parts = (version or "").split(".")
    try:
        return (int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")) >= floor
    except (IndexError, ValueError):
        return None


def _fill_from_log_args(cfg: EngineConfig, log_args: dict[str, Any]) -> None:
    """Fields the command line did not set, from the log's ``non-default args`` (into ``cfg``,
    the caller's own copy)."""
    args = {k: v for k, v in log_args.items() if not k.startswith("_")}
    explicit_keys = set(log_args.get("_explicit", []) or [])
    fill = {k: v for k, v in args.items() if k not in cfg.explicit}
    tmp = EngineConfig()
    update_config_from_args(tmp, {k: v for k, v in fill.items() if k in explicit_keys}, explicit=True)
    update_config_from_args(tmp, {k: v for k, v in fill.items() if k not in explicit_keys}, explicit=False)
    for name in vars(tmp):
        if name in ("explicit", "args", "command") or name in cfg.explicit:
            continue
        if name in tmp.explicit or (name in fill or _field_from_args(name, fill)):
            val = getattr(tmp, name)
            if val is not None:
                setattr(cfg, name, val)
    cfg.explicit |= tmp.explicit
    if cfg.gpu_memory_utilization is not None and "gpu_memory_utilization" in fill:
        # V0's 'args: Namespace(…)' lists every argument, defaults too: its gmu is the one in
        # effect, not a guess for the version's defaults to replace (issue 24 kind 3)
        cfg.explicit.add("gpu_memory_utilization")


def _field_from_args(name: str, args: dict[str, Any]) -> bool:
    aliases = {"max_model_len": ("max_seq_len",), "gpu_memory_utilization": ("gpu_memory_utilization",)}
    return any(a in args for a in aliases.get(name, ()))


def _fill_from_cache_config(cfg: EngineConfig, cc: dict[str, str]) -> None:
    from kvdoctor.derive.base import num

    if "block_size" not in cfg.explicit and num(cc.get("block_size")) is not None:
        cfg.block_size = int(num(cc.get("block_size")) or 16)
    if "gpu_memory_utilization" not in cfg.explicit and num(cc.get("gpu_memory_utilization")) is not None:
        cfg.gpu_memory_utilization = float(num(cc.get("gpu_memory_utilization")) or 0.0)
        cfg.explicit.add("gpu_memory_utilization")  # the engine's real value, not a guess
    dtype = cc.get("cache_dtype")
    if dtype and "kv_cache_dtype" not in cfg.explicit:
        cfg.kv_cache_dtype = dtype


def _snapshot_time(snap: Snapshot) -> float | None:
    if snap.timestamp is not None:
        return snap.timestamp
    for m in snap.metrics:
        if m.timestamp is not None:
            return m.timestamp
    return None


def recent_snapshots(
    snapshots: Sequence[Snapshot], window_s: float, columns: Columns | None = None
) -> tuple[list[Snapshot], bool]:
    """The snapshots within ``window_s`` seconds of the newest one (oldest first), found from the
    end backwards, and whether a scrape exists before them (looked for among the few snapshots
    just before the window: a live loop scrapes in each). Untimed snapshots are kept (a window
    without clocks is what was read). O(window), not O(Timeline).

    ``columns``: the :class:`Columns` synced with ``snapshots``: each snapshot's time is then
    read once in its life and a tail that is timed throughout and in time order is cut by
    bisection (the same cut)."""
    if columns is not None:
        cut = _recent_by_bisection(snapshots, window_s, columns)
        if cut is not None:
            return list(snapshots[len(snapshots) - cut[0] :]), cut[1]
    out: list[Snapshot] = []
    end: float | None = None
    older = False
    for i in range(len(snapshots) - 1, -1, -1):
        snap = snapshots[i]
        ts = _snapshot_time(snap)
        if ts is not None:
            if end is None:
                end = ts
            elif ts < end - window_s:
                older = any(s.metrics for s in snapshots[max(0, i - 8) : i + 1])
                break
        out.append(snap)
    out.reverse()
    return out, older


#: snapshots of the tail whose times :func:`_recent_by_bisection` reads first (a 60 s window
#: of a 1 s loop is 61); a window that starts before them reads four times as many, and so on.
_RECENT_TAIL = 64


def recent_count(snapshots: Sequence[Snapshot], window_s: float, columns: Columns) -> tuple[int, bool]:
    """(how many snapshots :func:`recent_snapshots` returns, whether a scrape exists before
    them), without the list: the window is the Timeline's tail."""
    cut = _recent_by_bisection(snapshots, window_s, columns)
    if cut is not None:
        return cut
    recent, older = recent_snapshots(snapshots, window_s)
    return len(recent), older


def _recent_by_bisection(
    snapshots: Sequence[Snapshot], window_s: float, columns: Columns
) -> tuple[int, bool] | None:
    """(count, scrape before) of :func:`recent_snapshots` for a tail timed throughout and never
    going back in time (the loop's cut: the newest snapshot older than the window's start is
    the last one before it), or None when the tail is not such."""
    n = len(snapshots)
    lo = max(0, n - _RECENT_TAIL)
    while n:
        ts: list[Any] = columns.span("snapshot_time", _snapshot_time, lo, n)
        if None in ts or not all(map(operator.le, ts, itertools.islice(ts, 1, None))):
            return None
        j = bisect.bisect_left(ts, ts[-1] - window_s)
        if j == 0 and lo > 0:
            lo = max(0, n - 4 * (n - lo))  # the window starts before the tail read
            continue
        if j == 0:
            return n, False
        i = lo + j - 1  # the newest snapshot before the window
        return n - i - 1, any(s.metrics for s in snapshots[max(0, i - 8) : i + 1])
    return None


def engine_series(snapshots: Sequence[Snapshot], engine_label: str | None) -> list[EngineMetrics]:
    """One engine's scrapes (the ``engine`` label, else the page's first engine), oldest first;
    a scrape without its own timestamp takes its snapshot's (a copy: facts are not modified).
    A :class:`kvdoctor.timeline.Series` (a list whose timestamps the window helpers index once)."""
    out: list[EngineMetrics] = Series()
    for snap in snapshots:
        pick: EngineMetrics | None = None
        for m in snap.metrics:
            if engine_label is None or m.engine == engine_label:
                pick = m
                break
        if pick is None and snap.metrics:
            pick = snap.metrics[0]
        if pick is not None:
            if pick.timestamp is None and snap.timestamp is not None:
                pick = dataclasses.replace(pick, timestamp=snap.timestamp)
            out.append(pick)
    return out


def _pick_raw(snap: Snapshot, engine_label: str | None) -> EngineMetrics | None:
    """The scrape :func:`engine_series` takes of one snapshot, as read (unstamped), or None."""
    for m in snap.metrics:
        if engine_label is None or m.engine == engine_label:
            return m
    return snap.metrics[0] if snap.metrics else None


def _pick(snap: Snapshot, engine_label: str | None) -> EngineMetrics | None:
    """:func:`_pick_raw`, stamped with the snapshot's time when it has none of its own (a
    copy: facts are not modified)."""
    pick = _pick_raw(snap, engine_label)
    if pick is not None and pick.timestamp is None and snap.timestamp is not None:
        pick = dataclasses.replace(pick, timestamp=snap.timestamp)
    return pick


def _pick_time(snap: Snapshot, engine_label: str | None) -> float | None:
    """The timestamp of :func:`_pick`'s scrape (without copying it)."""
    pick = _pick_raw(snap, engine_label)
    if pick is None:
        return None
    return pick.timestamp if pick.timestamp is not None else snap.timestamp


def _clean(v: Any) -> float | None:
    """A field's value as the window helpers keep it: None when absent or NaN, else a float."""
    return None if v is None or v != v else float(v)


def engine_series_at(columns: Columns, start: int, end: int, engine_label: str | None) -> list[EngineMetrics]:
    """:func:`engine_series` of the synced Timeline's snapshots ``start … end - 1`` (the window),
    from ``columns``: each snapshot's scrape is picked once in its life, and each field's
    values over the window are column slices the window helpers read instead of the samples
    (``kvdoctor.timeline.sourced_series``). Same samples, same values."""
    key = ("engine_pick", engine_label)
    picks = columns.span(key, lambda snap: _pick(snap, engine_label), start, end)
    if any(map(operator.is_, picks, itertools.repeat(None))):
        # a snapshot without a scrape: positions and samples part ways (and identity: ``in``
        # would call each scrape's __eq__)
        return Series(m for m in picks if m is not None)
    # the picks' timestamps, from a column: the samples themselves are not read here
    times = columns.span(
        ("engine_time", engine_label), lambda snap: _pick_time(snap, engine_label), start, end
    )

    def hist_of(snap: Snapshot, name: str) -> HistogramData | None:
        return getattr(_pick_raw(snap, engine_label), "histograms", {}).get(name)

    def reader(field: Any, lo: int, hi: int) -> Any:
        if isinstance(field, tuple):
            kind, name = field
            if kind == "histogram":
                hs = columns.span(
                    ("engine_histogram", engine_label, name), lambda snap: hist_of(snap, name), lo, hi
                )
                if any(map(operator.is_, hs, itertools.repeat(None))):
                    return [h for h in hs if h is not None]
                return hs
            if kind == "histogram_ends" and hi - lo >= 2:
                # Whether each sample's histogram steps well from the one before is worked out
                # once per pair of neighbours: a window whose every step is ok reads its ends only.
                steps = columns.span_steps(
                    ("engine_histogram_step", engine_label, name),
                    lambda prev, snap: _hist_step(prev, snap, name),
                    lo + 1,
                    hi,
                )
                if steps.count(True) != len(steps):
                    return None
                ends = columns.pick(
                    ("engine_histogram", engine_label, name), lambda snap: hist_of(snap, name), (lo, hi - 1)
                )
                return ends if ends[0] is not None and ends[1] is not None else None
            if kind == "present" and name in _METRIC_FIELDS:
                present = columns.span(
                    ("engine_present", engine_label, name),
                    lambda snap: getattr(_pick_raw(snap, engine_label), name) is not None,
                    lo,
                    hi,
                )
                return True in present
            if kind == "sample_fn":
                # a function of the sample alone: asked once per snapshot of the window's column
                return columns.span(
                    ("engine_sample_fn", engine_label, name),
                    lambda snap: name(_pick(snap, engine_label)),
                    lo,
                    hi,
                )
            return None
        if field == "timestamp" or field not in _METRIC_FIELDS:
            return None
        vals = columns.span(
            ("engine_value", engine_label, field),
            lambda snap: _clean(getattr(_pick_raw(snap, engine_label), field)),
            lo,
            hi,
        )
        # the window's timestamps are those of the picks above (shared, as the window's own)
        ts = times if (lo, hi) == (start, end) else times[lo - start : hi - start]
        if None not in vals:
            return ts, vals
        kept = [(t, v) for t, v in zip(ts, vals, strict=True) if v is not None]
        return [t for t, _ in kept], [v for _, v in kept]

    def _hist_step(prev: Snapshot | None, snap: Snapshot, name: str) -> bool | None:
        cur = hist_of(snap, name)
        before = hist_of(prev, name) if prev is not None else None
        if cur is None or before is None:
            return None
        return histogram_step_ok(before, cur)

    return sourced_series(picks, times, reader, start)


_METRIC_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineMetrics))


def bounded_history(snapshots: Sequence[_T], limit: int = MAX_HISTORY_POINTS) -> list[_T]:
    """At most ``limit`` items (snapshots, nvidia-smi ``-l`` moments) evenly spaced over the
    series, first and newest included (a least-squares slope over them matches the full
    series' within sampling noise)."""
    n = len(snapshots)
    if n <= limit:
        return list(snapshots)
    return [snapshots[i] for i in history_positions(n, limit)]


@functools.lru_cache(maxsize=64)
def history_positions(n: int, limit: int = MAX_HISTORY_POINTS) -> tuple[int, ...]:
    """The positions :func:`bounded_history` picks of ``n`` items, oldest first (a live
    Timeline keeps the same length cycle after cycle: worked out once)."""
    if n <= limit:
        return tuple(range(n))
    step = (n - 1) / (limit - 1)
    return tuple(round(i * step) for i in range(limit))


class SampledHistory(Sequence[Snapshot]):
    """The snapshots of a Timeline's list at ``index`` (:func:`history_positions`), oldest
    first, read on demand: an evaluation mostly asks only whether there is a history (the
    per-snapshot answers come from the Timeline's columns), and a list of them took and
    released a reference to each sampled snapshot, out of the cache, every cycle. Valid while
    the Timeline is unchanged (one evaluation)."""

    __slots__ = ("_index", "_snaps")

    def __init__(self, snapshots: Sequence[Snapshot], index: Sequence[int]) -> None:
        self._snaps = snapshots
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> Snapshot: ...

    @overload
    def __getitem__(self, i: slice) -> list[Snapshot]: ...

    def __getitem__(self, i: int | slice) -> Snapshot | list[Snapshot]:
        if isinstance(i, slice):
            return list(map(self._snaps.__getitem__, self._index[i]))
        return self._snaps[self._index[i]]


#: label tuples seen (bounded): equal tuples from different snapshots become one object.
_LABELS: dict[tuple[str, ...], tuple[str, ...]] = {}


def engine_labels(snap: Snapshot) -> tuple[str, ...]:
    """The ``engine`` labels of a snapshot's scrapes (None left out), in page order with repeats
    (a column function: equal answers are one shared tuple)."""
    got = tuple(m.engine for m in snap.metrics if m.engine is not None)
    hit = _LABELS.get(got)
    if hit is None:
        if len(_LABELS) > 256:
            _LABELS.clear()
        hit = _LABELS[got] = got
    return hit


def dp_targets(
    engines: list[Engine], labels: list[str]
) -> tuple[list[tuple[Engine | None, str | None]], list[Engine]]:
    """(engine, metrics label) per rule context, and the engines the report lists.

    Data parallelism: one PrometheusStatLogger serves every DP engine, told apart by the
    ``engine`` label (vllm-facts §1.1): each label is an engine of its own for the rules."""
    targets: list[tuple[Engine | None, str | None]] = []
    for idx, eng in enumerate(engines or [None]):
        if idx == 0 and eng is not None and len(labels) > 1:
            for dp_label in labels:
                dp = Engine(
                    id=f"{eng.id} [engine {dp_label}]", config=eng.config, pid=eng.pid, pids=list(eng.pids)
                )
                targets.append((dp, dp_label))
        else:
            targets.append((eng, labels[0] if (idx == 0 and labels) else None))
    listed = engines
    if len(labels) > 1 and engines:
        listed = [t for t, _ in targets if t is not None] + engines[1:]
    return targets, listed
