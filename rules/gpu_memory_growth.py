"""## What
The used memory of an engine's GPU rises over a series of readings (nvidia-smi
`--query-gpu=timestamp,index,memory.used,… --format=csv -l N`, repeated nvidia-smi tables, or
live samples). The slope is a least-squares fit in GiB per hour; a later half that is flat is a
plateau (info), a later half still rising is steady growth (warning) with a projected time to
full.

## Why
vLLM preallocates gpu_memory_utilization × total at start (weights, activation peak, KV cache),
so "the card is 92 % full" is normal and should not move afterwards. A rise during the first
minutes is warm-up (CUDA graphs captured lazily, allocator caches, NCCL buffers). Growth that
continues with traffic is memory outside the preallocation: a leak in a custom kernel or
extension, growing non-torch allocations, or another process, and ends in an OOM.

## How to confirm
`nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -l 60` over hours, next to
`vllm:request_success_total`; the engine's own per-process memory in
`nvidia-smi --query-compute-apps=pid,used_memory --format=csv`.

## Fix
No flag: find what grows (per-process memory), restart the engine before the projected time to
full, and report the leak upstream.

## Sources
vllm-facts.md §2.1 (what vLLM allocates at startup and when), §4.2 (`--gpu-memory-utilization`);
spec/rules.md family P.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Hit, Rule, na
from kvdoctor.units import GiB, fmt_bytes


@dataclass(frozen=True)
class Thresholds:
    #: GiB the used memory must have risen by (last − first reading)
    min_rise_gib: float = 0.5
    #: seconds the readings must span
    min_span_s: float = 600
    #: the later half levelled off when its slope is under this share of the overall one
    plateau_ratio: float = 0.25


def check(f: Facts, t: Thresholds) -> Hit | None:
    rise, rate, span = f["mem_growth_rise_bytes"], f["mem_growth_bytes_per_hour"], f["mem_growth_span_s"]
    if rise is None or rate is None or span is None:
        return None
    if rise < t.min_rise_gib * GiB or rate <= 0 or span < t.min_span_s:
        return None
    recent = f["mem_growth_recent_bytes_per_hour"]
    recent_gib_h = None if recent is None else recent / GiB
    plateau = recent is not None and recent < t.plateau_ratio * rate
    # the recent slope while still climbing, else the overall one
    growth_rate = recent if recent is not None and recent > 0 and not plateau else rate
    headroom = f["mem_growth_headroom_bytes"]
    hours_to_full = max(0.0, headroom / growth_rate) if headroom is not None and growth_rate > 0 else None

    words = (
        f"Used memory on GPU {na(f['mem_growth_gpu'])} rose by {fmt_bytes(rise)} over {span / 3600:.1f} h"
        f" ({na(f['mem_growth_points'])} readings, least-squares slope {rate / GiB:.2f} GiB/h)"
        f" to {fmt_bytes(f['mem_growth_used_bytes'])}. "
    )
    if plateau:
        words += (
            f"It has levelled off since ({na(recent_gib_h, '.2f')} GiB/h over the later half): warm-up -"
            " CUDA graphs, allocator caches and NCCL buffers filling once - not a leak."
        )
    else:
        requests_per_s = f["requests_per_s"]
        words += (
            f"It is still climbing ({na(recent_gib_h, '.2f')} GiB/h over the later half)"
            + (
                f": at this rate the card is full in about {hours_to_full:.1f} h"
                if hours_to_full is not None
                else ""
            )
            + ". vLLM preallocates its KV cache at start, so steady growth after warm-up is memory"
            " outside it (a leak in a custom op / extension, growing non-torch allocations, or another"
            " process): correlate with requests served"
            + (f" ({requests_per_s * 3600:,.0f} requests/h now)" if requests_per_s else "")
            + " and restart the engine before it runs out."
        )

    evidence = [
        Evidence(
            "used memory growth",
            f"{fmt_bytes(rise)} in {span:.0f} s, {rate / GiB:.2f} GiB/h",
            "nvidia-smi memory.used over time (-l loop) / NVML samples",
        )
    ]
    if recent_gib_h is not None:
        evidence.append(
            Evidence(
                "slope over the later half",
                f"{recent_gib_h:.2f} GiB/h",
                "least squares over the later readings",
            )
        )
    if hours_to_full is not None and not plateau:
        evidence.append(
            Evidence(
                "projected time to full", f"{hours_to_full:.1f} h", "(memory.total − memory.used) / slope"
            )
        )
    gpu = f["mem_growth_gpu"]
    return Hit(
        summary=words,
        evidence=evidence,
        gpus=[gpu] if gpu is not None else [],
        severity="info" if plateau else None,
    )


RULE = Rule(
    id="gpu-memory-growth",
    family="P",
    severity="warning",
    title="Used GPU memory keeps rising over time",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
)
