"""Family colocation: two or more vLLM engines on one GPU (their processes on it, or command
lines not pinned apart), what each asked for (gmu) and whether that fits the card.

The gmu split that fits them (target 0.95) is the rule's arithmetic
(``colocated-engines-overcommit`` threshold ``max_gmu_sum``, rule function ``gmu_split``):
this family reports what each engine asked for. Command lines are parsed when the processes
are read (``HostProcess.launch_gmu`` / ``launch_model``), never here."""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars, vllm_holders
from kvdoctor.devices import visible_devices
from kvdoctor.facts import EngineConfig, Gpu, HostProcess, Snapshot
from kvdoctor.vllm_flags import default_gpu_memory_utilization

WRITES: dict[str, str] = {
    "colocated_gpu": "int; a GPU that two or more vLLM engines share (processes on it, or command lines not pinned apart)",
    "colocated_count": "int; engines on it",
    "colocated_gmus": "list[fraction]; each engine's --gpu-memory-utilization (its command line via ps.txt / cmdline.txt; else its used memory / total)",
    "colocated_gmu_sum": "fraction; their sum",
    "colocated_reserved_bytes": "bytes; Σ gmu × card total: what the engines reserve together",
    "colocated_total_bytes": "bytes; the card's total memory",
    "colocated_desc": "str; 'pid 5120 (Llama-3.1-8B) gmu 0.60, pid 5388 (Qwen3-4B) gmu 0.50'",
    "colocated_bytes": "list[bytes]; each engine's NVML used memory on that GPU, in colocated_gmus order (None from command lines)",
    "colocated_names": "list[str]; a name per engine on it (served model, else pid or engine index), in colocated_gmus order",
    "colocated_self": "int; this engine's position in colocated_gmus (None when it is not one of them)",
    "colocated_gmu_explicit": "list[bool]; per engine (colocated_gmus order): its --gpu-memory-utilization was given (command line / non-default args); False where vLLM's default was assumed, None when unknown",
    "colocated_start_gap_s": "seconds; smallest gap between the engines' start times (process create times, else the times of their engine-initialisation lines in one log)",
}
READS: frozenset[str] = frozenset({"vllm_version"})


def _server_of(snapshot: Snapshot, pid: int) -> HostProcess | None:
    """The process (this pid or an ancestor) whose command line launched vLLM, from ps / psutil."""
    procs = {p.pid: p for p in snapshot.processes}
    cur = procs.get(pid)
    seen: set[int] = set()
    while cur is not None and cur.pid not in seen:
        seen.add(cur.pid)
        if cur.launches_vllm:
            return cur
        cur = procs.get(cur.ppid) if cur.ppid is not None else None
    return None


def _launch(server: HostProcess | None, version: str | None) -> tuple[float | None, str | None]:
    """(gmu, model) of a server's launch; vLLM's default gmu for the version when not given."""
    if server is None or (server.launch_model is None and server.launch_gmu is None):
        return None, None
    gmu = server.launch_gmu if server.launch_gmu is not None else default_gpu_memory_utilization(version)
    return gmu, server.launch_model


def _pinned_devices(cfg: EngineConfig, visible: list[Gpu], tp_pp: int) -> list[int]:
    """GPU indices an engine started from a command line lands on: its CUDA_VISIBLE_DEVICES
    prefix when given (first tp×pp of them), else the first tp×pp visible devices."""
    env = cfg.args.get("_env") or {}
    ids = visible_devices({k: str(v) for k, v in env.items()}) if isinstance(env, dict) else None
    if ids:
        return ids[: max(1, tp_pp)]
    base = [g.index for g in visible] or list(range(max(1, tp_pp)))
    return base[: max(1, tp_pp)]


def _from_processes(
    s: Scope, visible: list[Gpu], configs: list[EngineConfig], version: str | None
) -> tuple[Gpu | None, list[dict[str, Any]]]:
    for g in visible:
        holders = vllm_holders(g, s.weight_daemon_pids)
        if len(holders) < 2:
            continue
        found: list[dict[str, Any]] = []
        servers: set[int] = set()
        for p in holders:
            server = _server_of(s.snapshot, p.pid)
            if server is not None and server.pid in servers:
                continue  # two processes of one engine
            if server is not None:
                servers.add(server.pid)
            gmu, model = _launch(server, version)
            found.append(
                {
                    "pid": p.pid,
                    "gmu": gmu,
                    "model": model,
                    "bytes": p.used_bytes,
                    "start": server.create_time if server is not None else None,
                    "explicit": (server.launch_gmu is not None) if server is not None else None,
                }
            )
        if len(found) < 2:
            continue
        if all(e["gmu"] is None for e in found) and len(configs) == len(found):
            for e, c in zip(found, configs, strict=True):
                e["gmu"], e["model"] = c.gpu_memory_utilization, c.served_model_name or c.model
                e["explicit"] = "gpu_memory_utilization" in c.explicit
        return g, found
    return None, []


