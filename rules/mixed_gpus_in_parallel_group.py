"""## What
One TP group spans GPUs with different total memory.

## Why
gmu is a fraction of each card, and the block count is the minimum over ranks: the smallest card
sets the KV capacity of the whole group, the larger ones waste memory.

## How to confirm
`nvidia-smi`: the Memory-Usage totals of the engine's GPUs differ.

## Fix
Matched cards, or PP with `VLLM_PP_LAYER_PARTITION` proportional to the card sizes.

## Sources
spec/rules.md family W; vllm-facts.md §2.1 step 4.
"""

from __future__ import annotations

from typing import NamedTuple

from kvdoctor.rule_functions import proportional_layer_partition
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid

_ENV = "VLLM_PP_LAYER_PARTITION"


class Thresholds(NamedTuple):
    """None: the rule has no tunable thresholds."""


def _partition(f: Facts, ranks: int) -> str | None:
    """One pipeline stage per engine GPU, layers proportional to card sizes (spec/rules.md
    family W); None unless there is one GPU per rank (vLLM rejects a partition whose stage
    count is not the pipeline size)."""
    gpus, totals, arch = f["engine_gpus"], f["gpu_total_map"], f["arch"]
    if arch is None or gpus is None or totals is None or len(gpus) != ranks:
        return None
    try:
        return proportional_layer_partition(arch, gpus, totals)
    except (ValueError, TypeError, ZeroDivisionError, KeyError):
        return None


def check(f: Facts, t: Thresholds) -> Hit | None:
    ranks, small, large = f["tp_pp"], f["engine_gpu_total_min_bytes"], f["engine_gpu_total_max_bytes"]
    if ranks is None or ranks <= 1 or not small or not large or large - small <= 2**30:
        return None
    gmu = f["gmu"]
    partition = _partition(f, ranks)
    fixes: list[Fix] = []
    how = ""
    if partition:
        flags = {
            flag: str(value)
            for flag, value in (("--tensor-parallel-size", 1), ("--pipeline-parallel-size", ranks))
            if is_valid(f, flag, value)
        }
        with_flags = " ".join(f"{k} {v}" for k, v in flags.items())
        how = (
            f": {with_flags + ' with ' if with_flags else ''}{_ENV}={partition} (one stage per GPU"
            f" {', '.join(map(str, f['engine_gpus'] or ()))}, in that order), so each card holds the layers its memory allows"
        )
        fixes.append(
            Fix(flags=flags, env={_ENV: partition}, why="one pipeline stage per card, layers by card size")
        )
    budget = gmu * small if gmu is not None else None
    summary = (
        f"The engine's GPUs range from {gib_text(small, '.1f')} to {gib_text(large, '.1f')} GiB. vLLM gives every"
        " rank the same KV blocks, so the smallest card bounds every rank: usable budget per rank"
        f" {gib_text(budget, '.1f')} GiB. Use matched cards, or pipeline parallelism with a layer partition"
        f" proportional to card sizes{how}."
    )
    evidence = [
        Evidence(
            "smallest / largest card",
            f"{gib_text(small, '.1f')} / {gib_text(large, '.1f')} GiB",
            "nvidia-smi Memory-Usage total",
        )
    ]
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=f["engine_gpus"] or ())


RULE = Rule(
    id="mixed-gpus-in-parallel-group",
    family="W",
    severity="warning",
    title="The tensor-parallel group spans GPUs of different sizes",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    flags=("--tensor-parallel-size", "--pipeline-parallel-size", _ENV),
)
