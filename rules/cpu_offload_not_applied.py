"""## What
`--cpu-offload-gb G` (G > 0) was given, and the weights were not offloaded: the V2 model
runner ran on vLLM 0.12–0.27 ("Using V2 Model Runner", or `VLLM_USE_V2_MODEL_RUNNER=1`), or on
≥ 0.17 the log has "Model loading took" but neither "Offloader set to …" nor "Total CPU
offloaded parameters", or "Model loading took W GiB" with W ≥ S − 0.5 × min(G, S) (S: the
checkpoint per rank). Critical when the engine then failed (OOM while loading weights, or no
KV memory), a warning otherwise.

## Why
The weight offloader is installed by the V1 model runner in every version, and by the V2
runner only from 0.28.0. In every V2 runner from 0.12.0 to 0.27.0 the flag is accepted and
does nothing, silently. From 0.22 the V2 runner is chosen automatically for some
architectures (0.25 defaults any dense model and a MoE list including DeepseekV2ForCausalLM).

## How to confirm
`grep -E "Using V2 Model Runner|Offloader set to|Total CPU offloaded parameters|Model loading took" vllm.log`:
with a working offload "Model loading took" is about G below the checkpoint's size per rank.
Not this rule: the offloader lines are there (also when "Total CPU offloaded parameters" is
below G because the model had nothing more to offload).

## Fix
On vLLM ≥ 0.34 the cause is gone (one runner, and it installs the offloader) and
`VLLM_USE_V2_MODEL_RUNNER=0` is a startup error (`v1-runner-env-removed`): with evidence (b) or (c)
the finding is info, with G_needed and no flag. On 0.22–0.27 with V2 chosen automatically, `VLLM_USE_V2_MODEL_RUNNER=0` forces the V1 runner;
configurations that force V2 on 0.25–0.27 (DSpark speculative decoding, diffusion models)
need vLLM ≥ 0.28. On 0.12–0.21 remove `VLLM_USE_V2_MODEL_RUNNER=1`. The finding also says
whether G is enough once the offload works: G_needed = ceil_GiB(S + KV₁ + O − B), KV₁ the KV of
one max_model_len request, O peak activation + non-torch (1 GiB when not logged). While this
rule holds, `weights-not-sharded` does not suggest more tensor parallelism.

## Sources
spec/rules-catalogue2.md §3.1; vllm-facts.md §2.1 "CPU weight offload", §3.7 (offloader and
runner lines), §4.2 (`--cpu-offload-gb`, `VLLM_USE_V2_MODEL_RUNNER`).
"""

from __future__ import annotations

from typing import NamedTuple

from kvdoctor.findings import Severity
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, na
from kvdoctor.units import GiB, fmt_bytes

_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: the phases of a failed start whose OOM the missing offload explains
_FAILED_PHASES = ("weight_loading", "profile_run", "kv_cache_init")


class Thresholds(NamedTuple):
    """None: the rule has no tunable thresholds."""


