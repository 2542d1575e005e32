"""graphs-warmup-left-no-kv (spec/vllm-0.34.md §3.2, N2): a vLLM 0.34 extensible engine that passed
the pre-warm-up fit and lost its KV to CUDA graph capture and the sizing warm-up; fires on the
handed case and the §3.2 worked example, not on the near misses (pre-warm-up failure, another
process on the GPU, a non-extensible engine, a healthy one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.graphs_warmup_left_no_kv import RULE

from tests.rules._words import facts, finding
from tests.test_cases import diagnose_json

MiB = 2**20
DATA = Path(__file__).resolve().parent.parent / "data"


def _rtx4090(**over: Any) -> dict[str, Any]:
    """The handed 0.34 case: Qwen3-8B at 40,960 on one RTX 4090, gmu unset (u = 1.0), b = 9 MiB,
    A = 7,880 MiB, N = 608 after warm-up, G = 470 MiB, μ = 1 GiB."""
    v = dict(
        vllm_sizing_mode="extensible",
        vllm_v34=True,
        vllm_version="0.34.0",
        kv_error_after_warmup=True,
        kv_hint="H3",
        kv_hint_error="max_seq_len_exceeds_kv",
        kv_hint_line=45,
        kv_block_bytes=9 * MiB,
        kv_pool_blocks=608,
        kv_pool_bytes=608 * 9 * MiB,
        kv_shortfall_bytes=(640 - 607) * 9 * MiB,
        kv_reservation_bytes=7880 * MiB,
        log_available_kv_line=22,
        warmup_line=25,
        warmup_requested_bytes=24207 * MiB,
        startup_free_bytes=23787 * MiB,
        graph_capture_bytes=470 * MiB,
        warmup_margin_bytes=1024 * MiB,
        warmup_kept_bytes=780 * MiB,
        summary_activation_bytes=390 * MiB,
        mml_error_estimate=38848,
        max_model_len=40960,
        block_size=64,
        kv_cache_dtype="auto",
        gmu=1.0,
        gmu_resolved=1.0,
        gmu_explicit=False,
        max_num_batched_tokens=2048,
        decode_graph_max_requests=256,
        prefill_graph_max_tokens=512,
        foreign_bytes=0,
        engine_gpus=[0],
    )
    v.update(over)
    return facts(**v)


def test_fires_names_the_shortfall_the_largest_term_and_the_longest_length() -> None:
    f = finding(RULE, _rtx4090())
    assert f is not None and f.severity == "critical"
    fixes = [x.flags for x in f.fixes]
    assert fixes[0] == {"--max-model-len": "38848"}  # 607 x 64: the null block held back
    assert {"--kv-cache-dtype": "fp8"} in fixes  # (2 x 608 - 1) x 9 MiB >= 5,760 MiB
    assert {"--enforce-eager": ""} in fixes  # G 470 >= S 297 MiB
    # G/2 = 235 < S: halving the capture sizes is not claimed to cover it
    assert all("--compilation-config" not in x for x in fixes)
    # gmu unset on ext: 1.0 is in effect, never "increase gpu_memory_utilization"
    assert all("--gpu-memory-utilization" not in x for x in fixes)
    assert "297 MiB short" in f.summary
    assert "the largest is the after-warm-up margin μ" in f.summary


def test_smaller_graphs_when_half_the_graph_memory_covers_the_shortfall() -> None:
    f = finding(RULE, _rtx4090(graph_capture_bytes=1200 * MiB))
    assert f is not None
    cc = [x.flags["--compilation-config"] for x in f.fixes if "--compilation-config" in x.flags]
    assert cc and json.loads(cc[0]) == {
        "max_decode_cudagraph_capture_requests": 128,
        "max_prefill_cudagraph_capture_tokens": 256,
    }
    assert "not computed" in f.summary


def test_explicit_gmu_below_one_with_h2_gets_gmu_one_and_never_more() -> None:
    f = finding(RULE, _rtx4090(gmu=0.9, gmu_resolved=0.9, gmu_explicit=True, kv_hint="H2"))
    assert f is not None
    assert {"--gpu-memory-utilization": "1"} in [x.flags for x in f.fixes]


def test_the_largest_term_kept_minus_p_suggests_a_smaller_step() -> None:
    f = finding(
        RULE,
        _rtx4090(warmup_kept_bytes=4000 * MiB, kv_reservation_bytes=12000 * MiB, max_num_batched_tokens=8192),
    )
    assert f is not None
    assert {"--max-num-batched-tokens": "4096"} in [x.flags for x in f.fixes]


def test_fires_from_the_numbers_alone() -> None:
    f = finding(RULE, _rtx4090(kv_error_after_warmup=None, kv_hint=None, kv_hint_error=None))
    assert f is not None


@pytest.mark.parametrize(
    "near_miss",
    [
        # the pre-warm-up check failed: the reservation itself was short (hint {U} = the model and its activations)
        dict(
            kv_error_after_warmup=False,
            kv_reservation_bytes=5460 * MiB,
            warmup_line=None,
            kv_shortfall_bytes=None,
        ),
        # reservation short even with a warm-up line: not N2
        dict(kv_reservation_bytes=5000 * MiB),
        # another process on the GPU: shared-gpu-gmu-unset (N1)
        dict(foreign_bytes=3 * 2**30),
        # non-extensible 0.34 (or 0.33): cuda-graph-capture-oom / kv-budget-exhausted
        dict(vllm_sizing_mode="estimate"),
        # healthy: the pool holds a request, no error
        dict(kv_error_after_warmup=None, kv_hint_error=None, kv_shortfall_bytes=-100 * MiB),
    ],
)
def test_near_misses(near_miss: dict[str, Any]) -> None:
    assert finding(RULE, _rtx4090(**near_miss)) is None


@pytest.mark.parametrize(
    ("bundle", "fires"),
    [
        (DATA / "cases-034" / "v34-rtx4090-qwen3-8b-40960-after-warmup-38848", True),
        (DATA / "bundles-034" / "v34-ext-70b-fp8-after-warmup-no-kv", True),
        (DATA / "bundles" / "k1-v34-ext-prewarmup-fit-failed-gmu09", False),
        (DATA / "bundles-034" / "v34-ext-gmu09-explicit-cap-warning", False),
        (DATA / "bundles-034" / "v34-fallback-disabled-free-below-util", False),
    ],
    ids=lambda x: x.name if isinstance(x, Path) else str(x),
)
def test_bundles(bundle: Path, fires: bool) -> None:
    _code, report = diagnose_json(bundle)
    by_rule = {f["rule"]: f for f in report["findings"]}
    assert ("graphs-warmup-left-no-kv" in by_rule) is fires
    if fires:
        # N2 is the root cause; max-model-len-exceeds-kv-capacity keeps its after-warm-up fix
        mml = by_rule["max-model-len-exceeds-kv-capacity"]
        assert mml["caused_by"] == "graphs-warmup-left-no-kv"
        assert "kv-budget-exhausted" not in by_rule


def test_autofit_reduced_but_served_is_info_and_a_warning_when_short() -> None:
    served = dict(kv_error_after_warmup=None, kv_hint_error=None, kv_shortfall_bytes=-100 * MiB)
    f = finding(RULE, _rtx4090(**served, autofit_final_from=40960, autofit_final_len=38848))
    assert f is not None and f.severity == "info" and f.fixes == []
    g = finding(
        RULE, _rtx4090(**served, autofit_final_from=40960, autofit_final_len=6144, autofit_short=True)
    )
    assert g is not None and g.severity == "warning" and "longer than 6,144" in g.summary
    # not reduced: nothing to say
    assert finding(RULE, _rtx4090(**served, autofit_final_len=40960)) is None
