"""colocated-engines-overcommit: the split names the flag its fix sets, with the fix's values."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from tests.rule_contexts import all_contexts


def _findings(bundle: str, **changes: Any) -> dict[str | None, Any]:
    from rules.colocated_engines_overcommit import RULE

    contexts = [
        rulekit.RuleContext(e, {**v, **changes}, set(i)) for b, e, v, i in all_contexts() if b == bundle
    ]
    ev = rulekit.evaluate([RULE], contexts)
    assert not ev.errors
    return {f.engine: f for f in ev.findings}


def test_each_engine_gets_its_share_of_the_split_as_its_fix_and_in_the_words() -> None:
    found = _findings("k2-log-only-two-engines-overcommit")
    split = "Split the card with --gpu-memory-utilization per engine: "
    split += "meta-llama/Llama-3.1-8B-Instruct 0.4, Qwen/Qwen3-4B 0.54 (sum ≤ 0.95)."
    for engine, value in (("meta-llama/Llama-3.1-8B-Instruct", "0.4"), ("Qwen/Qwen3-4B", "0.54")):
        f = found[engine]
        assert f.severity == "critical"
        assert split in f.summary
        assert [fix.flags for fix in f.fixes] == [{"--gpu-memory-utilization": value}]


def test_engines_whose_gmu_fit_but_started_together_get_no_gmu() -> None:
    for f in _findings("k2-two-engines-one-log-close-start").values():
        assert f.severity == "warning"
        assert "--gpu-memory-utilization" not in f.summary
        assert "Start them one after another" in f.summary
        assert f.fixes == []


def test_without_this_engines_share_the_split_does_not_name_the_flag() -> None:
    # The engine is not one of the colocated ones (no index into the split): no fix of its own.
    f = _findings("k2-log-only-two-engines-overcommit", colocated_self=None)["Qwen/Qwen3-4B"]
    assert "Split the card: meta-llama/Llama-3.1-8B-Instruct 0.4, Qwen/Qwen3-4B 0.54" in f.summary
    assert "--gpu-memory-utilization" not in f.summary
    assert f.fixes == []
