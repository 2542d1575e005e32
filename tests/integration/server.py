"""Start, drive and stop a real vLLM OpenAI server (the CPU build of :mod:`vllm_env`).

Everything binds 127.0.0.1. The server runs in its own session (process group) so stopping it
also ends its EngineCore child; its stdout and stderr go to one log file, as ``vllm serve >
vllm.log 2>&1`` would. The load generator is bounded in requests, concurrency and time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.integration.vllm_env import VllmEnv

#: generous: the machine's CPUs are shared and a cold start imports torch and compiles (100-160 s
#: on 2 loaded cores; two failing startups side by side took 3.5 min): bounds for a hang only.
STARTUP_TIMEOUT_S = 480.0
#: a startup that fails (KV too small) still loads the model and compiles first.
FAILURE_TIMEOUT_S = 480.0
#: the last line vLLM's API server prints when its engine core did not start
STARTUP_FAILED = "Engine core initialization failed"
#: seconds a failed server gets to exit by itself before it is stopped
EXIT_GRACE_S = 20.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The server's niceness. On a GPU host the inference runs on the GPU and the CPU is free for
#: the tools watching it; the CPU build does that work on the host's cores, and under the
#: pressure tests (32 clients on 2 cores) it starved kvdoctor and the test itself (a
#: `kvdoctor sidecar --help` took over 60 s, a 30 s capture window read 3 pages). At nice 10
#: the server still gets every cycle the tools leave idle: the load, the KV pressure and the
#: preemptions are the same.
SERVER_NICE = 10


def server_env(env: VllmEnv, cache_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server runs in: offline hub, 1 GiB CPU KV space (vLLM's CPU default
    takes ~21 GB of RAM), no usage stats, a private cache, stats logged every 2 s."""
    out = dict(os.environ)
    for name in list(out):
        if name.startswith(("VLLM_", "HF_", "CUDA_")):
            del out[name]
    out.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache_dir),
            "VLLM_LOG_STATS_INTERVAL": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    out.update(extra or {})
    return out


def base_args(env: VllmEnv, port: int, served_name: str = "tiny") -> list[str]:
    """The launch command's head: the api_server module, the model, 127.0.0.1, float32 (bf16 +
    eager + a tiny first request crashed the CPU worker with SIGILL)."""
    return [
        str(env.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(env.model),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]


@dataclass
class VllmServer:
    """One real server process. ``argv`` is its full command line, ``log`` its output file."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    port: int
    served_name: str = "tiny"
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Launch the process (returns at once), at nice 10 (:data:`SERVER_NICE`)."""
        self.started_at = time.monotonic()
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        try:
            # before it forks its engine core (seconds of imports away): the children inherit it
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, SERVER_NICE)
        except OSError:
            pass  # not allowed here: the server runs at the test's priority

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Until ``/health`` answers 200; RuntimeError with the log's tail if the process exits
        or ``timeout`` seconds pass."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float = FAILURE_TIMEOUT_S, *, failed_marker: str = STARTUP_FAILED) -> int:
        """Wait for a failing startup to end; returns the exit code. Once the log shows
        ``failed_marker`` (vLLM's "Engine core initialization failed"), the process gets
        ``EXIT_GRACE_S`` to exit by itself and is then stopped (on busy CPUs its shutdown can take
        minutes). RuntimeError when neither happened within ``timeout``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self._reap_group()
                return rc
            if failed_at is None and failed_marker in self.log_tail(5):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > EXIT_GRACE_S:
                self.stop()
                return self.proc.returncode if self.proc.returncode is not None else -1
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM neither failed nor exited within {timeout:.0f} s:\n{self.log_tail()}")

    def _reap_group(self) -> None:
        # The EngineCore child shares the session: end what is left of this server's group only.
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout`` s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._reap_group()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_server(
    env: VllmEnv, workdir: Path, args: list[str], *, name: str, extra_env: dict[str, str] | None = None
) -> VllmServer:
    """A server on a free port with ``args`` after :func:`base_args`, logging to
    ``workdir/NAME.log``; started, not yet ready."""
    port = free_port()
    cache = workdir / f"{name}-cache"
    cache.mkdir(parents=True, exist_ok=True)
    srv = VllmServer(
        argv=[*base_args(env, port), *args],
        env=server_env(env, cache, extra_env),
        log=workdir / f"{name}.log",
        port=port,
    )
    srv.start()
    return srv


@dataclass
class Load:
    """A bounded load: ``concurrency`` client threads each sending completions back to back until
    ``duration_s`` has passed (requests in flight then finish or time out). Counts what happened."""

    url: str
    model: str
    concurrency: int = 32
    duration_s: float = 30.0
    max_tokens: int = 96
    prompt_words: int = 40
    request_timeout_s: float = 120.0
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _worker(self, i: int) -> None:
        prompt = " ".join(f"the cache block {i} token memory" for _ in range(self.prompt_words // 5))
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        deadline = time.monotonic() + self.duration_s
        with httpx.Client(timeout=self.request_timeout_s) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                with self._lock:
                    self.sent += 1
                try:
                    r = client.post(f"{self.url}/v1/completions", json=body)
                    ok = r.status_code == 200
                    err = "" if ok else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    ok, err = False, f"{type(e).__name__}: {e}"
                with self._lock:
                    if ok:
                        self.ok += 1
                    else:
                        self.failed += 1
                        if len(self.errors) < 5:
                            self.errors.append(err)

    def start(self) -> Load:
        """Start the client threads; returns self."""
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait for the threads (stop sending first when ``timeout`` is given and passes)."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        self._stop.set()

    def stop(self) -> None:
        """Send no new requests; those in flight finish."""
        self._stop.set()
