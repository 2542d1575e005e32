"""## What
A CUDA OOM after the engine was serving, while a large prefill batch ran: the traceback runs
through prefill code, or `vllm:iteration_tokens_total` shows engine steps of 8192+ tokens in
the window. When neither is recorded, it is inferred: a run-time OOM in the model's forward
pass (MLP / attention frames) on an engine with chunked prefill off (one step reaches
max(max_model_len, max_num_batched_tokens), at least 4 median prompts) and 3 or more requests
admitted within 5 s before it (the log's request lines and timestamps); the failed allocation
÷ (intermediate_size × dtype bytes) estimates the step's tokens.

## Why
vLLM sizes the KV cache after a profiling run at `max_num_batched_tokens`; what is left
outside gmu × total must hold the activation peak of every later step. A step that prefills
more tokens than profiled (chunked prefill off in V0, where a whole long prompt is one step),
or extra buffers on top of the profiled peak, leaves too little headroom and the step OOMs.

## How to confirm
The run-time `CUDA out of memory` traceback (prefill frames), the `vllm:iteration_tokens_total`
histogram's top buckets, and the prompt lengths at the time.

## Fix
`--max-num-batched-tokens 4096` (or half the current value, when that is lower), with chunked
prefill on (`--enable-chunked-prefill`) so long prompts are processed in chunks of that size.

On vLLM 0.34 with the extensible KV cache a step is bounded by torch's cap L (the OOM's
`X allowed` part, in the evidence); the default step (not logged on 0.34) is vLLM's for the
version and device; when the step is already small with chunked prefill on, the step size is not
the cause and `torch-cap-oom` owns the OOM.

## Sources
vllm-facts.md §1.2 and §1.4 (`vllm:iteration_tokens_total` and its buckets), §2.1 (the
profiling run at max_num_batched_tokens), §3.6 (the OOM message), §4.2 (flag defaults).
"""

from __future__ import annotations

from typing import NamedTuple

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na
from kvdoctor.units import fmt_bytes
from kvdoctor.vllm_flags import default_max_num_batched_tokens


class Thresholds(NamedTuple):
    #: tokens in one engine step (vllm:iteration_tokens_total bucket) that make a large prefill
    big_iteration: float = 8192
    #: "several requests admitted within a few seconds" (5 s, kvdoctor/derive/requests.py)
    burst_requests: int = 3
    #: "one step can hold many prompts' tokens": the step cap over the median prompt
    step_prompts: float = 4


