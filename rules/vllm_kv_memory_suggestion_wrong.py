"""## What
vLLM's own post-warm-up suggestion "Replace gpu_memory_utilization config with
`--kv-cache-memory=B1` … or `--kv-cache-memory=B2` …" is wrong, or a KV byte size taken from it
(or from a persisted startup plan) is in effect. On vLLM ≥ 0.34 a KV byte size also turns the
extensible KV cache off.

## Why
Non-extensible engines with the CUDA-graph estimate on count graph memory twice (vllm#57936): B1
and B2 are low by the estimate E, negative when E is large. On the extensible path (the 0.34
default) B1 − B2 = T − F0, so B1 exceeds what was free at startup; both keep only P + 150 MiB for
transients against the μ + kept the warm-up measured; and "Current kv cache memory in use" is the
reservation, not the pool. Setting the byte size turns the extensible cache off: the budget falls
back to 0.92 with gmu unset, the startup free-memory check returns and torch is uncapped.

## How to confirm
The summary line `Free memory on device … Replace gpu_memory_utilization config with …`, the
`CUDA graph pool memory: … E GiB (estimated)` line (non-extensible), `Memory after warmup: … N KV
cache blocks …` (extensible), `kv_cache_memory_bytes` in `non-default args`, or `Applying persisted
startup plan (fingerprint …): kv_cache_memory_bytes=N`.

## Fix
Non-extensible: the corrected size B1 + E (rounded down to a whole block), as a flag only where a
KV byte size is already in use or the engine has no extensible cache. Extensible: remove the KV
byte size so that the extensible cache sizes itself (no flag value restores it); where a fixed size
is wanted, N × b from `Memory after warmup`, which still turns the extensible cache off.

## Sources
spec/vllm-0.34.md §3.3 (N3); vllm-facts.md §9.6 (how vLLM computes the suggestion, the double
count), §9.1 (what turns the extensible cache off).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid, na

_MiB = 2**20


@dataclass(frozen=True)
class Thresholds:
    #: MiB by which vLLM's suggestion must be off to be called wrong
    wrong_min_mib: float = 256.0
    #: MiB within which a size in effect counts as the value vLLM suggested
    same_mib: float = 1.0


def _floor_block(nbytes: int, b: int | None) -> int:
    return nbytes // b * b if b else nbytes


def _gib(nbytes: float | None) -> str:
    return f"{gib_text(nbytes)} GiB"


def check(f: Facts, t: Thresholds) -> Hit | None:
    b1, b2 = f["vllm_kv_memory_fit_bytes"], f["vllm_kv_memory_full_bytes"]
    in_effect, plan = f["kv_cache_memory_bytes_value"], f["startup_plan_kv_bytes"]
    ext, v34 = f["vllm_sizing_mode"] == "extensible", bool(f["vllm_v34"])
    b, n = f["kv_block_bytes"], f["kv_pool_blocks"]
    wrong_min = t.wrong_min_mib * _MiB
    failed = bool(f["startup_failed"] or f["engine_failed"] or f["runtime_oom"])

    parts: list[str] = []
    fixes: list[Fix] = []
    title: str | None = None
    severity = "info"
    suggested = [x for x in (b1, b2, plan) if isinstance(x, int)]
    # 1. the suggestion line, judged by mode
    if ext and b1 is not None and n and b:
        pool = n * b
        if abs(b1 - pool) >= wrong_min:
            kept, mu = f["warmup_kept_bytes"], f["warmup_margin_bytes"]
            why = []
            if b2 is not None and b1 > b2:
                why.append(
                    f"the 'fit into requested memory' value exceeds the other by {_gib(b1 - b2)}, T − F0"
                )
            if kept is not None and mu is not None:
                why.append(
                    f"it keeps only the profile peak + 150 MiB for transients, against μ + kept ="
                    f" {_gib(mu + kept)} that warm-up measured"
                )
            parts.append(
                f"vLLM suggests kv_cache_memory_bytes {b1:,} ({_gib(b1)}); the correct value is {pool:,}"
                f" ({_gib(pool)}), the {n:,} blocks × {b:,} B the extensible KV cache committed after warm-up"
                + (f" ({'; '.join(why)})" if why else "")
                + ". Any fixed KV size turns the extensible KV cache off (budget 0.92 with gmu unset,"
                " the startup free-memory check back, no torch cap): keep kv_cache_memory_bytes unset."
            )
    elif not ext and b1 is not None and f["graph_estimate_bytes"]:
        e = int(f["graph_estimate_bytes"])
        if e >= wrong_min:
            b1_ok = _floor_block(b1 + e, b)
            b2_ok = _floor_block(b2 + e, b) if b2 is not None else None
            parts.append(
                f"vLLM suggests kv_cache_memory_bytes {b1:,} ({_gib(b1)}); the correct value is {b1_ok:,}"
                f" ({_gib(b1_ok)}): vLLM counts the {_gib(e)} CUDA-graph estimate twice (vllm#57936)"
                + (
                    f"; its 'fully utilize' value {b2:,} ({_gib(b2)}) is {b2_ok:,} ({_gib(b2_ok)})"
                    if b2_ok is not None and b2 is not None
                    else ""
                )
                + "."
            )
            if (in_effect or not v34) and is_valid(f, "--kv-cache-memory-bytes", b1_ok):
                parts.append(
                    f" A fixed size is --kv-cache-memory-bytes {b1_ok}: it fits the requested memory with the"
                    " graphs counted once; gmu then no longer sizes the KV cache."
                )
                fixes.append(
                    Fix(
                        flags={"--kv-cache-memory-bytes": str(b1_ok)},
                        why="vLLM's suggestion with the CUDA-graph memory counted once",
                    )
                )
    # 2. a KV byte size in effect (or applied from a persisted startup plan)
    size = in_effect if in_effect is not None else plan
    # the extensible KV cache exists only on CUDA/ROCm: a byte size on a CPU/XPU engine turns nothing off
    on_gpu = f["kv_cache_device"] in (None, "GPU")
    if size is not None and v34 and on_gpu:
        same = any(abs(size - x) <= t.same_mib * _MiB for x in suggested if x is not size)
        origin = (
            "applied from a persisted startup plan (VLLM_ENABLE_STARTUP_PLAN=1)"
            if in_effect is None
            else "set"
        )
        if plan is not None and in_effect is None:
            same = True
        if not f["gmu_explicit"] or same:
            severity = "critical" if failed else "warning"
            if not same and not parts:
                title = "A KV byte size turned the extensible KV cache off"
            pool_txt = (
                f" Where a fixed size is wanted, the one that reproduces the measured pool is {n * b:,} B"
                f" ({n:,} blocks × {b:,} B); it too keeps the extensible cache off."
                if n and b and ext
                else ""
            )
            parts.append(
                f" kv_cache_memory_bytes {size:,} ({_gib(size)}) is {origin}"
                + (", a value vLLM itself suggested," if same else "")
                + " and on vLLM ≥ 0.34 it turns the extensible KV cache off: the budget is 0.92 with gmu unset,"
                " the startup free-memory check is back and torch is no longer capped. Remove it from the launch"
                " so that the extensible cache sizes the KV cache from measured memory (no flag value restores"
                " it; adding the enable flag beside the byte size is a startup error)."
                + pool_txt
                + (" The engine then failed." if failed else "")
            )
    if not parts:
        return None
    summary = "".join(parts).strip()

    evidence: list[Evidence] = []
    if b1 is not None:
        evidence.append(
            Evidence(
                "vLLM's suggestion (fit / fully utilize)",
                f"{b1:,} / {na(b2, ',')} B",
                f"vllm.log line {na(f['vllm_kv_memory_line'])} (Free memory on device … Replace"
                " gpu_memory_utilization config with …)",
            )
        )
    if f["graph_estimate_bytes"] and not ext:
        evidence.append(
            Evidence(
                "CUDA-graph estimate E",
                _gib(f["graph_estimate_bytes"]),
                "vllm.log CUDA graph pool memory line",
            )
        )
    if ext and n and b:
        evidence.append(
            Evidence("committed KV pool", f"{n:,} blocks × {b:,} B", f"vllm.log line {na(f['warmup_line'])}")
        )
    if in_effect is not None:
        evidence.append(
            Evidence("kv_cache_memory_bytes in effect", f"{in_effect:,} B", "launch flags / non-default args")
        )
    if plan is not None:
        evidence.append(Evidence("startup plan applied", f"kv_cache_memory_bytes={plan:,}", "vllm.log"))
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity=severity,  # type: ignore[arg-type]
        title=title,
    )


RULE = Rule(
    id="vllm-kv-memory-suggestion-wrong",
    family="K",
    severity="critical",
    title="vLLM's --kv-cache-memory suggestion is wrong for this engine",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "config"),
    flags=("--kv-cache-memory-bytes",),
)
