"""Sampling vLLM from a sidecar container: /proc of a shared PID namespace (a fake /proc tree
here) and GPUs attributed by UUID."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from kvdoctor.facts import Gpu, GpuProcess, Snapshot, Timeline
from kvdoctor.pipeline import Pipeline
from kvdoctor.report import Report, render_json, render_text
from kvdoctor.sampler import LiveFeed, LiveOptions, Reading
from kvdoctor.sources.container import gpu_indices_for, gpu_uuids, vllm_processes
from kvdoctor.sources.processes import host_process_from_strings

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
#: the pod's vLLM API server, as its /proc cmdline reads
SERVER_ARGV = [
    "python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "/models/llama",
    "--port",
    "8000",
]


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


def test_gpu_uuids_only_from_uuid_lists() -> None:
    assert gpu_uuids({"NVIDIA_VISIBLE_DEVICES": f"{UUID0},{UUID1}"}) == [UUID0, UUID1]
    assert gpu_uuids({"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": UUID1}) == [UUID1]
    assert gpu_uuids({"CUDA_VISIBLE_DEVICES": "0,1"}) == []  # the container's own numbering
    assert gpu_uuids({"NVIDIA_VISIBLE_DEVICES": "void"}) == [] and gpu_uuids({}) == []


# --------------------------------------------------------------------------- wired: live feed → report

GiB = 2**30


class StubNvml:
    """Two GPUs of the node as NVML shows them from the sidecar: vLLM's processes on GPU 1 under
    *host* pids (absent from the pod's namespace), another pod's engine on GPU 0."""

    kind, origin, timeout_s = "nvml", "NVML", 1.0

    def __init__(self, engine_pid: int = 887766) -> None:
        self.engine_pid = engine_pid

    def read(self) -> Reading:
        def gpu(i: int, uuid: str, pid: int, name: str) -> Gpu:
            return Gpu(
                index=i,
                uuid=uuid,
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=80 * GiB,
                memory_used_bytes=74 * GiB,
                utilization_gpu=0.9,
                processes=[GpuProcess(pid=pid, name=name, used_bytes=73 * GiB)],
            )

        return Reading(
            {
                "gpus": [
                    gpu(0, UUID0, 912001, "VLLM::EngineCore"),
                    gpu(1, UUID1, self.engine_pid, "VLLM::EngineCore"),
                ]
            }
        )

    def close(self) -> None:
        pass


class StubPodProcesses:
    """psutil inside the pod: vLLM's API server (pid 7) and engine core (pid 8)."""

    kind, origin, timeout_s = "processes", "psutil", 1.0

    def read(self) -> Reading:
        argv = SERVER_ARGV
        procs = [
            host_process_from_strings(7, "python3", argv, ppid=1),
            host_process_from_strings(8, "VLLM::EngineCor", ["VLLM::EngineCore"], ppid=7),
        ]
        return Reading({"processes": procs, "process_table_known": True})

    def close(self) -> None:
        pass


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def pod_report(
    tmp_path: Path, env: dict[str, str] | None, engine_pid: int = 887766
) -> tuple[Report, Snapshot]:
    root = tmp_path / "proc"
    argv = SERVER_ARGV
    d = proc(root, 7, argv, env)
    (d / "root" / "models" / "llama").mkdir(parents=True)
    (d / "root" / "models" / "llama" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    feed = LiveFeed(
        LiveOptions(use_nvml=False, use_processes=False),
        sources=[StubNvml(engine_pid), StubPodProcesses()],
        proc_root=root,
    )
    try:
        timeline = Timeline()
        for _ in range(2):
            timeline.append(feed.next())
    finally:
        feed.close()
    latest = timeline.latest
    assert latest is not None
    return Pipeline.load().evaluate(timeline), latest


def test_pod_gpu_memory_is_the_engines_by_uuid_not_orphaned(tmp_path: Path) -> None:
    report, snap = pod_report(tmp_path, {"NVIDIA_VISIBLE_DEVICES": UUID1, "HF_TOKEN": "hf_secret"})
    assert snap.configs[0].args["_gpu_uuids"] == [UUID1]
    assert "hf_secret" not in repr(snap.configs[0].args)
    assert snap.model is not None and snap.model.num_key_value_heads == 8  # config.json via /proc/7/root
    (engine,) = report.engines
    assert engine["attribution"] == "gpu_uuid" and engine["gpus"] == [1]
    ids = {f.rule for f in report.findings}
    assert "orphaned-engine-processes" not in ids
    assert not any("foreign" in f.rule for f in report.findings)
    console = Console(record=True, width=200, color_system=None)
    render_text(report, console)
    text = console.export_text()
    assert "GPU memory of /models/llama (GPU 1): attributed by GPU UUID" in text
    assert json.loads(render_json(report))["engines"][0]["attribution"] == "gpu_uuid"


def test_without_the_uuid_the_host_pids_still_look_orphaned(tmp_path: Path) -> None:
    # The control: what the pod looked like before the container attribution (and on a host,
    # where a vLLM process whose pid is not in the table is an orphan).
    report, snap = pod_report(tmp_path, {"PATH": "/bin"})
    assert "_gpu_uuids" not in snap.configs[0].args
    (engine,) = report.engines
    assert engine["attribution"] is None
    assert "orphaned-engine-processes" in {f.rule for f in report.findings}


def test_pids_that_resolve_are_attributed_by_pid(tmp_path: Path) -> None:
    # hostPID (or a bare host): NVML's pid is the engine core's own
    report, _snap = pod_report(tmp_path, {"NVIDIA_VISIBLE_DEVICES": UUID1}, engine_pid=8)
    (engine,) = report.engines
    assert engine["attribution"] == "pid" and engine["gpus"] == [1]
    assert "orphaned-engine-processes" not in {f.rule for f in report.findings}


def test_sidecar_gpu_info_says_gpu_uuid(tmp_path: Path) -> None:
    import io

    from prometheus_client import generate_latest

    from kvdoctor.sidecar.server import Sidecar

    root = tmp_path / "proc"
    argv = SERVER_ARGV
    proc(root, 7, argv, {"NVIDIA_VISIBLE_DEVICES": UUID1})
    feed = LiveFeed(
        LiveOptions(use_nvml=False, use_processes=False),
        sources=[StubNvml(), StubPodProcesses()],
        proc_root=root,
    )
    sc = Sidecar(feed, Pipeline.load(), interval_s=1.0, out=io.StringIO())
    try:
        cycle = sc.loop.step()
        assert cycle is not None
        sc.on_cycle(cycle)
        page = generate_latest(sc.registry).decode()
    finally:
        feed.close()
    (line,) = [ln for ln in page.splitlines() if ln.startswith("kvdoctor_gpu_info{") and 'gpu="1"' in ln]
    assert 'attribution="gpu_uuid"' in line and 'model_name="/models/llama"' in line
    # every GPU series carries NVML's UUID: they join dcgm-exporter's UUID label
    mem = [ln for ln in page.splitlines() if ln.startswith("kvdoctor_gpu_memory_bytes{") and 'gpu="1"' in ln]
    assert mem and all('uuid="GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"' in ln for ln in mem)
