"""## What
NVML clock event reasons show thermal, power or hardware slowdown on the engine's GPUs, and it
costs something: GPU utilisation is low while there is work, or generation throughput while
throttled is at least 10 % below the throughput at comparable load (running requests within
25 %) in the unthrottled part of the series — over the whole series given, not only the last
60 s. A cap that costs no measurable throughput (or that cannot be compared) is info.

## Why
A throttled GPU computes slower at the same utilisation: no vLLM flag helps. Power capping
(`sw_power_cap`) is often active on a busy card without slowing generation measurably; only a
loss is worth a warning.

## How to confirm
`nvidia-smi -q -d PERFORMANCE`: "Clocks Event Reasons" with Active entries; compare
`rate(vllm:generation_tokens_total[5m])` with `vllm:num_requests_running` before and during.

## Fix
Cooling, power limits (`nvidia-smi -pl`), or drain the node.

## Sources
spec/rules.md family U; NVML documentation of clock event reasons; kvdoctor/derive/hardware.py
(throughput throttled vs unthrottled at comparable load).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Hit, Rule, na


@dataclass(frozen=True)
class Thresholds:
    #: GPU-Util (fraction) below this with traffic (or some work on the GPU) counts as a cost
    util_low: float = 0.4
    #: a GPU that reports this little use (fraction) is idle: a power cap on an idle card costs nothing
    util_idle: float = 0.05
    #: generation throughput while throttled at least this much (fraction) below the unthrottled
    #: readings at comparable load (spec/rules.md: ≥ 10 %)
    tput_loss: float = 0.10


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def _since(seconds: float | None) -> str:
    """' for the last 12 min of the series' (the last unbroken throttled stretch), '' unknown."""
    if not seconds:
        return ""
    if seconds >= 60:
        return f" for the last {seconds / 60:.0f} min of the series"
    return f" for the last {seconds:.0f} s of the series"


def check(f: Facts, t: Thresholds) -> Hit | None:
    reasons, util = f["throttle_reasons"], f["gpu_util"]
    if not reasons or util is None:
        return None
    loss = f["throttle_tput_loss"]
    throttled, unthrottled = f["throttle_tput_throttled"], f["throttle_tput_unthrottled"]
    util_cost = util < t.util_low and bool(f["traffic"] or util >= t.util_idle)
    costly = util_cost or (loss is not None and loss >= t.tput_loss)
    reasons_text = ", ".join(str(r) for r in reasons)

    words = f"NVML reports clock event reasons {reasons_text} on the engine's GPUs{_since(f['throttle_since_s'])}. "
    if loss is not None:
        words += (
            f"While throttled, generation ran at {na(throttled, ',.0f')} tokens/s against"
            f" {na(unthrottled, ',.0f')} tokens/s unthrottled at comparable load ({loss:.0%} lost,"
            f" {f['throttle_compared']} reading(s) compared). "
        )
    if util_cost:
        words += f"GPU utilisation is only {util:.0%}. "
    if costly:
        words += (
            "It costs throughput whatever vLLM is configured with: check cooling, power capping"
            " (nvidia-smi -q -d POWER) and the node's health."
        )
    else:
        compared = (
            f"throughput at comparable load is within {t.tput_loss:.0%}"
            if loss is not None
            else "no unthrottled readings at comparable load to compare with"
        )
        words += f"It costs nothing measurable here ({compared}): worth knowing, nothing to fix."

    evidence = [
        Evidence(
            "clock event reasons",
            reasons_text,
            "NVML nvmlDeviceGetCurrentClocksEventReasons / nvidia-smi -q clocks_event_reasons",
        ),
        Evidence("GPU utilisation", f"{util:.0%}", "NVML utilization.gpu"),
    ]
    if loss is not None:
        evidence.append(
            Evidence(
                "throughput lost while throttled",
                f"{loss:.0%} ({na(throttled, ',.0f')} vs {na(unthrottled, ',.0f')} tokens/s)",
                "rate(vllm:generation_tokens_total) at comparable vllm:num_requests_running, throttled vs"
                " not, over the whole series",
            )
        )
    if f["throttle_since_s"]:
        evidence.append(
            Evidence(
                "throttled for",
                f"{f['throttle_since_s']:.0f} s",
                "NVML clock event reasons over the series",
            )
        )
    return Hit(
        summary=words,
        evidence=evidence,
        gpus=_gpus(f["engine_gpus"]),
        severity=None if costly else "info",
    )


RULE = Rule(
    id="gpu-clock-throttled",
    family="U",
    severity="warning",
    title="The GPU clocks are throttled (thermal, power or hardware slowdown)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
)
