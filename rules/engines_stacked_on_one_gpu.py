"""## What
Two or more serving engines hold memory on the same GPU while another visible GPU holds none.

## Why
Each vLLM engine preallocates gmu × total of *its* GPU. Two engines started without distinct
`CUDA_VISIBLE_DEVICES` both land on GPU 0: the second one fails its startup memory check or
both run with a fraction of the KV cache they could have. On vLLM 0.34 with the extensible KV
cache there is no startup check: the later engine fails after warm-up (`No available memory for
the cache blocks. The extensible KV cache already takes all device memory left after the model,
its activations, CUDA graphs and warmup; …` or `To serve at least one request …` with that hint)
or starts with a small `Extended KV cache` pool. The gmu overcommit that follows
(`colocated-engines-overcommit`, `shared-gpu-gmu-unset`) is this stacking's consequence: the
move is the fix, a gmu split only the fallback.

## How to confirm
`nvidia-smi` lists two engine processes on one GPU; another GPU shows only a few MiB.

## Fix
Pin each engine to its own GPU: `CUDA_VISIBLE_DEVICES=k vllm serve …` for the idle index k.

## Sources
spec/rules.md family W.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rule_functions import gpus_under
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, na


@dataclass(frozen=True)
class Thresholds:
    #: GiB; a GPU holding less than this, with no process listed, is idle
    empty_max_gib: float = 1.0


def check(f: Facts, t: Thresholds) -> Hit | None:
    stacked = f["stacked_gpu"]
    empty = gpus_under(f["gpu_used_map"], t.empty_max_gib * 2**30, f["gpus_without_processes"])
    if stacked is None or not empty:
        return None
    target = str(empty[0])
    pids = f["stacked_pids"]
    summary = (
        f"{na(len(pids) if pids is not None else None)} vLLM processes hold memory on GPU {stacked}"
        f" ({na(f['stacked_desc'])}) while GPU(s) {empty} hold nothing: the device pinning"
        f" (CUDA_VISIBLE_DEVICES) is wrong. Start the second engine with CUDA_VISIBLE_DEVICES={target}."
    )
    gmu_sum = f["colocated_gmu_sum"]
    if gmu_sum is not None and f["colocated_gpu"] == stacked and gmu_sum > 0.95:
        # The overcommit (colocated-engines-overcommit) is this stacking's consequence.
        summary += (
            f" Together they ask for gmu {gmu_sum:.2f} of the one card: that overcommit goes away with the"
            " move, so splitting the gmu is only the fallback."
        )
    evidence = [
        Evidence(
            "engines on one GPU", na(f["stacked_desc"]), "nvidia-smi Processes / NVML compute processes"
        ),
        Evidence("idle GPUs", str(empty), "nvidia-smi Memory-Usage"),
    ]
    fixes = [
        Fix(
            env={"CUDA_VISIBLE_DEVICES": target},
            why="the second engine on the idle GPU, each with its own card",
        )
    ]
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted({stacked, *empty}))


RULE = Rule(
    id="engines-stacked-on-one-gpu",
    family="W",
    severity="critical",
    title="Several vLLM engines are stacked on one GPU while another GPU is idle",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    explains=("colocated-engines-overcommit", "shared-gpu-gmu-unset"),
    flags=("CUDA_VISIBLE_DEVICES",),
)
