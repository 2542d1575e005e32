"""wake-up-oom: the words advise a gmu only when the fix sets it."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.wake_up_oom import RULE

from kvdoctor.findings import Finding
from kvdoctor.units import GiB
from tests.rules._words import facts, finding
from tests.test_words_and_fixes import _problems

NEIGHBOUR = {"pid": 5120, "name": "VLLM::EngineCore", "bytes": 60 * GiB, "asleep": None}


def _findings(**values: Any) -> list[Finding]:
    variables = facts(
        wake_oom=True,
        wake_oom_line=15,
        wake_tags=[],
        wake_need_bytes=52 * GiB,
        gmu=0.7,
        device_total_bytes=80 * GiB,
        idle_headroom_bytes=18 * GiB,
        wake_neighbours=[NEIGHBOUR],
        wake_neighbours_bytes=60 * GiB,
        wake_neighbours_desc="pid 5120 (VLLM::EngineCore) 60.00 GiB",
        engine_gpus=[0],
    )
    found = finding(RULE, {**variables, **values})
    assert found is None or _problems(found) == []
    return [found] if found is not None else []


def test_the_awake_neighbour_is_named_and_the_gmu_that_fits_beside_it_is_the_fix() -> None:
    (f,) = _findings()
    # (80 − 60 − 0.5) GiB / 80 GiB = 0.24375 → 0.24
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.24"}
    assert "Make pid 5120 sleep before this wake, and size the set so a wake fits:" in f.summary
    assert "--gpu-memory-utilization ≤ 0.24 for this engine." in f.summary


def test_a_gmu_that_already_fits_is_not_advised() -> None:
    (f,) = _findings(gmu=0.2)
    assert f.fixes == []
    assert "--gpu-memory-utilization" not in f.summary
    assert f.summary.endswith(
        "Make pid 5120 sleep before this wake: this engine's gpu_memory_utilization 0.20 already fits"
        " beside what they hold now."
    )


def test_without_the_gpu_total_no_gmu_is_advised_and_the_sentence_starts_with_a_capital() -> None:
    (f,) = _findings(device_total_bytes=None, wake_neighbours=[{**NEIGHBOUR, "asleep": True}])
    assert f.fixes == []
    assert "≤ N/A" not in f.summary and "--gpu-memory-utilization" not in f.summary
    assert "Make pid" not in f.summary
    assert (
        "Size the set so a wake fits: with the GPU's total memory or the gmu in effect unknown" in f.summary
    )


def test_a_sleeping_neighbour_is_not_asked_to_sleep() -> None:
    (f,) = _findings(wake_neighbours=[{**NEIGHBOUR, "asleep": True}])
    assert "Make pid" not in f.summary
    assert "Size the set so a wake fits: --gpu-memory-utilization ≤ 0.24" in f.summary


def test_near_miss_no_wake_oom_logged() -> None:
    assert _findings(wake_oom=False) == []
