"""The fix contract (issue 24): every fix a rule suggests is one vLLM accepts, that changes
something, that leaves vLLM able to start, and that does not serialise a serving engine. The
checks live in ``kvdoctor.fix_validity.valid_fix``; the rule engine applies them to every
alternative of every finding (a fix that fails them is the rule's error, never shown), and
``test_every_fix_on_every_bundle_keeps_the_contract`` checks them over every bundle."""

from __future__ import annotations

from typing import Any

import pytest

from kvdoctor.fix_validity import valid_fix
from tests.rule_contexts import bundle_dirs

GiB = 2**30


def _ctx(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "gmu": 0.9,
        "gpu_total_bytes": 48 * GiB,
        "kv_bytes_per_token": 131072,  # 8B-class model, bf16 KV: 128 KiB a token
        "max_model_len": 32768,
        "log_available_kv_bytes": 20 * GiB,  # 163,840 tokens: five 32k requests
        "kv_capacity_tokens": 163840,
        "vllm_version": "0.33.0",
    }
    base.update(kw)
    return base


def test_a_lower_gmu_that_leaves_less_kv_than_one_request_is_refused() -> None:
    # 20 GiB − (0.9 − 0.5) × 48 GiB < 0: vLLM would refuse to start
    why = valid_fix("--gpu-memory-utilization", "0.5", _ctx())
    assert why is not None and "less than one 32768-token request" in why
    # near miss: 20 − 0.1 × 48 = 15.2 GiB still holds 4 GiB (one 32k request)
    assert valid_fix("--gpu-memory-utilization", "0.8", _ctx()) is None


@pytest.mark.parametrize("value", ["1", "2"])
def test_max_num_seqs_of_one_or_two_is_refused_where_the_kv_holds_more(value: str) -> None:
    why = valid_fix("--max-num-seqs", value, _ctx(max_num_seqs=256))
    assert why is not None and "serialises" in why


def test_max_num_seqs_of_two_is_kept_where_the_kv_holds_only_two_requests() -> None:
    ctx = _ctx(max_num_seqs=256, kv_capacity_tokens=70000, log_available_kv_bytes=None)
    assert valid_fix("--max-num-seqs", "2", ctx) is None


def test_max_num_seqs_below_the_running_before_the_trouble_is_refused() -> None:
    ctx = _ctx(max_num_seqs=256, running_before_trouble=48)
    assert "48 requests running" in (valid_fix("--max-num-seqs", "32", ctx) or "")
    assert valid_fix("--max-num-seqs", "64", ctx) is None


def test_a_flag_the_version_does_not_have_is_refused() -> None:
    ctx = _ctx(vllm_version="0.18.0")
    assert "has no --swap-space" in (valid_fix("--swap-space", "8", ctx) or "")
    assert valid_fix("--swap-space", "8", _ctx(vllm_version="0.10.0")) is None


def _reports() -> list[tuple[str, Any]]:
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    pipeline = Pipeline.load()
    return [(d.name, pipeline.evaluate(load_bundle(d).timeline, now=0)) for d in bundle_dirs()]


def test_every_fix_on_every_bundle_keeps_the_contract() -> None:
    problems = []
    for bundle, report in _reports():
        problems += [f"{bundle}: {e}" for e in report.errors if e.get("where") == "fix"]
        for f in report.findings:
            alternatives = [(*x.flags.items(), *x.env.items(), *x.commands) for x in f.fixes]
            if len(set(alternatives)) != len(alternatives):
                problems.append(f"{bundle}: {f.rule} lists one alternative twice")
    assert not problems, "\n".join(problems)


def test_max_num_seqs_below_the_peak_running_before_the_trouble_is_refused() -> None:
    # derive's running_before_trouble (peak over the scrapes before the first preemption) wins
    ctx = _ctx(max_num_seqs=256, running_before_trouble=33.0, log_running_first=12)
    assert "33 requests running" in (valid_fix("--max-num-seqs", "26", ctx) or "")
    assert valid_fix("--max-num-seqs", "40", ctx) is None
