"""mig-defaults-fallback: the words name the limits in effect by their field names."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.mig_defaults_fallback import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts
from kvdoctor.units import GiB


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """NVML NoPermission on an 80 GiB H100; max_num_batched_tokens 8192 logged, max_num_seqs
    left to vLLM's fallback tier."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        gpu_no_permission=True,
        gpu_name="NVIDIA H100 80GB HBM3",
        usable_device_bytes=80 * GiB,
        vllm_version="0.33.0",
        max_num_batched_tokens=8192,
        engine_gpus=[0],
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"gpus"})])


def test_only_the_limit_to_change_is_a_flag_in_the_words() -> None:
    # YAML: "In effect: --max-num-seqs 256 …, --max-num-batched-tokens 8192 (logged)" named a
    # flag no fix sets (max_num_batched_tokens is already the tier of 80 GiB)
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "1024"}]
    assert (
        "In effect: max_num_seqs 256 (vLLM's small tier), max_num_batched_tokens 8192 (logged)." in f.summary
    )
    assert "--max-num-batched-tokens" not in f.summary
    assert f.summary.endswith("Set them for the 80 GiB really available: --max-num-seqs 1024.")
    assert f.severity == "warning"


def test_unknown_memory_names_no_flag_and_is_info() -> None:
    (f,) = _evaluate(usable_device_bytes=None, gpu_no_permission=False, gpu_mig=True).findings
    assert f.fixes == [] and f.severity == "info"
    assert "--" not in f.summary
    assert f.summary.endswith("set max_num_seqs and max_num_batched_tokens explicitly for the slice.")


def test_at_the_cap_the_limits_double() -> None:
    ev = _evaluate(
        usable_device_bytes=None,
        max_num_batched_tokens=2048,
        running=256.0,
        waiting_max=41.0,
        kv_usage_max=0.42,
    )
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "512", "--max-num-batched-tokens": "4096"}]


def test_near_miss_both_limits_set_explicitly() -> None:
    ev = _evaluate(max_num_seqs_explicit=True, max_num_batched_tokens_explicit=True)
    assert ev.findings == [] and not ev.errors
