"""## What
`RuntimeError: CUDA Error: out of memory at …/csrc/cumem_allocator.cpp:N` (vLLM's cuMem
allocator), or on vLLM 0.34's extensible KV cache `RuntimeError: GPU driver error 2: out of
memory` (the KV `recommit`, also after `/checkpoint/restore` or a weight update's KV loan),
raised after a wake-up (the API server's "wake up the engine with tags: …", an
earlier sleep, or `wake_up` / `create_and_map` frames) on an engine with sleep mode. The same
text while loading weights at startup is a weights OOM, not this rule.

## Why
Wake maps every handle of the sleep pool back and needs W + K free (K on 0.34's extensible KV
cache = the committed pool of `Extended KV cache to N blocks (X GiB)`, not `Available KV cache
memory`, which is only an address reservation there) (W alone for
`tags=['weights']`, K for `['kv_cache']`, plus the graphs when offloaded). Engines that share a
GPU in a sleep-swap set fit only while the others sleep and hold no more than their residual.

## How to confirm
The wake-up line and the cumem OOM in the log; nvidia-smi's processes on the GPU and each
server's `vllm:engine_sleep_state`.

## Fix
Make the named neighbours sleep before this wake, and size the set:
`--gpu-memory-utilization` ≤ floor_0.01((T − Σ awake neighbours' bytes − Σ sleeping
neighbours' measured residual − 0.5 GiB)/T): a sleeping neighbour counts with what NVML shows
it holding. A sleeping neighbour that holds more than its residual is `sleep-memory-not-released`.
On 0.34's extensible KV cache a new gmu takes effect only at the engine's next start: recommit
maps the N blocks sized at startup (spec/vllm-0.34.md §2).

## Sources
spec/rules-catalogue2.md §3.5; vllm-facts.md §2.1 "Sleep mode and memory", §3.7 (wake-up
failure line), §9.4 and §9.7 (0.34: `GPU driver error`, recommit, checkpoints, KV loans).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import GiB, floor_to, fmt_bytes

_GMU = "--gpu-memory-utilization"
#: what the failed mapping followed (wake_oom_after) → how the words name it
_AFTER = {
    "wake": "A wake-up",
    "checkpoint_restore": "A checkpoint restore (/checkpoint/restore wakes the KV cache)",
    "kv_loan": "Recommitting the KV cache after a weight update's KV loan",
}


@dataclass(frozen=True)
class Thresholds:
    #: GiB kept free beside the neighbours when sizing this engine's gmu
    margin_gib: float = 0.5
    #: GiB a sleeping neighbour holds beyond which the words point at it (an estimate: graphs
    #: and the CUDA context; sleep-memory-not-released's slack floor)
    sleeping_residual_gib: float = 2.0


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def _awake_pids(f: Facts) -> list[object]:
    """The pids of the other processes on the GPU not known to be asleep."""
    try:
        return [n["pid"] for n in f["wake_neighbours"] or [] if not n["asleep"]]
    except (KeyError, TypeError):  # a neighbour without those keys: none named
        return []


def _heavy_sleepers(f: Facts, t: Thresholds) -> str:
    """The sleeping neighbours (a sleep-swap set) that NVML shows holding more than
    ``sleeping_residual_gib``: 'pid 5120 (35.00 GiB)', joined; '' when none."""
    try:
        heavy = [
            f"pid {n['pid']} ({fmt_bytes(n['bytes'])})"
            for n in f["wake_neighbours"] or []
            if n["asleep"] and (n["bytes"] or 0) > t.sleeping_residual_gib * GiB
        ]
    except (KeyError, TypeError):
        return ""
    return ", ".join(heavy)


def _why_no_gmu(gmu: float | None, gmu_fix: float | None) -> str:
    """Why no ``--gpu-memory-utilization`` is advised (the words where the fix has none)."""
    if gmu_fix is None or gmu is None:
        return (
            "with the GPU's total memory or the gmu in effect unknown, no gpu_memory_utilization is computed"
        )
    if gmu_fix <= 0:
        return "what the other processes hold leaves no room for this engine"
    return f"this engine's gpu_memory_utilization {gmu:.2f} already fits beside what they hold now"


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["wake_oom"]:
        return None
    total, gmu, idle = f["device_total_bytes"], f["gmu"], f["idle_headroom_bytes"]
    # T less what the neighbours hold and the margin, as a share of T
    gmu_fix = (
        floor_to((total - (f["wake_neighbours_bytes"] or 0) - t.margin_gib * GiB) / total, 0.01)
        if total
        else None
    )
    tags, desc, awake = f["wake_tags"], f["wake_neighbours_desc"], _awake_pids(f)

    vmm = f["wake_oom_error"] == "vmm"
    after = _AFTER.get(f["wake_oom_after"] or "wake", "A wake-up")
    kv = fmt_bytes(f["sleep_kv_bytes"]) if f["sleep_kv_extensible"] and f["sleep_kv_bytes"] else None
    words = (
        f"{after}{' (tags ' + ', '.join(str(x) for x in tags) + ')' if tags else ''} failed: "
        + (
            "the extensible KV cache's recommit could not map its blocks back"
            f' ("GPU driver error 2: out of memory", vllm.log line {na(f["wake_oom_line"])})'
            if vmm
            else "vLLM's cuMem allocator could not map the engine's memory back"
            f' ("CUDA Error: out of memory at …cumem_allocator.cpp", vllm.log line {na(f["wake_oom_line"])})'
        )
        + f". The wake needs {fmt_bytes(f['wake_need_bytes'])} per GPU"
        + (f" (the committed KV pool is {kv})" if kv else "")
        + f"{f' with {fmt_bytes(idle)} free' if idle is not None else ''}. "
    )
    if desc:
        words += f"Other processes hold the GPU: {desc}. "
    heavy = _heavy_sleepers(f, t)
    if heavy:
        words += (
            f"Asleep, {heavy} should hold little more than its CUDA graphs and context: that is"
            " sleep-memory-not-released on that engine; the size below counts what it holds now. "
        )
    sleep_first = f"Make pid {', pid '.join(str(p) for p in awake)} sleep before this wake" if awake else ""
    fixes = []
    if gmu_fix is not None and gmu is not None and gmu_fix < gmu and is_valid(f, _GMU, gmu_fix):
        sized = f"so a wake fits: {_GMU} ≤ {gmu_fix:.2f} for this engine."
        if kv:
            # recommit maps the N blocks sized at startup: a new gmu changes them only at a restart
            sized += (
                " It takes effect only at this engine's next start: its wake maps back the blocks sized then."
            )
        words += f"{sleep_first}, and size the set {sized}" if sleep_first else f"Size the set {sized}"
        fixes.append(
            Fix(flags={_GMU: str(flag_value(gmu_fix))}, why="this engine's wake fits beside its neighbours")
        )
    else:
        reason = _why_no_gmu(gmu, gmu_fix)
        words += f"{sleep_first}: {reason}." if sleep_first else f"Size the set so a wake fits: {reason}."
    evidence = [
        Evidence(
            "wake-up OOM",
            "GPU driver error 2: out of memory"
            if vmm
            else "CUDA Error: out of memory at …cumem_allocator.cpp",
            f"vllm.log line {na(f['wake_oom_line'])}",
        )
    ]
    if f["wake_need_bytes"]:
        kv_src = (
            "'Extended KV cache to N blocks (X GiB)' (the committed pool)"
            if f["sleep_kv_extensible"]
            else "'Available KV cache memory'"
        )
        evidence.append(
            Evidence(
                "wake needs",
                fmt_bytes(f["wake_need_bytes"]),
                f"'Model loading took' + {kv_src} (by the woken tags)",
            )
        )
    if idle is not None:
        evidence.append(
            Evidence("free on the GPU", fmt_bytes(idle), "nvidia-smi / NVML memory.total − memory.used")
        )
    if desc:
        evidence.append(
            Evidence(
                "other processes",
                desc,
                "nvidia-smi processes; sleep state from each server's vllm:engine_sleep_state",
            )
        )
    return Hit(summary=words, evidence=evidence, fixes=fixes, gpus=_gpus(f["engine_gpus"]))


RULE = Rule(
    id="wake-up-oom",
    family="P",
    severity="critical",
    title="Waking the engine up ran out of memory (other engines hold the GPU)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
    explains=("sleep-memory-not-released",),
    flags=(_GMU,),
)
