"""sampler-warmup-oom: the words advise only the fixes the finding carries."""

from __future__ import annotations

from typing import Any

from kvdoctor.rules.sampler_warmup_oom import RULE

from kvdoctor import rulekit
from kvdoctor.derive.facts_typed import Facts


def _evaluate(**values: Any) -> rulekit.Evaluation:
    """Qwen3-32B at gmu 0.95: the sampler warm-up with 1024 dummy requests OOMed."""
    variables: dict[str, Any] = dict.fromkeys(Facts.__annotations__)
    variables.update(
        sampler_oom=True,
        sampler_oom_requests=1024,
        sampler_oom_line=136,
        gmu=0.95,
        max_num_seqs_effective=1024,
    )
    variables.update(values)
    return rulekit.evaluate([RULE], [rulekit.RuleContext("e0", variables, {"log"})])


def test_the_two_alternatives_are_the_two_fixes() -> None:
    ev = _evaluate()
    assert not ev.errors
    (f,) = ev.findings
    assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "256"}, {"--gpu-memory-utilization": "0.92"}]
    assert "Lower --max-num-seqs to 256 (a quarter of 1024;" in f.summary
    assert f.summary.endswith("or lower --gpu-memory-utilization to 0.92 to leave the sampler room.")
    # no max_num_seqs value beside the fix's (YAML: "512 or 128 also work")
    assert "512" not in f.summary and "128" not in f.summary


def test_a_gmu_too_low_or_unknown_is_not_advised() -> None:
    for gmu in (0.1, None):
        ev = _evaluate(gmu=gmu)
        assert not ev.errors
        (f,) = ev.findings
        assert [x.flags for x in f.fixes] == [{"--max-num-seqs": "256"}]
        assert "--gpu-memory-utilization" not in f.summary and "N/A" not in f.summary.split(".", 1)[1]
        assert f.summary.endswith("anything from a half to an eighth works).")


def test_near_miss_no_sampler_oom() -> None:
    ev = _evaluate(sampler_oom=False)
    assert ev.findings == [] and not ev.errors
