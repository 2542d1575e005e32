"""Family attribution: which GPUs an engine uses and who else holds memory on them (foreign
processes, orphaned vLLM workers, engines stacked on one card), from NVML / nvidia-smi and the
host process table (psutil / ps.txt).

Decisions are the rules': this family reports per-GPU used/total bytes and which GPUs list no
process; "empty" (under 1 GiB) and "full" (≥ 95 % of total) are thresholds of the rules that
ask (``engines-stacked-on-one-gpu``, ``weights-not-sharded``).
"""

from __future__ import annotations

from kvdoctor.derive.base import (
    Family,
    Scope,
    Vars,
    describe_processes,
    gpu_spec,
    is_vllm_process,
    vllm_holders,
)
from kvdoctor.facts import Engine, Gpu, GpuProcess
from kvdoctor.lazyre import lazy_re
from kvdoctor.units import GiB
from kvdoctor.vllm_flags import default_max_num_seqs

WRITES: dict[str, str] = {
    "gpu_count": "int; GPUs visible (CUDA_VISIBLE_DEVICES, else all listed); of the engine's node when the GPUs span several nodes",
    "engine_gpus": "list[int]; GPU indices the engine uses",
    "engine_gpu_keys": "list[(str|None, int)]; the engine's GPUs as (node, index): nodes/<host>/ bundles, host-named nvidia-smi tables",
    "gpu_node": "str; the node the per-GPU maps below describe (the stacked GPU's, else the engine's first GPU's; None on one node)",
    "gpu_name": "str; first engine GPU's name",
    "gpu_total_bytes": "bytes; smallest total memory among the engine's GPUs (nvidia-smi Memory-Usage total; the catalogue's by name when the driver refused to read it)",
    "gpu_used_bytes": "bytes; largest used memory among the engine's GPUs",
    "gpu_used_fraction": "fraction; gpu_used_bytes / gpu_total_bytes",
    "gpu_free_bytes": "bytes; smallest total − used among the engine's GPUs",
    "gpu_util": "fraction; largest GPU-Util among the engine's GPUs",
    "gpu_util_known": "bool; utilization was read",
    "visible_gpus": "list[int]; indices of the visible GPUs",
    "gpu_used_map": "dict[int, bytes]; used memory of each visible GPU of gpu_node whose memory was read (nvidia-smi Memory-Usage / NVML memory.used)",
    "gpu_total_map": "dict[int, bytes]; total memory of each visible GPU of gpu_node whose total was read",
    "gpus_without_processes": "list[int]; visible GPUs of gpu_node holding no engine: no process listed, or only small (< 1 GiB) non-engine contexts (nvidia-smi Processes / NVML running processes)",
    "gpu_mig": "bool; MIG mode on any engine GPU (nvidia-smi MIG M., or MIG-… UUIDs in CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES)",
    "gpu_no_permission": "bool; the driver refused to read an engine GPU's memory (nvidia-smi '[Insufficient Permissions]', NVML NoPermission)",
    "throttle_reasons": "list[str]; NVML clock event reasons that slow the engine's GPUs (thermal, power, hardware)",
    "stacked_gpu": "int; a GPU on which two or more vLLM engines hold memory (None if none)",
    "stacked_node": "str; the node of that GPU (None on one node)",
    "stacked_pids": "list[int]; the engine processes stacked on it",
    "stacked_desc": "str; description of them",
    "rank_spread_bytes": "bytes; max − min used memory over the engine's GPUs (TP/PP ranks); when the GPU readings miss ranks, the spread of the workers' own log figures (vLLM 'Available KV cache memory' per worker, else 'Model loading took')",
    "rank_heavy_gpu": "int; the engine GPU using the most memory (None when the log's figures found it)",
    "rank_heavy_node": "str; node of that GPU (nodes/<host>/ bundles; the worker line's Ray ip=<host>; None on one node)",
    "rank_heavy_stage": "int; its pipeline stage (position in the engine's GPUs // tp; from the log: the worker's PP<n> name)",
    "rank_heavy_pid": "int; the heavy rank's worker pid when the log's figures found it",
    "rank_spread_source": "str; 'nvidia-smi' (per-GPU memory) or the log line the per-rank figures come from",
    "engine_gpu_total_min_bytes": "bytes; smallest card in the engine's group",
    "engine_gpu_total_max_bytes": "bytes; largest card in the engine's group",
    "foreign_pids": "list[int]; processes on the engine's GPUs that are not this engine",
    "foreign_bytes": "bytes; memory they hold (sum)",
    "foreign_desc": "str; 'pid 48213 (/opt/conda/bin/python3.10) 15.42 GiB on GPU 0, …'",
    "orphan_pids": "list[int]; vLLM engine/worker processes holding GPU memory with no live server",
    "orphan_bytes": "bytes; memory they hold (sum)",
    "orphan_gpus": "list[int]; GPUs they sit on",
    "orphan_desc": "str; 'pid 48211 (VLLM::Worker_TP0) 12.53 GiB on GPU 0, …'",
    "orphan_reason": "str; why they are orphans",
    "engine_cpu_percent": "percent of one core; engine processes' largest CPU use (psutil / ps.txt)",
    "engine_pids_known": "bool; the engine's own pids are known (live, ps.txt, or log prefixes)",
    "max_num_seqs_effective": "int; --max-num-seqs or vLLM's device default for the engine's GPU and version (vllm_flags.default_max_num_seqs)",
}
READS: frozenset[str] = frozenset(
    {"tp", "tp_pp", "gmu", "max_num_seqs", "vllm_version", "gpu_attribution", "unresolved_gpu_pids"}
)


