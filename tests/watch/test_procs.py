"""The process view: every GPU process with what kvdoctor calls it, sortable; K sends SIGTERM
to the processes the report calls orphaned, after a confirmation naming each pid and command
line — live only, never on a replay or a bundle."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from kvdoctor.facts import Gpu, GpuProcess, HostProcess, Snapshot, SourceStatus
from kvdoctor.watch import procs
from kvdoctor.watch.app import ConfirmTerminateScreen, ProcessScreen, WatchApp

from .conftest import make_app, screen_lines, wait_for

GiB = 2**30


class _HostFeed:
    """A live feed of one GPU holding an orphaned vLLM worker (``orphan``: a real process) and
    a foreign job (``job``, another real process), with no vLLM server running."""

    live = True
    label = "live"

    def __init__(self, orphan: subprocess.Popen, job: subprocess.Popen) -> None:
        self.orphan, self.job = orphan, job

    def next(self) -> Snapshot:
        now = time.time()
        return Snapshot(
            timestamp=now,
            gpus=[
                Gpu(
                    index=0,
                    name="NVIDIA H100 80GB HBM3",
                    memory_total_bytes=80 * GiB,
                    memory_used_bytes=30 * GiB,
                    processes=[
                        GpuProcess(pid=self.orphan.pid, name="VLLM::Worker_TP0", used_bytes=19 * GiB),
                        GpuProcess(pid=self.job.pid, name="python", used_bytes=10 * GiB),
                    ],
                )
            ],
            processes=[
                HostProcess(pid=self.orphan.pid, ppid=1, name="python", cmdline=["python", "-c", "orphan"]),
                HostProcess(pid=self.job.pid, ppid=1, name="python", cmdline=["python", "train.py"]),
            ],
            process_table_known=True,
            sources=[SourceStatus("nvml", "NVML", "ok", ""), SourceStatus("processes", "psutil", "ok", "")],
        )

    def close(self) -> None:
        pass


def _sleeper(tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(120)  # {tag}"])


def test_process_view_and_sigterm_after_confirmation(pipeline):
    orphan, job = _sleeper("orphan"), _sleeper("job")
    try:

        async def go():
            app = WatchApp(_HostFeed(orphan, job), pipeline, interval_s=0.5, host="test-host")
            async with app.run_test(size=(120, 30)) as pilot:
                await wait_for(pilot, lambda: app.view is not None and app.view.findings)
                assert "orphaned-engine-processes" in {r.finding.rule for r in app.view.findings}
                await pilot.press("t")
                await wait_for(pilot, lambda: isinstance(app.screen, ProcessScreen))
                screen = app.screen
                # psutil's figures for the shown pids arrive (user, RSS, the command line)
                await wait_for(pilot, lambda: any(r.user for r in screen.rows), timeout=10)
                roles = {r.pid: r.role for r in screen.rows}
                assert roles == {orphan.pid: "orphan", job.pid: "foreign"}
                row = next(r for r in screen.rows if r.pid == orphan.pid)
                assert row.gpu_bytes == 19 * GiB and row.rss_bytes and "# orphan" in row.command
                text = "\n".join(screen_lines(app.export_screenshot()))
                assert "ORPHAN" not in text and "orphan" in text and "K sends SIGTERM" in text
                await wait_for(pilot, lambda: screen._load is not None)
                screen._fill()
                assert "host CPU" in str(screen.query_one("#proc-title").render())
                # sorted by GPU memory (biggest first), then s cycles the column
                assert [r.pid for r in screen.rows] == [orphan.pid, job.pid]
                await pilot.press("s")
                assert screen.sort_by == "cpu_percent"
                # K asks first, naming the pid and its command line; n does nothing
                await pilot.press("K")
                await wait_for(pilot, lambda: isinstance(app.screen, ConfirmTerminateScreen))
                ask = "\n".join(screen_lines(app.export_screenshot()))
                assert f"pid {orphan.pid}" in ask and "# orphan" in ask
                assert f"pid {job.pid}" not in ask  # the foreign job is not offered
                await pilot.press("n")
                await wait_for(pilot, lambda: isinstance(app.screen, ProcessScreen))
                await pilot.pause(0.3)
                assert orphan.poll() is None
                # K, y: SIGTERM to the orphan only
                await pilot.press("K")
                await wait_for(pilot, lambda: isinstance(app.screen, ConfirmTerminateScreen))
                await pilot.press("y")
                await wait_for(pilot, lambda: orphan.poll() is not None, timeout=10)
                assert orphan.returncode == -15 and job.poll() is None
                await wait_for(pilot, lambda: any("SIGTERM sent" in n.message for n in app._notifications))
                await pilot.press("escape")
                assert not isinstance(app.screen, ProcessScreen)

        asyncio.run(go())
    finally:
        for p in (orphan, job):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_no_signal_key_on_a_replay(demo_feed, pipeline):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            await pilot.press("t")
            await wait_for(pilot, lambda: isinstance(app.screen, ProcessScreen))
            await pilot.pause(0.2)
            screen = app.screen
            roles = {r.role for r in screen.rows}
            assert {"engine", "foreign"} <= roles
            assert screen.check_action("terminate", ()) is False
            assert "SIGTERM" not in screen_lines(app.export_screenshot())[-1]
            await pilot.press("K")
            await pilot.pause(0.2)
            assert isinstance(app.screen, ProcessScreen)  # no confirmation: nothing to signal here

    asyncio.run(go())


def test_orphans_come_from_the_finding_not_from_names():
    """The rule's `kill` list names the orphans; a process name that spells "pid N (" cannot
    add another pid (only vLLM-named GPU processes count)."""
    from kvdoctor.findings import Evidence, Finding
    from kvdoctor.watch.controller import FindingRow, View

    f = Finding(
        rule=procs.ORPHAN_RULE,
        severity="critical",
        family="P",
        title="t",
        summary="Free the memory with `kill 4242 4243` (then `kill -9` if they linger)",
        evidence=[Evidence("orphaned processes", "pid 4242 (x, pid 1 (y) 1 GiB on GPU 0", "nvml")],
    )
    gpu = Gpu(
        index=0,
        processes=[
            GpuProcess(4242, "VLLM::Worker_TP0", GiB),
            GpuProcess(4243, "VLLM::Worker_TP1", GiB),
            GpuProcess(1, "systemd", GiB),
        ],
    )
    view = View(index=0, now=0.0, snapshot=Snapshot(gpus=[gpu]), report=None, findings=[FindingRow(f, 0.0)])
    assert procs.orphan_pids(view) == {4242, 4243}
    # report/2: the fix's command is the list
    from kvdoctor.findings import Fix

    f.fixes = [Fix(commands=("kill 4243",))]
    assert procs.orphan_pids(view) == {4243}
    f.fixes = []
    f.summary = "a wording with no kill list"
    assert procs.orphan_pids(view) == {4242}
    # resolved: no orphan any more
    view.findings[0].resolved_at = 1.0
    assert procs.orphan_pids(view) == set()
