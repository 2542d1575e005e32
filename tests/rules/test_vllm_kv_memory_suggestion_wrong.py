"""vllm-kv-memory-suggestion-wrong (spec/vllm-0.34.md §3.3, N3): vLLM's own `--kv-cache-memory=`
suggestion is corrected (non-extensible: + E, the double-counted graph estimate; extensible: N × b,
the committed pool) and never forwarded; a KV byte size on a 0.34 engine is flagged because it
turns the extensible KV cache off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.vllm_kv_memory_suggestion_wrong import RULE

from tests.rules._words import facts, finding
from tests.test_cases import diagnose_json

GiB, MiB = 2**30, 2**20
DATA = Path(__file__).resolve().parent.parent / "data"


def _noext(**over: Any) -> dict[str, Any]:
    """vllm#57936 on 0.34 non-extensible: B1 −20.83, B2 −9.10, E 57.45 GiB."""
    v = dict(
        vllm_v34=True,
        vllm_sizing_mode="estimate",
        vllm_kv_memory_fit_bytes=int(-20.83 * GiB),
        vllm_kv_memory_full_bytes=int(-9.10 * GiB),
        vllm_kv_memory_line=9,
        graph_estimate_bytes=int(57.45 * GiB),
        gmu=0.92,
        gmu_explicit=True,
        vllm_version="0.34.0",
    )
    v.update(over)
    return facts(**v)


def _ext(**over: Any) -> dict[str, Any]:
    """The handed RTX 4090 case: B1 7,612,661,760, B2 7,172,259,840; pool 608 × 9 MiB."""
    v = dict(
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        vllm_kv_memory_fit_bytes=7612661760,
        vllm_kv_memory_full_bytes=7172259840,
        vllm_kv_memory_line=24,
        kv_block_bytes=9 * MiB,
        kv_pool_blocks=608,
        warmup_line=25,
        warmup_kept_bytes=780 * MiB,
        warmup_margin_bytes=GiB,
        gmu=1.0,
        gmu_explicit=False,
        vllm_version="0.34.0",
    )
    v.update(over)
    return facts(**v)


def test_noext_double_count_reports_both_numbers_and_no_flag_when_not_in_use() -> None:
    f = finding(RULE, _noext())
    assert f is not None and f.severity == "info"
    assert "-20.83 GiB" in f.summary and "36.62 GiB" in f.summary  # vLLM's and the corrected B1
    assert "48.35 GiB" in f.summary  # B2 + E
    assert f.fixes == []  # the flag is not in use and the engine can run extensible


def test_noext_with_the_flag_in_use_gets_the_corrected_value_rounded_to_a_block() -> None:
    b = 2 * MiB
    f = finding(RULE, _noext(kv_cache_memory_bytes_value=30 * GiB, kv_block_bytes=b, gmu_explicit=True))
    assert f is not None
    (fix,) = f.fixes
    value = int(fix.flags["--kv-cache-memory-bytes"])
    assert value % b == 0 and value == (int(-20.83 * GiB) + int(57.45 * GiB)) // b * b
    assert value != int(-20.83 * GiB)  # never vLLM's own number


def test_ext_suggestion_is_corrected_to_the_committed_pool_and_no_flag() -> None:
    f = finding(RULE, _ext())
    assert f is not None and f.severity == "info"
    assert f"{608 * 9 * MiB:,}" in f.summary and "7,612,661,760" in f.summary
    assert f.fixes == []


def test_a_byte_size_on_034_with_gmu_unset_turned_extensible_off() -> None:
    v = _ext(
        kv_cache_memory_bytes_value=65435336704, vllm_kv_memory_fit_bytes=None, vllm_kv_memory_full_bytes=None
    )
    f = finding(RULE, v)
    assert f is not None and f.severity == "warning"
    assert "turns the extensible KV cache off" in f.summary and f.fixes == []
    failed = finding(RULE, {**v, "startup_failed": True})
    assert failed is not None and failed.severity == "critical"


def test_a_persisted_startup_plan_is_vllms_own_value() -> None:
    f = finding(RULE, _ext(startup_plan_kv_bytes=7612661760, vllm_kv_memory_fit_bytes=None))
    assert f is not None and f.severity == "warning"
    assert "persisted startup plan" in f.summary


@pytest.mark.parametrize(
    "near_miss",
    [
        _noext(graph_estimate_bytes=None),  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: no double count
        _noext(graph_estimate_bytes=100 * MiB),  # E below 256 MiB
        _ext(kv_pool_blocks=int(7612661760 / (9 * MiB))),  # the suggestion matches the pool
        # an explicit gmu with a byte size not taken from vLLM: the user's own choice, 0.33-style engine
        _noext(graph_estimate_bytes=None, kv_cache_memory_bytes_value=30 * GiB, gmu_explicit=True),
        # a 0.33 engine with a byte size: no extensible cache to turn off
        _noext(
            vllm_v34=False,
            vllm_version="0.33.0",
            graph_estimate_bytes=None,
            kv_cache_memory_bytes_value=30 * GiB,
        ),
    ],
)
def test_near_misses(near_miss: dict[str, Any]) -> None:
    assert finding(RULE, near_miss) is None


@pytest.mark.parametrize(
    ("bundle", "fires"),
    [
        (DATA / "bundles" / "k1-v34-noext-kv-memory-double-count", True),
        (DATA / "bundles-034" / "v34-kv-cache-memory-bytes-estimate", True),
        (DATA / "cases-034" / "v34-rtx4090-qwen3-8b-40960-after-warmup-38848", True),
        (DATA / "bundles" / "k1-v34-noext-estimate-off-kv-memory-line", False),
        # healthy 0.34 engine: vLLM's line is logged and wrong (info only, the case allows info)
        (DATA / "cases-034" / "v34-h100-llama8b-gmu-unset-near-full-healthy", True),
        (DATA / "bundles" / "k1-v34-ext-prewarmup-fit-failed-gmu09", False),
    ],
    ids=lambda x: x.name if isinstance(x, Path) else str(x),
)
def test_bundles(bundle: Path, fires: bool) -> None:
    _code, report = diagnose_json(bundle)
    mine = [f for f in report["findings"] if f["rule"] == "vllm-kv-memory-suggestion-wrong"]
    assert bool(mine) is fires
    if "healthy" in bundle.name:
        assert mine[0]["severity"] == "info"
    for f in report["findings"]:
        for alt in f.get("fixes") or []:
            # never vLLM's own --kv-cache-memory number, from any rule
            value = (alt.get("flags") or {}).get("--kv-cache-memory-bytes")
            assert value is None or int(value) not in (7612661760, 7172259840)


def test_a_byte_size_on_a_cpu_engine_turns_nothing_off() -> None:
    v = _ext(kv_cache_memory_bytes_value=8 * GiB, vllm_kv_memory_fit_bytes=None, kv_cache_device="CPU")
    assert finding(RULE, v) is None
