"""Family sleep: sleep mode and wake-up (``sleep-memory-not-released``, ``wake-up-oom``,
spec/rules-catalogue2.md §3.5) and the sleep-aware view of engines sharing a GPU (the
``colocated-engines-overcommit`` amendment of §3.6).

vLLM facts (vllm-facts §1.2 ``vllm:engine_sleep_state``, §3.7 sleep lines): sleep unmaps the
cuMem pool (weights and KV); the CUDA context, NCCL buffers and CUDA graphs stay unless
``--sleep-mode-offload-cudagraph`` (≥0.32) / ``--enable-nccl-comm-suspend`` (≥0.30). "Sleep mode
freed F GiB memory, U GiB memory is still in use." measures the device's free-memory change and
the whole device's used memory. A level-0 pause writes awake 0 with both level flags 0."""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars

WRITES: dict[str, str] = {
    "sleep_mode_on": "bool; --enable-sleep-mode given, or sleep / wake lines or the sleep-state gauge show it",
    "asleep": "bool; vllm:engine_sleep_state awake 0 with weights_offloaded or discard_all 1, or 'It took … seconds to fall asleep.' with no full wake after it",
    "sleep_level": "int; 1 (weights_offloaded) or 2 (discard_all), None when unknown",
    "sleep_source": "str; 'vllm:engine_sleep_state' or 'log'",
    "sleep_line": "int; log line of the last 'It took … seconds to fall asleep.'",
    "woken_tags": "list[str]; tags of a partial wake after the last sleep ('weights', 'kv_cache')",
    "sleep_freed_bytes": "bytes; F: smallest 'Sleep mode freed F GiB memory' over workers after the last sleep",
    "sleep_in_use_bytes": "bytes; U: 'U GiB memory is still in use' (the whole device, neighbours included)",
    "cumem_freed_bytes": "bytes; X: 'CuMemAllocator: sleep freed X GiB memory in total'",
    "sleep_pool_bytes": "bytes; W + K per worker: 'Model loading took' + sleep_kv_bytes",
    "sleep_kv_bytes": "bytes; K per worker: on vLLM 0.34's extensible KV cache the committed pool (smallest 'Extended KV cache to N blocks (X GiB)', else 'Memory after warmup … N KV cache blocks (X GiB)'; 'Available KV cache memory' is only an address reservation there, vllm-facts §9.2), else 'Available KV cache memory' (≥ 0)",
    "sleep_kv_extensible": "bool; K is an extensible KV pool (0.34): it lives outside the cuMem pool, so 'CuMemAllocator: sleep freed X' excludes it and a wake maps it back with recommit (vllm-facts §9.7)",
    "sleep_graph_kept_bytes": "bytes; G_kept: 'Graph capturing finished … took G GiB', 0 with --sleep-mode-offload-cudagraph",
    "sleep_resident_bytes": "bytes; what a partial wake brought back by design (W for ['weights'], K for ['kv_cache'])",
    "sleep_engine_gpu_bytes": "bytes; the engine's processes' NVML used memory on its fullest GPU (its pids, else the GPU's used memory when it is the only process)",
    "sleep_offload_cudagraph": "bool; --sleep-mode-offload-cudagraph given",
    "sleep_nccl_suspend": "bool; --enable-nccl-comm-suspend given",
    "wake_oom": "bool; 'CUDA Error: out of memory at …cumem_allocator.cpp:N' after a wake-up (the API server's 'wake up the engine with tags', a sleep line, or wake_up / create_and_map frames), or on vLLM 0.34 'GPU driver error 2: out of memory' (the KV recommit) after a wake-up, a checkpoint restore or a KV loan",
    "kv_recommits": "int; events after which the KV cache is mapped back while the engine lives: wake-ups ('It took … seconds to wake up', the API server's 'wake up the engine'), checkpoint restores, KV loans for weight updates (vllm-facts §9.7)",
    "wake_oom_error": "'cumem'|'vmm'; which text failed the wake: the cuMem allocator's (weights and, before 0.34, the KV) or 0.34's VMM driver error (the extensible KV's recommit)",
    "wake_oom_after": "'wake'|'checkpoint_restore'|'kv_loan'; what the failed mapping followed",
    "wake_oom_line": "int; its log line",
    "wake_tags": "list[str]; tags of the failed wake ([] for a full wake)",
    "wake_need_bytes": "bytes; what the wake maps back: W + K (full), W (['weights']), K (['kv_cache']), plus G with offloaded graphs",
    "wake_neighbours": "list[dict]; other processes on the engine's GPU: {'pid', 'name', 'bytes', 'asleep'} (asleep from their own /metrics when known)",
    "wake_neighbours_bytes": "bytes; Σ their NVML used memory",
    "wake_neighbours_desc": "str; 'pid 5120 (VLLM::EngineCore) 22.10 GiB asleep, …'",
    "colocated_sleeping": "list[bool]; per colocated engine (colocated_names order): its vllm:engine_sleep_state says asleep, else its own lines of a log holding several engines ('It took … seconds to fall asleep.' with no full wake after)",
    "colocated_effective_bytes": "bytes; Σ gmu × total of the awake colocated engines + Σ NVML bytes of the sleeping ones",
}
READS: frozenset[str] = frozenset(
    {
        "model_name",
        "weights_logged_bytes",
        "log_available_kv_bytes",
        "graph_capture_bytes",
        "engine_gpus",
        "colocated_gpu",
        "colocated_names",
        "colocated_gmus",
        "colocated_total_bytes",
        "colocated_bytes",
    }
)


