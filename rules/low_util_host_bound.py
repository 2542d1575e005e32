"""## What
With traffic (requests running or completed, or tokens flowing in the window), GPU utilisation is
low, KV usage is low, memory is not under pressure, and either nothing queues or the engine's
CPU is saturated. An idle server is `idle-preallocation`, not this.

## Why
The seed's fifth check ("low utilisation, memory not full"): the bottleneck is outside the GPU —
the client's concurrency, a CPU-bound API server (tokenization, detokenization, scheduling) or IO.

## How to confirm
`vllm:num_requests_waiting` stays 0 while requests complete; the API server or EngineCore
process near 100 % of a core in `top`.

## Fix
More client concurrency, `--api-server-count` > 1 when the API server is CPU-bound, asynchronous
preprocessing. No vLLM memory flag fixes this.

## Sources
spec/rules.md family U; seed tutorial.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Hit, Rule, na


@dataclass(frozen=True)
class Thresholds:
    #: GPU utilisation (fraction) below which the GPU counts as idle
    util_low: float = 0.4
    #: KV cache usage (fraction) below which memory is not under pressure
    kv_low: float = 0.5
    #: percent of one core at which the engine process is CPU-bound
    cpu_saturated: float = 90


def check(f: Facts, t: Thresholds) -> Hit | None:
    util, kv_max, cpu = f["gpu_util"], f["kv_usage_max"], f["engine_cpu_percent"]
    cpu_bound = cpu is not None and cpu >= t.cpu_saturated
    no_queue = (f["waiting_max"] or 0) == 0
    # A pooling engine's KV gauge is a placeholder (100 % on V0 pooling runners): ignored.
    kv_known = kv_max is not None and not f["is_pooling"]
    # An engine that died of a run-time OOM is idle because it is dead, not because the host is slow.
    if (
        not f["traffic"]
        or util is None
        or util >= t.util_low
        or (kv_known and kv_max is not None and kv_max >= t.kv_low)
        or not (no_queue or cpu_bound)
        or f["startup_failed"]
        or f["runtime_oom"]
        # A sleeping engine (sleep mode; its gauge or its log) is idle by design, not host-bound.
        or f["asleep"]
    ):
        return None
    kv_words = f" and the KV cache {kv_max:.0%} used" if kv_known and kv_max is not None else ""
    if cpu_bound:
        cause = (
            f"The engine process uses {cpu:.0f} % of a core - tokenization, scheduling or detokenization"
            " on the host is the bottleneck."
        )
    else:
        cause = (
            "Nothing waits in the engine queue, so the load does not reach it - raise client concurrency,"
            " or look at the network / preprocessing before vLLM."
        )
    summary = f"Requests flow but the GPU is only {util:.0%} busy{kv_words}. {cause}"
    evidence = [Evidence("GPU utilisation", f"{util:.0%}", "nvidia-smi GPU-Util / NVML")]
    if kv_known:
        evidence.append(
            Evidence("KV cache usage (max)", na(kv_max, ".0%"), "vllm:kv_cache_usage_perc / stats lines")
        )
    evidence.append(
        Evidence(
            "requests running / waiting",
            f"{na(f['running'])} / {na(f['waiting_max'])}",
            "vllm:num_requests_running / num_requests_waiting",
        )
    )
    tokens = f["generation_tokens_per_s"]
    if tokens is not None:
        evidence.append(
            Evidence("generation throughput", f"{tokens:.1f} tokens/s", "rate(vllm:generation_tokens_total)")
        )
    if cpu is not None:
        evidence.append(Evidence("engine CPU", f"{cpu:.0f} % of a core", "psutil / ps.txt"))
    return Hit(summary=summary, evidence=evidence, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="low-util-host-bound",
    family="U",
    severity="warning",
    title="The GPU is idle although traffic arrives (host, client or IO bound)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    needs_any=("metrics", "log"),
)
