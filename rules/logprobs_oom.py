"""## What
A CUDA OOM after the engine was serving whose traceback runs through logprobs /
prompt_logprobs / sampler code (`compute_logprobs`, `_get_prompt_logprobs_dict`, `log_softmax`,
`sampler.py`).

## Why
Logprobs need the full-vocabulary logits in fp32: one row per generated token, and for
prompt_logprobs one row per prompt token of the step. At 8192 batched tokens and a 128k
vocabulary that is 4 GiB, which the profiling run never allocated, so it must come out of the
headroom outside gmu × total.

## How to confirm
The run-time `CUDA out of memory` traceback with logprobs / sampler frames; requests with
`prompt_logprobs` or large `logprobs` at the time.

## Fix
A lower `--max-num-batched-tokens` (half, at most 4096) with chunked prefill on, and cap
`prompt_logprobs` / `logprobs` per request.

## Sources
vllm-facts.md §2.1 (profiling run and headroom), §3.6 (the OOM message), §4.2
(`--max-num-batched-tokens`, `--enable-chunked-prefill`).
"""

from __future__ import annotations

from typing import NamedTuple

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na
from kvdoctor.units import fmt_bytes


class Thresholds(NamedTuple):
    pass


def _mnbt_fix(mnbt: int | None) -> int | None:
    """Half the step in effect, at most 4096 and at least 256 (4096 when unknown); None when
    that would not lower it."""
    if not mnbt:
        return 4096
    half = max(256, min(4096, mnbt // 2))
    return half if half < mnbt else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    hints = f["runtime_oom_hints"] or []
    if not f["runtime_oom"] or not ("logprobs" in hints or "sampler" in hints):
        return None
    # a rejection-sampler OOM with k ≥ 2 drafts is spec-decode-sampler-oom's
    if f["oom_frames_rejection_sampler"] and f["spec_on"] and (f["spec_k"] or 0) >= 2:
        return None
    mnbt, vocab = f["max_num_batched_tokens"], f["vocab_size"]
    size = ""
    if mnbt and vocab:
        size = f" ({mnbt:,} tokens × {vocab:,} vocabulary × 4 bytes = {fmt_bytes(mnbt * vocab * 4)})"
    cap = _mnbt_fix(mnbt)
    if cap is not None and not is_valid(f, "--max-num-batched-tokens", cap):
        cap = None
    chunk_on = f["chunked_prefill_on"] is not True
    cap_requests = "cap prompt_logprobs / logprobs in the requests (or reject them at the gateway)."
    flags: dict[str, str] = {}
    if cap is not None:
        flags["--max-num-batched-tokens"] = str(cap)
        advice = f"Lower --max-num-batched-tokens to {cap}" + (
            " and turn chunked prefill on (--enable-chunked-prefill)"
            if chunk_on
            else " (chunked prefill splits prompts into steps of that size)"
        )
        advice += f", and {cap_requests}"
    elif chunk_on:
        advice = f"Turn chunked prefill on (--enable-chunked-prefill), and {cap_requests}"
    else:
        advice = f"Steps are already at most {na(mnbt, ',')} tokens: {cap_requests}"
    if chunk_on:
        flags["--enable-chunked-prefill"] = ""
    line = na(f["runtime_oom_line"])
    summary = (
        f"The engine ran out of GPU memory at run time in {'logprobs' if 'logprobs' in hints else 'sampler'}"
        f" code (vllm.log line {line}). prompt_logprobs materialise fp32 logits for every prompt token of"
        f" a step{size}, on top of the activation peak the profiling run measured. {advice}"
    )
    if f["vllm_sizing_mode"] == "extensible":
        # vLLM 0.34's sizing warm-up requests prompt logprobs at max_logprobs for one prompt
        # (v1/worker/gpu/warmup.py:495-525): one such request is measured, concurrent ones are not
        summary += (
            " (vLLM 0.34's sizing warm-up measured prompt logprobs for one request; several at once are"
            " outside what it kept for transients.)"
        )
    evidence = [
        Evidence(
            "run-time CUDA OOM",
            f"Tried to allocate {fmt_bytes(f['oom_requested_bytes'])}, {fmt_bytes(f['oom_free_bytes'])} free",
            f"vllm.log line {line}",
        ),
        Evidence(
            "traceback mentions", ", ".join(map(str, hints or ())), f"vllm.log traceback around line {line}"
        ),
    ]
    if mnbt:
        evidence.append(
            Evidence(
                "max_num_batched_tokens",
                f"{mnbt:,}",
                "launch command / 'Chunked prefill is enabled with max_num_batched_tokens=N'",
            )
        )
    if vocab:
        evidence.append(Evidence("vocabulary", f"{vocab:,} tokens", "config.json vocab_size"))
    fix = Fix(flags=flags, why="fewer prompt tokens per step: smaller fp32 logits for prompt_logprobs")
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=[fix] if flags else [],
        gpus=f["engine_gpus"] or (),
    )


RULE = Rule(
    id="logprobs-oom",
    family="L",
    severity="critical",
    title="Computing logprobs ran out of memory at run time",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    explains=("engine-crashed",),
    needs=("log",),
    flags=("--max-num-batched-tokens", "--enable-chunked-prefill"),
)
