"""Family container: an engine in another container of the pod, whose GPU processes NVML lists
under *host* pids.

In a Kubernetes pod with ``shareProcessNamespace`` the sidecar sees vLLM's processes (psutil,
``/proc``) under the pod's pids, while NVML's ``nvmlDeviceGetComputeRunningProcesses`` gives the
host's: no GPU process matches an engine pid. What does match is the GPU: the NVIDIA runtime
gives the vLLM container its GPUs by UUID (``NVIDIA_VISIBLE_DEVICES=GPU-…``, read from
``/proc/PID/environ`` by ``kvdoctor.sources.container`` into ``EngineConfig.args["_gpu_uuids"]``),
and NVML reports each GPU's UUID (``nvmlDeviceGetUUID``).

- :func:`engine_visible`: the GPUs an engine context sees — those its UUIDs name, when NVML shows
  them (the sidecar sees every GPU of the node; vLLM only its own).
- The family writes how GPU memory is attributed to the engine: ``"pid"`` (an engine pid holds
  memory on its GPUs), ``"gpu_uuid"`` (no GPU pid resolves in this PID namespace; the engine's
  GPUs by UUID) or None (neither can be said), and the GPU pids that did not resolve. The
  attribution family never calls those orphaned or foreign on that ground alone.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.facts import Engine, Gpu

WRITES: dict[str, str] = {
    "gpu_attribution": "'pid'|'gpu_uuid'; how GPU memory is matched to the engine: an engine pid among NVML's GPU processes, or the GPUs the engine's container was given by UUID (NVIDIA_VISIBLE_DEVICES via /proc/PID/environ, NVML nvmlDeviceGetUUID) when NVML's host pids are not in this PID namespace; None when neither",
    "unresolved_gpu_pids": "list[int]; NVML GPU process pids on the engine's GPUs absent from this PID namespace's process table (host pids of another container), with gpu_attribution 'gpu_uuid'",
}
READS: frozenset[str] = frozenset()


def gpu_uuids(engine: Engine | None) -> list[str]:
    """The GPU UUIDs the engine's container was given (``EngineConfig.args["_gpu_uuids"]``,
    upper case); [] when unknown."""
    if engine is None:
        return []
    raw: Any = engine.config.args.get("_gpu_uuids")
    if not isinstance(raw, list):
        return []
    return [str(u).upper() for u in raw if isinstance(u, str) and u]


def engine_visible(engine: Engine | None, visible: list[Gpu]) -> list[Gpu]:
    """The GPUs of ``visible`` that the engine's container was given by UUID, in index order;
    ``visible`` itself when no UUID is known or none matches NVML's."""
    uuids = set(gpu_uuids(engine))
    if not uuids:
        return visible
    mine = [g for g in visible if g.uuid and g.uuid.upper() in uuids]
    return mine or visible


def derive(s: Scope, v: Vars) -> None:
    """``gpu_attribution`` and ``unresolved_gpu_pids`` (see the module doc)."""
    on_gpu = {p.pid for g in s.visible for p in g.processes}
    if not on_gpu:
        return
    if s.engine_pids & on_gpu:
        v["gpu_attribution"] = "pid"
        return
    uuids = set(gpu_uuids(s.engine))
    if not uuids or not s.snapshot.process_table_known or not s.engine_pids:
        return  # nothing says the engine is in another namespace: attribution decides as before
    if not all(g.uuid and g.uuid.upper() in uuids for g in s.visible):
        return  # the UUIDs matched none of NVML's GPUs (engine_visible kept them all)
    table = {p.pid for p in s.snapshot.processes}
    unresolved = sorted(pid for pid in on_gpu if pid not in table)
    if unresolved:
        v["gpu_attribution"] = "gpu_uuid"
        v["unresolved_gpu_pids"] = unresolved


FAMILY = Family("container", WRITES, READS, derive)
