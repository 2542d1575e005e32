"""The process view's rows: every GPU process with what kvdoctor calls it, and its host figures.

A row per (GPU, process) from the View: NVML's pid and GPU memory, the role from the memory
breakdown (``kvdoctor.breakdown``: the engine's own processes, another engine's, foreign) and
from the report (pids the ``orphaned-engine-processes`` finding names are "orphan"), and host
figures (user, CPU % of one core, RSS, age, command line) from the process table the feed read
or, live, from psutil for these few pids (:class:`HostReader`, called every few seconds while
the view is open). Command lines are redacted (``kvdoctor.redact.redact_argv``). Nothing here
decides a diagnosis; signalling a process is :func:`terminate`, which re-checks it first.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from typing import Any

from kvdoctor.watch.controller import View

#: the rule whose finding names orphaned pids (``kill PID …`` in its summary)
ORPHAN_RULE = "orphaned-engine-processes"
_KILL_RE = re.compile(r"`kill ((?:\d{1,10} ?){1,64})`")
_KILL_CMD_RE = re.compile(r"kill ((?:\d{1,10} ?){1,64})")
_PID_RE = re.compile(r"(?:^|, )pid (\d{1,10}) \(")
#: columns of the view: key, heading
COLUMNS: tuple[tuple[str, str], ...] = (
    ("gpu", "GPU"),
    ("pid", "PID"),
    ("user", "USER"),
    ("role", "ROLE"),
    ("gpu_bytes", "GPU MEM"),
    ("cpu_percent", "CPU%"),
    ("rss_bytes", "RSS"),
    ("age_s", "AGE"),
    ("command", "COMMAND"),
)


@dataclass
class HostInfo:
    """A host process's figures: ``user`` name, ``cpu_percent`` of one core, ``rss_bytes``,
    ``create_time`` (unix seconds) and the redacted ``command`` line."""

    user: str | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    create_time: float | None = None
    command: str | None = None


@dataclass
class ProcRow:
    """One GPU process: ``gpu`` index, ``pid``, ``role`` ("engine", "worker", "other engine",
    "orphan", "foreign"), ``gpu_bytes`` (NVML used memory), host figures (None: unknown)."""

    gpu: int
    pid: int
    role: str
    gpu_bytes: int | None
    command: str
    user: str | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    age_s: float | None = None
    create_time: float | None = None

    def sort_key(self, column: str) -> Any:
        """Value to sort by ``column`` (unknown last, biggest first for numbers)."""
        v = getattr(self, column)
        if isinstance(v, str) or column in ("gpu", "pid"):
            return (v is None, v if v is not None else "")
        return (v is None, -(v or 0))


def orphan_pids(view: View | None) -> set[int]:
    """Pids the report's ``orphaned-engine-processes`` finding names (firing now): from its
    fix's ``kill PID …`` command (the rule's own list of ints), else its summary's, else its
    evidence's "pid N (name)";
    only pids that hold memory on a GPU of this View under a vLLM process name (a process
    cannot name another pid into the list)."""
    out: set[int] = set()
    if view is None:
        return out
    from kvdoctor.derive.base import is_vllm_process

    on_gpu = {p.pid for g in view.snapshot.gpus for p in g.processes if is_vllm_process(p.name)}
    for row in view.findings:
        f = row.finding
        if f.rule != ORPHAN_RULE or row.resolved_at is not None:
            continue
        # The rule's fix: ``kill PID …`` as a command (report/2 ``fixes``), else its summary.
        cmds = [str(c) for fx in getattr(f, "fixes", None) or [] for c in getattr(fx, "commands", ())]
        m = next((m for c in cmds if (m := _KILL_CMD_RE.fullmatch(c.strip()[:4096]))), None)
        m = m or _KILL_RE.search(f.summary[:4096])
        if m:
            out.update(int(x) for x in m.group(1).split())
            continue
        for e in f.evidence:
            if e.fact == "orphaned processes":
                out.update(int(x) for x in _PID_RE.findall(e.value[:4096]))
    return out & on_gpu


def process_rows(view: View | None, host: dict[int, HostInfo] | None = None) -> list[ProcRow]:
    """Every GPU process of ``view`` (one row per GPU it holds memory on), in GPU order."""
    if view is None:
        return []
    orphans = orphan_pids(view)
    table = {p.pid: p for p in view.snapshot.processes}
    now = view.now
    rows: list[ProcRow] = []
    for b in view.gpus:
        for p, kind in b.processes:
            hp = table.get(p.pid)
            info = (host or {}).get(p.pid)
            if p.pid in orphans:
                role = "orphan"
            elif kind == "engine":
                role = "worker" if hp is not None and hp.vllm_role == "worker" else "engine"
            else:
                role = kind.replace("_", " ")
            cmd = (info.command if info is not None else None) or (
                " ".join(hp.cmdline) if hp is not None and hp.cmdline else p.name or "?"
            )
            ctime = info.create_time if info is not None and info.create_time else None
            if ctime is None and hp is not None:
                ctime = hp.create_time
            rows.append(
                ProcRow(
                    gpu=b.index,
                    pid=p.pid,
                    role=role,
                    gpu_bytes=p.used_bytes,
                    command=cmd,
                    user=info.user if info is not None else None,
                    cpu_percent=info.cpu_percent
                    if info is not None and info.cpu_percent is not None
                    else (hp.cpu_percent if hp is not None else None),
                    rss_bytes=info.rss_bytes
                    if info is not None and info.rss_bytes is not None
                    else (hp.rss_bytes if hp is not None else None),
                    age_s=max(0.0, now - ctime) if ctime else None,
                    create_time=ctime,
                )
            )
    return rows


@dataclass
class HostLoad:
    """The host as nvitop's header shows it: ``cpu_percent`` of all cores (0..100 since the
    previous read), ``mem_used_bytes`` / ``mem_total_bytes`` (psutil ``virtual_memory``:
    total − available), ``cores``."""

    cpu_percent: float | None
    mem_used_bytes: int
    mem_total_bytes: int
    cores: int


def host_load() -> HostLoad | None:
    """This host's CPU and memory now (psutil ``cpu_percent(None)``, ``virtual_memory()``,
    ``cpu_count()``); None when psutil cannot read them."""
    import psutil

    try:
        vm = psutil.virtual_memory()
        return HostLoad(
            psutil.cpu_percent(None), int(vm.total - vm.available), int(vm.total), psutil.cpu_count() or 0
        )
    except (OSError, RuntimeError):
        return None


class HostReader:
    """psutil figures of a few pids (the GPU processes), for the live process view. CPU % is
    psutil's ``cpu_percent()`` since the previous call on the same Process object (the first
    call for a pid has none). Never raises: a pid that is gone or denied gets what was read."""

    def __init__(self) -> None:
        self._procs: dict[int, Any] = {}

    def read(self, pids: list[int]) -> dict[int, HostInfo]:
        """HostInfo per pid that exists (psutil ``username``, ``cpu_percent``,
        ``memory_info().rss``, ``create_time``, ``cmdline`` redacted)."""
        import psutil

        from kvdoctor.redact import redact_argv

        out: dict[int, HostInfo] = {}
        keep: dict[int, Any] = {}
        for pid in pids[:256]:
            proc = self._procs.get(pid)
            try:
                if proc is None or not proc.is_running():
                    proc = psutil.Process(pid)
                    first = True
                else:
                    first = False
                info = HostInfo(create_time=proc.create_time())
                with proc.oneshot():
                    info.user = _try(proc.username)
                    mem = _try(proc.memory_info)
                    info.rss_bytes = mem.rss if mem is not None else None
                    argv = _try(proc.cmdline)
                    info.command = " ".join(redact_argv(argv)) if argv else _try(proc.name)
                    cpu = proc.cpu_percent(None)
                    info.cpu_percent = None if first else cpu
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, OSError):
                continue
            keep[pid] = proc
            out[pid] = info
        self._procs = keep
        return out


def _try(call: Any) -> Any:
    """``call()``, None when psutil is denied or the process is a zombie."""
    import psutil

    try:
        return call()
    except (psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def terminate(rows: list[ProcRow]) -> list[str]:
    """Send SIGTERM to each row's pid, after checking it is the same process that was shown
    (psutil ``create_time`` equal to the row's, when the row has one). Returns one line per
    pid saying what happened."""
    import psutil

    out = []
    for r in rows:
        try:
            proc = psutil.Process(r.pid)
            if r.create_time is not None and abs(proc.create_time() - r.create_time) > 1.0:
                out.append(f"pid {r.pid}: not signalled (another process has that pid now)")
                continue
            os.kill(r.pid, signal.SIGTERM)
            out.append(f"pid {r.pid}: SIGTERM sent")
        except psutil.NoSuchProcess:
            out.append(f"pid {r.pid}: already gone")
        except (PermissionError, psutil.AccessDenied):
            out.append(f"pid {r.pid}: not permitted (run as its user or root)")
        except OSError as e:
            out.append(f"pid {r.pid}: {e.strerror or e}")
    return out


def fmt_age(seconds: float | None) -> str:
    """ "3d04h", "2h05m", "4m10s", "12s"; "–" when unknown."""
    if seconds is None:
        return "–"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
