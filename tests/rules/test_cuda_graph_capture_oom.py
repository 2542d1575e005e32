"""cuda-graph-capture-oom: the words advise only the fixes the finding carries, never vLLM's own
--kv-cache-memory= number (kvdoctor's own B1 + E instead); on vLLM 0.34 as spec/vllm-0.34.md §2
says (extensible: no headroom/run-time trigger, no gmu, no KV byte size; smaller graphs through
--compilation-config); the title says "ran out of memory" only for a capture OOM (issue 24 kind 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.cuda_graph_capture_oom import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.units import GiB


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """vLLM 0.33 on a 22 GiB L4 at gmu 0.95: graphs took 1.45 GiB outside the budget (the
    k7-graph-oom-vllm-kv-memory-suggestion bundle)."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        gmu=0.95,
        gpu_total_bytes=int(22.05 * GiB),
        graph_capture_bytes=int(1.45 * GiB),
        oom_count=1,
        max_num_seqs_effective=256,
        enforce_eager=False,
        vllm_version="0.33.0",
        vllm_release=33,
        vllm_kv_memory_fit_bytes=3274912563,
        vllm_kv_memory_line=11,
        vllm_kv_in_use_bytes=int(4.65 * GiB),
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_vllms_own_kv_cache_memory_number_is_evidence_not_advice() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [
        {"--gpu-memory-utilization": "0.88"},
        {"--max-num-seqs": "128"},
        {"--enforce-eager": ""},
    ]
    assert "--kv-cache-memory" not in f.summary and "3274912563" not in f.summary
    assert "vLLM's own suggestion (not advised: kvdoctor computes its own)" in [e.fact for e in f.evidence]
    assert f.summary.endswith(
        "Leave that much headroom with --gpu-memory-utilization 0.88, or capture fewer graphs with"
        " --max-num-seqs 128, or run without graphs (--enforce-eager)."
    )


def test_a_gmu_that_cannot_be_sized_is_not_advised() -> None:
    # no card total: YAML said "--gpu-memory-utilization N/A"; the gmu alternative is left out
    (f,) = _evaluate(gpu_total_bytes=None, graph_capture_oom=True).findings
    assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "128"}, {"--enforce-eager": ""}]
    assert "--gpu-memory-utilization" not in f.summary
    assert "ran out of memory. Capture fewer graphs with --max-num-seqs 128, or run" in f.summary


def test_a_max_num_seqs_already_in_effect_is_not_advised() -> None:
    # the logged max_num_seqs is already the half of the effective one (a gap between the two)
    (f,) = _evaluate(max_num_seqs=128).findings
    assert all("--max-num-seqs" not in x.flags for x in f.fixes)
    assert "--max-num-seqs" not in f.summary


def test_near_miss_graphs_fit_the_headroom() -> None:
    ev = _evaluate(graph_capture_bytes=int(0.5 * GiB))
    assert ev.findings == [] and not ev.errors


MiB = 2**20
B = 917504  # Qwen2.5-7B, 16-token blocks