def _gauge_asleep(st: dict[str, float]) -> int | None:
    """1 or 2 when the gauge says asleep at that level, 0 when awake or paused, None without it."""
    if not st:
        return None
    if (st.get("awake") or 0) >= 1:
        return 0
    if (st.get("discard_all") or 0) >= 1:
        return 2
    if (st.get("weights_offloaded") or 0) >= 1:
        return 1
    return 0  # a level-0 pause or a KV-only release: both level flags 0


def derive(s: Scope, v: Vars) -> None:
    """Sleep state and what it released; wake-up OOM need and neighbours; sleep-aware colocation."""
    args = s.cfg.args
    v["sleep_offload_cudagraph"] = bool(args.get("sleep_mode_offload_cudagraph"))
    v["sleep_nccl_suspend"] = bool(args.get("enable_nccl_comm_suspend"))
    # a sleep-swap set with one engine's log: its sleep and wake lines are not the others'
    log = s.log if _log_is_mine(s, v) else None
    _kv(v, log)
    w, k = v["weights_logged_bytes"], v["sleep_kv_bytes"]
    if w is not None and k is not None and log is not None:
        v["sleep_pool_bytes"] = w + k
    v["sleep_graph_kept_bytes"] = 0 if v["sleep_offload_cudagraph"] else (v["graph_capture_bytes"] or 0)
    level = _gauge_asleep(s.series[-1].sleep_state) if s.series else None
    if level is None and v["model_name"] is not None:
        # several engines' gauges in one scrape (a sleep-swap set): this engine's by model_name
        by_model = _asleep_by_model(s)
        if v["model_name"] in by_model:
            level = _gauge_level_by_model(s, str(v["model_name"]))
    sleep_lines = bool(log is not None and (log.of("fell_asleep") or log.of("sleep_freed")))
    v["sleep_mode_on"] = bool(args.get("enable_sleep_mode") or sleep_lines or level is not None)
    if level is not None:
        v["asleep"], v["sleep_source"] = level > 0, "vllm:engine_sleep_state"
        v["sleep_level"] = level or None
    if log is not None:
        _log_sleep(v, log, level)
        v["kv_recommits"] = sum(
            len(log.of(k)) for k in ("woke_up", "wake_up_request", "checkpoint_restore", "kv_loan")
        )
    _engine_bytes(s, v)
    _wake(s, v, log)
    _colocated(s, v)


def _log_is_mine(s: Scope, v: Vars) -> bool:
    """The log's server serves this engine's model, or either is unknown (one engine's log in a
    bundle of several engines names its model in its args: the others' sleep lines are not in it)."""
    log, model = s.log, v["model_name"]
    if log is None or model is None:
        return True
    args = log.args or {}
    logged = args.get("served_model_name") or args.get("model") or args.get("model_tag")
    if isinstance(logged, list):
        return model in logged
    return logged is None or logged == model


def _kv(v: Vars, log: Any) -> None:
    """K: the committed extensible pool where the log shows one (0.34), else the reservation
    that is the pool before 0.34 ('Available KV cache memory')."""
    committed: list[int] = []
    if log is not None:
        committed = [
            e.values["bytes"] for e in log.of("kv_extended") if isinstance(e.values.get("bytes"), int)
        ]
        if not committed:
            committed = [
                e.values["blocks_bytes"]
                for e in log.of("memory_after_warmup")
                if isinstance(e.values.get("blocks_bytes"), int)
            ]
    if committed:
        v["sleep_kv_bytes"], v["sleep_kv_extensible"] = min(committed), True
        return
    k = v["log_available_kv_bytes"]
    v["sleep_kv_bytes"] = max(0, k) if k is not None else None
    v["sleep_kv_extensible"] = False if k is not None else None


