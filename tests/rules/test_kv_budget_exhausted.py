"""kv-budget-exhausted on vLLM 0.34 (spec/vllm-0.34.md §2): gmu resolved (1.0 on the extensible
path), gmu advice up to 1.0 only for an explicit gmu below 1 with nothing else on the GPU, none
with gmu unset; no KV after graph capture and warm-up is graphs-warmup-left-no-kv's; 0.33 kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.kv_budget_exhausted import RULE

from tests.rules._words import facts, finding
from tests.test_cases import diagnose_json

GiB, MiB = 2**30, 2**20
DATA = Path(__file__).resolve().parent.parent / "data"


def _v(**over: Any) -> dict[str, Any]:
    v = dict(
        no_kv_memory=True,
        no_kv_memory_line=39,
        log_available_kv_bytes=-592 * MiB,
        gpu_total_bytes=24207 * MiB,
        kv_bytes_per_token=147456,
        max_model_len=40960,
        vllm_version="0.34.0",
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        gmu=0.65,
        gmu_resolved=0.65,
        gmu_explicit=True,
        kv_error_after_warmup=False,
        engine_gpus=[0],
    )
    v.update(over)
    return facts(**v)


def test_ext_explicit_gmu_below_one_gets_gmu_one() -> None:
    f = finding(RULE, _v())
    assert f is not None
    assert [x.flags for x in f.fixes][0] == {"--gpu-memory-utilization": "1"}


def test_ext_gmu_unset_gets_no_gmu_fix_and_says_so() -> None:
    f = finding(RULE, _v(gmu=1.0, gmu_resolved=1.0, gmu_explicit=False, log_available_kv_bytes=0))
    assert f is not None
    assert all("--gpu-memory-utilization" not in x.flags for x in f.fixes)
    assert "gmu is 1.0 already" in f.summary
    assert "Raise --gpu-memory-utilization" not in f.summary


def test_ext_another_process_keeps_its_gmu() -> None:
    f = finding(RULE, _v(foreign_bytes=4 * GiB))
    assert f is not None and all("--gpu-memory-utilization" not in x.flags for x in f.fixes)


def test_ext_no_kv_after_warmup_is_n2s() -> None:
    assert (
        finding(RULE, _v(kv_error_after_warmup=True, gmu_explicit=False, gmu=1.0, gmu_resolved=1.0)) is None
    )


def test_033_keeps_the_095_ceiling() -> None:
    # same figures on 0.33: gmu needed 0.92 ≤ 0.95 is advised as computed, not 1.0
    f = finding(RULE, _v(vllm_version="0.33.0", vllm_v34=False, vllm_sizing_mode="estimate"))
    assert f is not None
    assert [x.flags for x in f.fixes][0] == {"--gpu-memory-utilization": "0.92"}
    # and above 0.95 there is no gmu fix on 0.33
    g = finding(
        RULE, _v(vllm_version="0.33.0", vllm_v34=False, vllm_sizing_mode="estimate", max_model_len=60000)
    )
    assert g is not None and all("--gpu-memory-utilization" not in x.flags for x in g.fixes)


@pytest.mark.parametrize(
    ("bundle", "fires"),
    [
        (DATA / "bundles" / "k1-v34-ext-gmu065-no-kv-memory", True),
        (DATA / "cases-034" / "v34-rtx4090-qwen3-8b-40960-after-warmup-38848", False),
        (DATA / "bundles-034" / "v34-ext-70b-fp8-after-warmup-no-kv", False),
    ],
    ids=lambda x: x.name if isinstance(x, Path) else str(x),
)
def test_bundles(bundle: Path, fires: bool) -> None:
    _code, report = diagnose_json(bundle)
    assert any(f["rule"] == "kv-budget-exhausted" for f in report["findings"]) is fires
