"""Host processes: live through psutil, offline from a bundle's ``ps.txt`` → :class:`HostProcess`.

vLLM roles (``HostProcess.vllm_role``):

- ``api_server``: the launch command — ``vllm serve …``, ``python -m vllm.entrypoints…``,
  ``…/vllm/entrypoints/openai/api_server.py``, or a process titled ``VLLM::APIServer``;
- ``engine_core``: titled ``VLLM::EngineCore`` / ``VLLM::EngineCore_DP<n>`` (V1; vLLM calls
  setproctitle, and the kernel's 15-byte ``comm`` shows ``VLLM::EngineCor``);
- ``worker``: titled ``VLLM::Worker…`` (``VLLM::Worker_TP0``, ``VLLM::Worker_DP0_TP1``), the V0
  ``VllmWorkerProcess``, a Ray ``ray::RayWorkerWrapper``, or a ``multiprocessing`` spawn child of
  a vLLM process (V0 workers and pre-title V1 engine cores look like that);
- ``coordinator``: ``VLLM::DPCoordinator`` (data-parallel coordinator; holds no GPU memory);
- ``weight_daemon``: ``vllm preload …``, a daemon holding the deployment's weights in GPU memory
  for its engines (vLLM ≥ 0.32 "Externally held weights"): part of the deployment, no engine.

Process names are those of vllm-facts §3.1. psutil errors (AccessDenied, NoSuchProcess,
ZombieProcess) never escape: the field they concern is None (ports: ``[]``).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import HostProcess, SourceError
from kvdoctor.redact import redact_argv
from kvdoctor.sources.limits import guarded

if TYPE_CHECKING:
    import psutil

_T = TypeVar("_T")


def _errors() -> tuple[type[BaseException], ...]:
    """psutil's errors and OSError (psutil is imported by the live functions only: a bundle's
    ``ps.txt`` is read without it)."""
    import psutil

    return (psutil.Error, OSError)


def __getattr__(name: str) -> Any:
    # ``processes.psutil`` / ``processes._PSUTIL_ERRORS`` for callers and tests that patch them
    if name == "psutil":
        import psutil

        return psutil
    if name == "_PSUTIL_ERRORS":
        return _errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Process objects kept between calls so cpu_percent() measures since the previous call.
_SEEN: dict[tuple[int, float | None], psutil.Process] = {}


def _is_python(token: str) -> bool:
    return re.fullmatch(r"python[\d.]*", token.rsplit("/", 1)[-1]) is not None


def is_vllm_server_cmdline(cmdline: list[str]) -> bool:
    """True when argv is a vLLM API server launch: ``vllm serve``, ``python [opts] …/vllm serve``,
    ``python [opts] -m vllm.entrypoints.…`` or ``python …/vllm/entrypoints/…api_server.py``.

    Only the executable position counts, so ``grep vllm serve`` or ``kvdoctor --log vllm.log`` is
    not a server. Never raises."""
    if not cmdline:
        return False
    argv = [str(a) for a in cmdline]
    first = argv[0].rsplit("/", 1)[-1]
    if first == "vllm":
        return len(argv) > 1 and argv[1] == "serve"
    if not _is_python(argv[0]):
        return False
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok == "-m":
            if i + 1 < len(argv) and argv[i + 1] == "vllm.entrypoints.cli.main":
                return argv[i + 2 : i + 3] == ["serve"]  # `vllm preload` / `vllm bench` serve nothing
            return i + 1 < len(argv) and argv[i + 1].startswith("vllm.entrypoints")
        if tok in ("-X", "-W"):
            i += 2
            continue
        if tok.startswith("-"):
            i += 1
            continue
        base = tok.rsplit("/", 1)[-1]
        if base == "vllm":
            return i + 1 < len(argv) and argv[i + 1] == "serve"
        return tok.endswith(("vllm/entrypoints/openai/api_server.py", "vllm/entrypoints/api_server.py"))
    return False


def is_weight_daemon_cmdline(cmdline: list[str]) -> bool:
    """True when argv runs ``vllm preload`` (``vllm preload …``, ``python …/vllm preload …``,
    ``python -m vllm.entrypoints.cli.main preload …``): a daemon that holds a deployment's
    weights in GPU memory for its engines (vllm-facts §2.1 external weights). Never raises."""
    argv = [str(a) for a in cmdline[:8]]
    for i, tok in enumerate(argv[:-1]):
        if (tok.rsplit("/", 1)[-1] == "vllm" or tok == "vllm.entrypoints.cli.main") and argv[
            i + 1
        ] == "preload":
            return i == 0 or _is_python(argv[0])
    return False


def vllm_role(name: str, cmdline: list[str]) -> str | None:
    """The vLLM role of a process from its name (``comm``) and argv: "api_server",
    "engine_core", "worker", "coordinator", or None (see module docstring). A spawn child of a
    vLLM process is only recognised by :func:`list_processes`/:func:`parse_ps_text`, which see
    the parent. Never raises."""
    title = cmdline[0] if cmdline else ""
    for text in (title, name):
        if text.startswith("VLLM::EngineCor"):
            return "engine_core"
        if text.startswith("VLLM::Worker") or text.startswith("VllmWorkerProcess"):
            return "worker"
        if text.startswith("VLLM::APIServer"):
            return "api_server"
        if text.startswith("VLLM::DPCoordinat"):
            return "coordinator"
        if text.startswith("ray::RayWorkerWrapper"):
            return "worker"
    if is_vllm_server_cmdline(cmdline):
        return "api_server"
    if is_weight_daemon_cmdline(cmdline):
        return "weight_daemon"
    return None


def _is_spawn_child(cmdline: list[str]) -> bool:
    joined = " ".join(cmdline)
    return "multiprocessing.spawn" in joined or "--multiprocessing-fork" in joined


def _mark_spawn_children(procs: list[HostProcess]) -> None:
    """Give the worker role to multiprocessing children of vLLM processes (V0 workers)."""
    # One walk down the process tree from every vLLM process (linear: a chain of thousands of
    # children in reverse order once took one pass per link).
    children: dict[int, list[HostProcess]] = {}
    for p in procs:
        if p.ppid is not None:
            children.setdefault(p.ppid, []).append(p)
    todo = [p.pid for p in procs if p.vllm_role]
    seen: set[int] = set(todo)
    while todo:
        pid = todo.pop()
        for c in children.get(pid, ()):
            if c.pid in seen:
                continue
            if c.vllm_role is None and _is_spawn_child(c.cmdline):
                c.vllm_role = "worker"
            if c.vllm_role:
                seen.add(c.pid)
                todo.append(c.pid)


def _listen_ports(proc: psutil.Process) -> list[int]:
    """TCP ports in LISTEN state (psutil ``net_connections(kind="tcp")``); [] when unreadable."""
    import psutil

    try:
        getter = getattr(proc, "net_connections", None) or proc.connections
        conns = getter(kind="tcp")
    except _errors():
        return []
    ports = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    return sorted(ports)


def _safe(call: Callable[[], _T]) -> _T | None:
    """``call()``, or None when psutil says the process is gone or hidden."""
    try:
        return call()
    except _errors():
        return None


def _process_from_psutil(
    proc: psutil.Process,
    info: dict[str, Any],
    role: str | None,
    *,
    ports: list[int] | None = None,
    argv: list[str] | None = None,
    launch: dict[str, Any] | None = None,
) -> HostProcess:
    """One HostProcess; ``ports``/``argv`` (redacted)/``launch`` given by a caller that keeps
    them (:class:`ProcessTable`), else read / computed now."""
    key = (proc.pid, info.get("create_time"))
    cached = _SEEN.get(key)
    cpu: float | None = None
    if cached is not None:
        cpu = _safe(lambda: cached.cpu_percent(interval=None))
    else:
        _SEEN[key] = proc
        _safe(lambda: proc.cpu_percent(interval=None))  # primes the counter; first value is meaningless
    mem = _safe(proc.memory_info)
    if argv is None:
        argv = redact_argv(info.get("cmdline") or [])
    return HostProcess(
        pid=proc.pid,
        ppid=info.get("ppid"),
        name=info.get("name") or "",
        cmdline=argv,  # a kept argv is shared by every read of the process (facts stay as made)
        cpu_percent=cpu,
        rss_bytes=getattr(mem, "rss", None),
        listen_ports=ports if ports is not None else _listen_ports(proc),
        vllm_role=role,
        create_time=info.get("create_time"),
        **(launch if launch is not None else launch_fields(argv)),
    )


def list_processes(
    include_all: bool = False, *, cpu_interval: float = 0.0, cache: ProcessTable | None = None
) -> list[HostProcess]:
    """Host processes via psutil, vLLM-related ones only unless ``include_all``.

    Per process: pid, ppid, name (``comm``), cmdline (redacted), rss_bytes (``memory_info().rss``),
    listen_ports (``net_connections(kind="tcp")`` in LISTEN; AccessDenied → []), create_time
    (unix seconds), vllm_role (module docstring).

    ``cpu_percent`` follows psutil's two-call semantics: ``Process.cpu_percent(None)`` reports
    usage since the previous call on the same Process object (100 = one core busy). This module
    keeps those objects between calls, so the first call that sees a process returns None for it
    and later calls (a sampler polling every second) return the usage over the interval between.
    With ``cpu_interval > 0`` the function primes every process, sleeps that many seconds once,
    and measures, so a one-shot caller gets values on the first call.

    Any psutil error for one process leaves that field None; a process that vanished mid-read
    is skipped. Never raises for psutil errors.

    ``cache``: a :class:`ProcessTable` kept by a caller that reads every second (the live
    sampler); the vLLM processes are then read from it (``include_all`` and ``cpu_interval``
    do not apply).
    """
    if cache is not None:
        return cache.read()
    import psutil

    wanted: list[tuple[psutil.Process, dict[str, Any], str | None]] = []
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "create_time"], ad_value=None):
        try:
            info = dict(proc.info)
        except _errors():
            continue
        cmdline = [str(a) for a in (info.get("cmdline") or [])]
        info["cmdline"] = cmdline
        role = vllm_role(info.get("name") or "", cmdline)
        wanted.append((proc, info, role))
    # V0 workers: spawn children of a vLLM process.
    roles = {p.pid: r for p, _i, r in wanted}
    for _ in range(3):
        for n, (p, i, r) in enumerate(wanted):
            if r is None and roles.get(i.get("ppid") or -1) and _is_spawn_child(i["cmdline"]):
                wanted[n] = (p, i, "worker")
                roles[p.pid] = "worker"
    if not include_all:
        wanted = [w for w in wanted if w[2] is not None]
    if cpu_interval > 0:
        for p, i, _r in wanted:
            key = (p.pid, i.get("create_time"))
            if key not in _SEEN:
                _SEEN[key] = p
                _safe(p.cpu_percent)  # primes the counter
        time.sleep(cpu_interval)
    out = [_process_from_psutil(p, i, r) for p, i, r in wanted]
    live = {(p.pid, i.get("create_time")) for p, i, _r in wanted}
    for key in [k for k in _SEEN if k not in live and not include_all]:
        if not psutil.pid_exists(key[0]):
            del _SEEN[key]
    return out


_ATTRS = ["pid", "ppid", "name", "cmdline", "create_time"]

# /proc/loadavg kept open (a pread costs ~3 µs, an open + read + close ~20, a listing of /proc
# 60-300): None before the first use, False where the last-pid field cannot be trusted.
_CURSOR_FD: int | bool | None = None
_CURSOR_LOCK = threading.Lock()


def _read_cursor(fd: int) -> bytes | None:
    try:
        text = os.pread(fd, 256, 0)
    except OSError:
        return None
    last = text.rsplit(None, 1)[-1] if text.strip() else b""
    return last if last.isdigit() else None


def _pid_cursor() -> bytes | None:
    """The last pid the kernel handed out in this PID namespace (the last field of
    ``/proc/loadavg``, ``idr_get_cursor(task_active_pid_ns(current))``): it moves whenever a
    process or a thread is created in the namespace, so an unchanged value means no new pid
    appeared in ``psutil.PROCFS_PATH``'s listing since it was read. None where that does not
    hold or cannot be read: no loadavg (a ``subset=pid`` procfs), a procfs of another PID
    namespace than this process's (``/proc/self`` there is not :func:`os.getpid`, e.g. the
    host's /proc mounted into a container), or a kernel whose field stays put when a thread
    is started (checked once, with a thread started and joined)."""
    global _CURSOR_FD
    fd = _CURSOR_FD
    if fd is None:
        with _CURSOR_LOCK:
            if _CURSOR_FD is None:
                _CURSOR_FD = _open_cursor()
            fd = _CURSOR_FD
    if fd is False:
        return None
    return _read_cursor(fd)


def _open_cursor() -> int | bool:
    import psutil

    root = psutil.PROCFS_PATH
    try:
        if os.readlink(os.path.join(root, "self")) != str(os.getpid()):
            return False  # another PID namespace's procfs: the cursor is not its
        fd = os.open(os.path.join(root, "loadavg"), os.O_RDONLY)
    except OSError:
        return False
    before = _read_cursor(fd)
    t = threading.Thread(target=lambda: None, name="kvdoctor-pid-cursor-check")
    t.start()
    t.join()
    if before is None or _read_cursor(fd) == before:
        os.close(fd)
        return False  # the field does not follow pid allocation here
    return fd


def _pid_listed(pid: int) -> bool:
    """``pid`` is (still) in ``psutil.PROCFS_PATH``'s listing: its /proc directory exists (a
    zombie's too, as the listing shows it). One stat call."""
    import psutil

    return os.path.exists(f"{psutil.PROCFS_PATH}/{pid}")


