"""kvdoctor.breakdown: the per-GPU memory parts the sidecar exposes."""

from __future__ import annotations

from kvdoctor.breakdown import PARTS, gpu_breakdown
from kvdoctor.facts import Gpu, GpuProcess, HostProcess, LogEvent, Snapshot, VllmLog
from kvdoctor.report import Report

GiB = 2**30


def report(engines: list[dict[str, object]]) -> Report:
    return Report(generated_at="", health="ok", engines=engines)


def snap(processes: list[GpuProcess], host: list[HostProcess], *, table_known: bool) -> Snapshot:
    log = VllmLog(
        events=[
            LogEvent("model_loading", 10, {"weights_bytes": 15 * GiB}),
            LogEvent("available_kv_memory", 20, {"bytes": 50 * GiB}),
        ]
    )
    gpu = Gpu(
        index=0, uuid="GPU-1", memory_total_bytes=80 * GiB, memory_used_bytes=74 * GiB, processes=processes
    )
    return Snapshot(gpus=[gpu], processes=host, process_table_known=table_known, log=log)


def test_parts_add_up_and_a_foreign_process_is_named() -> None:
    procs = [GpuProcess(100, "VLLM::EngineCore", 70 * GiB), GpuProcess(200, "python train.py", 4 * GiB)]
    host = [
        HostProcess(99, name="vllm", vllm_role="api_server"),
        HostProcess(100, ppid=99, vllm_role="engine_core"),
        HostProcess(200),
    ]
    (b,) = gpu_breakdown(snap(procs, host, table_known=True), report([{"id": "m", "pid": 99, "gpus": [0]}]))
    assert [p.part for p in b.parts] == [p for p in PARTS if b.part(p) is not None]
    assert (
        b.part("weights"),
        b.part("kv_cache"),
        b.part("foreign"),
        b.part("other_engines"),
        b.part("free"),
    ) == (
        15 * GiB,
        50 * GiB,
        4 * GiB,
        None,
        6 * GiB,
    )
    assert b.part("activation_and_graphs") == 70 * GiB - 15 * GiB - 50 * GiB
    assert sum(p.bytes for p in b.parts) == b.total_bytes
    assert b.attribution == "pid"


def test_host_pid_from_another_namespace_is_never_called_foreign() -> None:
    # In a pod NVML reports host pids the sidecar's process table does not have.
    procs = [GpuProcess(48213, "python3", 74 * GiB)]
    host = [HostProcess(7, name="vllm", vllm_role="api_server")]
    (b,) = gpu_breakdown(snap(procs, host, table_known=True), report([{"id": "m", "pid": 7, "gpus": [0]}]))
    assert b.part("foreign") is None and b.part("other_engines") is None
    assert b.part("activation_and_graphs") == 74 * GiB - 65 * GiB  # the engine's share
    assert b.attribution == "gpu"  # said so: by the engine's GPU, not by pid


def test_gpu_without_engine_has_no_engine_parts() -> None:
    (b,) = gpu_breakdown(snap([], [], table_known=False), report([]))
    assert (b.part("weights"), b.part("kv_cache"), b.part("activation_and_graphs")) == (None, None, None)
    assert b.part("free") == 6 * GiB
    assert b.attribution is None
