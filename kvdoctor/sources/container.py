"""vLLM seen from a sidecar container: ``/proc`` of a shared PID namespace, GPUs by UUID.

In a pod with ``shareProcessNamespace: true`` the sidecar sees vLLM's processes under
``/proc``, but NVML reports *host* PIDs, which do not exist in the pod's namespace: GPU memory
cannot be matched to vLLM by pid. What can be read instead (this module; sampling only):

- ``/proc/PID/cmdline`` of each process: vLLM's launch flags (redacted);
- ``/proc/PID/environ``: only ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` are kept
  (every other variable is dropped unread into any fact: secrets never leave);
- the model's ``config.json`` through ``/proc/PID/root`` (the vLLM container's filesystem),
  when ``--model`` is a local directory;
- :func:`gpu_indices_for`: the GPUs an engine uses, by UUID (``NVIDIA_VISIBLE_DEVICES=GPU-…``)
  against NVML's ``nvmlDeviceGetUUID``, or by index.

Every read is bounded (:data:`MAX_READ`) and a process that vanishes or denies access is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvdoctor.facts import Gpu
from kvdoctor.redact import redact_argv

#: the most bytes read from one /proc file.
MAX_READ = 256 * 1024
#: environment variables kept from /proc/PID/environ (the rest is never kept).
KEPT_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


@dataclass
class ContainerProcess:
    """A vLLM process seen through /proc: ``pid`` (in this PID namespace), ``cmdline``
    (redacted argv), ``env`` (only :data:`KEPT_ENV`), ``config_path`` (the model's config.json
    as this process sees it, through /proc/PID/root) when ``--model`` is a local directory."""

    pid: int
    cmdline: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    config_path: Path | None = None


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_READ)
    except OSError:  # vanished, permission denied (another uid), not a process
        return None


def _env(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name.decode("ascii", "replace") in KEPT_ENV:
            out[name.decode()] = value.decode("utf-8", "replace")
    return out


def _model_dir(argv: list[str]) -> str | None:
    for i, tok in enumerate(argv):
        if tok == "serve" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
        if tok in ("--model", "--model-name-or-path") and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--model="):
            return tok.split("=", 1)[1]
    return None


def read_process(pid: int, proc_root: Path = Path("/proc")) -> ContainerProcess | None:
    """One process under ``proc_root``: its redacted argv, the kept environment
    (:data:`KEPT_ENV`) and, when ``--model`` (or ``vllm serve MODEL``) is an absolute local
    directory, its config.json through ``/proc/PID/root``. None when the process vanished or
    has no command line (a kernel thread). Never raises."""
    entry = proc_root / str(pid)
    raw = _read(entry / "cmdline")
    if not raw:
        return None
    argv = [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")]
    proc = ContainerProcess(pid=pid, cmdline=redact_argv(argv))
    env = _read(entry / "environ")
    if env:
        proc.env = _env(env)
    model = _model_dir(argv)
    if model and model.startswith("/"):
        cfg = entry / "root" / model.lstrip("/") / "config.json"
        try:
            if cfg.is_file():
                proc.config_path = cfg
        except OSError:
            pass
    return proc


def vllm_processes(proc_root: Path = Path("/proc")) -> list[ContainerProcess]:
    """The vLLM API servers visible under ``proc_root`` (a command line naming ``vllm serve``
    or ``vllm.entrypoints``), pid order. Never raises."""
    out: list[ContainerProcess] = []
    try:
        entries = [p for p in proc_root.iterdir() if p.name.isdigit()]
    except OSError:
        return out
    for entry in sorted(entries, key=lambda p: int(p.name)):
        raw = _read(entry / "cmdline")
        if not raw:
            continue
        argv = [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")]
        joined = " ".join(argv)
        if "vllm.entrypoints" not in joined and not ("vllm" in joined and "serve" in argv):
            continue
        proc = read_process(int(entry.name), proc_root)
        if proc is not None:
            out.append(proc)
    return out


def gpu_uuids(env: dict[str, str]) -> list[str]:
    """The GPU (or MIG) UUIDs a process was given: ``NVIDIA_VISIBLE_DEVICES`` when it lists
    UUIDs (the NVIDIA container runtime / Kubernetes device plugin), else ``CUDA_VISIBLE_DEVICES``
    when it does; [] for indices, ``all``, ``void`` or unset (indices are the container's own
    numbering, not NVML's here)."""
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        items = [v.strip() for v in (env.get(name) or "").split(",") if v.strip()]
        if items and all(i.upper().startswith(("GPU-", "MIG-")) for i in items):
            return items
    return []


def gpu_indices_for(env: dict[str, str], gpus: list[Gpu]) -> tuple[list[int], str]:
    """The indices (in ``gpus``, NVML's) of the GPUs a process may use, and how that was found:
    "uuid" (``NVIDIA_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` list GPU UUIDs, matched to
    NVML's), "index" (they list indices), "all" (unset or ``all``), or "none" (``void``/
    ``none``/empty). A UUID NVML does not show is skipped."""
    value = env.get("NVIDIA_VISIBLE_DEVICES")
    if value is None or value.strip().lower() == "all":
        value = env.get("CUDA_VISIBLE_DEVICES", value)
    if value is None or value.strip().lower() == "all":
        return [g.index for g in gpus], "all"
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or items[0].lower() in ("void", "none"):
        return [], "none"
    if all(i.upper().startswith(("GPU-", "MIG-")) for i in items):
        by_uuid = {(g.uuid or "").upper(): g.index for g in gpus if g.uuid}
        return [by_uuid[i.upper()] for i in items if i.upper() in by_uuid], "uuid"
    idx = [int(i) for i in items if i.isdigit()]
    known = {g.index for g in gpus}
    return [i for i in idx if i in known], "index"
