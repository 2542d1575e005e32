"""## What
"CUDA out of memory occurred when warming up sampler with N dummy requests." (≤ 0.33), or on
vLLM ≥ 0.34 (which dropped that text) a startup torch OOM whose frames run through
`_dummy_sampler_run`, before `init engine … took`.

## Why
The sampler warm-up runs max_num_seqs requests at once (1024 by default on 70+ GiB cards since
0.10) after the KV cache and graphs have taken gmu × total; with a high gmu there is no room left.

## How to confirm
The RuntimeError in the log, after "Graph capturing finished".

On 0.34, N = min(max_num_seqs, max_num_batched_tokens) (`gpu_worker.py:1184-1187`; no longer
printed), and with the extensible KV cache the warm-up runs before the KV pool is committed.

## Fix
`--max-num-seqs` N/2 … N/8; or a gmu about 0.03 lower — not on a 0.34 extensible engine, where a
lower gmu takes effect only at the KV sizing after the warm-up and frees nothing for it.

## Sources
vllm-facts.md §3.5 ("OOM wrapped by vLLM"), §9.5; spec/vllm-0.34.md §2 sampler-warmup-oom.
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
    # 0.33 and older wrap the OOM in their own text; 0.34 prints a plain torch OOM whose frames
    # run through _dummy_sampler_run before the engine serves (phase 'sampler_warmup')
    frames = "sampler_warmup" in (f["oom_phases"] or [])
    if not (f["sampler_oom"] or frames):
        return None
    v34 = bool(f["vllm_v34"])
    ext = v34 and f["vllm_sizing_mode"] == "extensible"
    n: int | None
    if f["sampler_oom_requests"]:
        n = f["sampler_oom_requests"]
    elif v34:
        # 0.34 no longer prints N: min(max_num_seqs, max_num_batched_tokens) (gpu_worker.py:1184-1187)
        seqs = f["sampler_warmup_requests"] or f["max_num_seqs_effective"]
        n = int(seqs) if seqs else None
    else:
        n = f["max_num_seqs_effective"]
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
    # On the extensible KV cache the sampler warm-up runs before the KV commit
    # (gpu_worker.py:1179-1194 precedes :1225-1238): a lower gmu frees nothing then.
    gmu_fix = floor_to(gmu - _GMU_STEP, 0.01) if gmu and gmu > 0.1 and not ext else None
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
    if ext:
        summary = (
            f"vLLM warmed up the sampler with {na(n)} dummy requests (min(max_num_seqs, max_num_batched_tokens))"
            " and ran out of memory before the extensible KV cache was committed, so a lower gmu would free"
            f" nothing here.{advice}"
        )
    else:
        summary = (
            f"After the KV cache and CUDA graphs were allocated, vLLM warmed up the sampler with {na(n)} dummy"
            f" requests (max_num_seqs) and ran out of memory.{advice}"
        )
    if f["sampler_oom"]:
        evidence = [
            Evidence(
                "sampler warm-up OOM",
                f"{na(f['sampler_oom_requests'])} dummy requests",
                f"vllm.log line {na(f['sampler_oom_line'])}",
            )
        ]
    else:
        evidence = [
            Evidence(
                "sampler warm-up OOM",
                f"torch OOM through _dummy_sampler_run, {na(n)} dummy requests",
                f"vllm.log line {na(f['oom_line'])} (traceback frames, before 'init engine … took')",
            )
        ]
    evidence.append(Evidence("gpu_memory_utilization", na(gmu), na(f["gmu_assumption"])))
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
