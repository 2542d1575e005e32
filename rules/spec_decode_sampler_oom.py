"""## What
Speculative decoding with k = num_speculative_tokens ≥ 2 (`--speculative-config`, the
engine-config line's `SpeculativeConfig(… num_spec_tokens=k)`, or
`vllm:spec_decode_num_drafts_total`), and a run-time torch OOM whose traceback passes through
the rejection sampler (`v1/sample/rejection_sampler.py`, V2 `v1/worker/gpu/spec_decode/
rejection_sampler.py`), or a run-time OOM with no other attribution where U exceeds the idle
headroom − 0.5 GiB.

## Why
The legacy runner's sampler warm-up gives each dummy request one draft token; the V2 runner's
warm-up has no speculative branch. At run time the sampler holds three fp32 (tokens × vocab)
tensors for the k·N draft positions. Draft weights and draft KV are inside the budget (they
are part of "Model loading took" and the KV pool).

## How to confirm
The OOM traceback with `rejection_sampler.py`; k in the engine-config line. Not this rule:
k = 1, a startup OOM while "Loading drafter model..." (the weights rules), a model-forward OOM
(long-context or prefill rules).

## Fix
U = V × (N_run·k − N_prof) × (b + 12) (+ 8 B more per element with probabilistic draft
sampling), N_run = min(max_num_seqs, ⌊mnbt/(k+1)⌋), N_prof = min(max_num_seqs, mnbt); for the
V2 runner the lower bound V × N_run × k × b. `--max-num-seqs` = the largest multiple of 8 with
U ≤ H_idle − 0.5 GiB; or `--gpu-memory-utilization` = floor_0.01((B − max(0, U + 0.5 GiB −
H_idle))/T); or the same `--speculative-config` with the largest k' that fits. U is an
estimate read off the code, not a measurement.

On vLLM 0.34 the legacy runner is gone: the V2 bound is used, only V2 rejection-sampler frames
exist, and on the extensible KV cache U is compared with H_torch (what torch may still grow
before its cap) instead of H_idle; the gmu alternative is valid there (it raises the cap).

## Sources
spec/rules-catalogue2.md §3.3, §2 (B, H_idle); vllm-facts.md §2.1 "Speculative decoding",
§3.7 (SpeculativeConfig line), §4.2 (`--speculative-config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rule_functions import spec_config_with_k, spec_k_fit, spec_max_num_seqs_fit, spec_sampler_bytes
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, floor_to, fmt_bytes


@dataclass(frozen=True)
class Thresholds:
    #: the smallest num_speculative_tokens this rule considers (k = 1 is what warm-up measured)
    min_k: int = 2
    #: GiB of headroom kept free beside the sampler's U
    margin_gib: float = 0.5


@dataclass(frozen=True)
class _Shape:
    """The engine's sampler inputs, for spec_sampler_bytes and the fits built on it."""

    vocab: int | None
    max_num_seqs: int | None
    mnbt: int | None
    k: int | None
    logit_bytes: int
    probabilistic: bool
    v2: bool


