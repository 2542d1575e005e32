"""## What
GPU memory ≈ gpu_memory_utilization × total with no traffic and KV usage ≈ 0.

## Why
vLLM preallocates its whole budget at startup (weights, activations, then every remaining byte
as KV blocks), so nvidia-smi shows the card "full" even at idle. That is by design — the seed
tutorial's "low utilisation with full memory" is vLLM's normal idle state.

## How to confirm
`vllm:kv_cache_usage_perc` 0, `vllm:num_requests_running` 0, used ≈ gmu × total.

On vLLM ≥ 0.34 with the extensible KV cache and gmu unset (u = 1.0) this is normal too:
0.34 measures after warm-up and commits all but μ + kept. A sleeping engine beside it on the
same GPU (a sleep-swap set) is counted by the memory it still holds.

## Fix
Nothing to fix. To share the card, start with a lower `--gpu-memory-utilization`: the finding
computes one that leaves 16 GiB free (0.5 GiB margin on 0.34 extensible), or, where that would
not hold the model and one max_model_len request, the lowest one that still does.

## Sources
vllm-facts.md §2.1; seed-tutorial errata 6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdoctor.kvmath import gmu_fitting
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na

GMU = "--gpu-memory-utilization"


@dataclass(frozen=True)
class Thresholds:
    #: GiB the suggested lower --gpu-memory-utilization leaves free to share the card
    share_free_gib: float = 16
    #: used memory at least this fraction of gmu × total counts as "looks full"
    near: float = 0.8
    #: GPU utilisation (fraction) at or below which the GPU is idle
    idle_util: float = 0.05


def _gmu_share(f: Facts, t: Thresholds, neighbours: int, ext: bool) -> float | None:
    """The gmu that leaves ``share_free_gib`` free (beside ``neighbours`` bytes other engines
    hold; 0.5 GiB margin on 0.34 extensible), else the lowest one vLLM still starts with (one
    max_model_len request), when lower than the gmu in effect; else None."""
    total, gmu = f["gpu_total_bytes"], f["gmu"]
    if not total or gmu is None:
        return None
    margin = int(0.5 * 2**30) if ext else 0
    try:
        share = gmu_fitting(int(total - neighbours - t.share_free_gib * 2**30), total, margin)
    except ValueError:
        return None
    lo, hi = round(share * 100), round(gmu * 100) - 1
    if lo < 1 or not is_valid(f, GMU, lo / 100):
        # The share does not hold the model: the lowest gmu above the weights (per rank) plus
        # 1 GiB that vLLM still starts with; without the weights, none.
        weights, tp_pp = f["weights_bytes"], f["tp_pp"]
        if weights is None or not tp_pp:
            return None
        lo = max(lo, math.ceil((weights / tp_pp + 2**30) / total * 100))
    # validity rises with the gmu (more KV): the lowest valid hundredth in [lo, hi]
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if is_valid(f, GMU, mid / 100):
            best, hi = mid / 100, mid - 1
        else:
            lo = mid + 1
    # a value that frees less than a quarter of the share beyond the gmu in effect is not worth
    # a restart (it changes nothing that matters)
    if best is not None and (gmu - best) * total < t.share_free_gib * 2**30 / 4:
        return None
    return best


def _awake_neighbour(f: Facts) -> bool:
    """Another awake vLLM engine shares this GPU (its memory is in the used figure; the
    colocation rules own the finding), or, on 0.34 extensible with gmu unset, another process
    does (shared-gpu-gmu-unset owns it)."""
    own, asleep = f["colocated_self"], f["colocated_sleeping"] or []
    n = f["colocated_count"] or 0
    if n >= 2 and any(i != own and not (i < len(asleep) and asleep[i]) for i in range(n)):
        return True
    ext_unset = bool(f["vllm_v34"]) and f["vllm_sizing_mode"] == "extensible" and f["gmu_explicit"] is False
    return ext_unset and (f["foreign_bytes"] or 0) >= 2**30 // 4


def _sleeping_neighbours(f: Facts) -> tuple[int, str | None]:
    """Bytes and names of the other engines on this GPU that are asleep (their gauge)."""
    own, names = f["colocated_self"], f["colocated_names"] or []
    asleep, held = f["colocated_sleeping"] or [], f["colocated_bytes"] or []
    out: list[tuple[str, int]] = []
    for i in range(min(len(names), len(asleep), len(held))):
        b = held[i]
        if i != own and asleep[i] and b:
            out.append((names[i], int(b)))
    if not out:
        return 0, None
    return sum(b for _, b in out), ", ".join(f"{n} {gib_text(b)} GiB" for n, b in out)


def check(f: Facts, t: Thresholds) -> Hit | None:
    used, total, gmu, util = f["gpu_used_bytes"], f["gpu_total_bytes"], f["gmu"], f["gpu_util"]
    pooling, kv_max = f["is_pooling"], f["kv_usage_max"]
    # KV usage must be read, not assumed: with --disable-log-stats there is none, and that is not
    # "empty". A pooling engine's gauge is a placeholder (100 % on V0 pooling runners): read but
    # ignored, idleness is judged from the traffic alone.
    kv_idle = kv_max is not None and (kv_max <= 0.01 or bool(pooling))
    if (
        f["traffic"]
        or not kv_idle
        or (util is not None and util > t.idle_util)
        or used is None
        or not total
        or gmu is None
        or used < t.near * gmu * total
        or f["startup_failed"]
        or f["oom_count"]
        or f["orphan_pids"]
        or f["asleep"]
        or _awake_neighbour(f)
    ):
        return None
    ext = bool(f["vllm_v34"]) and f["vllm_sizing_mode"] == "extensible"
    neighbours, neighbour_desc = _sleeping_neighbours(f)
    share = _gmu_share(f, t, neighbours, ext)
    kv_words = (
        " (a pooling engine: its KV usage gauge is a placeholder, not read)"
        if pooling
        else " and an empty KV cache"
    )
    if ext:
        idle = f["idle_headroom_design_bytes"]
        kept = f" ({gib_text(idle)} GiB here)" if idle is not None else ""
        how = (
            f"normal: vLLM 0.34 measures after warm-up and commits all but μ + kept{kept} of gmu"
            f" {float(gmu):.2f} × total as KV blocks (gmu {na(f['gmu_assumption'])})."
        )
    else:
        how = f"vLLM reserves gmu {gmu} × total at start for weights and KV blocks."
    asleep_words = (
        f" {gib_text(neighbours)} GiB of it is held by sleeping engine(s) beside it ({neighbour_desc})."
        if neighbour_desc
        else ""
    )
    summary = (
        f"{gib_text(used, '.1f')} of {gib_text(total, '.1f')} GiB is used with no traffic{kv_words}: {how}"
        f"{asleep_words} This is not a leak."
    )
    fixes: list[Fix] = []
    if share is not None:
        left = total - neighbours - share * total
        summary += (
            f" To share the card, {GMU} {flag_value(share)} would leave about {int(left // 2**30)} GiB free."
        )
        fixes.append(
            Fix(
                flags={GMU: str(flag_value(share))},
                why="memory left free to share the card",
            )
        )
    evidence = [
        Evidence(
            "GPU memory used",
            f"{gib_text(used)} / {gib_text(total)} GiB ({na(f['gpu_used_fraction'], '.0%')})",
            "nvidia-smi Memory-Usage",
        )
    ]
    if f["kv_usage"] is not None and not pooling:
        evidence.append(Evidence("KV cache usage", f"{f['kv_usage']:.0%}", "vllm:kv_cache_usage_perc"))
    if f["running"] is not None:
        evidence.append(
            Evidence(
                "requests running / waiting",
                f"{f['running']} / {na(f['waiting'])}",
                "vllm:num_requests_running / waiting",
            )
        )
    if util is not None:
        evidence.append(Evidence("GPU utilisation", f"{util:.0%}", "nvidia-smi GPU-Util"))
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="idle-preallocation",
    family="U",
    severity="info",
    title="Memory looks full but the server is idle - this is vLLM's normal preallocation",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    needs_any=("metrics", "log"),
    flags=(GMU,),
)