def _from_command_lines(
    visible: list[Gpu], configs: list[EngineConfig]
) -> tuple[Gpu | None, list[dict[str, Any]]]:
    # Command lines (the GPUs show the engines on one device at most, e.g. the second one
    # failed to start): engines not pinned apart land on the same device.
    placed = [
        (c, _pinned_devices(c, visible, (c.tensor_parallel_size or 1) * (c.pipeline_parallel_size or 1)))
        for c in configs
    ]
    for dev in sorted({d for _, ds in placed for d in ds}):
        on = [c for c, ds in placed if dev in ds]
        if len(on) >= 2:
            gpu = next((g for g in visible if g.index == dev), None) or Gpu(index=dev)
            entries = [
                {"pid": None, "gmu": c.gpu_memory_utilization, "model": c.served_model_name or c.model,
                 "bytes": None, "start": None, "explicit": "gpu_memory_utilization" in c.explicit}
                for c in on
            ]  # fmt: skip
            return gpu, entries
    return None, []


def derive(s: Scope, v: Vars) -> None:
    """The engines sharing a GPU, their gmu, sum and reservation, and their start-time gap."""
    visible = [g for g in s.visible if not g.mig_enabled]
    version = v["vllm_version"]
    configs = [e.config for e in (s.all_engines or ([s.engine] if s.engine else []))]
    gpu, entries = _from_processes(s, visible, configs, version)
    engine_gpus_seen = {g.index for g in visible if vllm_holders(g, s.weight_daemon_pids)}
    if gpu is None and len(configs) >= 2 and len(engine_gpus_seen) <= 1:
        gpu, entries = _from_command_lines(visible, configs)
    if gpu is None or len(entries) < 2:
        return
    total = gpu.memory_total_bytes
    for e in entries:
        if e["gmu"] is None and e["bytes"] is not None and total:
            e["gmu"] = round(e["bytes"] / total, 2)
    gmus = [e["gmu"] for e in entries]
    v["colocated_gpu"] = gpu.index
    v["colocated_count"] = len(entries)
    v["colocated_gmus"] = gmus
    v["colocated_bytes"] = [e["bytes"] for e in entries]
    v["colocated_gmu_explicit"] = [e.get("explicit") for e in entries]
    v["colocated_total_bytes"] = total
    v["colocated_names"] = [
        str(e["model"] or (f"pid {e['pid']}" if e["pid"] else f"engine {i}")) for i, e in enumerate(entries)
    ]
    known = [x for x in gmus if x is not None]
    if len(known) == len(gmus):
        v["colocated_gmu_sum"] = round(sum(known), 4)
        if total:
            v["colocated_reserved_bytes"] = int(sum(x * total for x in known))
    if s.engine is not None:
        ids = {s.engine.config.served_model_name, s.engine.config.model, s.engine.id}
        for i, e in enumerate(entries):
            if e["model"] is not None and e["model"] in ids:
                v["colocated_self"] = i
                break
    desc = []
    for e in entries:
        who = f"pid {e['pid']}" if e["pid"] else "engine"
        what = f" ({e['model']})" if e["model"] else ""
        share = f" gmu {e['gmu']:.2f}" if e["gmu"] is not None else ""
        desc.append(f"{who}{what}{share}")
    v["colocated_desc"] = ", ".join(desc)
    starts = sorted(e["start"] for e in entries if e["start"] is not None)
    if len(starts) < 2 and s.log is not None:
        # Without a process table the log's own times tell when each engine started.
        log_engines = s.log.log.engines
        if len(log_engines) == len(entries):
            starts = sorted(e.start_s for e in log_engines if e.start_s is not None)
    if len(starts) >= 2:
        v["colocated_start_gap_s"] = min(b - a for a, b in zip(starts, starts[1:], strict=False))


FAMILY = Family("colocation", WRITES, READS, derive)
