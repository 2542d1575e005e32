"""## What
A vLLM ≥ 0.34 engine ran the extensible KV cache with `--gpu-memory-utilization` unset on an
integrated (unified-memory) GPU: GB10 (DGX Spark) or a Jetson (Orin, Thor). A warning; critical
when the engine then died (on such a host the kernel's OOM killer ends it with SIGKILL).

## Why
On an integrated GPU the device memory is the host's RAM: vLLM reads free memory from
`psutil.virtual_memory().available` (`utils/mem_utils.py:105-124`, `platforms/cuda.py:741-742`
`is_integrated`). With gmu unset (1.0) the extensible KV cache commits all of it except μ + kept
(what warm-up measured) to the KV cache, so the operating system and every other host process
are left with a gigabyte or two. The gmu docstring names "the CPU on a unified-memory device" as
a reason to set gmu (`config/cache.py:229-234`).

## How to confirm
`nvidia-smi -L` names GB10 / Orin / Thor; `free -g` while the engine runs shows almost no
`available`; `dmesg | grep "Out of memory: Killed process"` after a crash.

## Fix
`--gpu-memory-utilization` = floor_0.01((T − H_host)/T), H_host = max(8 GiB, 0.1 × T)
*(starting values, overridable; not verified on a device)*, given only if it still leaves the
weights, the KV cache of one max_model_len request and the warm-up margin μ.

## Sources
spec/vllm-0.34.md §3.6 (N6); vllm-facts.md §9.2 (the after-warm-up sizing), §9.3 (gmu 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid
from kvdoctor.units import GiB


@dataclass(frozen=True)
class Thresholds:
    #: GiB left to the host at least (starting value)
    host_reserve_min_gib: float = 8.0
    #: share of the device (= host) memory left to the host at least (starting value)
    host_reserve_fraction: float = 0.1


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not (f["unified_memory_gpu"] and f["vllm_v34"] and f["vllm_sizing_mode"] == "extensible"):
        return None
    if f["gmu_explicit"]:
        return None
    total = f["gpu_total_bytes"] or f["device_total_bytes"]
    name = f["gpu_name"] or "an integrated GPU"
    died = bool(f["engine_failed"])
    words = [
        f"{name} is an integrated GPU: its memory is the host's RAM, and vLLM {f['vllm_version'] or '≥ 0.34'}"
        " reads free memory from the host's available memory. With gmu unset (1.0 with the extensible KV"
        " cache) the KV cache takes everything warm-up left except μ + kept, so the operating system and"
        " other host processes keep only that."
    ]
    idle = f["idle_headroom_design_bytes"]
    if idle:
        words.append(f"Here that is about {gib_text(idle, '.1f')} GiB.")
    if died:
        words.append(
            "The engine then died, as the kernel's OOM killer ends a process when the host runs out."
        )
    fixes: list[Fix] = []
    evidence = [
        Evidence("GPU", name, "nvidia-smi / NVML name (integrated: GB10, Jetson Orin/Thor)"),
        Evidence(
            "gpu_memory_utilization", "unset (1.0, extensible KV cache)", "launch command / non-default args"
        ),
    ]
    if total:
        reserve = max(t.host_reserve_min_gib * GiB, t.host_reserve_fraction * total)
        gmu = math.floor((total - reserve) / total * 100) / 100
        weights, per_token, mml = f["weights_bytes"], f["kv_bytes_per_token"], f["max_model_len"]
        margin = f["warmup_margin_bytes"] or GiB
        need = weights + per_token * mml + margin if weights and per_token and mml else None
        evidence.append(
            Evidence(
                "device total (host RAM)",
                f"{gib_text(total)} GiB",
                "NVML total, else vLLM's 'Free memory on device (F0/T GiB)'",
            )
        )
        if gmu <= 0 or (need is not None and gmu * total < need):
            words.append(
                f"A gmu that leaves the host {gib_text(reserve, '.0f')} GiB would not hold the weights and one"
                " max_model_len request: serve a smaller model or a shorter max_model_len on this device."
            )
        elif is_valid(f, "--gpu-memory-utilization", gmu):
            text = f"{gmu:.2f}"
            words.append(
                f"Set --gpu-memory-utilization {text}: it leaves the host about {gib_text(total - gmu * total, '.0f')}"
                f" GiB (max({t.host_reserve_min_gib:g} GiB, {t.host_reserve_fraction:g} × total), a starting value)."
                " vLLM then logs that gpu_memory_utilization caps this instance; that is expected here."
            )
            fixes.append(
                Fix(
                    flags={"--gpu-memory-utilization": text},
                    why="caps the KV cache so that the host keeps memory for the OS and its other processes",
                )
            )
    else:
        words.append("The device total was not read, so no gmu is computed.")
    return Hit(
        summary=" ".join(words),
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity="critical" if died else None,
    )


RULE = Rule(
    id="unified-memory-gmu-unset",
    family="K",
    severity="warning",
    title="An integrated GPU's KV cache takes the host's memory: gmu is unset",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("gpus", "log"),
    flags=("--gpu-memory-utilization",),
)
