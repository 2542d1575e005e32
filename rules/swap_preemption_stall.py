"""## What
A V0 engine preempts by SWAP (moves a sequence group's KV blocks to CPU memory) and the stats
lines then show `Swapped: N reqs` with `Avg generation throughput: 0.0 tokens/s` while
`Running` > 0 (or `vllm:num_requests_swapped` > 0 with no generated tokens in the window).

## Why
V0 preempts a sequence group with one sequence by recompute, but one with several sequences
(`n` > 1, `best_of`, beam search) by swapping its blocks to the CPU swap space (`--swap-space`,
4 GiB per GPU by default). Swapping in and out over PCIe, under a full KV cache, can stall
generation for the whole batch. V1 never swaps; it preempts by recompute only.

## How to confirm
The V0 stats line (`Running: …, Swapped: …, Pending: …, GPU KV cache usage: …, CPU KV cache
usage: …`) and the WARNING `Sequence group … is preempted by PreemptionMode.SWAP mode because
there is not enough KV cache space`.

## Fix
`--swap-space 0`, and cap `n` / `best_of` in the requests: with no swap space V0 cannot park a
multi-sequence group and aborts it instead of stalling. Or move to a V1 engine.

## Sources
vllm-facts.md §3.4 (V0 stats line), §3.5 ("Preemption", "Swap space"), §1.5 (V0 metrics:
`vllm:num_requests_swapped`; V1 never swaps), §4.2 (`--swap-space`, removed in 0.18).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    pass


def check(f: Facts, t: Thresholds) -> Hit | None:
    # V0 only: vLLM 0.34 has no V0 engine and no swap preemption (spec/vllm-0.34.md)
    if not f["swap_stall"] or f["is_pooling"] or f["vllm_v34"]:
        return None
    warnings, line, space = f["swap_preemptions"], f["swap_stall_line"], f["swap_space_gib"]
    swapped_n = f["log_swapped_max"] or f["swapped"]
    # --swap-space 0 is the fix unless it is already in effect (or the version has no such flag)
    fixes = (
        []
        if space == 0 or not is_valid(f, "--swap-space", 0)
        else [
            Fix(
                flags={"--swap-space": "0"},
                why="no swap space: a multi-sequence group is aborted instead of stalling the batch",
            )
        ]
    )
    preempted = f' ({warnings} "preempted by PreemptionMode.SWAP" warnings)' if warnings else ""
    parked = f"up to {swapped_n:,} requests sat in CPU swap and " if swapped_n else ""
    where = f" (vllm.log line {line})" if line else ""
    summary = (
        f"The V0 engine preempted requests by SWAP{preempted} and then generated nothing while {parked}"
        f"requests were still running{where}: swapping KV blocks over PCIe stalls the whole batch. "
    )
    if fixes:
        summary += f"Set --swap-space 0{f' (now {space:g} GiB)' if space else ''} and cap"
    elif space == 0:
        summary += "The swap space is already 0 GiB: cap"
    else:
        summary += "Cap"
    summary += (
        " n / best_of (and beam search) in the requests: only sequence groups with several sequences are"
        " swapped, single-sequence requests are preempted by recompute, and with no swap space a"
        " multi-sequence group that must be preempted is aborted rather than parked. V1 engines (the"
        " default since vLLM 0.8) never swap."
    )
    evidence: list[Evidence] = []
    if warnings:
        evidence.append(
            Evidence(
                "SWAP-mode preemptions",
                f"{warnings}",
                "vllm.log 'Sequence group … is preempted by PreemptionMode.SWAP mode'",
            )
        )
    if line is not None:
        evidence.append(
            Evidence(
                "stalled stats line",
                f"Swapped {na(f['log_swapped_max'])} reqs, Avg generation throughput 0.0 tokens/s,"
                " Running > 0",
                f"vllm.log line {line}",
            )
        )
    if f["swapped"]:
        evidence.append(Evidence("requests swapped", f"{f['swapped']:,.0f}", "vllm:num_requests_swapped"))
    rate = f["generation_tokens_per_s"]
    if rate is not None:
        evidence.append(
            Evidence("generation rate", f"{rate:.1f} tokens/s", "rate(vllm:generation_tokens_total)")
        )
    if space:
        evidence.append(Evidence("swap space", f"{space:g} GiB", "--swap-space (V0 default 4)"))
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="swap-preemption-stall",
    family="L",
    severity="critical",
    title="Requests preempted to CPU swap stall the V0 engine",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "metrics"),
    # root cause of these findings when they fire together (reports nest them under this one)
    explains=("preemption-storm", "low-util-kv-saturated"),
    flags=("--swap-space",),
)
