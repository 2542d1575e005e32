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

import json
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na
from kvdoctor.units import floor_to


@dataclass(frozen=True)
class Thresholds:
    #: GiB of CUDA graph memory assumed when the log does not say how much capture took
    graph_reserve_gib: float = 1.0
    #: a run-time OOM with graphs on counts when less than this many GiB is free at idle
    idle_free_min_gib: float = 1.0
    #: GiB another process must hold for shared-gpu-gmu-unset to own a 0.34 extensible capture OOM
    foreign_min_gib: float = 0.25


def _graph_estimate(f: Facts) -> int | None:
    """E, the CUDA-graph estimate vLLM subtracted before sizing the KV cache (bytes): the logged
    estimate (non-extensible 0.34), 0 when the estimate was off
    (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0) or did not exist (before 0.20), else unknown."""
    if f["graph_estimate_bytes"] is not None:
        return int(f["graph_estimate_bytes"])
    env = f["engine_env"] or {}
    release = f["vllm_release"]
    if env.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS") == "0" or (release is not None and release < 20):
        return 0
    return None


def _kv_bytes_fix(f: Facts) -> int | None:
    """kvdoctor's own --kv-cache-memory-bytes (vllm-facts §9.6): vLLM's 'fit into requested
    memory' B1 plus the graph estimate E it counted twice, rounded down to a whole block; only on a
    non-extensible engine where a KV byte size is already in use or the engine has no extensible
    cache (before 0.34). Never vLLM's raw number where E > 0, never on the extensible path."""
    b1, release = f["vllm_kv_memory_fit_bytes"], f["vllm_release"]
    if b1 is None or (release is not None and release < 11) or f["vllm_sizing_mode"] == "extensible":
        return None
    if f["vllm_v34"] and f["kv_cache_memory_bytes_value"] is None:
        return None
    e = _graph_estimate(f)
    if e is None:
        return None
    value = int(b1) + e
    b = f["kv_block_bytes"]
    if b:
        value = value // int(b) * int(b)
    in_use = f["vllm_kv_in_use_bytes"]
    if value <= 0 or (in_use is not None and value >= in_use):
        return None  # no smaller KV cache that still holds something
    return value


