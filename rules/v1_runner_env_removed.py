"""## What
vLLM ≥ 0.34 with `VLLM_USE_V2_MODEL_RUNNER` set to anything but `1` (env.txt, the pod spec,
`/proc/PID/environ`, the command's `VAR=value` prefix), or the log has
`VLLM_USE_V2_MODEL_RUNNER=… is no longer supported: Model Runner V1 has been removed. Unset this
variable.` Critical: vLLM refuses to start. `VLLM_USE_V2_MODEL_RUNNER=1` is only redundant on
0.34 (a WARNING): info.

## Why
0.34 removed Model Runner V1; the platform check raises a ValueError at startup for any value
but 1, an empty value included. The usual origin is 0.22–0.27 advice to force the V1 runner
(`VLLM_USE_V2_MODEL_RUNNER=0`) so that `--cpu-offload-gb` works, which kvdoctor's
`cpu-offload-not-applied` also gave.

## How to confirm
`grep "Model Runner V1 has been removed" vllm.log`, or `env | grep VLLM_USE_V2_MODEL_RUNNER`
in the engine's environment.

## Fix
Unset the variable (`unset VLLM_USE_V2_MODEL_RUNNER`, or remove it from the pod spec). No flag
or value replaces it. Where it was set for CPU offload: the 0.34 runner applies
`--cpu-offload-gb` itself.

## Sources
spec/vllm-0.34.md §3.5 (N5); vllm-facts.md §9.4 (`platforms/interface.py:1480-1486`),
`v1/worker/gpu/model_runner.py:379` (the offloader).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule
from kvdoctor.units import GiB

_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_UNSET = f"unset {_ENV}"


@dataclass(frozen=True)
class Thresholds:
    """None: the rule has no tunable thresholds."""


def check(f: Facts, t: Thresholds) -> Hit | None:
    line, env = f["v1_runner_removed_line"], f["v1_runner_env"]
    v34 = bool(f["vllm_v34"])
    if line is None and not (v34 and env is not None):
        return None
    version = f["vllm_version"] or "≥ 0.34"
    gpus = sorted(set(f["engine_gpus"] or ()))
    fix = Fix(commands=(_UNSET,), why=f"vLLM {version} has only the V2 model runner; {_ENV} has no other use")
    if line is None and str(env).strip() == "1":
        return Hit(
            summary=(
                f"{_ENV}=1 is set: on vLLM {version} it is redundant (vLLM logs that it can be unset) and"
                f" harmless. It may be removed: {_UNSET}."
            ),
            evidence=[Evidence(_ENV, "1", "env.txt / launch command")],
            fixes=[fix],
            gpus=gpus,
            severity="info",
            title=f"{_ENV}=1 is redundant on vLLM 0.34",
        )
    shown = env if env is not None else "?"
    words = [
        f"{_ENV}={shown} stops vLLM {version} from starting: Model Runner V1 was removed in 0.34, and any"
        f" value but 1 (an empty one too) is a startup ValueError."
    ]
    words.append(
        f"Unset the variable ({_UNSET}, or remove it from the pod spec's env); no value replaces it."
    )
    offload = f["cpu_offload_bytes"]
    if offload:
        words.append(
            f"It was likely set to make cpu_offload_gb {offload / GiB:g} work on vLLM 0.22–0.27; the 0.34"
            " runner applies cpu_offload_gb itself."
        )
    evidence = []
    if line is not None:
        evidence.append(
            Evidence("startup error", f"{_ENV}={shown} is no longer supported", f"vllm.log line {line}")
        )
    if env is not None:
        evidence.append(Evidence(_ENV, str(env), "env.txt / launch command"))
    return Hit(summary=" ".join(words), evidence=evidence, fixes=[fix], gpus=gpus)


RULE = Rule(
    id="v1-runner-env-removed",
    family="W",
    severity="critical",
    title="VLLM_USE_V2_MODEL_RUNNER is set on vLLM 0.34, which removed Model Runner V1",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "config"),
    explains=("cpu-offload-not-applied",),
)