def _log_sleep(v: Vars, log: Any, level: int | None) -> None:
    falls = log.of("fell_asleep")
    last = falls[-1] if falls else None
    v["sleep_line"] = last.line if last else None
    after = last.line if last else 0
    wakes = [e for e in log.of("woke_up") if e.line > after]
    tags = sorted({t for e in wakes for t in (e.values.get("tags") or [])})
    full = any(not e.values.get("tags") for e in wakes) or {"weights", "kv_cache"} <= set(tags)
    if level is None and last is not None:
        v["asleep"], v["sleep_source"] = not full, "log"
    v["woken_tags"] = [] if full else tags
    # The freed lines follow the fall-asleep line's start; take those after the previous wake.
    prev_wake = max((e.line for e in log.of("woke_up") if e.line < after), default=0)
    freed = [e for e in log.of("sleep_freed") if e.line > prev_wake]
    if freed:
        low = min(freed, key=lambda e: e.values.get("freed_bytes") or 0)
        v["sleep_freed_bytes"] = low.values.get("freed_bytes")
        v["sleep_in_use_bytes"] = low.values.get("in_use_bytes")
    pool = [e for e in log.of("cumem_sleep") if e.line > prev_wake]
    if pool:
        v["cumem_freed_bytes"] = min(e.values.get("freed_bytes") or 0 for e in pool)
    w, k = v["weights_logged_bytes"], v["sleep_kv_bytes"]
    resident = 0
    if "weights" in v["woken_tags"] and w:
        resident += w
    if "kv_cache" in v["woken_tags"] and k:
        resident += k
    v["sleep_resident_bytes"] = resident


def _gauge_level_by_model(s: Scope, model: str) -> int | None:
    """The sleep level (:func:`_gauge_asleep`) of the scrape series whose model_name is ``model``."""
    for m in s.snapshot.metrics:
        if m.model_name == model:
            return _gauge_asleep(m.sleep_state)
    return None


def _model_of(snap: Any, pid: int) -> str | None:
    """The model the vLLM server that launched ``pid`` serves: the process or an ancestor
    (at most 8 up) with a ``launch_model`` (an EngineCore's parent ``vllm serve``)."""
    procs = {p.pid: p for p in snap.processes}
    cur = procs.get(pid)
    for _ in range(8):
        if cur is None:
            return None
        if cur.launch_model:
            return str(cur.launch_model)
        cur = procs.get(cur.ppid) if cur.ppid is not None else None
    return None


def _own(s: Scope, v: Vars, pid: int) -> bool:
    """``pid`` is this engine's: by the model its server launches when GPU processes of
    several engines are told apart that way (a sleep-swap set), else any engine pid."""
    model = v["model_name"]
    if model is not None:
        launched = _model_of(s.snapshot, pid)
        if launched is not None:
            return launched == model
    return pid in s.engine_pids


def _engine_bytes(s: Scope, v: Vars) -> None:
    best = None
    for g in s.visible:
        if g.index not in (v["engine_gpus"] or []):
            continue
        # a `vllm preload` daemon's weights stay resident by design: not the engine's own bytes
        mine = [
            p.used_bytes or 0 for p in g.processes if _own(s, v, p.pid) and p.pid not in s.weight_daemon_pids
        ]
        if mine:
            got: int | None = sum(mine)
        elif len(g.processes) == 1:
            got = g.processes[0].used_bytes
        else:
            got = None
        if got is not None and (best is None or got > best):
            best = got
    v["sleep_engine_gpu_bytes"] = best


def _asleep_by_model(s: Scope) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for m in s.snapshot.metrics:
        lvl = _gauge_asleep(m.sleep_state)
        if m.model_name and lvl is not None:
            out[m.model_name] = lvl > 0
    return out


def _asleep_by_log(s: Scope) -> dict[str, bool]:
    """Served model → asleep, for each engine of a log that holds several: its own pids' last
    'It took … seconds to fall asleep.' with no full wake-up after it (issue 24 kind 7)."""
    if s.log is None:
        return {}
    whole = s.log.log
    out: dict[str, bool] = {}
    for eng in getattr(whole, "engines", None) or []:
        name = eng.args.get("served_model_name") or eng.args.get("model") or eng.args.get("model_tag")
        if isinstance(name, list):
            name = name[0] if name else None
        pids = set(eng.pids)
        if not name or not pids:
            continue
        mine = [e for e in whole.events if e.pid in pids and e.kind in ("fell_asleep", "woke_up")]
        falls = [e for e in mine if e.kind == "fell_asleep"]
        if not falls:
            continue
        wakes = [e for e in mine if e.kind == "woke_up" and e.line > falls[-1].line]
        tags = {t for e in wakes for t in (e.values.get("tags") or [])}
        full = any(not e.values.get("tags") for e in wakes) or {"weights", "kv_cache"} <= tags
        out[str(name)] = not full
    return out