def engine_gpus(s: Scope, engine: Engine, tp_pp: int) -> list[Gpu]:
    """Which GPUs an engine uses: where its pids hold memory, else the first tp×pp visible GPUs.

    A TP×PP engine spans tp×pp GPUs: when its known pids cover fewer (a V0 driver rank or a
    plain ``python`` application logs no prefix), the rest is filled from the visible GPUs
    holding memory but no other engine's process, then from the others, in index order."""
    want = max(1, tp_pp)
    if engine.gpus:
        got = [g for g in s.visible if g.index in engine.gpus]
        if got:
            return got
    # An engine told apart from others in one log has pids of its own: its GPUs are where they
    # are; else where any engine pid is.
    for pids in ((frozenset(engine.pids) if engine.pids else None), s.engine_pids):
        if not pids:
            continue
        got = [g for g in s.visible if any(p.pid in pids for p in g.processes)]
        if got:
            if len(got) < want:
                rest = [g for g in s.visible if g not in got and not _other_engine_on(g, pids)]
                rest.sort(key=lambda g: (not g.processes, g.index))
                got = sorted(got + rest[: want - len(got)], key=lambda g: (g.node or "", g.index))
            return got
    return s.visible[:want]


def _catalogue_total(egpus: list[Gpu]) -> int | None:
    """The card's memory from the catalogue by its name, when the driver did not report it
    (NoPermission): what the card really holds, for sizing the limits vLLM missed."""
    for g in egpus:
        if g.no_permission and g.name:
            try:
                return gpu_spec(g.name).memory_bytes
            except KeyError:
                return None
    return None


def _other_engine_on(g: Gpu, engine_pids: frozenset[int]) -> bool:
    return any(is_vllm_process(p.name) and p.pid not in engine_pids for p in g.processes)


def holds_no_engine(g: Gpu, engine_pids: frozenset[int]) -> bool:
    """No engine process on this GPU: none named like vLLM or with a known engine pid, and no
    process holding 1 GiB or more (a display server's or a monitor's small context is not an
    engine)."""
    return not any(
        p.pid in engine_pids or is_vllm_process(p.name) or (p.used_bytes or 0) >= GiB for p in g.processes
    )


def _engine_bytes_on(g: Gpu, engine_pids: frozenset[int]) -> int:
    """Bytes the engine holds on one GPU: its processes' memory when the process table lists
    them (vLLM-named or known engine pids), else the GPU's used memory."""
    mine = [p for p in g.processes if p.pid in engine_pids or is_vllm_process(p.name)]
    if mine and all(p.used_bytes is not None for p in mine):
        return sum(p.used_bytes or 0 for p in mine)
    return g.memory_used_bytes or 0


def _looks_like_the_engine(p: GpuProcess, g: Gpu, gmu: float | None) -> bool:
    """A process holding gmu × total (±2 % of the card) is the engine itself, whatever its
    name or pid namespace (a container's ``/usr/bin/python3``)."""
    if gmu is None or not g.memory_total_bytes or p.used_bytes is None:
        return False
    return abs(p.used_bytes - gmu * g.memory_total_bytes) <= 0.02 * g.memory_total_bytes


