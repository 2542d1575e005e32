#!/usr/bin/env python3
"""What the rules cost per cycle (figures, not pass/fail), in one process.

The contexts: derive over the sidecar-like Timeline of ``bench/cycle.py`` (a real 55 KB vLLM
0.33 /metrics page, 8 GPUs, 60 snapshots) and every engine context of every bundle in
``tests/data``. Timed: ``rulekit.evaluate`` of the shipped catalogue over each set, against the
baseline ``derive.build_contexts`` of the same Timeline (the step before the rules, measured in
the same run). Medians of interleaved runs after a warm-up.

usage: .venv/bin/python bench/rules.py [--runs N]
last line: rules_ms=… derive_ms=… ratio=… bundle_us_per_context=…
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _median_ms(fn, runs: int) -> float:  # noqa: ANN001
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()

    import cycle

    import kvdoctor.derive as derive
    from kvdoctor.pipeline import load_rules
    from kvdoctor.rulekit import RuleContext, evaluate
    from tests.rule_contexts import all_contexts

    rules = load_rules()
    tl = cycle.timeline(60)
    configs = list(tl.latest.configs)

    def contexts() -> list[RuleContext]:
        _e, ctxs, _kv = derive.build_contexts(tl, configs)
        return [RuleContext(eid, v, inputs) for eid, v, inputs in ctxs]

    ctxs = contexts()
    derive_ms = _median_ms(contexts, a.runs)
    rules_ms = _median_ms(lambda: evaluate(rules, ctxs), a.runs)
    bundles = [RuleContext(e, dict(v), set(i)) for _b, e, v, i in all_contexts()]
    all_ms = _median_ms(lambda: evaluate(rules, bundles), max(3, a.runs // 20))
    per_ctx_us = all_ms * 1000 / len(bundles)
    print(f"{len(rules)} rules over the sidecar-like Timeline's {len(ctxs)} context(s): {rules_ms:.3f} ms")
    print(
        f"derive of the same Timeline (baseline):           {derive_ms:.3f} ms  (rules {rules_ms / derive_ms:.2f}x)"
    )
    print(f"every bundle context ({len(bundles)}): {all_ms:.1f} ms, {per_ctx_us:.1f} µs per context")
    print(
        f"rules_ms={rules_ms:.3f} derive_ms={derive_ms:.3f} ratio={rules_ms / derive_ms:.2f} "
        f"bundle_us_per_context={per_ctx_us:.1f}"
    )


if __name__ == "__main__":
    main()
