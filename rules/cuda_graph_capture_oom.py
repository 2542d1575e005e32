"""## What
An out-of-memory error during or right after CUDA graph capture, or a run-time OOM with CUDA
graphs on while less than 1 GiB is left free on the card.

## Why
vLLM captures CUDA graphs *after* the KV cache is allocated. Before 0.20 (and with
`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`) graph memory is not part of the budget: it comes
out of the 1 − gpu_memory_utilization headroom, a classic OOM on 16 GB cards.

## How to confirm
"Capturing cudagraphs …" then "CUDA out of memory"; or "Graph capturing finished in N secs, took
X GiB" larger than (1 − gmu) × total.

## Fix
A gmu lower by the graph bytes / total; or `--max-num-seqs` lower (fewer capture sizes); or
`--enforce-eager`.

## Sources
vllm-facts.md §2.1 step 6, §3.3 items 4 and 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na
from kvdoctor.units import floor_to


@dataclass(frozen=True)
class Thresholds:
    #: GiB of CUDA graph memory assumed when the log does not say how much capture took
    graph_reserve_gib: float = 1.0
    #: a run-time OOM with graphs on counts when less than this many GiB is free at idle
    idle_free_min_gib: float = 1.0


def _kv_memory_suggestion(f: Facts) -> int | None:
    """vLLM's own '--kv-cache-memory=B1' (post-warm-up summary, ≥ 0.11) when it shrinks the KV
    in use: shown as evidence, never advised (vllm-facts §9.6: it double-counts the graph
    estimate, and setting it turns the 0.34 extensible cache off)."""
    fit, in_use, release = f["vllm_kv_memory_fit_bytes"], f["vllm_kv_in_use_bytes"], f["vllm_release"]
    if (
        not fit
        or fit <= 0
        or (in_use is not None and fit >= in_use)
        or (release is not None and release < 11)
    ):
        return None
    return fit


def check(f: Facts, t: Thresholds) -> Hit | None:
    gmu, captured = f["gmu"], f["graph_capture_bytes"]
    graph_bytes = captured or t.graph_reserve_gib * 2**30
    total = f["gpu_total_bytes"] or f["oom_total_bytes"]
    oom_count = f["oom_count"]
    headroom_short = bool(
        captured is not None
        and total
        and gmu is not None
        and (1 - gmu) * total < captured
        and oom_count is not None
        and oom_count > 0
    )
    free = f["gpu_free_bytes"]
    runtime_tight = bool(
        f["runtime_oom"]
        and not f["enforce_eager"]
        and free is not None
        and free < t.idle_free_min_gib * 2**30
    )
    if not (f["graph_capture_oom"] or headroom_short or runtime_tight) or f["fi_overflow"]:
        return None

    alternatives: list[str] = []
    fixes: list[Fix] = []
    gmu_fix = floor_to(gmu - graph_bytes / total, 0.01) if total and gmu is not None else None
    if gmu_fix is not None and is_valid(f, "--gpu-memory-utilization", gmu_fix):
        text = str(flag_value(gmu_fix))
        alternatives.append(f"Leave that much headroom with --gpu-memory-utilization {text}")
        fixes.append(
            Fix(flags={"--gpu-memory-utilization": text}, why="headroom outside the budget for the graphs")
        )
    # Fewer sequences → fewer capture sizes, smaller graph pool (half of what is in effect).
    seqs = f["max_num_seqs_effective"]
    seqs_fix = max(1, seqs // 2) if seqs and seqs > 1 else None
    if seqs_fix is not None and is_valid(f, "--max-num-seqs", seqs_fix):
        alternatives.append(f"capture fewer graphs with --max-num-seqs {seqs_fix}")
        fixes.append(
            Fix(flags={"--max-num-seqs": str(seqs_fix)}, why="fewer capture sizes, a smaller graph pool")
        )
    if not f["enforce_eager"] and is_valid(f, "--enforce-eager", True):
        alternatives.append("run without graphs (--enforce-eager)")
        fixes.append(
            Fix(flags={"--enforce-eager": ""}, why="no CUDA graphs at all, at the cost of slower decode")
        )
    if alternatives:
        advice = ", or ".join(alternatives)
        advice = " " + advice[0].upper() + advice[1:] + "."
    else:
        advice = ""
    summary = (
        f"The KV cache was sized inside gmu {na(gmu)} × {gib_text(total)} GiB, then CUDA graph capture"
        f" needed about {gib_text(graph_bytes)} GiB outside that budget and ran out of memory.{advice}"
    )

    evidence: list[Evidence] = []
    if f["graph_capture_oom"]:
        evidence.append(
            Evidence(
                "OOM during CUDA graph capture",
                f"line {na(f['oom_line'])}, GPU {na(f['oom_gpu'])}",
                "vllm.log (CUDA out of memory after 'Capturing cudagraphs')",
            )
        )
    if captured is not None:
        evidence.append(
            Evidence(
                "graph memory",
                f"{gib_text(captured)} GiB",
                "vllm.log 'Graph capturing finished … took X GiB'",
            )
        )
    suggestion = _kv_memory_suggestion(f)
    if suggestion:
        evidence.append(
            Evidence(
                "vLLM's own --kv-cache-memory suggestion",
                f"{suggestion:,} bytes ({gib_text(suggestion)} GiB) to fit into requested memory",
                f"vllm.log line {na(f['vllm_kv_memory_line'])} (Free memory on device … Replace"
                " gpu_memory_utilization config with --kv-cache-memory=…)",
            )
        )
    if runtime_tight:
        evidence.append(Evidence("free memory at idle", f"{gib_text(free)} GiB", "nvidia-smi Memory-Usage"))
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="cuda-graph-capture-oom",
    family="K",
    severity="critical",
    title="CUDA graph capture ran out of memory",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "gpus"),
    flags=("--gpu-memory-utilization", "--max-num-seqs", "--enforce-eager"),
)