def _info_of(proc: psutil.Process, info: dict[str, Any]) -> dict[str, Any]:
    info = dict(info)
    info["cmdline"] = [str(a) for a in (info.get("cmdline") or [])]
    return info


@shared_methods
@dataclass(repr=False, eq=False)
class _Entry:
    proc: psutil.Process
    info: dict[str, Any]
    role: str | None
    argv: list[str] | None = None  # redacted, once the process is listed
    launch: dict[str, Any] | None = None
    ports: list[int] | None = None  # read on the full rescans only
    #: a multiprocessing child without a role of its own (worker if its parent is vLLM's)
    spawn: bool = False
    #: a python process (argv[0]), the kind that may retitle itself
    python: bool = False


class ProcessTable:
    """The host process table kept between the reads of a sampler polling every second, so that
    a read costs the vLLM processes' own counters, not a walk of every process on the host
    (``process_iter`` + ``net_connections`` took ~50 ms a read on a host of 90 processes).

    - A rescan runs at most every ``rescan_s`` seconds, and on the read after NVML's GPU pid
      set changed (:meth:`note_gpu_pids`: an engine started or stopped). The first is a full
      walk (``psutil.process_iter``: name, ppid, cmdline, create_time of every process); later
      ones list the pids and read in full only the new ones, the python ones, the vLLM ones
      and any whose start time, name or parent changed (:meth:`_unchanged`: a kernel thread
      or a shell that did not ``exec`` costs one stat read); the API servers' listening ports
      (``net_connections``) are read again.
    - Between rescans: ``psutil.pids()`` (one listing of /proc), skipped while no pid was handed
      out since the last one (the kernel's pid cursor, :func:`_pid_cursor`, has not moved) and
      every vLLM process is still there (:func:`_pid_listed`); a pid not seen before is read
      alone, a python process younger than ``young_s`` seconds is re-read (its argv, and its
      name when the argv changed: vLLM retitles its spawned processes, ``setproctitle``, after
      they start), a vanished one is dropped; only the vLLM processes
      are read in full (``cpu_percent``, ``memory_info``), every ``stats_s`` seconds (and on
      every rescan, and at once for a process not read before): a TP=8 host's nine vLLM
      processes cost ~2 ms of /proc reads a read, and psutil's ``cpu_percent`` over ``stats_s``
      is the same measure averaged longer; between those reads a process's last
      :class:`HostProcess` is given again (facts are not modified). Ports stay those of the last rescan
      (other roles': those of their first read). The roles (V0 spawn children included) and the
      young candidates are derived again only when the entries change: a read of a host whose
      listing did not change walks the vLLM processes, not every process.

    :meth:`read` gives what :func:`list_processes` gives (vLLM processes only); psutil errors
    never escape. ``clock`` is monotonic seconds (tests step it).
    """

    def __init__(
        self,
        rescan_s: float = 60.0,
        young_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        stats_s: float = 5.0,
    ) -> None:
        self.rescan_s = rescan_s
        self.young_s = young_s
        self.stats_s = stats_s
        #: pid → (monotonic time read, the entry it was read from, its HostProcess)
        self._stats: dict[int, tuple[float, _Entry, HostProcess]] = {}
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._last_full: float | None = None
        self._gpu_pids: frozenset[int] | None = None
        self._gpu_changed = False
        #: full rescans done (tests, the bench)
        self.rescans = 0
        # What only changes with the entries, derived once per change (a read of an unchanged
        # host then walks the vLLM processes, not the whole table): the pids psutil listed,
        # the python processes still young enough to retitle themselves, the vLLM roles.
        self._listed: set[int] = set()
        self._young: list[int] = []
        self._changed = True
        self._roles: list[tuple[int, str]] = []
        self._live: set[tuple[int, float | None]] = set()
        #: the pid cursor (:func:`_pid_cursor`) read just before the last listing that read
        #: every listed pid; None: list /proc on the next read
        self._cursor: bytes | None = None
        #: reads between rescans that needed no listing (tests, the bench)
        self.listings_skipped = 0

    def note_gpu_pids(self, pids: set[int] | frozenset[int]) -> None:
        """NVML's GPU process pids of the latest read: a change rescans on the next read."""
        got = frozenset(pids)
        if self._gpu_pids is not None and got != self._gpu_pids:
            self._gpu_changed = True
        self._gpu_pids = got

    def _entry(self, proc: psutil.Process, info: dict[str, Any]) -> _Entry:
        info = _info_of(proc, info)
        argv = info["cmdline"]
        role = vllm_role(info.get("name") or "", argv)
        spawn = role is None and _is_spawn_child(argv)
        return _Entry(proc, info, role, spawn=spawn, python=bool(argv) and _is_python(argv[0]))

    def _read_pid(self, pid: int) -> _Entry | None:
        import psutil

        try:
            proc = psutil.Process(pid)
            info = proc.as_dict(attrs=_ATTRS, ad_value=None)
        except _errors():
            return None  # gone already, or hidden
        return self._entry(proc, info)

    def _rescan(self, now: float) -> None:
        import psutil

        entries: dict[int, _Entry] = {}
        pids: list[int] | None = None
        if self._entries:
            try:
                pids = psutil.pids()
            except _errors():
                pids = None  # the listing failed: the full walk below
        if pids is None:
            for proc in psutil.process_iter(_ATTRS, ad_value=None):
                try:
                    entries[proc.pid] = self._entry(proc, proc.info)
                except _errors():
                    continue
        else:
            # Known processes that cannot be vLLM's are checked (one stat read), not read again.
            for pid in pids:
                old = self._entries.get(pid)
                if old is not None and self._unchanged(old):
                    entries[pid] = old
                    continue
                e = self._read_pid(pid)
                if e is None:
                    continue  # gone, or hidden
                # the same process as before: keep what was derived from it (argv, launch, ports)
                entries[pid] = old if old is not None and old.info == e.info else e
        self._entries = entries
        self._last_full = now
        self._gpu_changed = False
        self.rescans += 1
        self._listed = set(entries)
        self._young = self._young_candidates(entries, time.time())
        self._changed = True
        self._cursor = None  # the next read lists /proc and keeps the cursor

    @staticmethod
    def _unchanged(e: _Entry) -> bool:
        """True when ``e`` is a process no vLLM role can come from and that still runs the same
        program: not python (the kind that retitles itself), no role, no spawn child, and its
        ``/proc/PID/stat`` (psutil's ``oneshot``) gives the same start time (psutil's pid-reuse
        check), name and parent; a kernel thread, the start time only. A process that ``exec``s (an entrypoint script
        that ends in ``exec vllm serve``) changes its name: it is read again in full. Costs
        about half of a full read (``process_iter``'s name, ppid, cmdline, create_time) on a
        host of a few hundred such processes."""
        if e.python or e.role is not None or e.spawn:
            return False
        try:
            if e.info.get("ppid") == 2:
                # a kernel thread (kthreadd's child) never execs: only its pid's reuse matters
                return bool(e.proc.is_running())
            with e.proc.oneshot():
                return bool(e.proc.name() == e.info.get("name") and e.proc.ppid() == e.info.get("ppid"))
        except _errors():
            return False  # gone, reused or hidden: read again (dropped if gone)

    def _young_candidates(self, entries: dict[int, _Entry], wall: float) -> list[int]:
        """Pids of the python processes younger than ``young_s`` (an old one never gets young
        again: the candidates are recomputed only when the entries change)."""
        out = []
        for pid, e in entries.items():
            if e.python:
                ctime = e.info.get("create_time")
                if ctime is not None and wall - ctime < self.young_s:
                    out.append(pid)
        return out

    def _listing_unchanged(self, cursor: bytes | None) -> bool:
        """No pid appeared since the last listing (the pid cursor has not moved) and every
        vLLM process of the last read is still listed: the listing would be the same but for
        the exits of processes that are not vLLM's, which change nothing this read gives (a
        young candidate that exited is dropped when its re-read fails). A few µs where the
        listing costs 60-300 µs (hundreds of processes)."""
        if cursor is None or cursor != self._cursor or not self._listed:
            return False
        return all(_pid_listed(pid) for pid, _role in self._roles)

    def _refresh(self) -> None:
        import psutil

        cursor = _pid_cursor()
        if self._listing_unchanged(cursor):
            self.listings_skipped += 1
            pids = self._listed
        else:
            try:
                pids = set(psutil.pids())
            except _errors():
                self._rescan(self._clock())
                return
        wall = time.time()
        fresh_pids: set[int] = set()
        self._cursor = cursor
        if pids != self._listed:
            entries = {pid: e for pid, e in self._entries.items() if pid in pids}
            unread = False
            for pid in pids:
                if pid not in entries:
                    fresh = self._read_pid(pid)
                    if fresh is not None:
                        entries[pid] = fresh
                        fresh_pids.add(pid)
                    else:
                        unread = True  # listed but unreadable: tried again next read
            self._listed = set() if unread else pids
            if unread:
                self._cursor = None
            if entries.keys() != self._entries.keys():
                self._young = self._young_candidates(entries, wall)
                self._changed = True
            self._entries = entries
        entries = self._entries
        young = []
        for pid in self._young:
            e = entries.get(pid)
            if e is None:
                continue
            ctime = e.info.get("create_time")
            if ctime is None or wall - ctime >= self.young_s:
                continue  # grown old: never re-read again
            young.append(pid)
            if pid in fresh_pids:
                continue  # just read
            # a young python process may have retitled itself (vLLM's spawned engine core
            # and workers call setproctitle, which rewrites argv and the name together): its
            # argv, and its name only when the argv changed (one /proc read a second, not 2-3)
            try:
                argv = [str(a) for a in e.proc.cmdline()]
                name = e.proc.name() if argv != e.info["cmdline"] else e.info.get("name")
            except _errors():
                del entries[pid]
                self._listed = set()
                self._cursor = None
                self._changed = True
                continue
            if name != e.info.get("name") or argv != e.info["cmdline"]:
                entries[pid] = self._entry(e.proc, {**e.info, "name": name, "cmdline": argv})
                self._changed = True
        self._young = young

    def _derive_roles(self) -> None:
        """The vLLM processes' (pid, role) in pid order, and the (pid, create_time) of every
        entry, from the entries (after a change only)."""
        entries = self._entries
        roles = {pid: e.role for pid, e in entries.items()}
        # V0 workers: spawn children of a vLLM process (as list_processes; only the spawn
        # children can change, walked in the table's order).
        spawned = [(pid, e.info.get("ppid") or -1) for pid, e in entries.items() if e.spawn]
        for _ in range(3 if spawned else 0):
            for pid, ppid in spawned:
                if roles[pid] is None and roles.get(ppid):
                    roles[pid] = "worker"
        self._roles = [(pid, r) for pid, r in sorted(roles.items()) if r is not None]
        self._live = {(pid, e.info.get("create_time")) for pid, e in entries.items()}
        self._changed = False

    def read(self) -> list[HostProcess]:
        """The vLLM processes now (see the class doc), pid order of psutil's listing."""
        now = self._clock()
        full = self._last_full is None or now - self._last_full >= self.rescan_s or self._gpu_changed
        try:
            if full:
                self._rescan(now)
            else:
                self._refresh()
        except _errors():
            return []
        if self._changed:
            self._derive_roles()
        entries = self._entries
        out: list[HostProcess] = []
        stats, kept = self._stats, {}
        for pid, role in self._roles:
            e = entries[pid]
            last = stats.get(pid)
            if not full and last is not None and last[1] is e and now - last[0] < self.stats_s:
                hp = last[2]
                if hp.vllm_role == role:  # the same process, read less than stats_s ago
                    kept[pid] = last
                    out.append(hp)
                    continue
            if e.argv is None:
                e.argv = redact_argv(e.info["cmdline"])
                e.launch = launch_fields(e.argv)
            if e.ports is None or (full and role == "api_server"):
                # the server's port is what discovery needs; /proc/net/tcp costs ~20 ms a read
                e.ports = _listen_ports(e.proc)
            hp = _process_from_psutil(e.proc, e.info, role, ports=e.ports, argv=e.argv, launch=e.launch)
            # a process seen for the first time has no CPU figure yet (psutil's counter was only
            # primed): read again next time rather than stats_s later
            kept[pid] = (now if hp.cpu_percent is not None else -math.inf, e, hp)
            out.append(hp)
        self._stats = kept
        live = self._live
        for key in [k for k in _SEEN if k not in live]:
            del _SEEN[key]
        return out


