"""## What
A torch OOM where the failed allocation is smaller than free memory plus "reserved by PyTorch but
unallocated".

## Why
PyTorch's caching allocator keeps freed blocks in segments; a large request that fits no single
cached segment fails although the sum would suffice. Expandable segments let it grow one segment.

## How to confirm
The OOM text: "Tried to allocate X … of which Y is free … Z is reserved by PyTorch but
unallocated", with X < Y + Z.

## Fix
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (not on MIG). When it is already set the
OOM is not fragmentation and this rule stays silent.

## Sources
vllm-facts.md §3.6 (PyTorch OOM message, current and historical forms).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na
from kvdoctor.units import MiB, fmt_bytes

_ENV = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class Thresholds:
    #: MiB "reserved by PyTorch but unallocated" at least (less is no fragmentation worth a flag)
    min_reserved_mib: float = 512


def alloc_conf_with_expandable(current: str | None) -> str:
    """``current`` (the engine's PYTORCH_CUDA_ALLOC_CONF, "key:value" options joined by ",")
    with ``expandable_segments:True`` in place of any expandable_segments option, the operator's
    other options kept: "max_split_size_mb:512" → "max_split_size_mb:512,expandable_segments:True"."""
    kept = [
        opt.strip()
        for opt in (current or "").split(",")
        if opt.strip() and opt.split(":", 1)[0].strip().lower() != "expandable_segments"
    ]
    return ",".join([*kept, "expandable_segments:True"])


def check(f: Facts, t: Thresholds) -> Hit | None:
    requested, free, reserved = (
        f["oom_requested_bytes"],
        f["oom_free_bytes"],
        f["oom_reserved_unallocated_bytes"],
    )
    if requested is None or reserved is None:
        return None
    if reserved < t.min_reserved_mib * MiB or not requested < (free or 0) + reserved:
        return None
    if f["oom_phase"] in ("cuda_graph_capture", "weight_loading"):
        return None
    if f["gpu_mig"] or f["alloc_conf_expandable"] or f["fi_overflow"]:
        return None

    words = (
        f"A {fmt_bytes(requested)} allocation failed with {fmt_bytes(free)} free on the GPU plus"
        f" {fmt_bytes(reserved)} reserved by PyTorch but unallocated: enough in total, but not in one piece."
    )
    fixes = []
    conf = alloc_conf_with_expandable((f["engine_env"] or {}).get(_ENV))
    if is_valid(f, _ENV, conf):
        words += f" Let the allocator grow segments: {_ENV}={conf}."
        fixes.append(Fix(env={_ENV: conf}, why="the allocator grows one segment instead of failing"))
    line = na(f["oom_line"])
    evidence = [
        Evidence(
            "failed allocation", fmt_bytes(requested), f"vllm.log line {line} (torch CUDA out of memory)"
        ),
        Evidence(
            "free + reserved-but-unallocated",
            f"{fmt_bytes(free)} + {fmt_bytes(reserved)}",
            f"vllm.log line {line}",
        ),
    ]
    gpu = f["oom_gpu"]
    return Hit(
        summary=words,
        evidence=evidence,
        fixes=fixes,
        gpus=[gpu] if gpu is not None else sorted(set(f["engine_gpus"] or ())),
    )


RULE = Rule(
    id="allocator-fragmentation",
    family="L",
    severity="warning",
    title="PyTorch's allocator failed although enough memory was reserved (fragmentation)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    flags=(_ENV,),
)
