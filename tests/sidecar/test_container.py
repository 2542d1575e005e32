"""Sampling vLLM from a sidecar container: /proc of a shared PID namespace (a fake /proc tree
here) and GPUs attributed by UUID."""

from __future__ import annotations

from pathlib import Path

from kvdoctor.facts import Gpu
from kvdoctor.sources.container import gpu_indices_for, vllm_processes

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def proc(root: Path, pid: int, argv: list[str], env: dict[str, str] | None = None) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    if env is not None:
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    return d


def test_reads_vllm_cmdline_env_and_config_through_proc(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    d = proc(
        root,
        7,
        [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/llama",
            "--api-key",
            "sk-x",
        ],
        {"NVIDIA_VISIBLE_DEVICES": UUID1, "HF_TOKEN": "hf_secretsecret", "PATH": "/bin"},
    )
    (d / "root" / "models" / "llama").mkdir(parents=True)
    (d / "root" / "models" / "llama" / "config.json").write_text("{}")
    proc(root, 3, ["/pause"])
    proc(root, 9, ["/usr/bin/kvdoctor", "sidecar"], {"HOME": "/"})
    (root / "self").mkdir()
    (p,) = vllm_processes(root)
    assert p.pid == 7 and "sk-x" not in " ".join(p.cmdline)
    assert p.env == {"NVIDIA_VISIBLE_DEVICES": UUID1}  # nothing else kept, no token
    assert p.config_path == d / "root" / "models" / "llama" / "config.json"


def test_unreadable_or_vanished_processes_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    proc(root, 5, ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"])  # no environ: another uid
    (root / "6").mkdir()  # vanished: no cmdline
    (p,) = vllm_processes(root)
    assert p.pid == 5 and p.env == {} and p.config_path is None
    assert vllm_processes(tmp_path / "absent") == []


def test_gpus_by_uuid_index_all_none() -> None:
    gpus = [Gpu(index=0, uuid=UUID0), Gpu(index=1, uuid=UUID1)]
    assert gpu_indices_for({"NVIDIA_VISIBLE_DEVICES": UUID1.lower()}, gpus) == ([1], "uuid")
    assert gpu_indices_for({"NVIDIA_VISIBLE_DEVICES": f"{UUID1},GPU-gone"}, gpus) == ([1], "uuid")
    assert gpu_indices_for({"CUDA_VISIBLE_DEVICES": "1"}, gpus) == ([1], "index")
    assert gpu_indices_for({"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0"}, gpus) == (
        [0],
        "index",
    )
    assert gpu_indices_for({}, gpus) == ([0, 1], "all")
    assert gpu_indices_for({"NVIDIA_VISIBLE_DEVICES": "void"}, gpus) == ([], "none")