def test_kvdoctors_own_kv_bytes_when_the_graph_estimate_was_off() -> None:
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: E = 0, B1 rounded down to a whole block
    (f,) = _evaluate(engine_env={"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}, kv_block_bytes=B).findings
    values = [x.flags.get("--kv-cache-memory-bytes") for x in f.fixes]
    assert "3274571776" in values and "3274912563" not in values
    assert "--kv-cache-memory-bytes 3274571776 (3.05 GiB instead of the 4.65 GiB in use" in f.summary


def test_non_extensible_034_adds_the_double_counted_estimate_only_where_the_flag_is_in_use() -> None:
    base = dict(
        vllm_version="0.34.0",
        vllm_release=34,
        vllm_v34=True,
        vllm_sizing_mode="estimate",
        graph_estimate_bytes=int(1.2 * GiB),
        kv_block_bytes=B,
        vllm_kv_in_use_bytes=int(8 * GiB),
        decode_graph_max_requests=256,
        prefill_graph_max_tokens=512,
    )
    (f,) = _evaluate(**base).findings
    assert all("--kv-cache-memory-bytes" not in x.flags for x in f.fixes)  # not in use on a 0.34 engine
    (f,) = _evaluate(**base, kv_cache_memory_bytes_value=6 * GiB).findings
    (value,) = [x.flags["--kv-cache-memory-bytes"] for x in f.fixes if "--kv-cache-memory-bytes" in x.flags]
    assert int(value) == (3274912563 + int(1.2 * GiB)) // B * B
    # 0.34: smaller graphs through the compilation config, not --max-num-seqs
    cc = [x.flags["--compilation-config"] for x in f.fixes if "--compilation-config" in x.flags]
    assert json.loads(cc[0]) == {
        "max_decode_cudagraph_capture_requests": 128,
        "max_prefill_cudagraph_capture_tokens": 256,
    }


def _ext(**values: Any) -> rulekit.Evaluation:
    return _evaluate(
        vllm_version="0.34.0",
        vllm_release=34,
        vllm_v34=True,
        vllm_sizing_mode="extensible",
        gmu=1.0,
        decode_graph_max_requests=256,
        prefill_graph_max_tokens=512,
        **values,
    )


def test_extensible_headroom_and_idle_free_do_not_fire() -> None:
    # (1 - 1.0) x T < graphs and a run-time OOM with little idle free memory: by design on ext (N4 owns it)
    assert _ext(runtime_oom=True, gpu_free_bytes=int(0.5 * GiB)).findings == []


def test_extensible_capture_oom_gets_smaller_graphs_never_gmu_or_kv_bytes() -> None:
    (f,) = _ext(graph_capture_oom=True, oom_line=40).findings
    flags = [x.flags for x in f.fixes]
    assert all("--gpu-memory-utilization" not in x and "--kv-cache-memory-bytes" not in x for x in flags)
    assert flags[0] == {
        "--compilation-config": '{"max_decode_cudagraph_capture_requests": 128, "max_prefill_cudagraph_capture_tokens": 256}'
    }
    assert {"--enforce-eager": ""} in flags
    assert f.title == RULE.title  # a capture OOM: "CUDA graph capture ran out of memory"


def test_extensible_capture_oom_with_another_process_is_n1s() -> None:
    assert _ext(graph_capture_oom=True, foreign_bytes=4 * GiB).findings == []


def test_a_run_time_oom_is_not_titled_a_capture_oom() -> None:
    (f,) = _evaluate(runtime_oom=True, oom_line=22, oom_phase="runtime").findings
    assert f.title != RULE.title and "run-time OOM" in f.title
    assert "ran out of memory" not in f.summary
    (g,) = _evaluate(graph_capture_oom=True).findings
    assert g.title == "CUDA graph capture ran out of memory"


def test_bundle_k7_runtime_oom_and_kvdoctors_value() -> None:
    from tests.test_cases import diagnose_json

    bundle = (
        Path(__file__).resolve().parent.parent / "data" / "bundles" / "k7-graph-oom-vllm-kv-memory-suggestion"
    )
    _code, report = diagnose_json(bundle)
    (f,) = [x for x in report["findings"] if x["rule"] == "cuda-graph-capture-oom"]
    assert "run-time OOM" in f["title"]
    values = [a["flags"].get("--kv-cache-memory-bytes") for a in f["fixes"]]
    assert "3274571776" in values and "3274912563" not in values


@pytest.mark.parametrize(
    ("bundle", "fires"),
    [("k1-v34-ext-capture-oom", True), ("k1-v34-ext-runtime-oom-not-capture", False)],
)
def test_034_extensible_bundles(bundle: str, fires: bool) -> None:
    from tests.test_cases import diagnose_json

    _code, report = diagnose_json(Path(__file__).resolve().parent.parent / "data" / "bundles" / bundle)
    mine = [x for x in report["findings"] if x["rule"] == "cuda-graph-capture-oom"]
    assert bool(mine) is fires
    for f in mine:
        flags = [a["flags"] for a in f["fixes"]]
        assert all("--gpu-memory-utilization" not in x and "--kv-cache-memory-bytes" not in x for x in flags)
