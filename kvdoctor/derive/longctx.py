"""Family longctx: run-time OOMs that vLLM's startup profile could not see
(spec/rules-catalogue2.md §3.3): attention scratch that grows with context
(``long-context-prefill-oom``) and the rejection sampler of speculative decoding
(``spec-decode-sampler-oom``).

vLLM facts (vllm-facts §2.1 "What the profile run does not see"): the profile run computes no
attention and no earlier context; the rejection sampler is warmed up with one draft token per
request (V1 runner) or not at all (V2 runner) and at run time holds three fp32 (tokens × vocab)
tensors for the k·N draft positions."""

from __future__ import annotations

import json

from kvdoctor import timeline as tl
from kvdoctor.derive.base import Family, Scope, Vars

WRITES: dict[str, str] = {
    "longest_context_tokens": "tokens; the longest context in the traffic: upper edge of the highest non-empty vllm:request_prompt_tokens bucket, or the KV-in-use bound, else max_model_len",
    "longest_context_source": "str; where it comes from ('prompt-length histogram', 'KV in use', 'max_model_len (no metrics)')",
    "context_at_oom_tokens": "tokens; C: the context at the OOM, bounded by vllm:kv_cache_usage_perc (last sample) × (blocks − 1) × block_size, else max_model_len / 2",
    "context_at_oom_assumed": "bool; C is the max_model_len / 2 assumption",
    "oom_frames_attention": "bool; the last run-time OOM's traceback is in attention / MLA / indexer code",
    "oom_frames_rejection_sampler": "bool; the run-time OOM's traceback passes through a rejection sampler (v1/sample/rejection_sampler.py, v1/worker/gpu/spec_decode/rejection_sampler.py)",
    "kv_available_bytes_now": "bytes; KV memory now: --kv-cache-memory-bytes, else 'Available KV cache memory'",
    "spec_k": "int; num_speculative_tokens (--speculative-config, the engine-config line's SpeculativeConfig(… num_spec_tokens=k))",
    "spec_method": "str; the speculative method (eagle, mtp, ngram, draft_model, …)",
    "spec_on": "bool; speculative decoding on (a k, or vllm:spec_decode_num_drafts_total present)",
    "spec_probabilistic": "bool; draft_sample_method is 'probabilistic' (draft probabilities passed; ≥0.22)",
    "spec_config_json": "str; --speculative-config as JSON (to rewrite with another k)",
    "logits_dtype_bytes": "bytes; bytes per logit: 2 for bf16/fp16 models, 4 for fp32",
    "v2_runner": "bool; the V2 model runner ran ('Using V2 Model Runner')",
}
READS: frozenset[str] = frozenset(
    {
        "prompt_max_bucket",
        "kv_usage",
        "cache_num_gpu_blocks",
        "kv_capacity_tokens",
        "block_size",
        "max_model_len",
        "log_available_kv_bytes",
        "arch",
        "v2_runner_line",
    }
)


def derive(s: Scope, v: Vars) -> None:
    """Context figures around a run-time OOM; the speculative-decoding configuration."""
    runtime = [e for e in s.log.of("cuda_oom") if e.values.get("phase") == "runtime"] if s.log else []
    hints = set(runtime[-1].values.get("frames") or []) if runtime else set()
    v["oom_frames_attention"] = "attention" in hints
    v["oom_frames_rejection_sampler"] = "rejection_sampler" in hints
    v["v2_runner"] = v["v2_runner_line"] is not None
    _context(v)
    v["kv_available_bytes_now"] = s.cfg.kv_cache_memory_bytes or v["log_available_kv_bytes"]
    _spec(s, v)


def _kv_tokens_in_use(v: Vars) -> int | None:
    usage, bs = v["kv_usage"], v["block_size"] or 16
    if usage is None:
        return None
    if v["cache_num_gpu_blocks"]:
        return int(usage * max(0, v["cache_num_gpu_blocks"] - 1) * bs)
    if v["kv_capacity_tokens"]:
        return int(usage * v["kv_capacity_tokens"])
    return None


def _context(v: Vars) -> None:
    in_use = _kv_tokens_in_use(v)
    cands = [(v["prompt_max_bucket"], "prompt-length histogram"), (in_use, "KV in use")]
    known = [(int(x), src) for x, src in cands if x]
    if known:
        v["longest_context_tokens"], v["longest_context_source"] = max(known)
    elif v["max_model_len"]:
        v["longest_context_tokens"] = v["max_model_len"]
        v["longest_context_source"] = "max_model_len (no metrics)"
    if in_use:
        v["context_at_oom_tokens"], v["context_at_oom_assumed"] = in_use, False
    elif v["max_model_len"]:
        v["context_at_oom_tokens"], v["context_at_oom_assumed"] = v["max_model_len"] // 2, True


def _spec(s: Scope, v: Vars) -> None:
    spec = s.cfg.args.get("speculative_config")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            spec = None
    k = method = None
    if isinstance(spec, dict):
        k = spec.get("num_speculative_tokens")
        method = spec.get("method")
        v["spec_probabilistic"] = spec.get("draft_sample_method") == "probabilistic"
        v["spec_config_json"] = json.dumps(spec, separators=(",", ":"), sort_keys=True)
    log = s.log
    if log is not None:
        ev = log.last("speculative_config")
        if ev is not None:
            k = k if k is not None else ev.values.get("num_spec_tokens")
            method = method or ev.values.get("method")
    try:
        v["spec_k"] = int(k) if k is not None else None
    except (TypeError, ValueError):
        v["spec_k"] = None
    v["spec_method"] = method
    drafts = tl.has_value(s.series, "spec_decode_num_drafts_total")
    v["spec_on"] = bool((v["spec_k"] or 0) > 0 or drafts)
    if v["spec_probabilistic"] is None:
        v["spec_probabilistic"] = False
    arch = v["arch"]
    dt = (s.cfg.dtype if s.cfg.dtype not in (None, "auto") else (arch.dtype if arch else None)) or ""
    v["logits_dtype_bytes"] = 4 if dt.lower() in ("float32", "fp32") else 2


FAMILY = Family("longctx", WRITES, READS, derive)
