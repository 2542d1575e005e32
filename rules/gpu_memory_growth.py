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

On vLLM 0.34's extensible KV cache torch's reservation may grow by H_torch after startup, up
to its cap L, on the first large steps: growth within H_torch + 0.5 GiB is a plateau by design
(info); growth beyond it is non-torch (NCCL, Triton, code objects) or the KV cache. Not growth:
a step between readings the size of the KV commit at startup, of a recommit after a wake, a
checkpoint restore or a KV loan (spec/vllm-0.34.md §2).

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

#: what vLLM 0.34 keeps outside torch's cap for non-torch allocations (vllm-facts §9.2 step 8)
_NON_TORCH_RESERVE = GiB // 2


@dataclass(frozen=True)
class Thresholds:
    #: GiB the used memory must have risen by (last − first reading)
    min_rise_gib: float = 0.5
    #: seconds the readings must span
    min_span_s: float = 600
    #: the later half levelled off when its slope is under this share of the overall one
    plateau_ratio: float = 0.25
    #: a step between two readings is a 0.34 KV commit / recommit when within this share …
    step_match_fraction: float = 0.1
    #: … plus this many GiB of the bytes mapped (an estimate)
    step_match_gib: float = 0.5


def _known_step(f: Facts, t: Thresholds) -> tuple[int, str] | None:
    """The largest step between two readings when it matches memory vLLM 0.34's extensible KV
    cache maps on purpose (spec/vllm-0.34.md §2 "not growth"): the KV commit at startup (the
    committed pool) or a recommit after a wake, a checkpoint restore or a KV loan (the pool, or
    weights + pool for a full wake). (bytes, what) or None."""
    step = f["mem_growth_max_step_bytes"]
    if f["vllm_sizing_mode"] != "extensible" or not step or step <= 0:
        return None
    pool = f["kv_pool_bytes"] or f["sleep_kv_bytes"]
    candidates: list[tuple[int, str]] = []
    if pool:
        candidates.append((pool, "the KV cache commit at startup ('Extended KV cache to N blocks')"))
    if f["kv_recommits"]:
        if pool:
            candidates.append((pool, "the KV cache recommitted after a wake-up, restore or KV loan"))
        if f["sleep_pool_bytes"]:
            candidates.append((f["sleep_pool_bytes"], "weights and KV cache mapped back by a wake-up"))
    for size, what in candidates:
        if abs(step - size) <= t.step_match_fraction * size + t.step_match_gib * GiB:
            return step, what
    return None


def check(f: Facts, t: Thresholds) -> Hit | None:
    rise, rate, span = f["mem_growth_rise_bytes"], f["mem_growth_bytes_per_hour"], f["mem_growth_span_s"]
    if rise is None or rate is None or span is None:
        return None
    if rise < t.min_rise_gib * GiB or rate <= 0 or span < t.min_span_s:
        return None
    step = _known_step(f, t)
    if step is not None and rise - step[0] < t.min_rise_gib * GiB:
        return None  # a step vLLM 0.34 takes on purpose, not growth
    ext = f["vllm_sizing_mode"] == "extensible"
    grown = rise - (step[0] if step else 0)
    h_torch = f["torch_headroom_bytes"]
    # 0.34 ext: torch may grow by H_torch after startup, up to its cap L: a plateau by design
    by_design = ext and h_torch is not None and grown <= h_torch + _NON_TORCH_RESERVE
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
    if step is not None:
        words += f"A {fmt_bytes(step[0])} step of it is {step[1]}, not growth. "
    if by_design:
        words += (
            f"On vLLM 0.34's extensible KV cache torch may still grow its reservation by"
            f" {fmt_bytes(h_torch)} after startup on the first large steps, up to its cap"
            f" ({fmt_bytes(f['torch_cap_bytes'])}, 'Torch may reserve up to'), plus 0.5 GiB outside it:"
            f" the {fmt_bytes(grown)} is within that, a plateau by design, not a leak; torch cannot pass the"
            " cap (it fails with an OOM at the cap instead)."
        )
    elif plateau:
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
            + (
                f". On vLLM 0.34's extensible KV cache torch may grow only by {fmt_bytes(h_torch)} (to its cap)"
                " plus 0.5 GiB outside it: growth beyond that is non-torch memory (NCCL, Triton, code"
                " objects) or the KV cache"
                if ext and h_torch is not None
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
    if by_design:
        evidence.append(
            Evidence(
                "torch headroom after startup",
                fmt_bytes(h_torch),
                "H_torch = F1 − (pool − committed) − 0.5 GiB, from 'Memory after warmup' (vllm-facts §9.2)",
            )
        )
    if hours_to_full is not None and not plateau and not by_design:
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
        severity="info" if plateau or by_design else None,
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