def derive(s: Scope, v: Vars) -> None:
    """GPUs of the engine, per-GPU memory, stacked engines, foreign and orphaned processes."""
    snapshot, visible = s.snapshot, s.visible
    v["engine_pids_known"] = bool(s.engine_pids)
    cpus = [p.cpu_percent for p in snapshot.processes if p.vllm_role and p.cpu_percent is not None]
    v["engine_cpu_percent"] = max(cpus) if cpus else None
    v["gpu_count"] = len(visible) if visible else None
    if visible:
        _gpu_vars(s, v)
        nodes = {g.node for g in visible}
        own = {n for n, _ in v.get("engine_gpu_keys") or []}
        if len(nodes) > 1 and len(own) <= 1:
            # An engine on one node of several (or on none yet) is sized by that node's GPUs: a
            # larger TP does not reach another node's cards (vLLM spans nodes with Ray and PP).
            counts = {n: sum(1 for g in visible if g.node == n) for n in nodes}
            node = next(iter(own)) if own else max(counts, key=lambda n: counts[n])
            v["gpu_count"] = counts[node]
    _max_num_seqs_effective(s, v)


def _gpu_vars(s: Scope, v: Vars) -> None:
    visible = s.visible
    egpus = engine_gpus(s, s.engine, v["tp_pp"]) if s.engine is not None else visible
    v["engine_gpus"] = [g.index for g in egpus]
    v["gpu_name"] = egpus[0].name if egpus else None
    totals = [g.memory_total_bytes for g in egpus if g.memory_total_bytes]
    used = [g.memory_used_bytes for g in egpus if g.memory_used_bytes is not None]
    free = [g.memory_free_bytes for g in egpus if g.memory_free_bytes is not None]
    utils = [g.utilization_gpu for g in egpus if g.utilization_gpu is not None]
    v["gpu_total_bytes"] = min(totals) if totals else _catalogue_total(egpus)
    v["gpu_used_bytes"] = max(used) if used else None
    if v["gpu_total_bytes"] and v["gpu_used_bytes"] is not None:
        v["gpu_used_fraction"] = v["gpu_used_bytes"] / v["gpu_total_bytes"]
    v["gpu_free_bytes"] = min(free) if free else None
    v["gpu_util"] = max(utils) if utils else None
    v["gpu_util_known"] = bool(utils)
    # Every per-GPU comparison keys GPUs by (node, index): index 0 of two nodes are two GPUs.
    # The index-keyed maps describe one node: the stacked GPU's, else the engine's first GPU's.
    v["engine_gpu_keys"] = [(g.node, g.index) for g in egpus]
    stacked = _stacked(visible, s.weight_daemon_pids)
    if stacked is not None:
        sg, holders = stacked
        v["stacked_gpu"] = sg.index
        v["stacked_node"] = sg.node
        v["stacked_pids"] = [p.pid for p in holders]
        v["stacked_desc"] = describe_processes([(p, sg.index) for p in holders])
    focus = stacked[0].node if stacked is not None else (egpus[0].node if egpus else None)
    here = [g for g in visible if g.node == focus] or visible
    v["gpu_node"] = focus
    v["visible_gpus"] = [g.index for g in here]
    v["gpu_used_map"] = {g.index: g.memory_used_bytes for g in here if g.memory_used_bytes is not None}
    v["gpu_total_map"] = {g.index: g.memory_total_bytes for g in here if g.memory_total_bytes}
    v["gpus_without_processes"] = [g.index for g in here if holds_no_engine(g, s.engine_pids)]
    # MIG also shows as MIG-… UUIDs in CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES; NVML
    # NoPermission makes vLLM fall back to its small-device defaults the same way (§4.2).
    launch_env = s.cfg.args.get("_env")
    envs = [s.snapshot.env or {}, launch_env if isinstance(launch_env, dict) else {}]
    mig_env = any(
        "MIG-" in str(e.get(k) or "")
        for e in envs
        for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    )
    v["gpu_mig"] = any(g.mig_enabled for g in egpus) or mig_env
    v["gpu_no_permission"] = any(g.no_permission for g in egpus)
    slow = ("thermal", "power", "hw_slowdown", "slowdown")
    v["throttle_reasons"] = sorted(
        {r for g in egpus for r in g.clock_event_reasons if any(map(r.__contains__, slow))}
    )
    if len(egpus) > 1 and all(g.memory_used_bytes is not None for g in egpus):
        # Compare what the engine itself holds on each rank: another job on one GPU is
        # gpu-shared-with-foreign-process, not an imbalance of the engine's ranks.
        # Keyed by (node, index): index 0 of two nodes are two ranks.
        own = {(g.node, g.index): _engine_bytes_on(g, s.engine_pids) for g in egpus}
        heavy = max(own, key=lambda k: own[k])
        v["rank_spread_bytes"] = own[heavy] - min(own.values())
        v["rank_heavy_gpu"] = heavy[1]
        v["rank_heavy_node"] = heavy[0]
        # ranks are laid out TP-major: stage = position // tp
        v["rank_heavy_stage"] = list(own).index(heavy) // max(1, v["tp"] or 1)
        v["rank_spread_source"] = "nvidia-smi"
    ranks_read = len(egpus) if all(g.memory_used_bytes is not None for g in egpus) else 0
    from_log = _log_rank_spread(s, v["tp"] or 1, max(1, v["tp_pp"] or 1) // max(1, v["tp"] or 1))
    if from_log is not None and (v["rank_spread_bytes"] is None or from_log[0] > max(1, ranks_read)):
        # The GPU readings miss ranks (one node's nvidia-smi of a multi-node engine): the
        # workers' own per-rank figures are the second source.
        _, spread, host, pid, stage, source = from_log
        v["rank_spread_bytes"], v["rank_heavy_node"], v["rank_heavy_pid"] = spread, host, pid
        v["rank_heavy_gpu"], v["rank_heavy_stage"], v["rank_spread_source"] = None, stage, source
    if totals:
        v["engine_gpu_total_min_bytes"], v["engine_gpu_total_max_bytes"] = min(totals), max(totals)
    _foreign_and_orphans(s, v)


_PP_RANK_RE = lazy_re(r"PP(\d{1,3})")


def _log_rank_spread(s: Scope, tp: int, pp: int) -> tuple[int, int, str | None, int, int, str] | None:
    """Per-rank memory from the workers' own log lines of the latest run, keyed by (host, pid):
    a worker with less "Available KV cache memory" (vllm-facts §3.3 item 5, logged by every
    worker) holds more of everything else; without those, "Model loading took X GiB" per worker.
    Returns (ranks, spread bytes, heavy host, heavy pid, heavy stage, source) or None when fewer
    than two ranks, more ranks than tp×pp (other engines' workers), or a pipeline stage that the
    worker's name (``Worker_PP1_TP0``) does not give."""
    if s.log is None:
        return None
    for kind, key, heavy_is_min, source in (
        ("available_kv_memory", "bytes", True, "vLLM log 'Available KV cache memory' per worker"),
        ("model_loading", "weights_bytes", False, "vLLM log 'Model loading took' per worker"),
    ):
        figures: dict[tuple[str | None, int], tuple[int, str | None]] = {}
        for e in s.log.of(kind):
            val = e.values.get(key)
            if e.pid is not None and isinstance(val, int):
                figures[(e.host, e.pid)] = (val, e.process)
        if len(figures) < 2:
            continue
        if len(figures) > tp * pp:
            return None
        pick = (min if heavy_is_min else max)(figures, key=lambda k: figures[k][0])
        spread = max(f for f, _ in figures.values()) - min(f for f, _ in figures.values())
        m = _PP_RANK_RE.search(figures[pick][1] or "")
        if pp > 1 and m is None:
            return None
        stage = int(m.group(1)) if m else 0
        return len(figures), spread, pick[0], pick[1], stage, source
    return None


def _stacked(visible: list[Gpu], daemon_pids: frozenset[int]) -> tuple[Gpu, list[GpuProcess]] | None:
    """The first GPU on which two or more vLLM engine processes hold 1 GiB or more, and them
    (a `vllm preload` weights daemon beside its engine is not a second engine)."""
    for g in visible:
        holders = vllm_holders(g, daemon_pids)
        if len(holders) >= 2:
            return g, holders
    return None


def _max_num_seqs_effective(s: Scope, v: Vars) -> None:
    # vLLM's device default for max_num_seqs (vllm-facts §4.2) when not set.
    if v["max_num_seqs"] is not None:
        v["max_num_seqs_effective"] = v["max_num_seqs"]
    else:
        v["max_num_seqs_effective"] = default_max_num_seqs(
            v["vllm_version"], v["gpu_total_bytes"], v["gpu_name"]
        )


def _known_foreign(s: Scope, g: Gpu, p: GpuProcess) -> bool:
    """A process is called foreign only when something says it is not the engine: the engine's
    own process is on the same GPU beside it, or the host's process table lists it as no
    vLLM process. On a GPU where no engine pid is seen, the largest unknown process is taken as
    the engine's own rank (a V0 driver worker, a ``python`` application's LLM) — never foreign."""
    if any(q.pid in s.engine_pids or is_vllm_process(q.name) for q in g.processes if q is not p):
        return True
    # The host's process table names it as no vLLM process (a training job beside an engine
    # that has exited): foreign even when it is the largest process left on the GPU.
    if _not_vllm_in_table(s, p.pid):
        return True
    unknown = [q for q in g.processes if q.pid not in s.engine_pids and not is_vllm_process(q.name)]
    if max(unknown, key=lambda q: q.used_bytes or 0) is not p:
        return _not_vllm_in_table(s, p.pid)
    return False


def _not_vllm_in_table(s: Scope, pid: int) -> bool:
    """The host's process table lists ``pid`` and neither it nor an ancestor launches vLLM."""
    if not s.snapshot.process_table_known:
        return False
    procs = {q.pid: q for q in s.snapshot.processes}
    cur = procs.get(pid)
    if cur is None:
        return False
    seen: set[int] = set()
    while cur is not None and cur.pid not in seen:
        seen.add(cur.pid)
        if cur.launches_vllm or cur.vllm_role is not None:
            return False
        cur = procs.get(cur.ppid) if cur.ppid is not None else None
    return True


def _foreign_and_orphans(s: Scope, v: Vars) -> None:
    snapshot, visible, engine_pids = s.snapshot, s.visible, s.engine_pids
    runs = s.runs
    old_pids = runs.pids_earlier if runs is not None else frozenset()
    live = {p.pid for p in snapshot.processes} if snapshot.process_table_known else None
    servers_alive = (
        any(p.vllm_role == "api_server" for p in snapshot.processes) if snapshot.process_table_known else None
    )
    foreign: list[tuple[GpuProcess, int]] = []
    orphans: list[tuple[GpuProcess, int]] = []
    reasons: set[str] = set()
    startup_refused = runs is not None and runs.run.last("free_memory_below_util") is not None
    egpu_idx = set(v["engine_gpus"] or [])
    # The log's pids may come from a container's pid namespace: trust them for "this process is
    # not the engine" only when some GPU process carries one of them (or the table is live).
    on_gpu = {p.pid for g in visible for p in g.processes}
    pids_comparable = snapshot.process_table_known or bool(engine_pids & on_gpu)
    # Host pids of the engine's own container (derive/container.py): absent from this PID
    # namespace, which makes them neither orphaned nor foreign.
    other_ns = set(v["unresolved_gpu_pids"] or ()) if v["gpu_attribution"] == "gpu_uuid" else set()
    for g in visible:
        for p in g.processes:
            if p.pid in other_ns:
                continue
            vllm_like = is_vllm_process(p.name)
            if vllm_like and p.pid not in engine_pids:
                if live is not None and p.pid not in live:
                    orphans.append((p, g.index))
                    reasons.add("their pids are not in the host's process table")
                    continue
                if p.pid in old_pids:
                    orphans.append((p, g.index))
                    reasons.add(
                        "their pids belong to an earlier run in the log and the server was restarted since"
                    )
                    continue
                if servers_alive is False:
                    orphans.append((p, g.index))
                    reasons.add("no vLLM API server is running")
                    continue
            # Without the engine's own pids a process can only be called foreign when the engine
            # never got to allocate anything (it failed the startup free-memory check).
            # MIG instances have memory of their own: a neighbour in another instance is not
            # on the engine's device.
            if (
                g.index in egpu_idx
                and not g.mig_enabled
                and p.pid not in engine_pids
                and not vllm_like
                and ((engine_pids and pids_comparable) or startup_refused)
                and (startup_refused or not _looks_like_the_engine(p, g, v["gmu"]))
                and (startup_refused or _known_foreign(s, g, p))
            ):
                foreign.append((p, g.index))
    v["foreign_pids"] = [p.pid for p, _ in foreign]
    v["foreign_bytes"] = sum(p.used_bytes or 0 for p, _ in foreign)
    v["foreign_desc"] = describe_processes(foreign) if foreign else None
    v["orphan_pids"] = [p.pid for p, _ in orphans]
    v["orphan_bytes"] = sum(p.used_bytes or 0 for p, _ in orphans)
    v["orphan_gpus"] = sorted({i for _, i in orphans})
    v["orphan_desc"] = describe_processes(orphans) if orphans else None
    v["orphan_reason"] = "; ".join(sorted(reasons)) if reasons else None


FAMILY = Family("attribution", WRITES, READS, derive)
