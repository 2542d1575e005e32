"""The process table the live sampler keeps between reads (ProcessTable): full rescans only
every rescan_s or when NVML's GPU pids change, new pids read alone, retitles of young processes
seen, the same vLLM processes as a one-shot list_processes()."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from kvdoctor.sources import processes
from kvdoctor.sources.processes import ProcessTable, list_processes

OLD = time.time() - 3600  # long-running processes: not "young"


class FakeHost:
    """A psutil stand-in: processes by pid, counting the reads a table makes."""

    def __init__(self) -> None:
        self.procs: dict[int, dict[str, Any]] = {}
        self.iter_calls = 0
        self.single_reads: list[int] = []
        self.port_reads: list[int] = []
        self.title_reads: list[int] = []
        self.stat_reads: list[int] = []  # the same-process checks of a rescan
        self.cursor = 100  # the kernel's last pid handed out (/proc/loadavg's last field)
        self.listings = 0  # psutil.pids() calls
        self.usage_reads: list[int] = []  # cpu_percent / memory_info reads

    def add(self, pid: int, name: str, cmdline: list[str], ppid: int = 1, ctime: float = OLD) -> None:
        self.procs[pid] = {"pid": pid, "ppid": ppid, "name": name, "cmdline": cmdline, "create_time": ctime}
        self.cursor += 1  # a new process takes a new pid (an exit moves nothing)

    def process(self, pid: int) -> Any:
        host = self

        class P:
            def __init__(self) -> None:
                if pid not in host.procs:
                    raise psutil.NoSuchProcess(pid)
                self.pid = pid
                self.info = dict(host.procs[pid])

            def as_dict(self, attrs: list[str], ad_value: Any = None) -> dict[str, Any]:
                host.single_reads.append(pid)
                return {k: host.procs[pid].get(k) for k in attrs}

            def name(self) -> str:
                if pid not in host.procs:
                    raise psutil.NoSuchProcess(pid)
                return str(host.procs[pid]["name"])

            def oneshot(self) -> Any:
                return contextlib.nullcontext()

            def ppid(self) -> int:
                if not self.is_running():  # psutil's pid-reuse check
                    raise psutil.NoSuchProcess(pid)
                return int(host.procs[pid]["ppid"])

            def is_running(self) -> bool:
                host.stat_reads.append(pid)
                return pid in host.procs and host.procs[pid]["create_time"] == self.info["create_time"]

            def cmdline(self) -> list[str]:
                host.title_reads.append(pid)  # a re-read of a young process starts here
                if pid not in host.procs:
                    raise psutil.NoSuchProcess(pid)
                return list(host.procs[pid]["cmdline"])

            def cpu_percent(self, interval: float | None = None) -> float:
                host.usage_reads.append(pid)
                return 3.0

            def memory_info(self) -> Any:
                return SimpleNamespace(rss=1000 + pid)

            def net_connections(self, kind: str = "tcp") -> list[Any]:
                host.port_reads.append(pid)
                return [SimpleNamespace(status=psutil.CONN_LISTEN, laddr=SimpleNamespace(port=8000))]

        return P()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def process_iter(attrs: Any = None, ad_value: Any = None) -> Any:
            self.iter_calls += 1
            return iter([self.process(pid) for pid in sorted(self.procs)])

        monkeypatch.setattr(processes.psutil, "process_iter", process_iter)

        def pids() -> list[int]:
            self.listings += 1
            return sorted(self.procs)

        monkeypatch.setattr(processes.psutil, "pids", pids)
        monkeypatch.setattr(processes.psutil, "Process", self.process)
        monkeypatch.setattr(processes, "_pid_cursor", lambda: str(self.cursor).encode())
        monkeypatch.setattr(processes, "_pid_listed", lambda pid: pid in self.procs)
        processes._SEEN.clear()


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    h = FakeHost()
    h.add(1, "systemd", ["/sbin/init"], ppid=0)
    h.add(10, "vllm", ["vllm", "serve", "m", "--port", "8000", "--api-key", "sk-secret"])
    h.add(11, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=10)
    h.add(12, "bash", ["bash"])
    h.install(monkeypatch)
    return h


def test_same_processes_as_a_one_shot_listing(host: FakeHost) -> None:
    table = ProcessTable()
    cached = table.read()
    oneshot = list_processes()
    strip = lambda ps: [(p.pid, p.vllm_role, p.cmdline, p.listen_ports, p.launch_model) for p in ps]  # noqa: E731
    assert strip(cached) == strip(oneshot)
    assert [p.pid for p in cached] == [10, 11]
    assert "sk-secret" not in " ".join(cached[0].cmdline)
    assert cached[0].listen_ports == [8000]


def test_between_rescans_only_new_pids_are_read(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=60.0, clock=lambda: now[0])
    table.read()
    assert table.rescans == 1
    host.single_reads.clear()
    for _ in range(5):
        now[0] += 1.0
        got = table.read()
    assert table.rescans == 1 and host.single_reads == []  # nothing new: no per-pid reads
    assert [p.pid for p in got] == [10, 11] and got[0].cpu_percent == 3.0  # counters still read
    host.add(20, "VLLM::Worker_TP0", ["VLLM::Worker_TP0"], ppid=10)
    del host.procs[11]
    now[0] += 1.0
    got = table.read()
    assert [p.pid for p in got] == [10, 20] and host.single_reads == [20] and table.rescans == 1
    now[0] += 60.0
    table.read()
    assert table.rescans == 2  # rescan_s elapsed


def test_gpu_pid_change_rescans_and_rereads_server_ports(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    table.note_gpu_pids({11})
    table.read()
    host.port_reads.clear()
    table.note_gpu_pids({11})  # unchanged
    now[0] += 1
    table.read()
    assert table.rescans == 1 and host.port_reads == []
    table.note_gpu_pids({11, 4000})  # an engine started
    now[0] += 1
    table.read()
    assert table.rescans == 2 and host.port_reads == [10]  # the API server's ports only


def test_a_young_process_that_retitles_itself_is_seen(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    table.read()
    host.add(
        30,
        "python3",
        ["python3", "-c", "from multiprocessing.spawn import spawn_main"],
        ppid=12,
        ctime=time.time(),
    )
    now[0] += 1
    assert 30 not in {p.pid for p in table.read()}  # a bash child, not vLLM (yet)
    host.procs[30].update(name="VLLM::EngineCor", cmdline=["VLLM::EngineCore"])  # setproctitle
    now[0] += 1
    got = {p.pid: p for p in table.read()}
    assert got[30].vllm_role == "engine_core" and table.rescans == 1


def test_only_young_python_processes_are_reread(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    host.add(40, "bash", ["bash", "-c", "sleep 9"], ctime=time.time())
    host.add(41, "python3", ["/usr/bin/python3.11", "worker.py"], ctime=time.time())
    table.read()
    for _ in range(3):
        now[0] += 1
        table.read()
    assert set(host.title_reads) == {41}  # bash does not become vLLM by setproctitle


def test_psutil_listing_failure_gives_a_rescan_not_an_error(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    table.read()

    def boom() -> list[int]:
        raise psutil.AccessDenied(0)

    monkeypatch.setattr(processes.psutil, "pids", boom)
    now[0] += 1
    assert [p.pid for p in table.read()] == [10, 11] and host.iter_calls == 2


def test_a_listed_pid_that_could_not_be_read_is_tried_again(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid psutil lists but cannot read yet (it vanished, or /proc raced) is read again on
    the next read, even when the listing did not change."""
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    table.read()
    host.add(50, "VLLM::Worker_TP1", ["VLLM::Worker_TP1"], ppid=10)
    make = host.process
    fail = [True]

    def flaky(pid: int) -> Any:
        if pid == 50 and fail[0]:
            raise psutil.NoSuchProcess(pid)
        return make(pid)

    monkeypatch.setattr(processes.psutil, "Process", flaky)
    now[0] += 1
    assert 50 not in {p.pid for p in table.read()}
    fail[0] = False
    now[0] += 1
    assert {p.pid: p.vllm_role for p in table.read()}[50] == "worker"
    assert table.rescans == 1


