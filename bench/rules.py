#!/usr/bin/env python3
"""The rule engine's two costs (issues #8 and #10), in one process: figures, not pass/fail.

1. Evaluation per cycle: ``rules_engine.evaluate`` of every shipped rule over the contexts
   ``derive`` builds from the sidecar-like Timeline of ``bench/cycle.py`` (a real 55 KB vLLM
   0.33 /metrics page, 8 GPUs), compiled expressions against the simpleeval reference
   evaluator (``evaluate(..., reference=True)``: the baseline, same rules, same contexts);
   and with a ``RuleMemo`` over the same contexts again (a steady engine: every rule replayed).
2. Rules load with a warm disk cache: ``load_rules`` as a new process does it (the in-process
   cache cleared, the cache file present; expressions' code is loaded when first evaluated)
   against parsing and compiling every rule file (the baseline, the cache's cold path: what
   the run that writes the cache does).

Medians of interleaved runs after a warm-up. Budgets: evaluation ≤ 5 ms of a cycle (issue 10);
the load is part of the cold start ``bench/coldstart.py`` measures (issue 8).
usage: .venv/bin/python bench/rules.py [--runs N]
last line: eval_ms=… eval_ref_ms=… eval_ratio=… load_ms=… parse_ms=… load_ratio=… memo_ms=…
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    cache = tempfile.TemporaryDirectory(prefix="kvdoctor-bench-rules-")
    os.environ["KVDOCTOR_CACHE_DIR"] = cache.name

    from cycle import timeline  # bench/cycle.py's sidecar-like Timeline

    from kvdoctor import rules_engine as RE
    from kvdoctor.derive import build_contexts
    from kvdoctor.pipeline import variable_catalogue

    known = variable_catalogue()
    rules = RE.load_rules(known_names=known)  # fills the disk cache
    tl = timeline(60)
    latest = tl.latest
    _, contexts, _ = build_contexts(tl, list(latest.configs) if latest else [], window_s=60.0)
    ctxs = [RE.RuleContext(engine=e, variables=v, inputs=i) for e, v, i in contexts]
    n_exprs = sum(1 for r in rules for _ in RE._all_exprs(r))

    has_ref = "reference" in RE.evaluate.__code__.co_varnames
    memo = RE.RuleMemo() if hasattr(RE, "RuleMemo") else None
    compiled: list[float] = []
    ref: list[float] = []
    kept: list[float] = []
    for i in range(10 + a.runs):
        t0 = time.perf_counter()
        RE.evaluate(rules, ctxs)
        t1 = time.perf_counter()
        if has_ref:
            RE.evaluate(rules, ctxs, reference=True)  # type: ignore[call-arg]
        t2 = time.perf_counter()
        if memo is not None:  # a long-running face's: the same variables, every rule replayed
            RE.evaluate(rules, ctxs, memo=memo)
        t3 = time.perf_counter()
        if i >= 10:
            compiled.append(t1 - t0)
            ref.append(t2 - t1)
            kept.append(t3 - t2)

    loads: list[float] = []
    parses: list[float] = []
    paths = [RE.default_rules_dir()]
    for i in range(3 + max(5, a.runs // 10)):
        RE._RULES_CACHE.clear()  # a new process: only the disk cache remains
        t0 = time.perf_counter()
        RE.load_rules(known_names=known)
        t1 = time.perf_counter()
        memo = getattr(RE, "_COMPILED", None)
        if memo is not None:
            memo.clear()  # each text compiles once per process: measure the first time
        parsed = RE._load_rules_uncached(paths, False, known)
        for rule in parsed:  # what the run that writes the cache compiles
            for e in RE._all_exprs(rule):
                getattr(e, "code", None)
        t2 = time.perf_counter()
        if i >= 3:
            loads.append(t1 - t0)
            parses.append(t2 - t1)
    size = sum(f.stat().st_size for f in Path(cache.name).iterdir())

    ev, er = _median_ms(compiled), _median_ms(ref) if has_ref else float("nan")
    em = _median_ms(kept) if memo is not None else float("nan")
    lo, pa = _median_ms(loads), _median_ms(parses)
    print(
        f"{len(rules)} rules, {n_exprs} expressions, {len(ctxs)} contexts, cache file(s) {size / 1024:.0f} KiB"
    )
    print(f"evaluate, compiled:           {ev:7.3f} ms per cycle")
    print(f"evaluate, simpleeval (base):  {er:7.3f} ms per cycle   ratio {ev / er:.3f}")
    print(f"evaluate, RuleMemo, steady:   {em:7.3f} ms per cycle   ratio {em / ev:.3f} (vs compiled)")
    print(f"load_rules, warm disk cache:  {lo:7.3f} ms")
    print(f"parse + compile (base):       {pa:7.3f} ms   ratio {lo / pa:.3f}")
    print(
        f"eval_ms={ev:.3f} eval_ref_ms={er:.3f} eval_ratio={ev / er:.3f} "
        f"load_ms={lo:.3f} parse_ms={pa:.3f} load_ratio={lo / pa:.3f} memo_ms={em:.3f}"
    )


if __name__ == "__main__":
    main()
