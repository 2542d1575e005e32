"""## What
GPU utilisation below 40 % while KV usage ≥ 0.9 and requests wait (or the running batch shrinks
while the queue grows).

## Why
The seed's fourth check ("low utilisation with full memory"). vLLM cannot admit more requests
than their KV blocks allow, so the batch stays small and the GPU idles between tiny decode steps.
Memory "full" in nvidia-smi alone means nothing (vLLM preallocates): this rule reads the KV usage
metric and the queue.

## How to confirm
`vllm:kv_cache_usage_perc` ≈ 1, `vllm:num_requests_waiting` > 0, nvidia-smi GPU-Util low.

## Fix
fp8 KV (capacity ×2), a shorter `--max-model-len`, fewer `--max-num-seqs` (counted in blocks of
the pool where known), or more replicas; if the engine process's CPU is saturated it is
host-bound as well. `vllm:kv_cache_usage_perc` counts blocks: with 64-token blocks (vLLM 0.34's
default) and short requests much of a "full" pool is padding. The finding gives the token
occupancy (block usage × n / (n + (B − 1)/2), n the typical request) and adds `--block-size 16`
only where the backend takes 16 and that token/block ratio is below 0.8.

## Sources
spec/rules.md family U; seed-tutorial errata 6; vllm-facts.md §1.2.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import max_model_len_for_tokens, max_num_seqs_for
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na

KV_DTYPE, MML, SEQS, BLOCK = "--kv-cache-dtype", "--max-model-len", "--max-num-seqs", "--block-size"
#: KV cache dtypes fp8 would halve (None: not known, vLLM's default is 16 bit)
_SIXTEEN_BIT = (None, "auto", "bfloat16", "float16")


@dataclass(frozen=True)
class Thresholds:
    #: GPU utilisation (fraction) below which the GPU counts as mostly idle
    util_low: float = 0.4
    #: KV cache usage (fraction) at which the pool counts as full
    kv_full: float = 0.9
    #: percent of one core at which the engine process is CPU-bound as well
    cpu_saturated: float = 90
    #: token/block ratio (typical request ÷ (typical + padding of its last block)) below which
    #: --block-size 16 is advised (starting value, spec/vllm-0.34.md)
    block16_ratio: float = 0.8


def _token_ratio(f: Facts) -> float | None:
    """Tokens per block slot for the typical request: n / (n + (B − 1)/2) (vllm-facts §9.9);
    kv_usage counts whole blocks, so token occupancy = block usage × this ratio."""
    n, pad = f["typical_request_tokens"], f["kv_padding_tokens_per_request"]
    if not n or pad is None or n + pad <= 0:
        return None
    return float(n) / (float(n) + float(pad))


def _block16_fix(f: Facts, t: Thresholds, ratio: float | None) -> bool:
    """--block-size 16 helps: blocks larger than 16 whose padding leaves the token/block ratio
    below ``block16_ratio``, on a backend that takes 16 (derive's block_size_16_valid)."""
    bs = f["block_size"]
    return bool(
        ratio is not None
        and ratio < t.block16_ratio
        and bs is not None
        and bs > 16
        and f["block_size_16_valid"] is True
        and is_valid(f, BLOCK, 16)
    )


def _mml_fix(f: Facts) -> int | None:
    """A shorter --max-model-len: four full-length requests fit the pool (as long-request-spike),
    when that is below the one in effect and vLLM accepts it."""
    cap, mml, block = f["kv_capacity_tokens"], f["max_model_len"], f["block_size"]
    if not cap or not mml or block is None or block < 1:
        return None
    shorter = max_model_len_for_tokens(int(cap // 4), block)
    return shorter if shorter and shorter < mml and is_valid(f, MML, shorter) else None


def _seqs_fix(f: Facts) -> int | None:
    """The batch the pool holds: the committed blocks ÷ the typical request's blocks where
    known (blocks, not tokens, run out: vllm-facts §9.9), else KV capacity ÷ the typical
    request, when vLLM accepts it and it is not the --max-num-seqs in effect."""
    by_blocks = f["kv_pool_requests_typical"]
    if by_blocks:
        return int(by_blocks) if is_valid(f, SEQS, int(by_blocks)) else None
    cap, typical = f["kv_capacity_tokens"], f["typical_request_tokens"]
    if not cap or not typical or int(typical) < 1:
        return None
    seqs = max_num_seqs_for(cap, int(typical))
    return seqs if seqs and is_valid(f, SEQS, seqs) else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    util, kv_max, waiting_max = f["gpu_util"], f["kv_usage_max"], f["waiting_max"]
    queued = (waiting_max or 0) > 0 or ((f["running_trend"] or 0) < 0 and (f["waiting_trend"] or 0) > 0)
    if (
        util is None
        or util >= t.util_low
        or kv_max is None
        or kv_max < t.kv_full
        or not queued
        or f["is_pooling"]
    ):
        return None
    dtype, fp8_supported, cap = f["kv_cache_dtype"], f["fp8_supported"], f["kv_capacity_tokens"]
    fp8 = dtype == "auto" and fp8_supported is not False and is_valid(f, KV_DTYPE, "fp8")
    mml = _mml_fix(f)
    seqs = None if fp8 else _seqs_fix(f)

    ratio = _token_ratio(f)
    block16 = _block16_fix(f, t, ratio)
    fixes: list[Fix] = []
    padding = ""
    if ratio is not None and ratio < 0.95:
        bs = f["block_size"]
        padding = (
            f" In {na(bs)}-token blocks about {1 - ratio:.0%} of that is padding (typical request"
            f" ~{int(f['typical_request_tokens'] or 0):,} tokens): token occupancy ≈ {kv_max * ratio:.0%}."
        )
    if block16:
        padding += (
            f" {BLOCK} 16 (the backend takes it) cuts the padding per request from"
            f" {na(f['kv_padding_tokens_per_request'], '.1f')} to 7.5 tokens."
        )
    if fp8:
        tokens = f" ({cap * 2:,} tokens instead of {cap:,})" if cap else ""
        shorter = f", or shorten {MML} to {flag_value(mml)} (four full-length requests fit)" if mml else ""
        advice = f"Double the tokens per GB with {KV_DTYPE} fp8{tokens}{shorter}, or add replicas."
        fixes.append(Fix(flags={KV_DTYPE: "fp8"}, why="twice the KV tokens in the same memory"))
    else:
        parts = []
        if seqs:
            typical = int(f["typical_request_tokens"] or 0)
            parts.append(
                f"cap the batch at what the pool holds with {SEQS} {flag_value(seqs)}"
                f" ({na(cap, ',')} KV tokens / ~{typical:,} per request)"
            )
            fixes.append(
                Fix(flags={SEQS: str(flag_value(seqs))}, why="a batch the KV pool holds without waiting")
            )
        if mml:
            parts.append(f"shorten {MML} to {flag_value(mml)}")
        # fp8 would double the tokens of a 16-bit KV cache only (not one already 8 bit or less).
        fp8_words = (
            "; fp8 KV would double the tokens" if fp8_supported is not False and dtype in _SIXTEEN_BIT else ""
        )
        advice = ", ".join(
            [*parts, f"add tensor parallelism for more KV per rank, or add replicas{fp8_words}."]
        )
        advice = advice[0].upper() + advice[1:]
    if mml:
        fixes.append(Fix(flags={MML: str(flag_value(mml))}, why="four full-length requests fit the KV pool"))

    if block16:
        fixes.append(Fix(flags={BLOCK: "16"}, why="less padding per request in the last block"))

    cpu = f["engine_cpu_percent"]
    host = (
        f" The engine process is CPU-bound ({cpu:.0f} % of a core) - it is also host-bound."
        if cpu is not None and cpu >= t.cpu_saturated
        else ""
    )
    summary = (
        f"The GPU is {util:.0%} busy while the KV cache is {kv_max:.0%} full and up to"
        f" {na(waiting_max, ',.0f')} requests wait: the KV pool, not compute, limits throughput.{padding}"
        f" {advice}{host}"
    )
    evidence = [
        Evidence("GPU utilisation", f"{util:.0%}", "nvidia-smi GPU-Util / NVML utilization.gpu"),
        Evidence(
            "KV cache usage (max)",
            f"{kv_max:.1%}",
            "vllm:kv_cache_usage_perc / 'GPU KV cache usage' log lines",
        ),
        Evidence(
            "requests waiting (max)",
            na(waiting_max, ",.0f"),
            "vllm:num_requests_waiting / 'Waiting|Pending' in stats lines",
        ),
    ]
    if ratio is not None:
        evidence.append(
            Evidence(
                "token occupancy (estimate)",
                f"{kv_max * ratio:.1%} (block usage × {ratio:.2f} tokens per block slot)",
                "kv_usage × n / (n + (block_size − 1)/2), n = typical request from the length histograms",
            )
        )
    trend = f["running_trend"]
    if trend is not None:
        evidence.append(
            Evidence("running requests trend", f"{trend:+.0f}", "vllm:num_requests_running / stats lines")
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="low-util-kv-saturated",
    family="U",
    severity="warning",
    title="The GPU is mostly idle because the KV cache is full and requests queue",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    needs_any=("metrics", "log"),
    flags=(KV_DTYPE, SEQS, MML, BLOCK),
)