def test_a_young_process_is_no_longer_reread_once_old(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    wall = [time.time()]
    monkeypatch.setattr(processes, "time", SimpleNamespace(time=lambda: wall[0], sleep=time.sleep))
    table = ProcessTable(rescan_s=600.0, young_s=15.0, clock=lambda: now[0])
    host.add(41, "python3", ["/usr/bin/python3.11", "worker.py"], ctime=wall[0] - 10.0)
    table.read()
    for _ in range(3):
        now[0] += 1
        wall[0] += 1
        table.read()
    assert host.title_reads == [41, 41, 41]
    wall[0] += 5  # 16 s old
    for _ in range(3):
        now[0] += 1
        table.read()
    assert host.title_reads == [41, 41, 41]
    # a process that appears later, young, is re-read in its turn
    host.add(42, "python3", ["python3", "w.py"], ctime=wall[0])
    for _ in range(2):
        now[0] += 1
        table.read()
    assert host.title_reads == [41, 41, 41, 42]


def test_spawn_children_of_vllm_are_workers_as_in_a_one_shot_listing(host: FakeHost) -> None:
    spawn = [
        "python3",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main()",
        "--multiprocessing-fork",
    ]
    host.add(60, "python3", spawn, ppid=10)  # the server's V0 worker
    host.add(61, "python3", spawn, ppid=60)  # and its own child
    host.add(62, "python3", spawn, ppid=12)  # a child of bash: not vLLM's
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    roles = {p.pid: p.vllm_role for p in table.read()}
    assert roles == {p.pid: p.vllm_role for p in list_processes()}
    assert roles == {10: "api_server", 11: "engine_core", 60: "worker", 61: "worker"}
    scans = table.rescans
    host.add(63, "python3", spawn, ppid=61)  # appears between rescans
    now[0] += 1
    assert {p.pid: p.vllm_role for p in table.read()}[63] == "worker" and table.rescans == scans


def test_a_rescan_reads_again_only_the_processes_that_can_be_vllm(host: FakeHost) -> None:
    """systemd and bash are checked (same start time, name and parent: one stat read), not
    read again in full; the vLLM processes and every python process are."""
    host.add(13, "python3", ["python3", "tool.py"])
    now = [0.0]
    table = ProcessTable(rescan_s=60.0, clock=lambda: now[0])
    table.read()
    host.single_reads.clear()
    host.stat_reads.clear()
    now[0] += 60.0
    assert [p.pid for p in table.read()] == [10, 11] and table.rescans == 2
    assert sorted(host.single_reads) == [10, 11, 13]
    assert sorted(set(host.stat_reads)) == [1, 12]


def test_a_process_that_execs_into_vllm_is_seen_at_the_next_rescan(host: FakeHost) -> None:
    """An entrypoint script that ends in `exec vllm serve`: same pid and start time, a new
    name and command line."""
    host.add(70, "entrypoint.sh", ["/bin/sh", "/entrypoint.sh"])
    now = [0.0]
    table = ProcessTable(rescan_s=60.0, clock=lambda: now[0])
    assert 70 not in {p.pid for p in table.read()}
    host.procs[70].update(name="vllm", cmdline=["vllm", "serve", "m", "--port", "8001"])
    now[0] += 60.0
    got = {p.pid: p for p in table.read()}
    assert got[70].vllm_role == "api_server" and got[70].listen_ports == [8000]


def test_an_old_python_process_that_retitles_itself_is_seen_at_the_next_rescan(host: FakeHost) -> None:
    host.add(71, "python3", ["python3", "-m", "myengine"])  # old: not re-read between rescans
    now = [0.0]
    table = ProcessTable(rescan_s=60.0, clock=lambda: now[0])
    assert 71 not in {p.pid for p in table.read()}
    host.procs[71].update(name="VLLM::EngineCor", cmdline=["VLLM::EngineCore"])
    now[0] += 1.0
    assert 71 not in {p.pid for p in table.read()}  # between rescans: not young, not re-read
    now[0] += 60.0
    assert {p.pid: p.vllm_role for p in table.read()}[71] == "engine_core"


def test_a_kernel_thread_pid_reused_by_vllm_is_read_again(host: FakeHost) -> None:
    """A kernel thread is only checked for pid reuse (start time); a vLLM server that got its
    pid after it exited is read in full."""
    host.add(80, "kworker/0:1-events", [], ppid=2)
    now = [0.0]
    table = ProcessTable(rescan_s=60.0, clock=lambda: now[0])
    table.read()
    host.single_reads.clear()
    now[0] += 60.0
    table.read()
    assert 80 not in host.single_reads
    host.add(80, "vllm", ["vllm", "serve", "m"], ppid=1, ctime=OLD + 5)  # same pid, a new process
    now[0] += 60.0
    assert {p.pid: p.vllm_role for p in table.read()}[80] == "api_server" and 80 in host.single_reads


# --------------------------------------------------------------------------- no listing while no pid appears


def test_no_listing_while_the_pid_cursor_stays(host: FakeHost) -> None:
    """Between rescans /proc is listed only after a new pid appeared (the pid cursor moved):
    an unchanged host costs no listing, a new process is still seen on the next read."""
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    table.read()
    now[0] += 1
    table.read()  # the first read between rescans lists /proc and keeps the cursor
    host.listings = 0
    for _ in range(5):
        now[0] += 1
        got = table.read()
    assert host.listings == 0 and table.listings_skipped == 5
    assert [p.pid for p in got] == [10, 11] and got[0].cpu_percent == 3.0  # counters still read
    host.add(20, "VLLM::Worker_TP0", ["VLLM::Worker_TP0"], ppid=10)
    now[0] += 1
    assert [p.pid for p in table.read()] == [10, 11, 20] and host.listings == 1


def test_a_vllm_process_that_exits_is_dropped_without_a_new_pid(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 1
        table.read()
    del host.procs[11]  # the engine core exits; no pid is handed out
    now[0] += 1
    assert [p.pid for p in table.read()] == [10] and table.rescans == 1


def test_the_same_processes_with_and_without_the_cursor(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Differential: a table that skips listings while the cursor stays and one that lists
    /proc on every read (no cursor) give the same processes over a run of exits, starts,
    retitles and unreadable pids."""
    now = [0.0]
    wall = [time.time()]
    monkeypatch.setattr(processes, "time", SimpleNamespace(time=lambda: wall[0], sleep=time.sleep))
    cursor = processes._pid_cursor
    skipping = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    listing = ProcessTable(rescan_s=600.0, clock=lambda: now[0])
    spawn = ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    steps: list[Any] = [
        lambda: None,
        lambda: host.add(13, "python3", ["python3", "tool.py"], ctime=wall[0]),
        lambda: host.procs.pop(12),  # bash exits: no new pid
        lambda: host.procs[13].update(name="VLLM::Worker_TP0", cmdline=["VLLM::Worker_TP0"]),
        lambda: host.add(60, "python3", spawn, ppid=10),
        lambda: host.procs.pop(13),  # a worker exits
        lambda: host.procs.pop(60),
        lambda: host.add(61, "VLLM::Worker_TP1", ["VLLM::Worker_TP1"], ppid=10),
        lambda: host.procs.pop(10),  # the server exits, its engine core stays
        lambda: None,
    ]
    strip = lambda ps: [(p.pid, p.vllm_role, p.name, p.cmdline, p.rss_bytes) for p in ps]  # noqa: E731
    for step in steps:
        step()
        now[0] += 1
        wall[0] += 1
        monkeypatch.setattr(processes, "_pid_cursor", cursor)
        a = skipping.read()
        monkeypatch.setattr(processes, "_pid_cursor", lambda: None)
        b = listing.read()
        assert strip(a) == strip(b)
    assert skipping.listings_skipped > 0 and listing.listings_skipped == 0


def test_the_pid_cursor_of_this_host() -> None:
    """The real cursor (/proc/loadavg): it moves when a process starts; None where it cannot
    be trusted. /proc/PID of a live pid is listed, of a reaped one not."""
    import subprocess
    import sys

    before = processes._pid_cursor()
    if before is None:
        pytest.skip("this procfs gives no usable pid cursor")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert processes._pid_cursor() != before
    assert processes._pid_listed(child.pid) is False
    import os

    assert processes._pid_listed(os.getpid()) is True


def test_no_cursor_from_another_namespaces_procfs_or_a_still_field(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A procfs whose /proc/self is not this process (another PID namespace's, e.g. the
    host's mounted into a container), or whose last-pid field does not move when a thread
    starts, gives no cursor: every read lists /proc."""
    import os

    (tmp_path / "loadavg").write_text("0.00 0.01 0.05 1/80 4242\n")
    monkeypatch.setattr(processes.psutil, "PROCFS_PATH", str(tmp_path))
    (tmp_path / "self").symlink_to("1")
    assert processes._open_cursor() is False
    (tmp_path / "self").unlink()
    (tmp_path / "self").symlink_to(str(os.getpid()))
    assert processes._open_cursor() is False  # 4242 stays when a thread starts


def test_vllm_process_usage_is_read_every_stats_s(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0], stats_s=5.0)
    first = table.read()
    assert [p.cpu_percent for p in first] == [None, None]  # psutil's counters only primed
    now[0] = 1.0
    second = table.read()  # no figure yet: read again at once, not stats_s later
    assert [p.cpu_percent for p in second] == [3.0, 3.0]
    host.usage_reads.clear()
    for t in (2.0, 3.0, 5.9):
        now[0] = t
        again = table.read()
        assert all(a is b for a, b in zip(again, second, strict=True))  # the same facts
    assert host.usage_reads == []
    now[0] = 6.0  # stats_s after the last read: read again, new facts
    fresh = table.read()
    assert sorted(host.usage_reads) == [10, 11]
    assert all(a is not b for a, b in zip(fresh, second, strict=True))


def test_usage_is_read_again_on_a_rescan_and_an_exit_is_seen_at_once(host: FakeHost) -> None:
    now = [0.0]
    table = ProcessTable(rescan_s=600.0, clock=lambda: now[0], stats_s=5.0)
    table.read()
    now[0] = 1.0
    table.read()
    host.usage_reads.clear()
    now[0] = 2.0
    table.note_gpu_pids({10})
    table.note_gpu_pids({10, 11})  # NVML's GPU pids changed: a full rescan
    table.read()
    assert table.rescans == 2 and sorted(host.usage_reads) == [10, 11]
    del host.procs[11]  # the engine core exits within stats_s of its last read
    now[0] = 3.0
    assert [p.pid for p in table.read()] == [10]
