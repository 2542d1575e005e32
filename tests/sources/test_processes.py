"""Host processes (sources/processes.py): role detection, a real fake-`vllm serve` child through
psutil, psutil errors, and ps.txt / top output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from kvdoctor.facts import HostProcess, SourceError
from kvdoctor.sources import processes
from kvdoctor.sources.processes import (
    host_process_from_strings,
    is_vllm_server_cmdline,
    list_processes,
    metrics_url_for,
    parse_ps_text,
    process_table,
    vllm_role,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "cmdline"

FAKE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1]))); s.listen()
print("ready", flush=True)
time.sleep(30)
"""
FAKE_ENGINE = """
import sys, time
with open("/proc/self/comm", "w") as f:  # what setproctitle does to comm
    f.write("VLLM::EngineCor")
print("ready", flush=True)
time.sleep(30)
"""


# --------------------------------------------------------------------------- roles


@pytest.mark.parametrize(
    "name,cmdline,role",
    [
        ("vllm", "/usr/bin/python3 /usr/local/bin/vllm serve org/m --port 8000", "api_server"),
        ("vllm", "vllm serve org/m", "api_server"),
        ("python3", "python3 -m vllm.entrypoints.openai.api_server --model org/m", "api_server"),
        ("python", "python -u -X dev -m vllm.entrypoints.api_server --model org/m", "api_server"),
        ("python3.12", "python3.12 /x/vllm/entrypoints/openai/api_server.py --model m", "api_server"),
        ("VLLM::EngineCor", "VLLM::EngineCore_DP0", "engine_core"),
        ("VLLM::EngineCor", "", "engine_core"),
        ("VLLM::Worker_TP", "VLLM::Worker_TP1", "worker"),
        ("VLLM::Worker_DP", "VLLM::Worker_DP0_TP1", "worker"),
        ("python3", "VllmWorkerProcess", "worker"),
        ("ray::RayWorkerW", "ray::RayWorkerWrapper", "worker"),
        ("VLLM::APIServer", "VLLM::APIServer", "api_server"),
        ("VLLM::DPCoordin", "VLLM::DPCoordinator", "coordinator"),
        ("grep", "grep vllm serve", None),
        ("kvdoctor", "kvdoctor diagnose --log vllm.log", None),
        ("tini", "/usr/bin/tini -- vllm serve m", None),
        ("python3", "python3 -c import vllm", None),
        ("python3", "python3 -m pip install vllm", None),
        ("bash", "", None),
    ],
)
def test_roles(name: str, cmdline: str, role: str | None) -> None:
    hp = host_process_from_strings(1, name, cmdline)
    assert hp.vllm_role == role
    assert vllm_role(name, cmdline.split()) == role


def test_is_vllm_server_cmdline_edges() -> None:
    assert not is_vllm_server_cmdline([])
    assert not is_vllm_server_cmdline(["python3"])
    assert not is_vllm_server_cmdline(["vllm"])
    assert not is_vllm_server_cmdline(["python3", "-m"])


def test_host_process_from_strings_redacts() -> None:
    hp = host_process_from_strings(7, "vllm", "vllm serve m --api-key hunter2 --port 9000")
    assert hp.cmdline[-3:] == ["***", "--port", "9000"]
    assert "hunter2" not in hp.cmdline


# --------------------------------------------------------------------------- metrics URL


@pytest.mark.parametrize(
    "cmdline,ports,url",
    [
        ("vllm serve m --port 8200", [8200, 43111], "http://127.0.0.1:8200/metrics"),
        ("vllm serve m --port 8200", [], "http://127.0.0.1:8200/metrics"),
        ("vllm serve m --port=8200 --host 10.0.0.5", [], "http://10.0.0.5:8200/metrics"),
        ("vllm serve m --host 0.0.0.0", [8000, 39000], "http://127.0.0.1:8000/metrics"),
        ("vllm serve m --host ::1 --port 9", [9], "http://[::1]:9/metrics"),
        ("vllm serve m", [], "http://127.0.0.1:8000/metrics"),
        ("vllm serve m", [41000, 40000], "http://127.0.0.1:40000/metrics"),
        ("VLLM::APIServer", [], None),
        ("VLLM::APIServer", [8100], "http://127.0.0.1:8100/metrics"),
    ],
)
def test_metrics_url(cmdline: str, ports: list[int], url: str | None) -> None:
    name = cmdline.split()[0]
    hp = host_process_from_strings(1, name, cmdline)
    hp.listen_ports = ports
    assert metrics_url_for(hp) == url


