"""## What
"CUDA out of memory occurred when warming up sampler with N dummy requests."

## Why
The sampler warm-up runs max_num_seqs requests at once (1024 by default on 70+ GiB cards since
0.10) after the KV cache and graphs have taken gmu × total; with a high gmu there is no room left.

## How to confirm
The RuntimeError in the log, after "Graph capturing finished".

## Fix
`--max-num-seqs` N/2 … N/8; or a gmu about 0.03 lower.

## Sources
vllm-facts.md §3.5 ("OOM wrapped by vLLM").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import floor_to


@dataclass(frozen=True)
class Thresholds:
    """None: the rule has no tunable thresholds."""


#: how much lower a gmu leaves the sampler room (fraction of the card)
_GMU_STEP = 0.03


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["sampler_oom"]:
        return None
    n = f["sampler_oom_requests"] or f["max_num_seqs_effective"]
    gmu = f["gmu"]

    alternatives: list[str] = []
    fixes: list[Fix] = []
    seqs_fix = max(1, n // 4) if n else None
    if seqs_fix is not None and is_valid(f, "--max-num-seqs", seqs_fix):
        alternatives.append(
            f"lower --max-num-seqs to {seqs_fix} (a quarter of {n}; anything from a half to an eighth works)"
        )
        fixes.append(
            Fix(flags={"--max-num-seqs": str(seqs_fix)}, why="fewer dummy requests in the sampler warm-up")
        )
    gmu_fix = floor_to(gmu - _GMU_STEP, 0.01) if gmu and gmu > 0.1 else None
    if gmu_fix is not None and is_valid(f, "--gpu-memory-utilization", gmu_fix):
        text = str(flag_value(gmu_fix))
        alternatives.append(f"lower --gpu-memory-utilization to {text} to leave the sampler room")
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": text},
                why="room outside the budget for the sampler warm-up",
            )
        )
    advice = ", or ".join(alternatives)
    advice = f" {advice[0].upper()}{advice[1:]}." if advice else ""
    summary = (
        f"After the KV cache and CUDA graphs were allocated, vLLM warmed up the sampler with {na(n)} dummy"
        f" requests (max_num_seqs) and ran out of memory.{advice}"
    )
    evidence = [
        Evidence(
            "sampler warm-up OOM",
            f"{na(f['sampler_oom_requests'])} dummy requests",
            f"vllm.log line {na(f['sampler_oom_line'])}",
        ),
        Evidence("gpu_memory_utilization", na(gmu), "launch command / log args"),
    ]
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="sampler-warmup-oom",
    family="K",
    severity="critical",
    title="The sampler warm-up with max_num_seqs dummy requests ran out of memory",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    flags=("--max-num-seqs", "--gpu-memory-utilization"),
)
