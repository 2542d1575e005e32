"""The port of the rules from YAML expressions to Python modules, verified while both exist:
every ported rule gives the same finding as its YAML form on every engine context of every
bundle, and on a seeded fuzz of those contexts (values crossed over between contexts, numbers
scaled). Differences are allowed only where listed in :data:`DIFFERENCES`, each a bug of the
YAML form fixed by the port (with its own test in the rule's tests)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from tests.rule_contexts import all_contexts

#: rule id → {aspect: why the Python rule differs from the YAML one on purpose}. Aspects:
#: "summary" (the words), "flags" (the union of the fixes' flags and environment).
DIFFERENCES: dict[str, dict[str, str]] = {
    "kv-budget-exhausted": {
        "summary": "no longer advises a --tensor-parallel-size (or gmu, mnbt) the fix dropped as invalid "
        "or already in effect",
    },
    "gpu-shared-with-foreign-process": {
        "summary": "no longer advises a --gpu-memory-utilization the fix dropped as invalid or already in "
        "effect (±0.005); says to stop the other process (kill PID, the fix) or, for preloaded "
        "weights, to preload a smaller model instead; names the gmu as the fix writes it (0.28, not "
        "0.28200000000000006); the gmu in effect reads 'gmu 0.92', not '--gpu-memory-utilization 0.92', "
        "which read as advice the fix does not hold; 'or stop the other process first' carries its command "
        "(kill PID, once per pid) as a second fix",
    },
    "idle-preallocation": {
        "summary": "no longer suggests '--gpu-memory-utilization 0.0' (a card smaller than the share, its "
        "fix dropped as outside (0, 1]) or a gmu already in effect",
    },
    "low-util-kv-saturated": {
        "summary": "no longer advises a --max-num-seqs the fix dropped as already in effect, nor 'fp8 KV would "
        "double the tokens' for a KV cache already fp8/int8; the advice sentence starts with a capital",
    },
    "colocated-engines-overcommit": {
        "summary": "the split names the flag its fix sets ('Split the card with --gpu-memory-utilization per "
        "engine: a 0.4, b 0.54'), each value as the fix writes it (never 'None'); the words never named the flag",
    },
    "dp-engine-load-skew": {
        "summary": "no longer names --data-parallel-external-lb / --data-parallel-rank (no fix sets them), "
        "and no longer says twice that X-data-parallel-rank requests skip the balancer",
    },
    "parallel-rank-imbalance": {
        "summary": "no longer names VLLM_PP_LAYER_PARTITION without a value when no partition could be "
        "computed (the fix was empty)",
    },
    "allocator-fragmentation": {
        "summary": "the advised PYTORCH_CUDA_ALLOC_CONF keeps the options the engine already sets "
        "(max_split_size_mb, ...) instead of replacing them; not advised when the fix is refused",
        "flags": "PYTORCH_CUDA_ALLOC_CONF = the engine's options + expandable_segments:True, not "
        "expandable_segments:True alone (which silently dropped the operator's other options)",
    },
    "flashinfer-workspace-overflow": {
        "summary": "no longer names --gpu-memory-utilization as the thing that does not help (the words "
        "named a flag no fix set), nor advises a gmu the fix dropped (vLLM <= 0.11, or invalid)",
        "flags": "the FLASH_ATTN alternative the words always gave is now a fix (--attention-backend "
        "from 0.13 and when the version is unknown, VLLM_ATTENTION_BACKEND before); it was set only <= 0.11",
    },
    "triton-autotune-oom": {
        "summary": "no longer advises a --gpu-memory-utilization the fix dropped (not above 0, or within "
        "0.005 of the gmu in effect); an unknown version reads 'vLLM N/A runs ...', not a stray 'N/A'",
    },
    "wake-up-oom": {
        "summary": "advises --gpu-memory-utilization only when the fix sets it (not when the gmu in effect "
        "already fits, nor '<= N/A' without the GPU's total), saying why instead; capitalised 'Size the set'",
    },
    "max-model-len-exceeds-kv-capacity": {
        "summary": "no longer advises a --max-model-len, gmu or fp8 KV cache dtype the fix dropped as invalid "
        "or already in effect ('Cap --max-model-len at N/A'), nor renders 'N/A' for an unknown TP × PP; "
        "names the length in effect as max_model_len, not as a flag no fix sets",
    },
    "cuda-graph-capture-oom": {
        "summary": "no longer advises a gmu or --max-num-seqs the fix dropped as invalid or already in effect "
        "('--gpu-memory-utilization N/A'), nor vLLM's own --kv-cache-memory= number",
        "flags": "never vLLM's own --kv-cache-memory= number as --kv-cache-memory-bytes: it double-counts "
        "the graph estimate and turns 0.34's extensible cache off (vllm-facts §9.6, issue 28)",
    },
    "multimodal-profile-oom": {
        "summary": "no longer advises --max-num-seqs (8) after that fix was dropped as already in effect; "
        "each alternative named with the very value its fix sets ('{\"max_pixels\":802816}')",
        "flags": "no --limit-mm-per-prompt '{\"image\":1}' where that limit is already in effect",
    },
    "sampler-warmup-oom": {
        "summary": "no longer advises a --max-num-seqs or gmu the fix dropped (gmu ≤ 0.1 or unknown: "
        "'--gpu-memory-utilization to N/A'), nor names max_num_seqs values ('512 or 128') no fix holds",
    },
    "invalid-kv-cache-dtype": {
        "summary": "no longer says 'Use --kv-cache-dtype X' when X is unknown or the fix dropped it as a value "
        "that vLLM version rejects",
    },
    "cpu-offload-not-applied": {
        "summary": "names the setting in effect as cpu_offload_gb, not as a --flag no fix sets; no 'N/A' "
        "sentences when the offload evidence or G is unknown",
    },
    "weights-not-sharded": {
        "summary": "no longer says 'Shard the model with --tensor-parallel-size 1' (already in effect) or a TP "
        "the fix dropped as invalid",
    },
    "mig-defaults-fallback": {
        "summary": "names the limits in effect as max_num_seqs / max_num_batched_tokens, not as --flags no fix "
        "sets; no longer advises a value the fix dropped as invalid",
    },
    "mixed-gpus-in-parallel-group": {
        "summary": "no longer names --tensor-parallel-size 1 / --pipeline-parallel-size N when the fix dropped "
        "them as already in effect",
        "flags": "no VLLM_PP_LAYER_PARTITION whose stage count is not the pipeline size it is set with "
        "(one stage per engine GPU, but fewer or more GPUs than TP × PP ranks): vLLM rejects it",
    },
    "long-request-spike": {
        "summary": "no longer advises 'Cap --max-model-len at N' after that cap was dropped as invalid, nor "
        "names the max model length or --max-num-batched-tokens in effect (or N/A) as if they were fixes; "
        "'vllm.log line N/A', not 'line None'",
        "flags": "with the KV capacity unknown it still chunks long prefills (--max-num-batched-tokens 2048); "
        "the YAML form fixed nothing while its words named '--max-num-batched-tokens N/A'",
    },
    "max-num-seqs-exceeds-kv": {
        "summary": "the limit in effect reads 'max_num_seqs 1,024', not '--max-num-seqs 1,024' beside the "
        "fix's different value; no '--max-num-seqs N' advised when that fix is dropped",
    },
    "preemption-storm": {
        "summary": "no longer names a --tensor-parallel-size (or --max-num-seqs, --kv-cache-dtype) the fix "
        "dropped as invalid",
    },
    "prefill-burst-oom": {
        "summary": "with 256 or fewer tokens per step in effect, no '--max-num-batched-tokens 256' advised",
        "flags": "never raises --max-num-batched-tokens: with 256 or fewer in effect the YAML form set 256",
    },
    "logprobs-oom": {
        "summary": "with 256 or fewer tokens per step in effect, no 'Lower --max-num-batched-tokens to 256'",
        "flags": "never raises --max-num-batched-tokens: with 256 or fewer in effect the YAML form set 256",
    },
    "long-context-prefill-oom": {
        "summary": "no dangling '; or' when the gmu alternative is withheld (too little KV left), and no "
        "--gpu-memory-utilization / --kv-cache-memory-bytes named after its fix was dropped as invalid",
    },
    "swap-preemption-stall": {
        "summary": "no 'Set --swap-space 0' when the swap space in effect is already 0",
        "flags": "no --swap-space 0 when it is already in effect",
    },
    "spec-decode-sampler-oom": {
        "summary": "no leading 'or' or trailing ';', no gmu named when that fix is invalid, and the smaller k "
        "names --speculative-config, the flag that carries it",
        "flags": "each alternative the words offer is a fix (--max-num-seqs; or --gpu-memory-utilization; or "
        "--speculative-config with a smaller k): the YAML form held only one, so its words named values no "
        "fix carried",
    },
}


def _old_rules() -> dict[str, Any]:
    from kvdoctor.rules_engine import load_rules

    return {r.id: r for r in load_rules()}


def _new_rules() -> dict[str, Any]:
    from kvdoctor.rulekit import load_rules

    return {r.id: r for r in load_rules(plugins=False)}


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _shape(findings: list[Any]) -> tuple[Any, ...] | None:
    if not findings:
        return None
    (f,) = findings
    flags: dict[str, str] = dict(f.suggested_flags)
    for fix in getattr(f, "fixes", ()):
        flags.update(fix.flags)
        flags.update(fix.env)
    return (
        f.severity,
        _norm(f.title),
        _norm(f.summary),
        tuple((_norm(e.fact), _norm(e.value), _norm(e.source)) for e in f.evidence),
        tuple(sorted(flags.items())),
        tuple(f.gpus),
    )


#: how many comparisons had the rule fire (in either form), per rule id
FIRED: dict[str, int] = {}


def _compare(
    rule_id: str, old_rule: Any, new_rule: Any, engine: str | None, v: dict[str, Any], inputs: Any
) -> list[str]:
    from kvdoctor import rulekit, rules_engine

    old = rules_engine.evaluate([old_rule], [rules_engine.RuleContext(engine, dict(v), set(inputs))])
    new = rulekit.evaluate([new_rule], [rulekit.RuleContext(engine, dict(v), set(inputs))])
    if old.findings or new.findings:
        FIRED[rule_id] = FIRED.get(rule_id, 0) + 1
    problems = [f"new rule error: {e}" for e in new.errors]
    a, b = _shape(old.findings), _shape(new.findings)
    if (a is None) != (b is None):
        return [*problems, f"fires: yaml {a is not None}, python {b is not None}"]
    if a is None or b is None:
        return problems
    allowed = DIFFERENCES.get(rule_id, {})
    names = ("severity", "title", "summary", "evidence", "flags", "gpus")
    for name, x, y in zip(names, a, b, strict=True):
        if x != y and name not in allowed:
            problems.append(f"{name}:\n  yaml:   {x}\n  python: {y}")
    return problems


def _ported() -> list[str]:
    return sorted(_new_rules())


@pytest.mark.parametrize("rule_id", _ported())
def test_a_ported_rule_gives_the_yaml_rules_finding_on_every_bundle(rule_id: str) -> None:
    old, new = _old_rules()[rule_id], _new_rules()[rule_id]
    failures = []
    for bundle, engine, v, inputs in all_contexts():
        problems = _compare(rule_id, old, new, engine, v, inputs)
        if problems:
            failures.append(f"{bundle} [{engine}]: " + "; ".join(problems))
    assert not failures, "\n".join(failures[:5])
    assert FIRED.get(rule_id), f"{rule_id} fires on no bundle: the comparison would be vacuous"


def _mutate(rng: random.Random, v: dict[str, Any], pool: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(v)
    for name in rng.sample(sorted(out), k=min(len(out), rng.randint(1, 12))):
        roll = rng.random()
        value = out[name]
        if roll < 0.6:
            out[name] = rng.choice(pool).get(name)  # a value derive gave elsewhere
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled = value * rng.choice((0.25, 0.5, 0.9, 1.1, 2.0, 4.0, -1.0))
            out[name] = type(value)(scaled)
        elif isinstance(value, bool):
            out[name] = not value
    return out


@pytest.mark.parametrize("rule_id", _ported())
def test_a_ported_rule_gives_the_yaml_rules_finding_on_fuzzed_contexts(rule_id: str) -> None:
    old, new = _old_rules()[rule_id], _new_rules()[rule_id]
    contexts = all_contexts()
    pool = [v for _b, _e, v, _i in contexts]
    rng = random.Random(f"port:{rule_id}")
    failures = []
    for _ in range(1500):
        bundle, engine, v, inputs = rng.choice(contexts)
        mutated = _mutate(rng, v, pool)
        problems = _compare(rule_id, old, new, engine, mutated, inputs)
        if problems:
            failures.append(f"{bundle} [{engine}] mutated: " + "; ".join(problems))
    assert not failures, f"{len(failures)} of 1500 differ, e.g.\n" + "\n".join(failures[:3])