def process_table() -> set[int]:
    """Pids of every live process on the host (``psutil.pids()``): a GPU process whose pid is
    absent is dead (orphaned GPU memory). Returns an empty set if psutil cannot list them."""
    import psutil

    try:
        return set(psutil.pids())
    except _errors():
        return set()


def _flag_value(cmdline: list[str], flag: str) -> str | None:
    for i, tok in enumerate(cmdline):
        if tok == flag and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if tok.startswith(flag + "="):
            return tok[len(flag) + 1 :]
    return None


def metrics_url_for(proc: HostProcess) -> str | None:
    """The ``/metrics`` URL of an API server process (vllm-facts §5: all endpoints share
    ``--host``/``--port``), or None for other roles.

    Port: ``--port`` from its cmdline when it is among the listening ports or ports are unknown;
    else 8000 if it listens there, else its lowest listening port; with neither ports nor a
    cmdline (only a title), 8000 for ``vllm serve``-style commands, None for a bare title.
    Host: ``--host`` unless it is a wildcard (0.0.0.0, ::, empty) → 127.0.0.1.
    """
    if proc.vllm_role != "api_server":
        return None
    port_text = _flag_value(proc.cmdline, "--port")
    cmd_port = int(port_text) if port_text and port_text.isdigit() else None
    port: int | None
    if proc.listen_ports:
        if cmd_port in proc.listen_ports:
            port = cmd_port
        elif 8000 in proc.listen_ports:
            port = 8000
        else:
            port = min(proc.listen_ports)
    elif cmd_port is not None:
        port = cmd_port
    elif is_vllm_server_cmdline(proc.cmdline):
        port = 8000
    else:
        return None
    host = _flag_value(proc.cmdline, "--host") or ""
    if host in ("", "0.0.0.0", "::", "[::]", "*"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


# --------------------------------------------------------------------------- ps.txt / top

_NAME_COLS = {"COMM", "UCOMM"}
_ARGS_COLS = {"ARGS", "CMD", "COMMAND"}


def _parse_rss_kib(text: str, default_kib: bool = True) -> int | None:
    """ps ``RSS`` (KiB) / top ``RES`` (KiB, or with m/g/t suffix) → bytes."""
    m = re.fullmatch(r"(\d{1,20}(?:\.\d{1,20})?)([kmgtpKMGTP]?)", text.strip())
    if not m:
        return None
    num = float(m.group(1))
    mult = {"": 1024, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}[m.group(2).lower()]
    return int(num * mult)


@guarded("origin", 1)
def parse_ps_text(text: str, origin: str = "") -> list[HostProcess]:
    """Parse a bundle's ``ps.txt`` into :class:`HostProcess` facts, every row kept (``vllm_role``
    set where it applies).

    Formats: ``ps -eo pid,ppid,pcpu,rss,etime,comm,args`` (header ``PID PPID %CPU RSS ELAPSED
    COMMAND COMMAND``: the first COMMAND is ``comm``, the last the full args), any ``ps -o``
    column set with PID and a command column (``ps aux`` too), and ``top -b -n 1`` (summary lines
    skipped, ``RES`` in KiB or with m/g suffix, ``COMMAND`` the name, or the args with ``-c``).
    RSS becomes bytes; %CPU is percent of one core. Args are split on spaces (ps does not quote)
    and redacted. ``create_time`` is None (ps gives elapsed time, not the snapshot's clock).

    Raises :class:`SourceError` (origin, line) on binary data, no header, or a row whose PID is
    not a number.
    """
    lines = text.splitlines()
    header_idx: int | None = None
    cols: list[str] = []
    for idx, raw in enumerate(lines):
        if "\x00" in raw or "\ufffd" in raw:
            raise SourceError("binary or corrupt data, not ps output", origin=origin or None, line=idx + 1)
        toks = raw.split()
        upper = [t.upper() for t in toks]
        if "PID" in upper and (set(upper) & (_ARGS_COLS | _NAME_COLS)):
            header_idx = idx
            cols = upper
            break
    if header_idx is None:
        raise SourceError("no ps/top header with PID and COMMAND columns", origin=origin or None)
    cmd_positions = [i for i, c in enumerate(cols) if c in _ARGS_COLS | _NAME_COLS]
    last = len(cols) - 1
    name_col = next((i for i in cmd_positions if cols[i] in _NAME_COLS), None)
    if name_col is None and len(cmd_positions) > 1:
        name_col = cmd_positions[0]
    args_col = last if cols[last] in _ARGS_COLS and last != name_col else None
    procs: list[HostProcess] = []
    first_bad: SourceError | None = None  # a bad row costs that row; raised only if none is good
    for idx in range(header_idx + 1, len(lines)):
        raw = lines[idx]
        if "\x00" in raw or "\ufffd" in raw:
            raise SourceError("binary or corrupt data, not ps output", origin=origin or None, line=idx + 1)
        if not raw.strip():
            continue
        parts = raw.split(None, last)
        if len(parts) < last + 1 and args_col is None and name_col is None:
            continue
        row = dict(zip(cols, parts, strict=False))
        pid_text = row.get("PID", "")
        if not pid_text.isdigit() or len(pid_text) > 10:
            first_bad = first_bad or SourceError(
                "expected a PID number in the PID column", origin=origin or None, line=idx + 1
            )
            continue
        pid = int(pid_text)
        args_text = parts[args_col] if args_col is not None and args_col < len(parts) else ""
        name_text = parts[name_col] if name_col is not None and name_col < len(parts) else ""
        if name_col is None and args_col is None:
            name_text = parts[-1] if parts else ""
        argv = args_text.split()
        if not name_text and argv:
            name_text = argv[0].rsplit("/", 1)[-1]
        cpu_text = row.get("%CPU")
        try:
            cpu = float(cpu_text.replace(",", ".")) if cpu_text is not None else None
        except ValueError:
            cpu = None
        rss_text = row.get("RSS") or row.get("RES")
        ppid_text = row.get("PPID")
        procs.append(
            HostProcess(
                pid=pid,
                ppid=int(ppid_text) if ppid_text and ppid_text.isdigit() else None,
                name=name_text,
                cmdline=redact_argv(argv),
                cpu_percent=cpu,
                rss_bytes=_parse_rss_kib(rss_text) if rss_text else None,
                vllm_role=vllm_role(name_text, argv),
                **launch_fields(redact_argv(argv)),
            )
        )
    if not procs and first_bad is not None:
        raise first_bad
    _mark_spawn_children(procs)
    return procs


def host_process_from_strings(
    pid: int, name: str, cmdline: str | list[str], ppid: int | None = None
) -> HostProcess:
    """Build a :class:`HostProcess` from a name and a command line (shell string or argv), with
    its role detected and the command line redacted; for tests and for sources that only have
    text (compute-apps CSV names). Raises nothing; an unbalanced shell string is split on
    spaces."""
    if isinstance(cmdline, str):
        try:
            argv = shlex.split(cmdline)
        except ValueError:
            argv = cmdline.split()
    else:
        argv = [str(a) for a in cmdline]
    return HostProcess(
        pid=pid,
        ppid=ppid,
        name=name,
        cmdline=redact_argv(argv),
        vllm_role=vllm_role(name, argv),
        **launch_fields(redact_argv(argv)),
    )


def launch_fields(argv: list[str]) -> dict[str, Any]:
    """The :class:`HostProcess` launch fields of a (redacted) command line: ``launches_vllm``,
    ``launch_model`` and ``launch_gmu`` (``--gpu-memory-utilization`` as given), parsed here, when
    the process is read, so that derive never parses a command line. {} when it does not
    launch vLLM; a launch whose flags do not parse keeps only ``launches_vllm``. Never raises."""
    from kvdoctor.sources.cmdline import locate_vllm_args, parse_argv

    if not argv or locate_vllm_args(list(argv)) is None:
        return {}
    try:
        cfg = parse_argv(list(argv))
    except (SourceError, ValueError, TypeError):
        return {"launches_vllm": True}
    gmu = cfg.gpu_memory_utilization if "gpu_memory_utilization" in cfg.explicit else None
    return {"launches_vllm": True, "launch_model": cfg.served_model_name or cfg.model, "launch_gmu": gmu}
