"""cuda-graph-capture-oom: the words advise only the fixes the finding carries, never vLLM's own
--kv-cache-memory= number."""

from __future__ import annotations

from typing import Any

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
    assert "vLLM's own --kv-cache-memory suggestion" in [e.fact for e in f.evidence]
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
