"""flashinfer-workspace-overflow: every setting the words advise is a fix, and no other."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.flashinfer_workspace_overflow import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.findings import Finding
from kvdoctor.units import GiB, MiB
from tests.test_words_and_fixes import _problems

W = 394 * MiB


def _finding(**values: Any) -> Finding:
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        fi_overflow=True,
        fi_overflow_line=13,
        fi_overflow_phase="cuda_graph_capture",
        fi_overflow_buffer="batch_prefill_tmp_v",
        fi_overflow_size_bytes=536_346_624,
        fi_overflow_available_bytes=W,
        fi_workspace_bytes=W,
        fi_workspace_source="default 394 MiB (vLLM ≥ 0.12)",
        fi_need_bytes=536_346_624,
        vllm_release=19,
        vllm_version="0.19.1",
        gmu=0.9,
        engine_gpus=[0],
    )
    variables.update(values)
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])
    assert not ev.errors
    (finding,) = ev.findings
    assert _problems(finding) == []
    return finding


def test_the_flash_attn_alternative_the_words_give_is_a_fix() -> None:
    f = _finding()
    assert [x.env or x.flags for x in f.fixes] == [
        {"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": str(640 * MiB)},
        {"--attention-backend": "FLASH_ATTN"},
    ]
    assert "Alternative: --attention-backend FLASH_ATTN" in f.summary
    assert "a lower gpu_memory_utilization alone changes nothing" in f.summary


def test_before_0_13_the_alternative_is_the_environment_variable() -> None:
    f = _finding(vllm_release=12, vllm_version="0.12.0")
    assert f.fixes[1].env == {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}
    assert "Alternative: VLLM_ATTENTION_BACKEND=FLASH_ATTN" in f.summary


def test_a_bigger_buffer_that_does_not_fit_at_idle_lowers_gmu_in_the_same_fix() -> None:
    f = _finding(idle_headroom_bytes=GiB // 2, device_total_bytes=80 * GiB)
    # Δ = 640 − 394 MiB = 246 MiB > 0.5 GiB idle − 0.5 GiB margin: gmu 0.9 − ceil_0.01(Δ/T) = 0.89
    assert f.fixes[0].env == {"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": str(640 * MiB)}
    assert f.fixes[0].flags == {"--gpu-memory-utilization": "0.89"}
    assert "also lower --gpu-memory-utilization to 0.89" in f.summary


def test_on_0_11_the_words_name_no_gmu_flag_the_fix_cannot_set() -> None:
    f = _finding(
        vllm_release=11,
        vllm_version="0.11.0",
        fi_workspace_bytes=256 * MiB,
        fi_need_bytes=283_115_520,
        idle_headroom_bytes=GiB // 2,
        device_total_bytes=80 * GiB,
    )
    assert [x.env for x in f.fixes] == [{"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}]
    assert "--gpu-memory-utilization" not in f.summary
    assert "Upgrade to vLLM ≥ 0.12" in f.summary


def test_no_alternative_when_flash_attn_is_in_effect() -> None:
    f = _finding(attention_backend="FLASH_ATTN")
    assert [x.env for x in f.fixes] == [{"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": str(640 * MiB)}]
    assert "Alternative" not in f.summary


def test_near_miss_no_overflow_logged() -> None:
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(fi_need_bytes=536_346_624, fi_workspace_bytes=W, vllm_release=19)
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])
    assert ev.findings == [] and not ev.errors
