#!/usr/bin/env python3
"""Parser and rule-engine throughput (figures, not pass/fail; tests assert behaviour).

Prints, in one run so the machine's state is shared, each against a baseline measured in the
same process:
- the vLLM log parser over the repo's sample logs (×5) against plain ``str.splitlines``;
- the nvidia-smi table parser on an 8-GPU table against ``str.splitlines`` of the same text;
- the shipped rule catalogue over one context.

Last line: ``log_lines_per_s=… smi_table_ms=… rules_ms=…``.
usage: .venv/bin/python bench/parsers.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data"


def median_s(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    runs = ap.parse_args().runs

    from kvdoctor.sources.nvidia_smi import parse_nvidia_smi_table
    from kvdoctor.sources.vllm_log import parse_log

    text = (
        "\n".join(
            p.read_text(encoding="utf-8", errors="replace") for p in sorted((DATA / "vllm_log").glob("*.log"))
        )
        * 5
    )
    n = text.count("\n") + 1
    base = median_s(lambda: text.splitlines(), runs)
    t_log = median_s(lambda: parse_log(text), max(3, runs // 4))
    print(
        f"log parser      {n / t_log:12,.0f} lines/s  ({t_log * 1e3:.1f} ms for {n:,} lines; splitlines ×{t_log / base:.0f})"
    )

    smi = (DATA / "nvidia_smi" / "b20.txt").read_text()
    base = median_s(lambda: smi.splitlines(), runs * 10)
    t_smi = median_s(lambda: parse_nvidia_smi_table(smi), runs * 10)
    print(f"nvidia-smi table {t_smi * 1e3:10.3f} ms per 8-GPU table (splitlines ×{t_smi / base:.0f})")

    n_rules, t_rules = rules_catalogue(runs)
    print(f"rule catalogue   {t_rules * 1e3:10.3f} ms for {n_rules} rules over one context")
    print(f"log_lines_per_s={n / t_log:.0f} smi_table_ms={t_smi * 1e3:.3f} rules_ms={t_rules * 1e3:.3f}")


def rules_catalogue(runs: int) -> tuple[int, float]:
    """The shipped catalogue over one context whose variables all read None (every condition
    is evaluated; None-guards decide)."""
    from kvdoctor.derive import VARIABLES
    from kvdoctor.pipeline import load_rules
    from kvdoctor.rulekit import RuleContext, evaluate

    rules = load_rules()
    ctx = RuleContext("e", dict.fromkeys(VARIABLES, None), {"config", "log", "metrics", "gpus"})
    return len(rules), median_s(lambda: evaluate(rules, [ctx]), runs)


if __name__ == "__main__":
    main()
