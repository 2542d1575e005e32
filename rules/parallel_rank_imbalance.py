"""## What
Per-GPU used memory inside one engine's TP/PP group differs by more than max(1 GiB, 5 % of the card).

## Why
vLLM cuts every worker to the smallest `num_blocks` among ranks (vllm-facts.md §2.1 step 4), so
memory held by one rank (a foreign process, a larger last pipeline stage with lm_head and the
sampler) shrinks the KV cache of all of them.

## How to confirm
`nvidia-smi` per GPU; the log's "Available KV cache memory" differs between workers.

## Fix
For PP, a `VLLM_PP_LAYER_PARTITION` that moves layers off the heavy stage; otherwise remove what
else sits on the heavy GPU.

## Sources
spec/rules.md family W; vllm-facts.md §2.1.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rule_functions import pp_layer_partition
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid, na

PARTITION = "VLLM_PP_LAYER_PARTITION"


@dataclass(frozen=True)
class Thresholds:
    #: GiB; the smallest spread between the heaviest and lightest rank that counts
    min_spread_gib: float = 1.0
    #: the smallest spread as a fraction of the card's total memory (the larger of the two counts)
    min_spread_fraction: float = 0.05


def _partition(f: Facts) -> str | None:
    """A VLLM_PP_LAYER_PARTITION that moves layers off the heavy pipeline stage, or None (no PP,
    an input unknown, or no layer would move)."""
    arch, pp, stage = f["arch"], f["pp"], f["rank_heavy_stage"]
    spread, weights = f["rank_spread_bytes"], f["weights_bytes"]
    if arch is None or pp is None or pp <= 1 or stage is None or spread is None or weights is None:
        return None
    split = pp_layer_partition(arch, pp, stage, spread, weights)
    return split if split is not None and is_valid(f, PARTITION, split) else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    tp_pp, spread, total = f["tp_pp"], f["rank_spread_bytes"], f["gpu_total_bytes"]
    if (
        tp_pp is None
        or tp_pp <= 1
        or spread is None
        or not total
        or spread <= max(t.min_spread_gib * 2**30, t.min_spread_fraction * total)
    ):
        return None
    gpu, pid, node = f["rank_heavy_gpu"], f["rank_heavy_pid"], f["rank_heavy_node"]
    pp = f["pp"]
    partition = _partition(f)
    heavy = f"GPU {gpu}" if gpu is not None else f"the rank of worker pid {pid}"
    summary = (
        f"Within the engine's TP/PP group, {heavy}{f' of node {node}' if node else ''} uses {gib_text(spread)} GiB"
        " more than the lightest rank. Every rank gets the same number of KV blocks (the minimum over ranks), so"
        " the heavy rank bounds the whole group."
    )
    fixes: list[Fix] = []
    if pp is not None and pp > 1:
        summary += " With pipeline parallelism, move layers off the heavy stage (the last one holds lm_head and the sampler)"
        if partition is not None:
            # The words name the variable only with the value the fix sets.
            summary += f" with {PARTITION} = {partition}"
            fixes.append(Fix(env={PARTITION: partition}, why="fewer layers on the heavy pipeline stage"))
        summary += "."
    if gpu is not None:
        evidence = [
            Evidence(
                "memory spread across ranks", f"{gib_text(spread)} GiB", "nvidia-smi Memory-Usage per GPU"
            ),
            Evidence("heaviest rank", f"GPU {gpu}", "nvidia-smi"),
        ]
    else:
        source = na(f["rank_spread_source"])
        evidence = [
            Evidence("memory spread across ranks", f"{gib_text(spread)} GiB", source),
            Evidence("heaviest rank", f"worker pid {na(pid)}{f' on {node}' if node else ''}", source),
        ]
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="parallel-rank-imbalance",
    family="W",
    severity="warning",
    title="One tensor/pipeline-parallel rank uses much more memory than the others",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    flags=(PARTITION,),
)
