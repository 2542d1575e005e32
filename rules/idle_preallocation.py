"""## What
GPU memory ≈ gpu_memory_utilization × total with no traffic and KV usage ≈ 0.

## Why
vLLM preallocates its whole budget at startup (weights, activations, then every remaining byte
as KV blocks), so nvidia-smi shows the card "full" even at idle. That is by design — the seed
tutorial's "low utilisation with full memory" is vLLM's normal idle state.

## How to confirm
`vllm:kv_cache_usage_perc` 0, `vllm:num_requests_running` 0, used ≈ gmu × total.

## Fix
Nothing to fix. To share the card, start with a lower `--gpu-memory-utilization` (the finding
computes one that leaves 16 GiB free).

## Sources
vllm-facts.md §2.1; seed-tutorial errata 6.
"""

from __future__ import annotations

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


def _gmu_share(f: Facts, t: Thresholds) -> float | None:
    """The gmu that leaves ``share_free_gib`` free, when lower than the gmu in effect (and a
    value vLLM accepts); else None."""
    total, gmu = f["gpu_total_bytes"], f["gmu"]
    if not total or gmu is None:
        return None
    try:
        share = gmu_fitting(int(total - t.share_free_gib * 2**30), total, 0)
    except ValueError:
        return None
    return share if share < gmu and is_valid(f, GMU, share) else None


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
    ):
        return None
    share = _gmu_share(f, t)
    kv_words = (
        " (a pooling engine: its KV usage gauge is a placeholder, not read)"
        if pooling
        else " and an empty KV cache"
    )
    summary = (
        f"{gib_text(used, '.1f')} of {gib_text(total, '.1f')} GiB is used with no traffic{kv_words}: vLLM reserves"
        f" gmu {gmu} × total at start for weights and KV blocks. This is not a leak."
    )
    fixes: list[Fix] = []
    if share is not None:
        summary += (
            f" To share the card, {GMU} {flag_value(share)} would leave about {t.share_free_gib} GiB free."
        )
        fixes.append(
            Fix(
                flags={GMU: str(flag_value(share))},
                why=f"about {t.share_free_gib} GiB left free to share the card",
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