def _wake(s: Scope, v: Vars, log: Any) -> None:
    if log is None:
        return
    # the cuMem allocator's OOM (weights; the KV too before 0.34) or 0.34's VMM driver OOM (the
    # extensible KV's recommit, vllm-facts §9.4 / §9.7)
    ooms = [(e, "cumem") for e in log.of("cumem_oom")]
    ooms += [(e, "vmm") for e in log.of("vmm_driver_error") if e.values.get("oom")]
    if not ooms:
        v["wake_oom"] = False
        return
    ev, error = max(ooms, key=lambda x: x[0].line)
    reqs = [e for e in log.of("wake_up_request") if e.line < ev.line]
    prior_sleep = [e for e in log.of("fell_asleep") if e.line < ev.line]
    in_wake = "wake_up" in (ev.values.get("frames") or [])
    # a checkpoint restore wakes ['kv_cache']; a KV loan recommits after a weight update (§9.7)
    restore = [e for e in log.of("checkpoint_restore") if e.line < ev.line] if error == "vmm" else []
    loan = [e for e in log.of("kv_loan") if e.line < ev.line] if error == "vmm" else []
    woke = bool(reqs or prior_sleep or in_wake)
    v["wake_oom"] = bool((v["sleep_mode_on"] or restore) and (woke or restore)) or bool(loan)
    if not v["wake_oom"]:
        return
    v["wake_oom_line"], v["wake_oom_error"] = ev.line, error
    last_wake = max([e.line for e in (*reqs, *prior_sleep)], default=0)
    after = max(
        [(last_wake, "wake"), (max([e.line for e in restore], default=-1), "checkpoint_restore")]
        + [(max([e.line for e in loan], default=-1), "kv_loan")]
    )
    v["wake_oom_after"] = after[1]
    tags = list(reqs[-1].values.get("tags") or []) if reqs and after[1] == "wake" else []
    if after[1] != "wake":
        tags = ["kv_cache"]  # a restore wakes ['kv_cache']; a loan recommits the KV only
    v["wake_tags"] = tags
    w, k = v["weights_logged_bytes"], v["sleep_kv_bytes"]
    if w is not None and k is not None:
        need = w if tags == ["weights"] else k if tags == ["kv_cache"] else w + k
        if v["sleep_offload_cudagraph"]:
            need += v["graph_capture_bytes"] or 0
        v["wake_need_bytes"] = need
    asleep = {**_asleep_by_log(s), **_asleep_by_model(s)}
    neighbours: list[dict[str, Any]] = []
    for g in s.visible:
        if g.index not in (v["engine_gpus"] or []):
            continue
        for p in g.processes:
            # another engine of a sleep-swap set is a neighbour too (its server's model differs)
            if _own(s, v, p.pid):
                continue
            model = _model_of(s.snapshot, p.pid)
            neighbours.append(
                {"pid": p.pid, "name": model or p.name, "bytes": p.used_bytes or 0,
                 "asleep": asleep.get(model) if model else None}
            )  # fmt: skip
        break
    v["wake_neighbours"] = neighbours
    v["wake_neighbours_bytes"] = sum(n["bytes"] for n in neighbours)
    from kvdoctor.units import fmt_bytes

    def state(n: dict[str, Any]) -> str:
        return " asleep" if n["asleep"] else (" awake" if n["asleep"] is False else "")

    v["wake_neighbours_desc"] = (
        ", ".join(
            f"pid {n['pid']} ({n['name'] or '?'}) {fmt_bytes(n['bytes'])}{state(n)}" for n in neighbours
        )
        or None
    )


def _colocated(s: Scope, v: Vars) -> None:
    names, gmus, total = v["colocated_names"], v["colocated_gmus"], v["colocated_total_bytes"]
    if not names or not gmus or not total:
        return
    asleep = {**_asleep_by_log(s), **_asleep_by_model(s)}
    sleeping = [bool(asleep.get(str(n))) for n in names]
    v["colocated_sleeping"] = sleeping
    held = v["colocated_bytes"] or [None] * len(names)
    eff = 0.0
    for gmu, is_asleep, b in zip(gmus, sleeping, held, strict=False):
        if is_asleep and b is not None:
            eff += b
        elif gmu is not None:
            eff += gmu * total
        else:
            return
    v["colocated_effective_bytes"] = int(eff)


FAMILY = Family("sleep", WRITES, READS, derive)
