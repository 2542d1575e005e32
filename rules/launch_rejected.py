"""## What
The launch command asks for something vLLM rejects before it loads the model: a
`--max-model-len` above the model's maximum, a `--tensor-parallel-size` that does not divide the
attention heads, or a flag the vLLM version does not have.
The engine will not start (or, when it ran, did not). A length the log shows the engine ran
with (it sized its KV cache for it: "Maximum concurrency for L tokens per request") is not
reported: the model maximum in hand (the catalogue's, a config.json of another revision) is
then not the one that ran.

## Why
vLLM checks the configuration first: `_get_and_verify_max_len` refuses a max_model_len above the
model's max_position_embeddings (rope scaling included) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1;
the model's parallel layers need the heads divisible by TP ("Total number of attention heads …
must be divisible by tensor parallel size"); argparse refuses a flag the version removed (or does
not yet have).

## How to confirm
`kvdoctor diagnose --cmdline '…'` before the launch (with `--model-config` for a model the
catalogue does not know); the engine's own ValueError or "unrecognized arguments" after it.

## Fix
`--max-model-len` at the model's maximum; the nearest `--tensor-parallel-size` vLLM accepts; drop the flags the version does not have.

## Sources
issue 24 kind 10; vllm-facts §4.2 (flags by version); kvmath.derived_max_model_len,
valid_tensor_parallel_size.
"""

from __future__ import annotations

from typing import NamedTuple

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


class Thresholds(NamedTuple):
    """None: the rule has no tunable thresholds."""


def _tp_alternatives(f: Facts) -> list[int]:
    """The valid TP sizes nearest the one asked for: the largest below it, then the smallest above
    it (is_valid drops one the visible GPUs cannot hold)."""
    tp = f["tp"] or 1
    sizes = [n for n in f["launch_tp_valid_sizes"] or [] if n != tp]
    below = [n for n in sizes if n < tp]
    above = [n for n in sizes if n > tp]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def check(f: Facts, t: Thresholds) -> Hit | None:
    reasons: list[str] = []
    mml_fix: dict[str, str] = {}
    tp_fixes: list[int] = []
    evidence: list[Evidence] = []
    mml, limit = f["launch_max_model_len"], f["model_max_model_len"]
    ran = f["log_kv_concurrency_len"]  # vLLM sized the KV cache for this length: it accepted it
    if (
        mml is not None
        and limit is not None
        and mml > limit
        and not f["long_max_model_len_allowed"]
        and not (ran is not None and ran >= mml)
    ):
        text = (
            f"max_model_len {mml:,} is above the {limit:,} tokens the model supports"
            f" (vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which risks wrong output)"
        )
        if is_valid(f, "--max-model-len", limit):
            text += f": use --max-model-len {limit}"
            mml_fix = {"--max-model-len": str(limit)}
        reasons.append(text)
        evidence.append(
            Evidence(
                "max_model_len / model maximum",
                f"{mml:,} / {limit:,} tokens",
                f"launch command; {na(f['model_source'])}",
            )
        )
    tp = f["tp"] or 1
    if f["launch_tp_invalid"]:
        heads, kv = f["num_attention_heads"], f["num_kv_heads"]
        text = (
            f"tensor_parallel_size {tp} does not divide the model's {na(heads)} attention heads"
            f" ({na(kv)} KV heads)"
        )
        alts = [n for n in _tp_alternatives(f) if is_valid(f, "--tensor-parallel-size", n)]
        if alts:
            text += ": use " + " or ".join(f"--tensor-parallel-size {n}" for n in alts)
            tp_fixes = alts
        reasons.append(text)
        evidence.append(
            Evidence(
                "tensor_parallel_size / valid sizes",
                f"{tp} / {f['launch_tp_valid_sizes'] or 'N/A'}",
                "launch command; model config",
            )
        )
    gone = f["launch_flags_unavailable"] or []
    if gone:
        names = ", ".join(g.lstrip("-").replace("-", "_") for g in gone)
        reasons.append(
            f"vLLM {f['launch_version']} has no {names} (argparse stops at it): remove it from the launch"
        )
        evidence.append(
            Evidence(
                "flags the version lacks", names, f"vLLM {f['launch_version']} ({f['launch_version_source']})"
            )
        )
    if not reasons:
        return None
    # every problem must be fixed at once: each alternative carries the length fix too
    why = " and ".join(
        w
        for w, on in (
            ("the model's maximum length", mml_fix),
            ("a tensor-parallel size vLLM accepts", tp_fixes),
        )
        if on
    )
    fixes = [Fix(flags={**mml_fix, "--tensor-parallel-size": str(n)}, why=why) for n in tp_fixes]
    if not fixes and mml_fix:
        fixes = [Fix(flags=mml_fix, why=why)]
    summary = "vLLM would reject this launch before loading the model: " + "; ".join(reasons) + "."
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=f["engine_gpus"] or ())


RULE = Rule(
    id="launch-rejected",
    family="K",
    severity="critical",
    title="vLLM would reject this launch configuration",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("config",),
    flags=("--max-model-len", "--tensor-parallel-size"),
)