def _mnbt_fix(mnbt: int | None) -> int | None:
    """Half the step in effect, at most 4096 and at least 256 (4096 when unknown); None when
    that would not lower it."""
    if not mnbt:
        return 4096
    half = max(256, min(4096, mnbt // 2))
    return half if half < mnbt else None


def _inferred(f: Facts, t: Thresholds, prefill_seen: bool) -> bool:
    """No batch recorded (no iteration histogram, no prefill frame): a forward-pass OOM on an
    engine whose one step can hold many prompts (chunked prefill off), with several requests
    admitted within a few seconds before it."""
    cap = f["step_token_cap"]
    many_prompts = cap is not None and cap >= t.step_prompts * (
        f["log_prompt_tokens_median"] or (cap / t.step_prompts)
    )
    return bool(
        not prefill_seen
        and f["iteration_tokens_max_bucket"] is None
        and f["chunked_prefill_off"]
        and f["oom_forward_frames"]
        and many_prompts
        and (f["oom_burst_requests"] or 0) >= t.burst_requests
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    hints = f["runtime_oom_hints"] or []
    if not f["runtime_oom"] or "logprobs" in hints or "sampler" in hints:
        return None
    prefill_seen = "prefill" in hints
    step_max = f["iteration_tokens_max_bucket"]
    big_step = step_max is not None and step_max >= t.big_iteration
    inferred = _inferred(f, t, prefill_seen)
    if not (prefill_seen or big_step or inferred):
        return None

    line = na(f["runtime_oom_line"])
    seen = ""  # what shows the large prefill
    if prefill_seen:
        seen += ": the traceback is in the prefill path"
    if big_step:
        assert step_max is not None
        seen += (" and" if prefill_seen else ":") + (
            f" engine steps reached {int(step_max):,}+ tokens (vllm:iteration_tokens_total)"
        )
    burst, burst_tokens, estimate = (
        f["oom_burst_requests"],
        f["oom_burst_prompt_tokens"],
        f["oom_step_tokens_estimate"],
    )
    if inferred:
        frames = ", ".join(map(str, f["oom_forward_frames"] or ()))
        seen += (
            f": no batch is logged, but the OOM is in the model forward pass ({frames} frames), chunked"
            f" prefill is off so one step may hold up to {na(f['step_token_cap'], ',')} tokens, and"
            f" {burst} requests"
        )
        if burst_tokens:
            seen += f" ({burst_tokens:,} prompt tokens)"
        seen += " were admitted within 5 s before it"
        if estimate:
            seen += f" - the failed allocation is about {estimate:,} tokens of MLP activation"

    mnbt = f["max_num_batched_tokens"]
    ext = f["vllm_sizing_mode"] == "extensible"
    if mnbt is None and ext and f["gpu_total_bytes"]:
        # not logged on 0.34: vLLM's default for the version and device, the value in effect
        mnbt = default_max_num_batched_tokens(f["vllm_defaults_version"], f["gpu_total_bytes"], f["gpu_name"])
    cap = _mnbt_fix(mnbt)
    if cap is not None and not is_valid(f, "--max-num-batched-tokens", cap):
        cap = None
    chunk_on = f["chunked_prefill_on"] is not True
    if ext and cap is None and not chunk_on:
        # the step size is not the cause: a step past torch's cap is torch-cap-oom's (spec N4)
        return None
    flags: dict[str, str] = {}
    if cap is not None:
        flags["--max-num-batched-tokens"] = str(cap)
        advice = f"Cap the tokens per step with --max-num-batched-tokens {cap}"
        if mnbt:
            advice += f" (now {mnbt:,})"
        if chunk_on:
            advice += (
                " and turn chunked prefill on (--enable-chunked-prefill) so long prompts are split into"
                " chunks of that size."
            )
        else:
            advice += ", chunked prefill splits longer prompts into chunks of that size."
    elif chunk_on:
        advice = (
            "Turn chunked prefill on (--enable-chunked-prefill) so long prompts are split into chunks of"
            f" {na(mnbt, ',')} tokens."
        )
    else:
        advice = (
            f"Steps are already capped at {na(mnbt, ',')} tokens with chunked prefill on, so the step size"
            " is not the lever here."
        )
    if chunk_on:
        flags["--enable-chunked-prefill"] = ""
    summary = (
        f"The engine ran out of GPU memory at run time (vllm.log line {line}) while a large prefill"
        f" ran{seen}. The activations of one step grow with the tokens it prefills, beyond what the"
        f" profiling run measured. {advice}"
    )

    evidence = [
        Evidence(
            "run-time CUDA OOM",
            f"Tried to allocate {fmt_bytes(f['oom_requested_bytes'])}, {fmt_bytes(f['oom_free_bytes'])} free",
            f"vllm.log line {line}",
        )
    ]
    if ext and f["oom_allowed_bytes"] is not None:
        evidence.append(
            Evidence(
                "torch cap at the OOM",
                f"{fmt_bytes(f['oom_allowed_bytes'])} allowed",
                "the OOM's 'X allowed' part: on vLLM 0.34's extensible KV cache a step is bounded by torch's cap L",
            )
        )
    if hints:
        evidence.append(
            Evidence(
                "traceback mentions",
                ", ".join(map(str, hints or ())),
                f"vllm.log traceback around line {line}",
            )
        )
    if step_max is not None:
        evidence.append(
            Evidence(
                "largest engine step",
                f"{step_max:,.0f} tokens (bucket upper bound)",
                "vllm:iteration_tokens_total",
            )
        )
    if inferred:
        evidence.append(
            Evidence(
                "requests admitted within 5 s before the OOM",
                f"{burst} ({na(burst_tokens, ',')} prompt tokens)",
                "vllm.log request lines (Received request … prompt_token_ids) and their timestamps",
            )
        )
        if estimate:
            evidence.append(
                Evidence(
                    "step tokens estimated from the failed allocation",
                    f"{estimate:,}",
                    "Tried to allocate ÷ (config.json intermediate_size × dtype bytes)",
                )
            )
    if mnbt:
        evidence.append(
            Evidence(
                "max_num_batched_tokens",
                f"{mnbt:,}",
                "launch command / 'Chunked prefill is enabled with max_num_batched_tokens=N'",
            )
        )
    fix = Fix(flags=flags, why="smaller prefill steps: a smaller activation peak")
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=[fix] if flags else [],
        gpus=f["engine_gpus"] or (),
    )


RULE = Rule(
    id="prefill-burst-oom",
    family="L",
    severity="critical",
    title="The engine ran out of memory while a large prefill batch ran",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    # on a 0.34 extensible engine the failed prefill step also hits torch's cap: the step size is
    # the root cause when this rule fires (spec/vllm-0.34.md prefill-burst-oom row, N4)
    explains=("torch-cap-oom", "engine-crashed"),
    flags=("--max-num-batched-tokens", "--enable-chunked-prefill"),
)
