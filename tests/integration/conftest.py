"""Fixtures of the integration tier: the vLLM venv and tiny model (built once per machine), real
servers, and kvdoctor run as a user runs it (its console script, in a subprocess).

Every test here carries the ``integration`` marker, which the default ``pytest`` run deselects
(pyproject addopts); ``.ci/run`` runs ``pytest -m integration tests/integration``. The tier skips
(with the reason) only when the venv cannot be built; ``KVDOCTOR_IT_REQUIRE=1`` (set by
``.ci/run``) turns that into a failure. ``KVDOCTOR_IT_PIN=1`` rewrites the pinned real-server
record under ``tests/data/real-vllm-<version>/`` from this run; ``KVDOCTOR_IT_KEEP=1`` keeps the
work directory (server logs, scrapes, reports) after the session.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import vllm_env
from tests.integration.server import STARTUP_TIMEOUT_S, VllmServer, start_server

REPO = Path(__file__).resolve().parents[2]
PIN_DIR = REPO / "tests" / "data" / f"real-vllm-{vllm_env.VLLM_VERSION}"
#: The pressure server: 4 KV blocks of 128 tokens (one is vLLM's null block) at max-model-len
#: 256, so a few 220-token requests already overflow the cache and preempt each other.
PRESSURE_ARGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "4"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def vllm() -> vllm_env.VllmEnv:
    """The built environment with this checkout of kvdoctor installed into it (so vLLM loads
    the stat-logger plugin)."""
    t0 = time.monotonic()
    try:
        env = vllm_env.ensure()
        vllm_env.install_kvdoctor(env)
    except vllm_env.BuildError as e:
        if os.environ.get("KVDOCTOR_IT_REQUIRE") == "1":
            pytest.fail(f"the vLLM venv cannot be built: {e}")
        pytest.skip(f"the vLLM venv cannot be built ({e}); the integration tier needs it")
    print(f"[it] vLLM {env.version} env ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return env


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    """Logs, scrapes and reports of this run, in a directory of its own: pytest's shared
    basetemp keeps only the newest three runs of any pytest on the machine, and other runs
    would delete this one's server logs mid-session. Removed at the end unless
    ``KVDOCTOR_IT_KEEP=1``."""
    path = Path(tempfile.mkdtemp(prefix="kvdoctor-it-"))
    print(f"[it] work directory {path}", file=sys.stderr)
    yield path
    if os.environ.get("KVDOCTOR_IT_KEEP") != "1":
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(vllm: vllm_env.VllmEnv, workdir: Path) -> Iterator[VllmServer]:
    """One real server (the pressure configuration) for a test module, stopped after it. The
    in-process plugin evaluates every 4 s."""
    srv = start_server(vllm, workdir, PRESSURE_ARGS, name="server", extra_env={"KVDOCTOR_VLLM_INTERVAL": "4"})
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        print(f"[it] server ready in {srv.ready_after_s:.0f} s", file=sys.stderr)
        pin("cmdline.txt", shlex.join(srv.argv) + "\n")
        yield srv
    finally:
        srv.stop()


def kvdoctor(*args: str, timeout: float = 240.0, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the kvdoctor console script of the test venv, as a user would."""
    exe = Path(sys.executable).with_name("kvdoctor")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvdoctor"]
    return subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        stdin=subprocess.DEVNULL,
    )


def kvdoctor_json(*args: str, timeout: float = 240.0) -> dict[str, Any]:
    """``kvdoctor ARGS --format json`` → the report (asserts an exit code of the spec and JSON)."""
    out = kvdoctor(*args, "--format", "json", timeout=timeout)
    assert out.returncode in (0, 1, 2), f"exit {out.returncode}: {out.stderr[-2000:]}"
    doc: dict[str, Any] = json.loads(out.stdout)
    assert doc["exit_code"] == out.returncode
    return doc


@functools.cache
def has_command(name: str) -> bool:
    """True when ``kvdoctor NAME --help`` exists on this checkout (asked once a session: ask
    before a load starts, whose starved 2-core box once ran a 0.3 s ``watch --help`` past 60 s)."""
    return kvdoctor(name, "--help", timeout=60).returncode == 0


def pin(name: str, source: Path | str) -> None:
    """With ``KVDOCTOR_IT_PIN=1``: copy a file (or write text) into the pinned record."""
    if os.environ.get("KVDOCTOR_IT_PIN") != "1":
        return
    dest = PIN_DIR / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, Path):
        shutil.copyfile(source, dest)
    else:
        dest.write_text(source)
