"""## What
A run-time torch OOM on an engine with chunked prefill on, where the overrun E = P + A − B is
positive (the engine process outgrew its own budget), the OOM is not fragmentation (R <
max(A, 512 MiB), or expandable segments already on) and long context is in play: the longest
context in the traffic (highest prompt-length bucket, or the KV in use) is ≥ 4 ×
max_num_batched_tokens (max_model_len when there are no metrics, and the finding says so).

## Why
vLLM's profile run computes no attention (backends return zeros without metadata; the V2
runner passes `skip_attn=True`) and its dummy requests have no earlier context, so the profiled
activation peak covers the MLP/linear side of one max_num_batched_tokens chunk. Attention and
indexer scratch for a chunk deep into a long context is outside it.

## How to confirm
The OOM's "this process has X memory in use" plus "Tried to allocate" exceeds gmu × total;
prompts far longer than the chunk; attention / MLA / indexer frames. Not this rule: E ≤ 0 (a
neighbour grew: `gpu-shared-with-foreign-process`), fragmentation (`allocator-fragmentation`),
short contexts, rejection-sampler frames (`spec-decode-sampler-oom` with k ≥ 2).

## Fix
C, the context at the OOM, is bounded by KV usage × (blocks − 1) × block_size (else
max_model_len / 2, said). E_max = E × max(1, max_model_len / C). `--gpu-memory-utilization` =
floor_0.01((B − E_max − 0.5 GiB)/T), or with explicit KV bytes `--kv-cache-memory-bytes` =
KV_now − E_max − 0.5 GiB; alternative `--max-num-batched-tokens` = half, a multiple of 256 and
≥ 2048. When the gmu would leave less KV than one max_model_len request the chunk change leads.
The factor 4 (`long_factor`) is an estimate, overridable in the user config.

On vLLM 0.34 with the extensible KV cache (gmu unset means B = T, so P + A − B never exceeds 0)
E is measured against torch's cap: E = (allocated by PyTorch + reserved but unallocated + A) −
L, and only attention / MLA / indexer frames make it this rule's (else `torch-cap-oom`); the
gmu fix floor_0.01((R − E_max − 0.5 GiB)/T) is valid there: it lowers the KV pool and raises L by
the same bytes.

## Sources
spec/rules-catalogue2.md §3.3, §2 (B, P, A, E, run-time phase); vllm-facts.md §2.1 "What the
profile run does not see", §3.6 (the OOM message).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, MiB, floor_to, fmt_bytes
from kvdoctor.vllm_flags import default_max_num_batched_tokens


@dataclass(frozen=True)
class Thresholds:
    #: estimate (spec/rules-catalogue2.md §6): "long context" = this many × max_num_batched_tokens
    long_factor: float = 4
    #: MiB reserved but unallocated, at least, that make the OOM fragmentation (not this rule)
    min_fragment_mib: float = 512
    #: GiB of room left beside the need E_max
    margin_gib: float = 0.5
    #: the smallest --max-num-batched-tokens worth suggesting
    min_chunk_tokens: int = 2048


def _overrun(f: Facts) -> tuple[int | None, bool]:
    """E and whether it is the torch-cap form: on a 0.34 extensible engine E = (allocated by
    PyTorch + reserved but unallocated + A) − L (the budget is T with gmu unset, so P + A − B
    never exceeds 0; spec/vllm-0.34.md long-context-prefill-oom row), else P + A − B."""
    if f["vllm_sizing_mode"] == "extensible" and f["torch_cap_overrun_bytes"] is not None:
        return f["torch_cap_overrun_bytes"], True
    return f["oom_overrun_bytes"], False


def _e_max(f: Facts) -> int | float | None:
    """E_max = E × max(1, max_model_len / C): the overrun grown linearly to max_model_len."""
    e, mml, c = _overrun(f)[0], f["max_model_len"], f["context_at_oom_tokens"]
    if e and mml and c:
        return e * max(1.0, mml / c)
    return e


def check(f: Facts, t: Thresholds) -> Hit | None:
    (e, at_cap), requested, reserved = (
        _overrun(f),
        f["oom_requested_bytes"],
        f["oom_reserved_unallocated_bytes"],
    )
    fragmented = (
        reserved is not None
        and requested is not None
        and reserved >= max(requested, t.min_fragment_mib * MiB)
        and not f["alloc_conf_expandable"]
    )
    longest, mnbt = f["longest_context_tokens"], f["max_num_batched_tokens"]
    if mnbt is None and at_cap and f["gpu_total_bytes"]:
        # not logged on 0.34: vLLM's default for the version and device, the value in effect
        mnbt = default_max_num_batched_tokens(f["vllm_defaults_version"], f["gpu_total_bytes"], f["gpu_name"])
    long_ctx = longest is not None and bool(mnbt) and longest >= t.long_factor * (mnbt or 0)
    if not (
        f["runtime_oom"]
        and f["oom_at_runtime"]
        and f["chunked_prefill_on"] is not False
        and e is not None
        and e > 0
        and not fragmented
        and long_ctx
        # a rejection-sampler OOM is the sampler's (spec-decode-sampler-oom), not attention's
        and not f["oom_frames_rejection_sampler"]
        # at the torch cap only attention frames make it this rule's (else torch-cap-oom's)
        and (not at_cap or f["oom_frames_attention"])
    ):
        return None
    assert e is not None and mnbt
    e_max = _e_max(f)
    budget, total, gmu = f["engine_budget_bytes"], f["device_total_bytes"], f["gmu"]
    kv_set, kv_now = f["kv_cache_memory_bytes_set"], f["kv_available_bytes_now"]
    margin = t.margin_gib * GiB
    gmu_fix = (
        floor_to((budget - e_max - margin) / total, 0.01)
        if e_max and budget and total and not kv_set
        else None
    )
    kvb_fix = int(floor_to(kv_now - e_max - margin, 64 * MiB)) if kv_set and kv_now and e_max else None
    mnbt_fix = max(t.min_chunk_tokens, int(floor_to(mnbt / 2, 256))) if mnbt > t.min_chunk_tokens else None
    if gmu_fix is None and kvb_fix is None and mnbt_fix is None:
        return None
    # with the gmu lowered, would KV still hold one max_model_len request?
    # the KV pool: on the extensible cache 'Available KV cache memory' is only a reservation
    avail = f["kv_pool_bytes"] if at_cap and f["kv_pool_bytes"] else f["log_available_kv_bytes"]
    one_request = f["offload_kv_one_request_bytes"]
    too_little_kv = (
        gmu_fix is not None
        and avail is not None
        and gmu is not None
        and total is not None
        and one_request is not None
        and avail - (gmu - gmu_fix) * total < one_request
    )

    fixes: list[Fix] = []
    levers: list[str] = []
    if mnbt_fix is not None and is_valid(f, "--max-num-batched-tokens", mnbt_fix):
        levers.append(f"--max-num-batched-tokens {mnbt_fix} halves the per-chunk intermediate")
        fixes.append(
            Fix(
                flags={"--max-num-batched-tokens": str(mnbt_fix)}, why="half the chunk: half its intermediate"
            )
        )
    if (
        gmu_fix is not None
        and not too_little_kv
        and gmu is not None
        and gmu_fix < gmu
        and is_valid(f, "--gpu-memory-utilization", gmu_fix)
    ):
        levers.append(f"--gpu-memory-utilization {gmu_fix:.2f} leaves that room")
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": str(flag_value(gmu_fix))},
                why="room outside the budget for attention scratch up to max_model_len",
            )
        )
    if kvb_fix is not None and is_valid(f, "--kv-cache-memory-bytes", kvb_fix):
        levers.append(f"--kv-cache-memory-bytes {kvb_fix} leaves that room")
        fixes.append(
            Fix(
                flags={"--kv-cache-memory-bytes": str(kvb_fix)},
                why="room beside the KV cache for attention scratch up to max_model_len",
            )
        )
    lead = (
        "KV would then hold less than one max_model_len request: lead with the chunk change. "
        if too_little_kv
        else ""
    )
    advice = lead + ("; or ".join(levers) + "." if levers else "")
    advice = advice.rstrip()

    line = na(f["oom_line"])
    process, source = f["oom_process_bytes"], na(f["longest_context_source"])
    c = f["context_at_oom_tokens"]
    in_attention = " (the traceback is in attention code)" if f["oom_frames_attention"] else ""
    assumed = " (assumed: max_model_len / 2)" if f["context_at_oom_assumed"] else ""
    over = (
        f"its torch cap (E = allocated by PyTorch + reserved but unallocated + A − L, L ="
        f" {fmt_bytes(f['torch_cap_bytes'])} on the extensible KV cache)"
        if at_cap
        else (
            f"its own budget (E = P + A − B = {fmt_bytes(process)} + {fmt_bytes(requested)} −"
            f" {fmt_bytes(budget)})"
        )
    )
    summary = (
        f"The engine ran out of memory at run time (vllm.log line {line}) with {fmt_bytes(e)} more than"
        f" {over}: vLLM itself outgrew its plan. Contexts reach {na(longest, ',')} tokens"
        f" ({source}), ≥ {t.long_factor} × the {mnbt:,}-token chunk, and vLLM's profile run computes no"
        " attention and no earlier context, so attention scratch deep into a long context is outside the"
        f" profiled peak{in_attention}. At a context of about {na(c, ',')} tokens{assumed}, growing"
        f" linearly to max_model_len {na(f['max_model_len'], ',')} the need is about {fmt_bytes(e_max)}."
    )
    if advice:
        summary += " " + advice
    evidence = [
        Evidence(
            "run-time OOM",
            f"Tried to allocate {fmt_bytes(requested)}, this process {fmt_bytes(process)} in use",
            f"vllm.log line {line} ({na(f['oom_process_source'])})",
        ),
        Evidence("engine budget B", fmt_bytes(budget), "ceil(gmu × total) (vLLM's requested memory)"),
        Evidence(
            "overrun E",
            fmt_bytes(e),
            "allocated + reserved-unallocated + A − L ('Torch may reserve up to L')"
            if at_cap
            else "P + A − B",
        ),
        Evidence("longest context", f"{na(longest, ',')} tokens", source),
    ]
    if not f["context_at_oom_assumed"]:
        evidence.append(
            Evidence(
                "context at the OOM",
                f"{na(c, ',')} tokens",
                "vllm:kv_cache_usage_perc × (num_gpu_blocks − 1) × block_size",
            )
        )
    if reserved is not None:
        evidence.append(Evidence("reserved but unallocated", fmt_bytes(reserved), f"vllm.log line {line}"))
    oom_gpu = f["oom_gpu"]
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=[oom_gpu] if oom_gpu is not None else sorted(set(f["engine_gpus"] or ())),
    )


RULE = Rule(
    id="long-context-prefill-oom",
    family="L",
    severity="critical",
    title="Attention memory grew with long context past the profiled peak",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    # long-request-spike: capping max_model_len at a quarter of the KV does not stop a prompt
    # that OOMs in chunked prefill's attention; the step size does (issue 24 kind 4)
    explains=("allocator-fragmentation", "cuda-graph-capture-oom", "long-request-spike", "torch-cap-oom"),
    flags=("--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory-bytes"),
)