def _shape(f: Facts) -> _Shape | None:
    """None without the logits' dtype size (no estimate can be made)."""
    logit_bytes = f["logits_dtype_bytes"]
    if logit_bytes is None:
        return None
    return _Shape(
        f["vocab_size"],
        f["max_num_seqs_effective"],
        f["max_num_batched_tokens"],
        f["spec_k"],
        logit_bytes,
        bool(f["spec_probabilistic"]),
        # on vLLM 0.34 the V2 runner is the only one ("Using V2 Model Runner" is no longer logged)
        bool(f["v2_runner"] or f["vllm_v34"]),
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    k = f["spec_k"]
    if not f["spec_on"] or (k or 0) < t.min_k or not f["runtime_oom"]:
        return None
    s = _shape(f)
    u = (
        spec_sampler_bytes(s.vocab, s.max_num_seqs, s.mnbt, s.k, s.logit_bytes, s.probabilistic, s.v2)
        if s
        else None
    )
    if s is None or u is None or u <= 0:
        return None
    # on 0.34's extensible KV cache torch may only grow by H_torch before its cap (spec row:
    # case (b) compares U with H_torch, not H_idle)
    ext_headroom = f["torch_headroom_bytes"] if f["vllm_sizing_mode"] == "extensible" else None
    idle = ext_headroom if ext_headroom is not None else f["idle_headroom_bytes"]
    margin = t.margin_gib * GiB
    limit = idle - margin if idle is not None else None
    hints = f["runtime_oom_hints"] or []
    other = any(h in hints for h in ("logprobs", "multimodal", "attention", "prefill"))
    by_frames = bool(f["oom_frames_rejection_sampler"])
    by_size = not other and limit is not None and u > limit
    if not (by_frames or by_size):
        return None

    shape = (s.vocab, s.max_num_seqs, s.mnbt, s.k, s.logit_bytes, s.probabilistic, s.v2)
    seqs_fix = spec_max_num_seqs_fit(limit, *shape)
    budget, total, gmu = f["engine_budget_bytes"], f["device_total_bytes"], f["gmu"]
    gmu_fix = (
        floor_to((budget - max(0, u + margin - idle)) / total, 0.01)
        if budget and total and idle is not None
        else None
    )
    k_fix = spec_k_fit(limit, *shape)
    spec_config = spec_config_with_k(f["spec_config_json"], k_fix)

    # alternatives, the smallest change first
    levers: list[str] = []
    fixes: list[Fix] = []
    if seqs_fix and is_valid(f, "--max-num-seqs", seqs_fix):
        levers.append(f"--max-num-seqs {seqs_fix} brings it under the headroom")
        fixes.append(
            Fix(flags={"--max-num-seqs": str(seqs_fix)}, why="fewer sequences: fewer draft positions")
        )
    if (
        gmu_fix is not None
        and gmu is not None
        and gmu_fix < gmu
        and is_valid(f, "--gpu-memory-utilization", gmu_fix)
    ):
        levers.append(f"--gpu-memory-utilization {gmu_fix:.2f}")
        fixes.append(
            Fix(
                flags={"--gpu-memory-utilization": str(flag_value(gmu_fix))},
                why="room outside the budget for the sampler (a smaller KV cache)",
            )
        )
    if spec_config and is_valid(f, "--speculative-config", spec_config):
        levers.append(f"num_speculative_tokens {k_fix} (--speculative-config '{spec_config}')")
        fixes.append(Fix(flags={"--speculative-config": spec_config}, why="fewer draft tokens per request"))

    line = na(f["runtime_oom_line"])
    method = f" ({f['spec_method']})" if f["spec_method"] else ""
    fed = "no draft tokens at all (V2 runner)" if s.v2 else "one draft token per request"
    what = (
        "the extra target logits alone, a lower bound"
        if s.v2
        else "three fp32 copies of the logits at every draft position"
    )
    against = f", against {fmt_bytes(idle)} free at idle" if idle is not None else ""
    summary = (
        f"A run-time OOM (vllm.log line {line}){' in the rejection sampler' if by_frames else ''} with"
        f" speculative decoding at k = {k} draft tokens{method}. vLLM's warm-up feeds the rejection sampler"
        f" {fed}, so a real step with {k} drafts per request needs about {fmt_bytes(u)} more than was"
        f" measured ({what}; an estimate from the code path, not measured){against}."
    )
    if levers:
        summary += " " + "; or ".join(levers) + "."

    evidence = [
        Evidence(
            "speculative decoding",
            f"k = {k}",
            "--speculative-config / engine-config line SpeculativeConfig(… num_spec_tokens=k)",
        ),
        Evidence(
            "run-time OOM",
            f"Tried to allocate {fmt_bytes(f['oom_requested_bytes'])}",
            f"vllm.log line {line}",
        ),
    ]
    if by_frames:
        evidence.append(
            Evidence("traceback mentions", "rejection_sampler.py", f"vllm.log traceback around line {line}")
        )
    evidence.append(
        Evidence(
            "sampler memory outside the profile (U)",
            fmt_bytes(u),
            "vocab × (N_run·k − N_prof) × (b + 12) (estimate)",
        )
    )
    if idle is not None:
        evidence.append(
            Evidence("free at idle", fmt_bytes(idle), "nvidia-smi / NVML memory.total − memory.used")
        )
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="spec-decode-sampler-oom",
    family="L",
    severity="critical",
    title="Speculative decoding's rejection sampler needs more memory than vLLM profiled",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    explains=("logprobs-oom",),
    flags=("--max-num-seqs", "--gpu-memory-utilization", "--speculative-config"),
)
