"""## What
In the recent window the prompt-length distribution has a heavy tail (p99 or the highest bucket
≥ 4 × median) and it coincides with KV usage ≥ 0.95, preemptions or an OOM.

## Why
The seed's third check: intermittent OOM or thrashing from sudden long requests. One request of
max_model_len tokens can take a large share of the KV pool.

## How to confirm
Histogram quantiles of `vllm:request_prompt_tokens` from bucket deltas over the window.

## Fix
`--max-model-len` ≤ KV capacity / 4 (four full-length requests fit), rounded to a block, and not
below the typical traffic; `--max-num-batched-tokens` to chunk prefill.

KV pressure is judged on the token occupancy behind `vllm:kv_cache_usage_perc` (with 64-token
blocks the gauge counts padding). On vLLM 0.34 the cap is a multiple of the block size in
effect (64 by default) over the committed pool's capacity, and a run-time OOM at torch's cap
(the OOM's `X allowed` part) is named as `torch-cap-oom` evidence.

## Sources
spec/rules.md family L; vllm-facts.md §1.4 (buckets).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.kvmath import max_model_len_for_tokens
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import fmt_bytes


@dataclass(frozen=True)
class Thresholds:
    #: a prompt is in the tail at this many × the median prompt
    tail_ratio: float = 4
    #: KV cache usage (fraction) that counts as pressure
    kv_full: float = 0.95


def _cap(f: Facts, t: Thresholds, p50: float | None) -> tuple[int | None, bool]:
    """The --max-model-len to cap at (a block multiple ≤ KV capacity / 4, but not below the p99
    of the traffic outside the tail, else tail_ratio × the median) and whether the p99 bound
    set it (the capacity bound was below it); (None, False) without the capacity."""
    kv, bs = f["kv_capacity_tokens"], f["block_size"]
    body_p99 = f["prompt_p99_body"] or (p50 * t.tail_ratio if p50 else None)
    if not kv or bs is None or bs < 1 or not body_p99:
        return None, False
    target = max_model_len_for_tokens(int(kv // 4), bs)
    if not target:
        return None, False
    if target < body_p99:
        return bs * -(-int(body_p99) // bs), True
    return target, False


def _chunk(mnbt: int | None) -> int | None:
    """--max-num-batched-tokens that chunks long prefills: 2048, or half the value in effect
    when that is already 2048 or less (not below 256); None at 256 or less."""
    if mnbt is None or mnbt > 2048:
        return 2048
    return max(256, mnbt // 2) if mnbt > 256 else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    p50 = f["prompt_p50"] or f["log_prompt_tokens_median"]
    prompt_p50, oom_tokens = f["prompt_p50"], f["oom_prompt_tokens"]
    # the log clause: an OOM while a prompt ≥ tail_ratio × the usual one was being prefilled
    log_spike = bool(f["runtime_oom"] and oom_tokens is not None and p50 and oom_tokens >= t.tail_ratio * p50)
    tail = (
        prompt_p50 is not None
        and prompt_p50 > 0
        and max(f["prompt_p99"] or 0, f["prompt_max_bucket"] or 0) >= t.tail_ratio * prompt_p50
    )
    # a pooling engine's KV gauge is a placeholder (100 % on V0 pooling runners): not pressure
    kv_max = f["kv_usage_max"]
    # token occupancy behind the block usage (64-token blocks count padding, vllm-facts §9.9)
    pad, n = f["kv_padding_tokens_per_request"], f["typical_request_tokens"]
    factor = n / (n + pad) if pad and n and n > 0 else 1.0
    pressure = bool(
        (not f["is_pooling"] and kv_max is not None and kv_max * factor >= t.kv_full)
        or (f["preemptions_in_window"] or 0) > 0
        or f["runtime_oom"]
    )
    if not ((tail and pressure) or log_spike):
        return None

    if tail and pressure:
        head = (
            f"Prompt lengths have a heavy tail (median {prompt_p50:,.0f}, p99 {f['prompt_p99'] or 0:,.0f}"
            " tokens) and the tail coincides with KV pressure."
        )
    else:
        assert oom_tokens is not None and p50
        head = (
            f"The engine ran out of memory while a {oom_tokens:,}-token prompt (vllm.log line"
            f" {na(f['oom_prompt_line'])}) was being prefilled, {oom_tokens / p50:.0f} x the median request"
            f" ({p50:,.0f} tokens)."
        )

    mml, cap_short = _cap(f, t, p50)
    mml_ok = mml is not None and is_valid(f, "--max-model-len", mml)
    chunk = _chunk(f["max_num_batched_tokens"])
    if chunk is not None and not is_valid(f, "--max-num-batched-tokens", chunk):
        chunk = None
    chunk_on = chunk is not None and bool(f["chunked_prefill_off"])

    flags: dict[str, str] = {}
    why: list[str] = []
    kv_text = na(f["kv_capacity_tokens"], ",")
    if mml_ok:
        flags["--max-model-len"] = str(flag_value(mml))
        why.append(
            "no request longer than "
            + ("the usual traffic's p99" if cap_short else "a quarter of the KV cache")
        )
        if cap_short:
            advice = (
                f"Cap --max-model-len at {mml}, the p99 of the usual traffic (a quarter of the"
                f" {kv_text}-token cache would cut it)"
            )
        else:
            advice = (
                f"Cap --max-model-len at {mml} so four full-length requests fit the {kv_text}-token cache"
            )
        advice += ", and chunk" if chunk is not None else "."
    elif mml is not None:
        mml_now = f["max_model_len"]
        at = f" ({mml_now:,} tokens)" if mml_now is not None else ""
        advice = f"Four full-length requests already fit the cache at the max model length in effect{at}"
        advice += ": chunk" if chunk is not None else "."
    else:
        advice = "The KV cache capacity is not known, so no max model length can be sized from it"
        advice += ": chunk" if chunk is not None else "."
    if chunk is not None:
        flags["--max-num-batched-tokens"] = str(chunk)
        why.append(f"long prompts prefilled {chunk} tokens at a time")
        advice += f" long prefills with --max-num-batched-tokens {chunk}"
        if chunk_on:
            flags["--enable-chunked-prefill"] = ""
            advice += " (chunked prefill is off: add --enable-chunked-prefill)"
        advice += "."

    evidence: list[Evidence] = []
    if prompt_p50 is not None:
        quantiles = (prompt_p50, f["prompt_p99"], f["prompt_max_bucket"])
        window = "window deltas" if f["prompt_hist_recent"] else "lifetime"
        evidence.append(
            Evidence(
                "prompt tokens p50 / p99 / max bucket",
                " / ".join(na(q, ",.0f") for q in quantiles),
                f"vllm:request_prompt_tokens histogram ({window})",
            )
        )
    if log_spike:
        evidence.append(
            Evidence(
                "prompt being prefilled at the OOM / median request",
                f"{na(oom_tokens, ',')} / {na(p50, ',.0f')} tokens",
                f"vllm.log request lines (line {na(f['oom_prompt_line'])})",
            )
        )
    if kv_max is not None and not f["is_pooling"]:
        evidence.append(Evidence("KV cache usage (max)", f"{kv_max:.0%}", "vllm:kv_cache_usage_perc"))
        if factor < 1.0 and (f["block_size"] or 0) > 16:
            evidence.append(
                Evidence(
                    "token occupancy behind it",
                    f"≈ {kv_max * factor:.0%} ({f['block_size']}-token blocks: ~{pad:.1f} padding tokens a request)",
                    "usage × n / (n + (B − 1)/2), vllm-facts §9.9",
                )
            )
    if f["vllm_sizing_mode"] == "extensible" and f["runtime_oom"] and f["oom_allowed_bytes"] is not None:
        evidence.append(
            Evidence(
                "torch cap at the OOM",
                f"{fmt_bytes(f['oom_allowed_bytes'])} allowed",
                "the OOM's 'X allowed' part: the step hit torch's cap (see torch-cap-oom)",
            )
        )
    return Hit(
        summary=f"{head} {advice}",
        evidence=evidence,
        fixes=[Fix(flags=flags, why="; ".join(why))] if flags else [],
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity="critical" if f["runtime_oom"] else None,
    )


RULE = Rule(
    id="long-request-spike",
    family="L",
    severity="warning",
    title="A few very long prompts spike the KV cache",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("metrics", "log"),
    flags=("--max-model-len", "--max-num-batched-tokens", "--enable-chunked-prefill"),
)
