"""The shipped rule catalogue (rules/*.py): loads, documents itself, and each rule fires and does
not fire on the facts it is about.

Rules the real cases do not reach (tests/test_cases.py) are exercised here on contexts built by
the pipeline (derive + rules + report) from small synthetic snapshots, so the rule and its variables are tested
together.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvdoctor.facts import (
    EngineConfig,
    EngineMetrics,
    Gpu,
    GpuProcess,
    HistogramData,
    HostProcess,
    Snapshot,
    Timeline,
)
from kvdoctor.pipeline import Pipeline
from kvdoctor.rulekit import load_rules
from tests.conftest import all_flags

GiB = 2**30
RULES = load_rules(plugins=False)
PIPELINE = Pipeline(rules=RULES)
SPEC_IDS = {
    "weights-not-sharded", "engines-stacked-on-one-gpu", "parallel-rank-imbalance", "mixed-gpus-in-parallel-group",
    "gpu-shared-with-foreign-process", "max-model-len-exceeds-kv-capacity", "kv-budget-exhausted",
    "invalid-kv-cache-dtype", "cuda-graph-capture-oom", "sampler-warmup-oom", "preemption-storm",
    "long-request-spike", "allocator-fragmentation", "low-util-kv-saturated", "low-util-host-bound",
    "idle-preallocation", "gpu-clock-throttled", "orphaned-engine-processes",
    "max-num-seqs-exceeds-kv", "swap-preemption-stall", "prefill-burst-oom", "logprobs-oom", "multimodal-profile-oom",
    "gpu-hardware-errors", "gpu-memory-growth", "colocated-engines-overcommit",
}  # fmt: skip
#: spec/rules-catalogue2.md §3: the failure kinds of 2026 vLLM.
SPEC2_IDS = {
    "cpu-offload-not-applied", "flashinfer-workspace-overflow", "triton-autotune-oom",
    "long-context-prefill-oom", "spec-decode-sampler-oom", "dp-engine-load-skew",
    "sleep-memory-not-released", "wake-up-oom",
}  # fmt: skip


def test_catalogue_holds_the_issue_rules_and_each_documents_itself() -> None:
    ids = {r.id for r in RULES}
    assert SPEC_IDS <= ids
    assert SPEC2_IDS <= ids
    assert len(ids) >= 35
    for r in RULES:
        for section in ("## What", "## Why", "## How to confirm", "## Fix", "## Sources"):
            assert section in (r.doc or ""), (r.id, section)


def test_rules_ship_from_the_top_level_rules_dir() -> None:
    import kvdoctor.rules

    assert Path(kvdoctor.rules.__file__).resolve().parent == Path(__file__).resolve().parent.parent / "rules"
    assert {r.source for r in RULES} >= {"kvdoctor.rules.preemption_storm"}


def test_textual_is_never_imported_by_diagnose() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from kvdoctor.cli import cli;"
        "CliRunner().invoke(cli, ['diagnose', '--demo', '--format', 'text']);"
        "CliRunner().invoke(cli, ['rules']); CliRunner().invoke(cli, ['explain', 'preemption-storm']);"
        "print('textual' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _gpu(
    i: int, used_gib: float, total_gib: float = 80, util: float | None = 0.5, procs=(), reasons=()
) -> Gpu:
    return Gpu(
        index=i,
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=int(total_gib * GiB),
        memory_used_bytes=int(used_gib * GiB),
        utilization_gpu=util,
        processes=list(procs),
        clock_event_reasons=list(reasons),
    )


def fired(
    snap: Snapshot, cfg: EngineConfig | None = None, extra: list[Snapshot] | None = None
) -> dict[str, dict]:
    tl = Timeline()
    for s in extra or []:
        tl.append(s)
    if cfg is not None:
        snap.configs = [cfg]
    tl.append(snap)
    report = PIPELINE.evaluate(tl, now=0)
    return {
        f.rule: {"severity": f.severity, "flags": all_flags(f), "summary": f.summary} for f in report.findings
    }


def test_engines_stacked_on_one_gpu() -> None:
    two = [
        GpuProcess(pid=10, name="VLLM::EngineCore", used_bytes=30 * GiB),
        GpuProcess(pid=20, name="VLLM::EngineCore", used_bytes=30 * GiB),
    ]
    got = fired(Snapshot(gpus=[_gpu(0, 61, procs=two), _gpu(1, 0.01)]))
    assert got["engines-stacked-on-one-gpu"]["flags"] == {"CUDA_VISIBLE_DEVICES": "1"}
    # One engine per GPU: nothing stacked.
    one = [GpuProcess(pid=10, name="VLLM::EngineCore", used_bytes=30 * GiB)]
    got = fired(
        Snapshot(
            gpus=[
                _gpu(0, 31, procs=one),
                _gpu(1, 31, procs=[GpuProcess(pid=20, name="VLLM::EngineCore", used_bytes=30 * GiB)]),
            ]
        )
    )
    assert "engines-stacked-on-one-gpu" not in got


def test_parallel_rank_imbalance_and_mixed_cards() -> None:
    cfg = EngineConfig(model="m", tensor_parallel_size=2, explicit={"tensor_parallel_size"})
    got = fired(Snapshot(gpus=[_gpu(0, 70), _gpu(1, 60)]), cfg)
    assert "parallel-rank-imbalance" in got and "GPU 0" in got["parallel-rank-imbalance"]["summary"]
    assert "mixed-gpus-in-parallel-group" not in got
    got = fired(Snapshot(gpus=[_gpu(0, 70), _gpu(1, 69.8)]), cfg)
    assert "parallel-rank-imbalance" not in got
    got = fired(Snapshot(gpus=[_gpu(0, 40, total_gib=80), _gpu(1, 40, total_gib=48)]), cfg)
    assert "mixed-gpus-in-parallel-group" in got


def test_gpu_clock_throttled() -> None:
    got = fired(Snapshot(gpus=[_gpu(0, 70, util=0.3, reasons=["hw_thermal_slowdown"])]))
    assert got["gpu-clock-throttled"]["severity"] == "warning"
    got = fired(Snapshot(gpus=[_gpu(0, 70, util=0.3, reasons=["gpu_idle"])]))
    assert "gpu-clock-throttled" not in got


def _metrics(ts: float, **kw) -> EngineMetrics:
    base = dict(timestamp=ts, engine="0", model_name="m", kv_cache_usage=0.2, num_requests_running=4, num_requests_waiting=0,
                num_preemptions_total=0, prompt_tokens_total=1000 * ts, generation_tokens_total=100 * ts, request_success_total=ts,
                cache_config={"num_gpu_blocks": "20000", "block_size": "16"})  # fmt: skip
    base.update(kw)
    return EngineMetrics(**base)


def test_low_util_host_bound_needs_traffic_and_no_queue() -> None:
    snaps = [Snapshot(timestamp=t, metrics=[_metrics(t)]) for t in (0.0, 10.0)]
    last = snaps[-1]
    last.gpus = [_gpu(0, 70, util=0.1)]
    got = fired(last, EngineConfig(model="m"), extra=snaps[:-1])
    assert "low-util-host-bound" in got and "idle-preallocation" not in got
    # An idle server (flat counters, nothing running) is idle-preallocation instead.
    idle = [Snapshot(timestamp=t, metrics=[_metrics(t, kv_cache_usage=0.0, num_requests_running=0, prompt_tokens_total=5.0,
                                                        generation_tokens_total=5.0, request_success_total=1.0)]) for t in (0.0, 10.0)]  # fmt: skip
    idle[-1].gpus = [_gpu(0, 70, util=0.0)]
    got = fired(idle[-1], EngineConfig(model="m"), extra=idle[:-1])
    assert "low-util-host-bound" not in got and "idle-preallocation" in got


def _prompt_hist(counts: dict[float, float]) -> HistogramData:
    les = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, float("inf")]
    cum, buckets = 0.0, []
    for le in les:
        cum += counts.get(le, 0.0)
        buckets.append((float(le), cum))
    return HistogramData(buckets=buckets, count=cum, sum=0.0)


def test_long_request_spike_needs_a_heavy_tail_with_pressure() -> None:
    early = Snapshot(
        timestamp=0.0, metrics=[_metrics(0.0, histograms={"vllm:request_prompt_tokens": _prompt_hist({})})]
    )
    tail = _prompt_hist({500: 95.0, 20000: 5.0})
    late = Snapshot(
        timestamp=30.0,
        metrics=[_metrics(30.0, kv_cache_usage=0.97, histograms={"vllm:request_prompt_tokens": tail})],
    )
    got = fired(late, EngineConfig(model="m"), extra=[early])
    spike = got["long-request-spike"]
    assert spike["severity"] == "warning"
    # KV capacity 20000 × 16 = 320000 tokens: a quarter is 80000, a block multiple.
    assert spike["flags"]["--max-model-len"] == "80000"
    even = _prompt_hist({500: 100.0})
    late.metrics = [_metrics(30.0, kv_cache_usage=0.97, histograms={"vllm:request_prompt_tokens": even})]
    assert "long-request-spike" not in fired(late, EngineConfig(model="m"), extra=[early])


def test_orphans_from_the_live_process_table() -> None:
    orphan = GpuProcess(pid=4242, name="VLLM::Worker_TP0", used_bytes=12 * GiB)
    snap = Snapshot(
        gpus=[_gpu(0, 12.5, procs=[orphan])],
        processes=[HostProcess(pid=1, name="init")],
        process_table_known=True,
    )
    got = fired(snap)
    assert "kill 4242" in got["orphaned-engine-processes"]["summary"]
    snap.processes.append(HostProcess(pid=4242, name="VLLM::Worker_TP0", vllm_role="worker"))
    snap.processes.append(HostProcess(pid=4000, name="vllm", vllm_role="api_server"))
    assert "orphaned-engine-processes" not in fired(snap)


def test_foreign_process_fix_is_never_a_gmu_too_small_for_the_weights() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    def refused(free_gib: float) -> Snapshot:
        line = (
            f"ERROR 09-01 10:00:00 [core.py:700] ValueError: Free memory on device cuda:0 ({free_gib:.2f}/79.19 GiB) on "
            "startup is less than desired GPU memory utilization (0.92, 72.85 GiB). Decrease GPU memory utilization or "
            "reduce GPU memory used by other processes."
        )
        foreign = GpuProcess(pid=12345, name="python3", used_bytes=int((79.19 - free_gib) * GiB))
        return Snapshot(
            gpus=[_gpu(0, 79.19 - free_gib, total_gib=79.19, procs=[foreign])], log=parse_log(line)
        )

    cfg = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", explicit={"model"})
    ok = fired(refused(40.0), cfg)["gpu-shared-with-foreign-process"]
    assert ok["flags"] == {"--gpu-memory-utilization": "0.49"}  # (40 − 0.5) / 79.19 = 0.4988, rounded down
    big = EngineConfig(model="meta-llama/Llama-3.1-70B-Instruct", explicit={"model"})
    stop = fired(refused(1.9), big)["gpu-shared-with-foreign-process"]
    assert stop["flags"] == {} and "Stop the other process (kill 12345)" in stop["summary"]
