"""shared-gpu-gmu-unset (spec/vllm-0.34.md §3.1, N1): a 0.34 extensible engine with gmu unset
beside another process; gpu-shared-with-foreign-process and colocated-engines-overcommit give way."""

from __future__ import annotations

from typing import Any

from kvdoctor.units import GiB
from rules.colocated_engines_overcommit import RULE as COLOCATED
from rules.gpu_shared_with_foreign_process import RULE as FOREIGN
from rules.shared_gpu_gmu_unset import RULE
from tests.rules._words import facts, finding

T = int(79.19 * GiB)


def _ext(**changes: Any) -> dict[str, Any]:
    base = dict(
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        vllm_sizing_mode_source="vllm.log 'Memory after warmup'",
        gmu=1.0,
        gmu_resolved=1.0,
        gmu_explicit=False,
        gmu_assumption="unset: 1.0 with the extensible KV cache (vLLM ≥ 0.34)",
        gpu_total_bytes=T,
        engine_gpus=[0],
        foreign_pids=[7311],
        foreign_bytes=6 * GiB,
        foreign_desc="pid 7311 (python3) 6.00 GiB on GPU 0",
        weights_logged_bytes=int(14.99 * GiB),
        kv_block_bytes=8 * 2**20,
        block_size=64,
        max_model_len=131072,
        warmup_free_bytes=int(62.25 * GiB),
        warmup_committed_bytes=int(0.06 * GiB),
        warmup_kept_bytes=int(1.86 * GiB),
        idle_headroom_design_bytes=int(3.1 * GiB),
    )
    return facts(**{**base, **changes})


def test_fires_as_warning_with_the_gmu_that_leaves_the_other_process_its_memory() -> None:
    f = finding(RULE, _ext())
    assert f is not None and f.severity == "warning"
    # spec §3.1 worked example: floor_0.01((79.19 − 6 − 0.5)/79.19) = 0.91
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.91"}
    assert "caps this instance at" in f.summary and "kill 7311" in f.summary
    assert [fx.commands for fx in f.fixes][-1] == ("kill 7311",)


def test_critical_when_the_engine_ran_out_of_memory_with_little_free() -> None:
    f = finding(RULE, _ext(oom_at_runtime=True, oom_free_bytes=412 * 2**20, oom_line=15))
    assert f is not None and f.severity == "critical"
    assert "0.40 GiB free" in f.summary


def test_critical_when_the_engine_failed_after_warmup() -> None:
    f = finding(RULE, _ext(kv_error_after_warmup=True, kv_hint="H3", kv_hint_line=12))
    assert f is not None and f.severity == "critical"


def test_near_misses_explicit_gmu_non_ext_033_small_context() -> None:
    assert finding(RULE, _ext(gmu_explicit=True, gmu=0.9)) is None
    assert finding(RULE, _ext(vllm_sizing_mode="estimate")) is None
    assert finding(RULE, _ext(vllm_v34=False, vllm_sizing_mode="estimate", gmu=0.92)) is None
    assert finding(RULE, _ext(foreign_bytes=200 * 2**20)) is None


def test_no_gmu_when_it_cannot_hold_the_model_then_move_or_stop() -> None:
    f = finding(
        RULE,
        _ext(foreign_bytes=60 * GiB, gpu_used_map={0: 75 * GiB, 1: 0}, gpus_without_processes=[1]),
    )
    assert f is not None
    assert "--gpu-memory-utilization" not in f.summary
    assert f.fixes[0].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert f.fixes[-1].commands == ("kill 7311",)


def test_two_unset_engines_get_the_split_once() -> None:
    v = _ext(
        foreign_pids=[],
        foreign_bytes=0,
        foreign_desc=None,
        colocated_count=2,
        colocated_gpu=0,
        colocated_gmus=[1.0, 1.0],
        colocated_gmu_sum=2.0,
        colocated_gmu_explicit=[False, False],
        colocated_names=["llama", "qwen"],
        colocated_bytes=[70 * GiB, 6 * GiB],
        colocated_self=1,
        colocated_total_bytes=T,
        colocated_desc="pid 1 (llama) gmu 1.00, pid 2 (qwen) gmu 1.00",
    )
    f = finding(RULE, v)
    assert f is not None and f.suggested_flags == {"--gpu-memory-utilization": "0.47"}
    assert "llama 0.47, qwen 0.47" in f.summary
    # colocated-engines-overcommit does not repeat the split; with one explicit gmu it does.
    assert finding(COLOCATED, v) is None
    assert finding(COLOCATED, {**v, "colocated_gmu_explicit": [True, False]}) is not None


def test_gpu_shared_with_foreign_process_gives_way_on_ext_unset_only() -> None:
    assert finding(FOREIGN, _ext()) is None
    f = finding(FOREIGN, _ext(gmu_explicit=True, gmu=0.95, gmu_resolved=0.95))
    assert f is not None
    assert "caps this engine" in f.summary and "not a fit to the memory free now" in f.summary
