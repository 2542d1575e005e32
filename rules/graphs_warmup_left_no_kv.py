"""## What
A vLLM ≥ 0.34 engine with the extensible KV cache passed the fit check before warm-up (the
reservation "Available KV cache memory" held one max_model_len request), then CUDA graph capture
and the sizing warm-up took so much that the KV pool committed afterwards no longer holds one
request: "CUDA graph capture and warmup left no memory for the KV cache", "No available memory
for the cache blocks … left after the model, its activations, CUDA graphs and warmup", or
"To serve at least one request …" with that hint.

## Why
On 0.34's extensible path "Available KV cache memory" A is only an address reservation. The pool
is committed after graph capture and warm-up: K = min(A, F1 − μ) − kept. So A − K = (R − F0) + G +
X + μ + kept − P: memory never free at startup, the CUDA graphs, other persistent growth, the
margin μ = max(1 GiB, 0.75 × Tr) and the transient headroom the warm-up measured beyond the
profile run's peak. When that exceeds A − one request, the engine stops after capture.

## How to confirm
`Memory after warmup: … N KV cache blocks (X GiB) …` with (N − 1) × b below one request's
blocks × b; `Graph capturing finished in … took G GiB`; the error's hint names "CUDA graphs and
warmup".

## Fix
Each only when it covers the shortfall S = b × req_blocks(max_model_len) − (N − 1) × b:
`--max-model-len` = vLLM's estimate (a multiple of the block size) or the longest the pool holds;
`--kv-cache-dtype fp8`; smaller graphs (`--compilation-config` with half the capture maxima when
G/2 ≥ S; the saving per size is not computed) or `--enforce-eager` when G ≥ S;
`--max-num-batched-tokens` halved when the transient headroom is the largest term;
`--gpu-memory-utilization 1.0` only for an explicit gmu < 1; the smallest TP that fits.
Never "increase gpu_memory_utilization" at gmu 1.0, although vLLM's auto-fit text says so.

## Sources
spec/vllm-0.34.md §3.2 (N2); vllm-facts.md §9.2 (the sizing pipeline), §9.4 (hint texts H1/H2/H3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvdoctor.kvmath import smallest_tensor_parallel_size
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid, na

_MiB = 2**20
_KEPT = "transient headroom kept beyond the profile peak (kept − P)"


@dataclass(frozen=True)
class Thresholds:
    #: GiB another process must hold on the GPU for shared-gpu-gmu-unset (N1) to own the case
    foreign_min_gib: float = 0.25
    #: the smallest --max-num-batched-tokens worth suggesting
    min_batched_tokens: int = 2048
    #: an auto-fit max_model_len below this many tokens is a warning (vLLM rejects longer requests)
    short_len: int = 8192


def _mib(nbytes: float | None) -> str:
    return "N/A" if nbytes is None else f"{nbytes / _MiB:,.0f}"


def _terms(f: Facts) -> dict[str, int]:
    """Where A went (A − K = (R − F0) + G + X + μ + kept − P), the terms that were read; X is what
    the others leave of A − K (≥ 0)."""
    r, f0 = f["warmup_requested_bytes"], f["startup_free_bytes"]
    g, mu, kept = f["graph_capture_bytes"], f["warmup_margin_bytes"], f["warmup_kept_bytes"]
    p = f["summary_activation_bytes"]
    out: dict[str, int] = {}
    if r is not None and f0 is not None and r > f0:
        out["memory not free at startup (R − F0)"] = int(r - f0)
    if g:
        out["CUDA graphs (G)"] = int(g)
    if mu:
        out["the after-warm-up margin μ"] = int(mu)
    if kept is not None and p is not None:
        out[_KEPT] = max(0, int(kept - p))
    elif kept is not None:
        out["transient headroom kept (kept; the profile peak P was not logged)"] = int(kept)
    a, k = f["kv_reservation_bytes"], f["kv_pool_bytes"]
    if a is not None and k is not None:
        rest = int(a - k) - sum(out.values())
        if rest > 0:
            out["other persistent growth (X)"] = rest
    return out


def _autofit_reduced(f: Facts, t: Thresholds) -> Hit | None:
    """`--max-model-len auto` reduced after graph capture and warm-up, and the engine served: info,
    a warning below ``short_len`` tokens, where vLLM rejects longer requests (spec §3.2 near misses)."""
    final, start = f["autofit_final_len"], f["autofit_final_from"]
    if not (final and start and final < start):
        return None
    short = bool(f["autofit_short"]) or final < t.short_len
    g = f["graph_capture_bytes"]
    summary = (
        f"max_model_len auto was reduced from {start:,} to {final:,} tokens after CUDA graph capture and warm-up"
        f" (vLLM ≥ 0.34, extensible KV cache){f', with {gib_text(g)} GiB of CUDA graphs' if g else ''}."
        + (f" Requests longer than {final:,} tokens are rejected." if short else " The engine serves.")
    )
    line = "vllm.log ('--max-model-len auto reduced max_model_len from A to B')"
    return Hit(
        summary=summary,
        evidence=[Evidence("max_model_len auto", f"{start:,} → {final:,} tokens", line)],
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity="warning" if short else "info",
        title="max_model_len auto was reduced after graph capture and warm-up",
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    if f["vllm_sizing_mode"] != "extensible":
        return None
    if (f["foreign_bytes"] or 0) >= t.foreign_min_gib * 2**30:
        return None  # another process on the GPU: shared-gpu-gmu-unset (N1)
    b, n, shortfall = f["kv_block_bytes"], f["kv_pool_blocks"], f["kv_shortfall_bytes"]
    after_error = bool(
        f["kv_error_after_warmup"]
        and f["kv_hint_error"] in ("no_available_kv_memory", "max_seq_len_exceeds_kv", "autofit_failed")
    )
    short_numbers = bool(shortfall is not None and shortfall > 0 and f["warmup_line"] is not None)
    if not (after_error or short_numbers):
        return _autofit_reduced(f, t)
    need = shortfall + (n - 1) * b if b and n and shortfall is not None else None
    a = f["kv_reservation_bytes"]
    if a is not None and b and need is not None and a - b < need:
        return None  # the pre-warm-up fit would have failed: the reservation was already short

    mml, bs = f["max_model_len"], f["block_size"]
    fixes: list[Fix] = []
    alternatives: list[str] = []
    # (1) the longest max_model_len the committed pool holds, a multiple of the block size
    est = f["mml_error_estimate"] or f["max_model_len_fit_pool"] or f["autofit_final_len"]
    if est and bs:
        est = int(est) // int(bs) * int(bs)
    if est and is_valid(f, "--max-model-len", est):
        alternatives.append(f"cap --max-model-len at {est}")
        fixes.append(
            Fix(flags={"--max-model-len": str(est)}, why="the longest request the committed KV pool holds")
        )
    # (2) fp8 KV: the pool holds twice the blocks of half the size
    if (
        f["kv_cache_dtype"] in (None, "auto")
        and f["fp8_supported"] is not False
        and b
        and n
        and need is not None
        and (2 * n - 1) * b >= need
        and is_valid(f, "--kv-cache-dtype", "fp8")
    ):
        alternatives.append("halve the KV per token with --kv-cache-dtype fp8 (the full length then fits)")
        fixes.append(Fix(flags={"--kv-cache-dtype": "fp8"}, why="half the KV bytes per token"))
    # (3) smaller graphs, or none
    g = f["graph_capture_bytes"]
    n_dec, t_pre = f["decode_graph_max_requests"], f["prefill_graph_max_tokens"]
    if not f["enforce_eager"] and g and shortfall is not None and shortfall > 0:
        if g / 2 >= shortfall and n_dec and t_pre and n_dec >= 2 and t_pre >= 2:
            cc = json.dumps(
                {
                    "max_decode_cudagraph_capture_requests": int(n_dec) // 2,
                    "max_prefill_cudagraph_capture_tokens": int(t_pre) // 2,
                },
                separators=(", ", ": "),
            )
            if is_valid(f, "--compilation-config", cc):
                alternatives.append(
                    f"capture smaller CUDA graphs with --compilation-config '{cc}' (the memory each size"
                    " saves is not computed here; G/2 covers the shortfall if graphs shrink by half)"
                )
                fixes.append(Fix(flags={"--compilation-config": cc}, why="half the widest captured graphs"))
        if g >= shortfall and is_valid(f, "--enforce-eager", True):
            alternatives.append("run without CUDA graphs (--enforce-eager), at the cost of slower decode")
            fixes.append(Fix(flags={"--enforce-eager": ""}, why="the graph memory goes to the KV pool"))
    # (4) a smaller step when the transient headroom dominates
    terms = _terms(f)
    largest = max(terms, key=lambda k: terms[k]) if terms else None
    mnbt = f["max_num_batched_tokens"]
    if largest == _KEPT and mnbt and mnbt > t.min_batched_tokens:
        half = max(t.min_batched_tokens, int(mnbt) // 2)
        if not (f["chunked_prefill_on"] is False and half < (mml or 0)) and is_valid(
            f, "--max-num-batched-tokens", half
        ):
            alternatives.append(f"shrink the warm-up's transient with --max-num-batched-tokens {half}")
            fixes.append(Fix(flags={"--max-num-batched-tokens": str(half)}, why="a smaller step, less kept"))
    # (5) an explicit gmu below 1.0 whose hint was H2, nothing else on the GPU
    gmu = f["gmu_resolved"]
    if f["gmu_explicit"] and gmu is not None and gmu < 1.0 and f["kv_hint"] == "H2":
        if is_valid(f, "--gpu-memory-utilization", 1.0):
            alternatives.append("let the extensible cache take the whole GPU with --gpu-memory-utilization 1")
            fixes.append(
                Fix(
                    flags={"--gpu-memory-utilization": "1"},
                    why="nothing else on this GPU needs the memory gmu withholds",
                )
            )
    # (6) more GPUs
    arch, weights, total, gpus = f["arch"], f["weights_bytes"], f["gpu_total_bytes"], f["gpu_count"]
    if not fixes and arch is not None and weights and total and gpus and mml and gmu is not None:
        tp = smallest_tensor_parallel_size(
            arch,
            weights_bytes=weights,
            gpu_total_bytes=total,
            gpu_memory_utilization=gmu,
            visible_gpus=gpus,
            max_model_len=mml,
            kv_cache_dtype=f["kv_cache_dtype"] or "auto",
            block_size=bs,
        )
        if tp and tp > (f["tp"] or 1) and is_valid(f, "--tensor-parallel-size", tp):
            alternatives.append(f"shard the model with --tensor-parallel-size {tp}")
            fixes.append(
                Fix(flags={"--tensor-parallel-size": str(tp)}, why="the weights split over more GPUs")
            )

    where = ""
    if terms and a is not None and f["kv_pool_bytes"] is not None:
        parts = ", ".join(f"{name} {_mib(v)} MiB" for name, v in sorted(terms.items(), key=lambda kv: -kv[1]))
        where = (
            f" Of the {_mib(a)} MiB reservation, {_mib(a - f['kv_pool_bytes'])} MiB went elsewhere: {parts};"
            f" the largest is {largest}."
        )
    short = (
        f" One max_model_len {na(mml, ',')}-token request needs {_mib(need)} MiB; the pool of {na(n, ',')}"
        f" blocks holds {_mib((n - 1) * b)} MiB after the null block, {_mib(shortfall)} MiB short."
        if need is not None and n and b and shortfall is not None
        else ""
    )
    if alternatives:
        advice = " " + "; or ".join(alternatives) + "."
        advice = advice[:2].upper() + advice[2:]
    else:
        advice = " No setting that covers the shortfall could be computed from what was read."
    unset = (
        " gmu is unset, so 1.0 is already in effect: raising it is no fix." if not f["gmu_explicit"] else ""
    )
    summary = (
        "The KV fit passed before warm-up, but CUDA graph capture and the sizing warm-up left too little"
        f" for the KV cache committed afterwards (vLLM ≥ 0.34, extensible KV cache).{short}{where}{unset}{advice}"
    )

    evidence: list[Evidence] = []
    if a is not None:
        evidence.append(
            Evidence(
                "Available KV cache memory (a reservation on 0.34)",
                f"{gib_text(a)} GiB",
                f"vllm.log line {na(f['log_available_kv_line'])}",
            )
        )
    if g:
        evidence.append(
            Evidence(
                "CUDA graph memory", f"{gib_text(g)} GiB", "vllm.log 'Graph capturing finished … took X GiB'"
            )
        )
    if f["warmup_line"] is not None:
        evidence.append(
            Evidence(
                "committed KV pool after warm-up",
                f"{na(n, ',')} blocks ({gib_text(f['kv_pool_bytes'])} GiB), kept {gib_text(f['warmup_kept_bytes'])} GiB,"
                f" margin μ {gib_text(f['warmup_margin_bytes'])} GiB",
                f"vllm.log line {f['warmup_line']} (Memory after warmup)",
            )
        )
    if after_error:
        evidence.append(
            Evidence(
                "KV-fit error after graph capture and warm-up",
                f"{f['kv_hint_error']} (hint {na(f['kv_hint'])})",
                f"vllm.log line {na(f['kv_hint_line'])}",
            )
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="graphs-warmup-left-no-kv",
    family="K",
    severity="critical",
    title="CUDA graph capture and warm-up left too little memory for the KV cache",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log",),
    explains=("max-model-len-exceeds-kv-capacity", "kv-budget-exhausted"),
    flags=(
        "--max-model-len",
        "--kv-cache-dtype",
        "--compilation-config",
        "--enforce-eager",
        "--max-num-batched-tokens",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
    ),
)