def test_metrics_url_none_for_engine_and_others() -> None:
    assert (
        metrics_url_for(
            HostProcess(pid=1, name="VLLM::EngineCor", vllm_role="engine_core", listen_ports=[8000])
        )
        is None
    )
    assert metrics_url_for(HostProcess(pid=1, name="bash")) is None


# --------------------------------------------------------------------------- live psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    script = tmp_path / "vllm"
    script.write_text(FAKE_SERVER)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "serve",
            "fake/model",
            "--port",
            str(port),
            "--api-key",
            "s3cr3t-value",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def test_live_fake_vllm_server(fake_server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = fake_server
    found = [p for p in list_processes() if p.pid == proc.pid]
    assert len(found) == 1
    hp = found[0]
    assert hp.vllm_role == "api_server"
    assert hp.ppid == os.getpid()
    assert "s3cr3t-value" not in hp.cmdline and "***" in hp.cmdline
    assert hp.rss_bytes and hp.rss_bytes > 1_000_000
    assert hp.create_time and abs(hp.create_time - time.time()) < 120
    assert port in hp.listen_ports
    assert metrics_url_for(hp) == f"http://127.0.0.1:{port}/metrics"
    assert hp.cpu_percent is None  # first sight: psutil's first cpu_percent() is meaningless
    again = [p for p in list_processes() if p.pid == proc.pid][0]
    assert again.cpu_percent is not None and again.cpu_percent >= 0.0
    assert proc.pid in process_table()
    # this test process is not vLLM: not listed by default, listed with include_all
    assert os.getpid() not in {p.pid for p in list_processes()}
    everyone = {p.pid: p for p in list_processes(include_all=True)}
    assert everyone[os.getpid()].vllm_role is None


def test_cpu_interval_gives_values_on_first_call(fake_server: tuple[subprocess.Popen[str], int]) -> None:
    proc, _port = fake_server
    processes._SEEN.clear()
    hp = [p for p in list_processes(cpu_interval=0.05) if p.pid == proc.pid][0]
    assert hp.cpu_percent is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/comm is Linux")
def test_live_engine_core_by_title(tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(FAKE_ENGINE)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        hp = [p for p in list_processes() if p.pid == proc.pid][0]
        assert hp.vllm_role == "engine_core" and hp.name == "VLLM::EngineCor"
        assert metrics_url_for(hp) is None
    finally:
        proc.kill()
        proc.wait()


class _FakeProc:
    """A psutil.Process stand-in whose reads fail the way psutil fails."""

    def __init__(self, pid: int, info: dict[str, Any] | None, error: type[Exception] | None = None) -> None:
        self.pid = pid
        self._info = info
        self._error = error

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            raise psutil.NoSuchProcess(self.pid)
        return self._info

    def _fail(self, *a: object, **k: object) -> Any:
        assert self._error is not None
        if self._error is psutil.ZombieProcess:
            raise psutil.ZombieProcess(self.pid)
        raise self._error(self.pid)

    def cpu_percent(self, interval: float | None = None) -> float:
        if self._error:
            return self._fail()  # type: ignore[no-any-return]
        return 5.0

    def memory_info(self) -> Any:
        if self._error:
            return self._fail()
        return SimpleNamespace(rss=123)

    def net_connections(self, kind: str = "tcp") -> list[Any]:
        if self._error:
            return self._fail()  # type: ignore[no-any-return]
        return []


@pytest.mark.parametrize("error", [psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess])
def test_psutil_errors_become_none(monkeypatch: pytest.MonkeyPatch, error: type[Exception]) -> None:
    info = {
        "pid": 4242,
        "ppid": 1,
        "name": "vllm",
        "cmdline": ["vllm", "serve", "m", "--port", "8123"],
        "create_time": 1.0,
    }
    fakes = [
        _FakeProc(4242, info, error),
        _FakeProc(4243, None),  # vanished before its info could be read
        _FakeProc(
            4244, {"pid": 4244, "ppid": 1, "name": "VLLM::Worker_TP", "cmdline": None, "create_time": None}
        ),
    ]
    monkeypatch.setattr(processes.psutil, "process_iter", lambda *a, **k: iter(fakes))
    processes._SEEN.clear()
    for _ in range(2):  # the second call reads cpu_percent from the kept object
        out = {p.pid: p for p in list_processes()}
    assert set(out) == {4242, 4244}
    hp = out[4242]
    assert (hp.cpu_percent, hp.rss_bytes, hp.listen_ports) == (None, None, [])
    assert hp.vllm_role == "api_server"
    assert metrics_url_for(hp) == "http://127.0.0.1:8123/metrics"  # from --port when ports are unreadable
    assert (out[4244].vllm_role, out[4244].cpu_percent, out[4244].rss_bytes) == ("worker", 5.0, 123)
    processes._SEEN.clear()


def test_process_table_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[int]:
        raise psutil.AccessDenied(0)

    monkeypatch.setattr(processes.psutil, "pids", boom)
    assert process_table() == set()


# --------------------------------------------------------------------------- ps.txt / top


def test_ps_txt_b26_style() -> None:
    procs = {p.pid: p for p in parse_ps_text((DATA / "ps.txt").read_text(), origin="ps.txt")}
    assert len(procs) == 6
    api = procs[4242]
    assert (api.vllm_role, api.ppid, api.cpu_percent, api.rss_bytes) == (
        "api_server",
        1,
        12.5,
        2150400 * 1024,
    )
    assert api.name == "vllm"
    assert "hunter2" not in api.cmdline and api.cmdline[-1] == "***"
    assert metrics_url_for(api) == "http://127.0.0.1:8000/metrics"
    assert (procs[4301].vllm_role, procs[4301].name) == ("engine_core", "VLLM::EngineCor")
    assert procs[4388].vllm_role == "worker" and procs[4389].vllm_role == "worker"
    assert procs[1].vllm_role is None and procs[5120].vllm_role is None
    assert all(p.create_time is None for p in procs.values())


def test_ps_txt_v0_spawn_workers() -> None:
    procs = {p.pid: p for p in parse_ps_text((DATA / "ps-v0.txt").read_text())}
    assert procs[700].vllm_role == "api_server"
    assert procs[733].vllm_role == "worker"  # spawn child of the server
    assert procs[800].vllm_role is None  # spawn child of someone else


def test_top_output() -> None:
    procs = {p.pid: p for p in parse_ps_text((DATA / "top.txt").read_text(), origin="top.txt")}
    assert set(procs) == {4301, 4242, 77}
    assert procs[4301].vllm_role == "engine_core"
    assert procs[4301].rss_bytes == 5 * 1024**3
    assert procs[4301].cpu_percent == 99.8
    assert procs[4242].rss_bytes == int(2.1 * 1024**3)
    assert procs[77].rss_bytes == 4000 * 1024
    assert procs[4242].vllm_role is None  # top shows only "vllm", not the serve args


def test_ps_aux_format() -> None:
    text = (
        "USER  PID %CPU %MEM    VSZ   RSS TTY STAT START   TIME COMMAND\n"
        "root  900 50.0  1.0 100000 20480 ?   Sl   10:00   1:00 python3 -m vllm.entrypoints.openai.api_server --model m --api-key k\n"
    )
    (hp,) = parse_ps_text(text)
    assert (hp.pid, hp.vllm_role, hp.rss_bytes, hp.name) == (900, "api_server", 20480 * 1024, "python3")
    assert hp.cmdline[-1] == "***"


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "no ps/top header"),
        ("hello world\n", "no ps/top header"),
        ("PID COMMAND\nabc bash\n", "PID number"),
        ("PID COMMAND\n1 bash\x00\x01\n", "binary"),
        ("\x7fELF\x00\x00", "binary"),
    ],
)
def test_ps_garbage(text: str, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        parse_ps_text(text, origin="ps.txt")