def _v1_runner_fix(f: Facts, evidence: list[str]) -> str | None:
    """'0' (force the V1 runner, which installs the offloader) where the V2 runner ran on
    0.12–0.27 and nothing forces V2 (DSpark speculative decoding on 0.25–0.27)."""
    release = f["vllm_release"]
    if f["vllm_v34"]:
        return None  # a startup ValueError on 0.34 (vllm-facts §9.4)
    if release is None or not 12 <= release <= 27 or "v2_runner" not in evidence:
        return None
    if release >= 25 and f["dspark_speculative"]:
        return None
    return "0"


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["offload_not_applied"]:
        return None
    offload = f["cpu_offload_bytes"]
    g_gib = offload / GiB if offload is not None else None
    g = na(g_gib, ".0f")
    evidence_kinds = f["offload_evidence"] or []
    release, env, runner_line = f["vllm_release"], f["v2_runner_env"], f["v2_runner_line"]
    fix_env = _v1_runner_fix(f, evidence_kinds)

    words = [
        f"cpu_offload_gb {g} was given, but vLLM {f['vllm_version'] or '?'} did not offload any weights."
    ]
    if "v2_runner" in evidence_kinds:
        how = f"Using V2 Model Runner, vllm.log line {runner_line}" if runner_line else f"{_ENV}={env}"
        words.append(
            f"The V2 model runner ran ({how}), and no V2 runner from 0.12 to 0.27 installs the weight"
            " offloader: the flag is accepted and does nothing."
        )
    if "no_offloader_lines" in evidence_kinds:
        words.append('No "Offloader set to …" or "Total CPU offloaded parameters" line was logged.')
    if "weights_not_reduced" in evidence_kinds:
        per_rank = f["checkpoint_bytes_per_rank"]
        expected = per_rank - offload if per_rank is not None and offload is not None else None
        words.append(
            f"Model loading took {fmt_bytes(f['weights_logged_bytes'])}, the whole checkpoint per rank"
            f" ({fmt_bytes(per_rank)}) rather than about {fmt_bytes(expected)}."
        )
    fixes: list[Fix] = []
    if f["vllm_v34"]:
        words.append(
            f"vLLM {f['vllm_version'] or '≥ 0.34'} has one model runner and it installs the weight offloader, so"
            " no version cause is known: check that the offload took effect (the log lines above) before"
            " relying on it."
        )
    elif fix_env is not None:
        chosen = (
            " (the V2 runner was chosen automatically for this model on 0.22–0.27)"
            if env in (None, "")
            else f" (remove {_ENV}=1)"
        )
        words.append(f"Set {_ENV}={fix_env}{chosen}: the V1 runner installs the offloader.")
        fixes.append(Fix(env={_ENV: fix_env}, why="the V1 model runner, which installs the weight offloader"))
    elif release is not None and release <= 27:
        words.append("Upgrade to vLLM ≥ 0.28, whose V2 runner installs the offloader.")
    needed = f["offload_needed_gib"]
    if needed is not None and g_gib is not None and needed <= g_gib:
        assumed = (
            " (assuming 1 GiB of activation and non-torch memory: the post-warm-up summary was not logged)"
            if f["offload_other_assumed"]
            else ""
        )
        words.append(
            f"Once it works, {g} GiB is enough: configured G = {g} GiB, needs ≥ {needed} GiB{assumed}."
        )
    elif needed is not None and g_gib is not None:
        words.append(f"Even then configured G = {g} GiB, needs ≥ {needed} GiB.")

    evidence = [
        Evidence("--cpu-offload-gb", f"{g} GiB", "launch command / non-default args 'cpu_offload_gb'")
    ]
    if runner_line is not None:
        evidence.append(Evidence("V2 model runner", "Using V2 Model Runner", f"vllm.log line {runner_line}"))
    if env is not None:
        evidence.append(Evidence(_ENV, env, "env.txt / launch command"))
    if "no_offloader_lines" in evidence_kinds:
        evidence.append(
            Evidence(
                "offloader lines", "none ('Offloader set to …', 'Total CPU offloaded parameters')", "vllm.log"
            )
        )
    if "weights_not_reduced" in evidence_kinds:
        evidence.append(
            Evidence(
                "weights on the GPU",
                f"{fmt_bytes(f['weights_logged_bytes'])} of a {fmt_bytes(f['checkpoint_bytes_per_rank'])}"
                " checkpoint per rank",
                f"vllm.log line {na(f['model_loading_line'])} ('Model loading took') vs config.json",
            )
        )
    if needed is not None:
        evidence.append(
            Evidence(
                "offload needed once applied",
                f"≥ {needed} GiB",
                "S + KV of one max_model_len request + activation/non-torch − gmu × total",
            )
        )
    failed = (
        f["weight_loading_oom"]
        or f["no_kv_memory"]
        or (f["startup_failed"] and f["oom_phase"] in _FAILED_PHASES)
    )
    severity: Severity | None = "critical" if failed else None
    if f["vllm_v34"]:
        # 0.34 has one runner and it installs the offloader (v1/worker/gpu/model_runner.py:379):
        # no version cause is known, so this is what the log shows, not a diagnosis
        severity = "info"
    return Hit(
        summary=" ".join(words),
        evidence=evidence,
        fixes=fixes,
        gpus=f["engine_gpus"] or (),
        severity=severity,
    )


RULE = Rule(
    id="cpu-offload-not-applied",
    family="W",
    severity="warning",
    title="--cpu-offload-gb was accepted but the weights were not offloaded",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    explains=("weights-not-sharded", "kv-budget-exhausted"),
    flags=(_ENV,),
)
