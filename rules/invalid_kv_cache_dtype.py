"""## What
The launch configuration names a KV-cache dtype that vLLM rejects (e.g. `int8`, which the seed
tutorial recommends but no vLLM version has accepted), or fp8 on a GPU without fp8 support.

## Why
vLLM validates `--kv-cache-dtype` against its list (`Invalid kv_cache_dtype: 'int8'. Valid
values are: […]`) before touching the GPU. Accepted values grow by version: `fp8`, `fp8_e4m3`,
`fp8_e5m2` since 0.8; `int8_per_token_head` from 0.20.

## How to confirm
The pydantic validation error in the log, or compare the flag with the version's list
(`kvdoctor explain invalid-kv-cache-dtype`).

## Fix
The nearest valid value for that vLLM version: `fp8` (halves the KV cache like int8 would) or
`int8_per_token_head` where available.

## Sources
vllm-facts.md §4.1; seed-tutorial errata 2 and 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    """None: the rule has no tunable thresholds."""


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["invalid_kv_dtype"]:
        return None
    version, rejected = f["vllm_version"], f["invalid_kv_dtype_value"]
    suggested, cc = f["suggested_kv_dtype"], f["log_compute_capability"]
    no_fp8 = ""
    if suggested == "auto" and f["fp8_supported"] is False:
        gpu = f["gpu_name"] or f["log_gpu_name"] or "this GPU"
        stated = f" (compute capability {cc}, as the log states)" if cc else ""
        no_fp8 = f" on {gpu}{stated}, which has no fp8 support"

    fixes: list[Fix] = []
    if suggested and is_valid(f, "--kv-cache-dtype", suggested):
        halves = ", which halves KV bytes per token like int8 would" if suggested != "auto" else ""
        why = "the nearest value this vLLM version accepts" + (
            " (half the KV bytes per token)" if halves else ""
        )
        fixes.append(Fix(flags={"--kv-cache-dtype": suggested}, why=why))
        summary = (
            f"vLLM {version or ''} does not accept --kv-cache-dtype {na(rejected)}{no_fp8}."
            f" Use --kv-cache-dtype {suggested}{halves}."
        )
    else:
        summary = (
            f"vLLM {version or ''} does not accept kv_cache_dtype {na(rejected)}{no_fp8}; no valid value"
            " could be chosen for it here."
        )

    evidence: list[Evidence] = []
    line = f["invalid_kv_dtype_line"]
    if line is not None:
        evidence.append(Evidence("rejected kv_cache_dtype", na(rejected), f"vllm.log line {line}"))
    else:
        evidence.append(Evidence("rejected kv_cache_dtype", na(rejected), "launch command --kv-cache-dtype"))
    if version is not None:
        evidence.append(Evidence("vLLM version", version, "vllm.log"))
    if cc is not None and f["fp8_supported"] is False:
        evidence.append(
            Evidence(
                "compute capability",
                f"{cc} (fp8 needs ≥ 8.9)",
                "vllm.log capability line (vLLM's dtype check / PyTorch's capability warning)",
            )
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="invalid-kv-cache-dtype",
    family="K",
    severity="critical",
    title="--kv-cache-dtype names a value vLLM does not accept",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("config", "log"),
    flags=("--kv-cache-dtype",),
)
