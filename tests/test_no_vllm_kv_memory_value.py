"""No rule forwards vLLM's own `--kv-cache-memory=` numbers (spec/vllm-0.34.md §1 fix validity 5;
issue 28 "Done when"): checked over every bundle."""

from __future__ import annotations

from tests.rule_contexts import all_contexts
from tests.test_words_and_fixes import _reports


def test_no_fix_is_vllms_kv_memory_number() -> None:
    vllm_numbers: dict[str, set[str]] = {}
    for bundle, _engine, v, _inputs in all_contexts():
        for name in ("vllm_kv_memory_fit_bytes", "vllm_kv_memory_full_bytes", "startup_plan_kv_bytes"):
            if v.get(name) is not None:
                vllm_numbers.setdefault(bundle, set()).add(str(v[name]))
    assert vllm_numbers, "no bundle logs vLLM's suggestion: the check would be empty"
    bad = []
    for bundle, report in _reports():
        for f in report.findings:
            for fix in f.fixes:
                value = fix.flags.get("--kv-cache-memory-bytes")
                if value is not None and value in vllm_numbers.get(bundle, set()):
                    bad.append(f"{bundle}: {f.rule} forwards vLLM's --kv-cache-memory={value}")
    assert not bad, bad