def _smaller_graphs(f: Facts) -> str | None:
    """The 0.34 compilation-config JSON that halves the widest captured graphs (spec §1 rule 7)."""
    n_dec, t_pre = f["decode_graph_max_requests"], f["prefill_graph_max_tokens"]
    if not (f["vllm_v34"] and n_dec and t_pre and n_dec >= 2 and t_pre >= 2):
        return None
    return json.dumps(
        {
            "max_decode_cudagraph_capture_requests": int(n_dec) // 2,
            "max_prefill_cudagraph_capture_tokens": int(t_pre) // 2,
        },
        separators=(", ", ": "),
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    gmu, captured = f["gmu"], f["graph_capture_bytes"]
    graph_bytes = captured or t.graph_reserve_gib * 2**30
    total = f["gpu_total_bytes"] or f["oom_total_bytes"]
    oom_count = f["oom_count"]
    ext = f["vllm_sizing_mode"] == "extensible"
    capture = bool(f["graph_capture_oom"])
    if ext and (f["foreign_bytes"] or 0) >= t.foreign_min_gib * 2**30:
        return None  # another process holds the memory: shared-gpu-gmu-unset (N1)
    # On the extensible path graphs are captured with only the null block committed: the KV cannot
    # have taken their memory, and idle free memory is μ + kept by design (spec/vllm-0.34.md §2).
    headroom_short = bool(
        not ext
        and captured is not None
        and total
        and gmu is not None
        and (1 - gmu) * total < captured
        and oom_count is not None
        and oom_count > 0
    )
    free = f["gpu_free_bytes"]
    runtime_tight = bool(
        not ext
        and f["runtime_oom"]
        and not f["enforce_eager"]
        and free is not None
        and free < t.idle_free_min_gib * 2**30
    )
    if not (capture or headroom_short or runtime_tight) or f["fi_overflow"]:
        return None

    alternatives: list[str] = []
    fixes: list[Fix] = []
    kv_fix = _kv_bytes_fix(f)
    # A lower gmu frees nothing during capture on the extensible path (spec §1 fix validity 4).
    gmu_fix = floor_to(gmu - graph_bytes / total, 0.01) if total and gmu is not None and not ext else None
    if gmu_fix is not None and is_valid(f, "--gpu-memory-utilization", gmu_fix):
        text = str(flag_value(gmu_fix))
        alternatives.append(f"Leave that much headroom with --gpu-memory-utilization {text}")
        fixes.append(
            Fix(flags={"--gpu-memory-utilization": text}, why="headroom outside the budget for the graphs")
        )
    if kv_fix is not None and is_valid(f, "--kv-cache-memory-bytes", kv_fix):
        in_use = f["vllm_kv_in_use_bytes"]
        bpt = f["kv_bytes_per_token"]
        cost = (
            f" instead of the {gib_text(in_use)} GiB in use"
            + (f", about {int((in_use - kv_fix) // bpt):,} KV tokens fewer" if bpt else "")
            if in_use is not None
            else ""
        )
        alternatives.append(
            f"fix the KV size with --kv-cache-memory-bytes {kv_fix} ({gib_text(kv_fix)} GiB{cost}; kvdoctor's"
            " value: vLLM's 'fit into requested memory' figure with graph memory counted once, whole blocks;"
            " gmu then no longer sizes the KV cache)"
        )
        fixes.append(
            Fix(
                flags={"--kv-cache-memory-bytes": str(kv_fix)},
                why="a KV cache that leaves the requested memory room for the captured graphs",
            )
        )
    cc = _smaller_graphs(f)
    if cc is not None and not f["enforce_eager"] and is_valid(f, "--compilation-config", cc):
        alternatives.append(
            f"capture smaller graphs with --compilation-config '{cc}' (the saving is not computed)"
        )
        fixes.append(Fix(flags={"--compilation-config": cc}, why="half the widest captured CUDA graphs"))
    elif not f["vllm_v34"]:
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
    title = None
    if ext:
        summary = (
            "CUDA graph capture ran out of memory on the extensible KV cache (vLLM ≥ 0.34): graphs are captured"
            " with only the null KV block committed, so the weights, activations and"
            + (
                f" about {gib_text(captured)} GiB of graphs"
                if captured
                else " the graphs (their size is not logged)"
            )
            + " exceeded the free memory; a lower gmu frees nothing before"
            f" the KV cache is sized.{advice}"
        )
    elif capture:
        summary = (
            f"The KV cache was sized inside gmu {na(gmu)} × {gib_text(total)} GiB, then CUDA graph capture"
            f" needed about {gib_text(graph_bytes)} GiB outside that budget and ran out of memory.{advice}"
        )
    else:
        # issue 24 kind 3: no capture frames or capture phase, so the words and the title say what the
        # evidence shows: the graphs live outside the budget and a later (run-time) OOM followed.
        title = "CUDA graphs live outside the KV budget; a run-time OOM followed"
        if headroom_short:
            left = f"more than the {gib_text((1 - gmu) * total)} GiB gmu leaves outside the budget"  # type: ignore[operator]
        else:
            left = f"leaving {gib_text(free)} GiB free at idle"
        summary = (
            f"The KV cache was sized inside gmu {na(gmu)} × {gib_text(total)} GiB without the"
            f" {gib_text(graph_bytes)} GiB of CUDA graphs captured afterwards, {left}; a run-time OOM"
            f" (log line {na(f['oom_line'])}, not during capture) followed.{advice}"
        )

    evidence: list[Evidence] = []
    if capture:
        evidence.append(
            Evidence(
                "OOM during CUDA graph capture",
                f"line {na(f['oom_line'])}, GPU {na(f['oom_gpu'])}",
                "vllm.log (CUDA out of memory after 'Capturing cudagraphs')",
            )
        )
    elif f["oom_line"] is not None:
        evidence.append(
            Evidence(
                "OOM", f"line {f['oom_line']}, phase {na(f['oom_phase'])}", "vllm.log (CUDA out of memory)"
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
    b1 = f["vllm_kv_memory_fit_bytes"]
    if b1 is not None and f["vllm_kv_memory_line"] is not None:
        evidence.append(
            Evidence(
                "vLLM's own suggestion (not advised: kvdoctor computes its own)",
                f"{b1:,} bytes ({gib_text(b1)} GiB) to fit into requested memory",
                f"vllm.log line {f['vllm_kv_memory_line']} (Free memory on device … Replace"
                " gpu_memory_utilization config with …)",
            )
        )
    if runtime_tight:
        evidence.append(Evidence("free memory at idle", f"{gib_text(free)} GiB", "nvidia-smi Memory-Usage"))
    return Hit(
        summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())), title=title
    )


RULE = Rule(
    id="cuda-graph-capture-oom",
    family="K",
    severity="critical",
    title="CUDA graph capture ran out of memory",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "gpus"),
    flags=(
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--compilation-config",
        "--max-num-seqs",
        "--enforce-eager",
    ),
)
