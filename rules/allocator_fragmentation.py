"""## What
A torch OOM where the failed allocation is smaller than free memory plus "reserved by PyTorch but
unallocated".

## Why
PyTorch's caching allocator keeps freed blocks in segments; a large request that fits no single
cached segment fails although the sum would suffice. Expandable segments let it grow one segment.

On vLLM 0.34's extensible KV cache torch is capped at L ("Torch may reserve up to L GiB"):
the test is X < Z + min(Y, allowed − reserved_total), allowed = the OOM's "X allowed" or L,
reserved_total = allocated by PyTorch + Z. A request above that is the cap (torch-cap-oom),
not fragmentation.

## How to confirm
The OOM text: "Tried to allocate X … of which Y is free … Z is reserved by PyTorch but
unallocated", with X < Y + Z.

## Fix
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (not on MIG). When it is already set the
OOM is not fragmentation and this rule stays silent.

## Sources
vllm-facts.md §3.6 (PyTorch OOM message, current and historical forms); spec/vllm-0.34.md §2
(the torch cap on 0.34).
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


def _cap_headroom(f: Facts) -> int | None:
    """allowed − reserved_total: what torch may still reserve under its per-process cap on a 0.34
    extensible engine (allowed = the OOM's 'X allowed', else L from 'Memory after warmup';
    reserved_total = allocated by PyTorch + reserved but unallocated); None off that path or
    when a figure is unknown."""
    if f["vllm_sizing_mode"] != "extensible":
        return None
    allowed = f["oom_allowed_bytes"] if f["oom_allowed_bytes"] is not None else f["torch_cap_bytes"]
    allocated, reserved = f["oom_allocated_bytes"], f["oom_reserved_unallocated_bytes"]
    if allowed is None or allocated is None or reserved is None:
        return None
    return max(0, int(allowed) - int(allocated) - int(reserved))


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
    # vLLM 0.34's extensible KV cache caps torch at L ('Torch may reserve up to L'): torch may
    # grow only to the cap, so free memory beyond it does not count (spec/vllm-0.34.md §2). A
    # request above what the cap leaves is the cap (torch-cap-oom), not fragmentation.
    capped = _cap_headroom(f)
    if capped is not None and not requested < reserved + min(free or 0, capped):
        return None
    if f["oom_phase"] in ("cuda_graph_capture", "weight_loading"):
        return None
    if f["gpu_mig"] or f["alloc_conf_expandable"] or f["fi_overflow"]:
        return None

    words = (
        f"A {fmt_bytes(requested)} allocation failed with {fmt_bytes(free)} free on the GPU plus"
        f" {fmt_bytes(reserved)} reserved by PyTorch but unallocated: enough in total, but not in one piece."
    )
    if capped is not None:
        words += (
            f" Torch's cap on vLLM 0.34's extensible KV cache left it {fmt_bytes(capped)} more to reserve,"
            " which the allocation fit too."
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
