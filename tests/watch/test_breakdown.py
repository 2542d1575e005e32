"""kvdoctor.breakdown: per-GPU memory parts and per-engine figures from facts + Report."""

from __future__ import annotations

import copy

from kvdoctor.breakdown import PARTS, engine_stats, gpu_breakdown
from kvdoctor.facts import Gpu, GpuProcess, LogEvent, Snapshot, Timeline, VllmLog
from kvdoctor.report import Report
from kvdoctor.units import GiB


def _report(engines: list[dict]) -> Report:
    return Report(generated_at="2025-01-01T00:00:00Z", health="ok", engines=engines)


def _engine(gpus: list[int], gmu: float = 0.9, eid: str = "m", pid: int | None = None) -> dict:
    return {
        "id": eid,
        "pid": pid,
        "model": eid,
        "gpus": gpus,
        "config": {"gpu_memory_utilization": gmu},
        "kv": {},
    }


def _log() -> VllmLog:
    return VllmLog(
        origin="/x/vllm.log",
        events=[
            LogEvent("model_loading", 21, {"weights_bytes": 15 * GiB}),
            LogEvent("available_kv_memory", 26, {"bytes": 20 * GiB}),
        ],
    )


def test_parts_from_log_figures_and_processes_sum_to_total():
    g = Gpu(
        0,
        name="L40S",
        memory_total_bytes=48 * GiB,
        memory_used_bytes=44 * GiB,
        processes=[GpuProcess(10, "VLLM::EngineCore", 40 * GiB), GpuProcess(11, "python3", 3 * GiB)],
    )
    [b] = gpu_breakdown(Snapshot(gpus=[g], log=_log()), _report([_engine([0])]))
    assert b.engine == "m"
    assert b.part("weights") == 15 * GiB
    assert b.part("kv_cache") == 20 * GiB
    assert b.part("activation_and_graphs") == 5 * GiB  # 40 − 15 − 20
    assert b.part("foreign") == 3 * GiB
    assert b.part("unlisted") == 1 * GiB
    assert b.part("free") == 4 * GiB
    assert sum(p.bytes for p in b.parts) == 48 * GiB
    assert b.gmu_bytes == int(0.9 * 48 * GiB)
    assert [p.part for p in b.parts] == [p for p in PARTS if b.part(p) is not None]
    assert "line 21" in next(p.source for p in b.parts if p.part == "weights")


def test_without_log_the_engine_is_one_unsplit_part():
    g = Gpu(
        0,
        memory_total_bytes=80 * GiB,
        memory_used_bytes=70 * GiB,
        processes=[GpuProcess(5, "vllm", 70 * GiB)],
    )
    [b] = gpu_breakdown(Snapshot(gpus=[g]), _report([_engine([0])]))
    assert b.part("engine") == 70 * GiB and b.part("weights") is None and b.part("free") == 10 * GiB


def test_second_engine_on_the_card_counts_as_other_engines():
    from kvdoctor.facts import HostProcess

    g = Gpu(
        0,
        memory_total_bytes=80 * GiB,
        memory_used_bytes=70 * GiB,
        processes=[
            GpuProcess(101, "VLLM::EngineCore", 40 * GiB),
            GpuProcess(201, "VLLM::EngineCore", 30 * GiB),
        ],
    )
    snap = Snapshot(
        gpus=[g],
        processes=[
            HostProcess(100, 1, vllm_role="api_server"),
            HostProcess(101, 100, vllm_role="engine_core"),
            HostProcess(200, 1, vllm_role="api_server"),
            HostProcess(201, 200, vllm_role="engine_core"),
        ],
    )
    rep = _report([_engine([0], eid="a", pid=100), _engine([0], eid="b", pid=200)])
    [b] = gpu_breakdown(snap, rep)
    assert b.part("other_engines") == 30 * GiB
    assert b.part("engine") == 40 * GiB
    kinds = {p.pid: k for p, k in b.processes}
    assert kinds == {101: "engine", 201: "other_engine"}


def test_engine_without_process_figures_takes_used_minus_others():
    # NVML in a container often lists no process for the engine: used − others is the engine's.
    g = Gpu(
        0,
        memory_total_bytes=48 * GiB,
        memory_used_bytes=42 * GiB,
        processes=[GpuProcess(7, "python3", 2 * GiB)],
    )
    [b] = gpu_breakdown(Snapshot(gpus=[g], log=_log()), _report([_engine([0])]))
    assert b.part("foreign") == 2 * GiB
    assert b.part("weights") == 15 * GiB and b.part("activation_and_graphs") == 40 * GiB - 35 * GiB


def test_gpu_of_no_engine_has_no_gmu_line_and_foreign_bytes():
    g = Gpu(
        3,
        memory_total_bytes=48 * GiB,
        memory_used_bytes=38 * GiB,
        processes=[GpuProcess(9, "torchrun", 38 * GiB)],
    )
    [b] = gpu_breakdown(Snapshot(gpus=[g]), _report([_engine([0])]))
    assert b.engine is None and b.gmu_bytes is None and b.part("foreign") == 38 * GiB


def test_engine_stats_from_the_demo_incident(demo_feed, pipeline):
    tl = Timeline()
    for _ in range(150):
        tl.append(demo_feed.next())
    rep = pipeline.evaluate(tl)
    [st] = engine_stats(tl, rep, 60.0)
    assert st.tp == 1 and st.pp == 1 and st.dp == 1 and st.gpus == [0]
    assert st.max_model_len == 131072
    assert st.kv_capacity_tokens == 194384
    assert st.kv_usage is not None and st.kv_usage > 0.9
    assert st.preemptions_per_min is not None and st.preemptions_per_min > 10
    assert st.waiting and st.waiting > 0
    assert st.prompt_p99 is not None and st.prompt_p50 is not None and st.prompt_p99 >= st.prompt_p50
    assert st.ttft_p99 is not None and st.ttft_p99 > 1.0  # seconds, KV-starved
    assert st.longest_prompt is not None and st.longest_prompt >= 60000
    assert len(st.kv_history) > 30


def test_engine_stats_healthy_window_has_no_preemptions(demo_feed, pipeline):
    tl = Timeline()
    for _ in range(50):
        tl.append(demo_feed.next())
    [st] = engine_stats(tl, pipeline.evaluate(tl), 60.0)
    assert st.preemptions_per_min == 0
    assert st.ttft_p99 is not None and st.ttft_p99 < 1.0


def test_breakdown_does_not_mutate_facts(demo_feed, pipeline):
    tl = Timeline()
    for _ in range(5):
        tl.append(demo_feed.next())
    rep = pipeline.evaluate(tl)
    before = copy.deepcopy(tl.latest)
    gpu_breakdown(tl.latest, rep)
    engine_stats(tl, rep)
    assert tl.latest == before


def test_engine_figures_read_only_the_window_of_a_long_timeline(demo_feed, pipeline):
    """A long live Timeline is cut to its last minute plus the snapshot before it (the
    baseline of the counter and histogram deltas)."""
    from kvdoctor.breakdown import _recent

    tl = Timeline()
    for _ in range(200):
        tl.append(demo_feed.next())
    recent = _recent(tl, 60.0)
    assert len(recent.snapshots) == 62  # 61 in [t-60, t] and the one before
    latest = tl.snapshots[-1].timestamp
    assert recent.snapshots[0].timestamp < latest - 60 <= recent.snapshots[1].timestamp
    assert recent.snapshots[-1] is tl.snapshots[-1]
