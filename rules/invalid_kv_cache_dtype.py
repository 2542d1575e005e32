"""## What
The launch configuration names a KV-cache dtype that vLLM rejects (e.g. `int8`, which the seed
tutorial recommends but no vLLM version has accepted), or an fp8 form the GPU's attention
backends refuse: any fp8 KV cache on Volta/Turing (compute capability < 8.0), e4m3 (`fp8`,
`fp8_e4m3`) on Ampere (8.0–8.7), which takes `fp8_e5m2`. Ada, Hopper and Blackwell take all.

## Why
vLLM validates `--kv-cache-dtype` against its list (`Invalid kv_cache_dtype: 'int8'. Valid
values are: […]`) before touching the GPU. Accepted values grow by version: `fp8`, `fp8_e4m3`,
`fp8_e5m2` since 0.8; `int8_per_token_head` from 0.20.

## How to confirm
The pydantic validation error in the log, or compare the flag with the version's list
(`kvdoctor explain invalid-kv-cache-dtype`).

## Fix
The nearest valid value for that vLLM version and GPU: `fp8` (halves the KV cache like int8
would; `fp8_e5m2` on Ampere) or `int8_per_token_head` where available; `auto` on Volta/Turing.

## Sources
vllm-facts.md §4.1; seed-tutorial errata 2 and 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.devices import FP8_KV_PLAIN
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


@dataclass(frozen=True)
class Thresholds:
    """None: the rule has no tunable thresholds."""


def _backend_words(f: Facts, rejected: str | None) -> str:
    """Why this GPU's backends refuse that fp8 form, naming the backend and the capability
    (never a bare "no fp8 support"): '' when the refusal is not about the GPU."""
    takes = f["fp8_kv_dtypes"]
    if rejected not in FP8_KV_PLAIN or takes is None or rejected in takes:
        return ""
    gpu = f["gpu_name"] or f["log_gpu_name"] or "this GPU"
    cc, arch = f["compute_capability"], f["gpu_architecture"]
    stated = ", as the log states" if f["log_compute_capability"] else ""
    backend = f["attention_backend"]
    who, verb = (f"the {backend} attention backend", "s") if backend else ("vLLM's attention backends", "")
    if takes:
        return (
            f": on {gpu} ({arch}, compute capability {cc}{stated}) {who} store{verb} an fp8 KV cache only as"
            f" {', '.join(takes)}; e4m3 ({rejected}) needs native fp8, compute capability ≥ 8.9"
        )
    has = "has" if backend else "have"
    return f": on {gpu} ({arch}, compute capability {cc}{stated}) {who} {has} no fp8 KV-cache kernel"


def _refused(version: str | None, rejected: str | None, why_gpu: str, flag: str) -> str:
    if why_gpu:
        return f"kv_cache_dtype {na(rejected)} cannot run here{why_gpu}"
    return f"vLLM {version or ''} does not accept {flag} {na(rejected)}"


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["invalid_kv_dtype"]:
        return None
    version, rejected = f["vllm_version"], f["invalid_kv_dtype_value"]
    suggested = f["suggested_kv_dtype"]
    why_gpu = _backend_words(f, rejected)

    fixes: list[Fix] = []
    if suggested and is_valid(f, "--kv-cache-dtype", suggested):
        halves = ", which halves KV bytes per token like int8 would" if suggested != "auto" else ""
        if why_gpu and suggested != "auto":
            halves = ", the fp8 form this GPU takes (half the KV bytes per token)"
        why = "the nearest value this vLLM version accepts" + (
            " (half the KV bytes per token)" if suggested != "auto" else ""
        )
        if why_gpu:
            why = "the KV-cache dtype this GPU's attention backend takes"
        fixes.append(Fix(flags={"--kv-cache-dtype": suggested}, why=why))
        summary = f"{_refused(version, rejected, why_gpu, '--kv-cache-dtype')}. Use --kv-cache-dtype {suggested}{halves}."
    else:
        summary = f"{_refused(version, rejected, why_gpu, 'kv_cache_dtype')}; no valid value could be chosen for it here."

    evidence: list[Evidence] = []
    line = f["invalid_kv_dtype_line"]
    if line is not None:
        evidence.append(Evidence("rejected kv_cache_dtype", na(rejected), f"vllm.log line {line}"))
    else:
        evidence.append(Evidence("rejected kv_cache_dtype", na(rejected), "launch command --kv-cache-dtype"))
    if version is not None:
        evidence.append(Evidence("vLLM version", version, "vllm.log"))
    if why_gpu:
        source = (
            "vllm.log capability line (vLLM's dtype check / PyTorch's capability warning)"
            if f["log_compute_capability"]
            else "GPU catalogue by name"
        )
        evidence.append(
            Evidence(
                "compute capability",
                f"{f['compute_capability']} ({f['gpu_architecture']}; fp8 KV forms: "
                f"{', '.join(f['fp8_kv_dtypes'] or []) or 'none'})",
                source,
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
