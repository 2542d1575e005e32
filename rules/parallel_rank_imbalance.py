"""## What
Per-GPU used memory inside one engine's TP/PP group differs by more than max(1 GiB, 5 % of the card).

## Why
vLLM cuts every worker to the smallest `num_blocks` among ranks (vllm-facts.md §2.1 step 4), so
memory held by one rank (a foreign process, a larger last pipeline stage with lm_head and the
sampler) shrinks the KV cache of all of them.

On vLLM 0.34 with the extensible KV cache each rank logs its own `Memory after warmup: … N_r KV
cache blocks` before the minimum over the world group (every MoE-DP rank included); the
limiting rank is the one with the smallest N_r and each other rank leaves (N_r − N_min) × b
unused. The rule reads those when NVML per-GPU memory is not there.

## How to confirm
`nvidia-smi` per GPU; the log's "Available KV cache memory" differs between workers (before
0.34; on 0.34 extensible that line is only a reservation, compare the `Memory after warmup`
block counts instead).

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


def _warmup_ranks(f: Facts) -> tuple[list[int], int, int] | None:
    """vLLM 0.34 extensible: each rank's 'Memory after warmup … N_r KV cache blocks' (log order),
    the limiting rank (smallest N_r) and the bytes the others leave unused, Σ (N_r − N_min) × b
    (spec/vllm-0.34.md §2; the pool is the minimum over the world group)."""
    blocks, b = f["warmup_blocks_per_rank"], f["kv_block_bytes"]
    if f["vllm_sizing_mode"] != "extensible" or not blocks or len(blocks) < 2 or not b:
        return None
    n_min = min(blocks)
    return list(blocks), blocks.index(n_min), sum((n - n_min) * b for n in blocks)


def check(f: Facts, t: Thresholds) -> Hit | None:
    tp_pp, spread, total = f["tp_pp"], f["rank_spread_bytes"], f["gpu_total_bytes"]
    if not total and f["device_total_bytes"]:
        total = f["device_total_bytes"]
    if not total and f["warmup_requested_bytes"] and f["gmu_resolved"]:
        # log only: 'fit within the requested R GiB', R = ceil(u × T)
        total = int(f["warmup_requested_bytes"] / f["gmu_resolved"])
    floor = max(t.min_spread_gib * 2**30, t.min_spread_fraction * (total or 0))
    ranks = _warmup_ranks(f)
    # The per-rank KV blocks after warm-up count where NVML per-GPU memory is not available;
    # the heaviest rank then leaves (N_max − N_min) × b of KV memory unused on the lightest.
    b = f["kv_block_bytes"] or 0
    block_spread = (max(ranks[0]) - ranks[0][ranks[1]]) * b if ranks else None
    nvml = spread is not None and spread > floor
    from_blocks = spread is None and block_spread is not None and total and block_spread > floor
    if tp_pp is None or tp_pp <= 1 or not total or not (nvml or from_blocks):
        return None
    if not nvml:
        spread = block_spread
    gpu, pid, node = f["rank_heavy_gpu"], f["rank_heavy_pid"], f["rank_heavy_node"]
    pp = f["pp"]
    partition = _partition(f)
    if gpu is not None:
        heavy = f"GPU {gpu}"
    elif pid is not None:
        heavy = f"the rank of worker pid {pid}"
    elif ranks is not None:
        heavy = f"rank {ranks[1]} (in the order of the 'Memory after warmup' lines)"
    else:
        heavy = "one rank"
    summary = (
        f"Within the engine's TP/PP group, {heavy}{f' of node {node}' if node else ''} uses {gib_text(spread)} GiB"
        " more than the lightest rank. Every rank gets the same number of KV blocks (the minimum over ranks), so"
        " the heavy rank bounds the whole group."
    )
    if ranks is not None:
        summary += (
            f" vLLM 0.34 measured each rank after warm-up: {', '.join(f'{n:,}' for n in ranks[0])} KV blocks;"
            f" the pool is the minimum, {ranks[0][ranks[1]]:,} (rank {ranks[1]}), so the other ranks leave"
            f" {gib_text(ranks[2])} GiB of KV memory unused."
        )
    fixes: list[Fix] = []
    if pp is not None and pp > 1:
        summary += " With pipeline parallelism, move layers off the heavy stage (the last one holds lm_head and the sampler)"
        if partition is not None:
            # The words name the variable only with the value the fix sets.
            summary += f" with {PARTITION} = {partition}"
            fixes.append(Fix(env={PARTITION: partition}, why="fewer layers on the heavy pipeline stage"))
        summary += "."
    if ranks is not None:
        extra = [
            Evidence(
                "KV blocks per rank after warm-up",
                ", ".join(f"{n:,}" for n in ranks[0]),
                f"vllm.log 'Memory after warmup … N KV cache blocks' (line {na(f['warmup_line'])}, last)",
            ),
            Evidence(
                "KV memory the limiting rank leaves unused",
                f"{gib_text(ranks[2])} GiB",
                "Σ (N_r − N_min) × b",
            ),
        ]
    else:
        extra = []
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
    if not nvml:
        evidence = []
    return Hit(
        summary=summary, evidence=[*evidence, *extra], fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ()))
    )


RULE = Rule(
    id="parallel-rank-imbalance",
    family="W",
    severity="warning",
    title="One tensor/pipeline-parallel rank uses much more memory than the others",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("gpus", "log"),
    flags=(PARTITION,),
)
