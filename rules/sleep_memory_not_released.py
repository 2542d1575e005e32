"""## What
An engine started with `--enable-sleep-mode` is asleep at level 1 or 2
(`vllm:engine_sleep_state{sleep_state="weights_offloaded"|"discard_all"}` = 1, or "It took …
seconds to fall asleep." with no full wake after it) and still holds memory: the worker's
"Sleep mode freed F GiB memory" has F < (W + K) − s, or NVML shows the engine holding more
than G_kept + s while asleep. W = "Model loading took", K = "Available KV cache memory" (on
vLLM 0.34's extensible KV cache the committed pool, "Extended KV cache to N blocks (X GiB)":
there "Available KV cache memory" is only an address reservation and would fire on healthy
engines),
s = max(2 GiB, 0.1 × (W + K)), G_kept = the CUDA-graph memory (0 with
`--sleep-mode-offload-cudagraph`). Critical when a wake-up on the GPU then fails.

## Why
Sleep unmaps vLLM's cuMem pool (weights and KV); the CUDA context, NCCL buffers and CUDA graphs
stay unless offloaded. vLLM 0.14–0.15 regressed (vllm #32714: ~6 GB freed of 21 GB per GPU,
where 0.13 freed 20 GB+). Memory allocated outside the pool stays too.

On 0.34's extensible KV cache "CuMemAllocator: sleep freed X" counts only the cuMem pool (the
weights): the KV is released outside it, so the pool is short only when X < W − s; K is checked
through "Sleep mode freed F" alone. Several engines on one GPU (a sleep-swap set): each sleeping
engine is held against its own pool, by NVML per process.

## How to confirm
`grep -E "Sleep mode freed|CuMemAllocator: sleep freed|fall asleep|wake up" vllm.log`; the
sleep-state gauge. The worker's "still in use" is the whole device's used memory. Not this
rule: a level-0 pause or a KV-only release (both level flags 0), a partial wake
(`wake_up?tags=weights` brings W back on purpose).

## Fix
On 0.14–0.15 change version (the release that fixed it is not verified).
`--sleep-mode-offload-cudagraph` (≥ 0.32) when G_kept ≥ 1 GiB; `--enable-nccl-comm-suspend`
(≥ 0.30, experimental) when tp × pp > 1 and the residual without graphs is still > s. The slack
is an estimate (thresholds `slack_min_gib`, `slack_fraction`).

## Sources
spec/rules-catalogue2.md §3.5; vllm-facts.md §1.2 (`vllm:engine_sleep_state`), §2.1 "Sleep
mode and memory", §3.7 (sleep lines), §4.2 (sleep flags), §9.7 (0.34: the extensible KV
outside the cuMem pool); spec/vllm-0.34.md §2.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na
from kvdoctor.units import GiB, fmt_bytes

_OFFLOAD_GRAPHS = "--sleep-mode-offload-cudagraph"
_NCCL_SUSPEND = "--enable-nccl-comm-suspend"


@dataclass(frozen=True)
class Thresholds:
    #: GiB of slack at least: s = max(slack_min_gib, slack_fraction × (W + K)) (an estimate,
    #: spec/rules-catalogue2.md §6)
    slack_min_gib: float = 2.0
    #: share of weights + KV the slack is at least
    slack_fraction: float = 0.1
    #: GiB of CUDA graphs kept while asleep from which offloading them is suggested
    graph_offload_min_gib: float = 1.0


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def check(f: Facts, t: Thresholds) -> Hit | None:
    pool, freed, graphs = f["sleep_pool_bytes"], f["sleep_freed_bytes"], f["sleep_graph_kept_bytes"] or 0
    resident, on_gpu, cumem = (
        f["sleep_resident_bytes"] or 0,
        f["sleep_engine_gpu_bytes"],
        f["cumem_freed_bytes"],
    )
    release = f["vllm_release"]
    slack = max(t.slack_min_gib * GiB, t.slack_fraction * pool) if pool else t.slack_min_gib * GiB
    kept = graphs + resident
    # the worker's "Sleep mode freed F" fell short of W + K, or NVML shows the engine holding more
    freed_short = freed is not None and pool is not None and freed < pool - resident - slack
    held_now = f["sleep_source"] == "vllm:engine_sleep_state" and on_gpu is not None and on_gpu > kept + slack
    if not (f["sleep_mode_on"] and f["asleep"] and (freed_short or held_now)):
        return None
    if f["wake_oom"] and not freed_short:
        return None  # NVML shows what this engine's own failed wake mapped back (wake-up-oom)
    # held: NVML's reading when it shows too much, else what the log says stayed; the shortfall:
    # the log's when it fell short, else NVML's excess
    held: float
    if held_now and on_gpu is not None:
        held = on_gpu
    elif freed_short and pool is not None and freed is not None:
        held = pool - freed + graphs
    else:
        return None  # unreachable: one of the two holds
    if freed_short and pool is not None and freed is not None:
        shortfall = pool - resident - freed
    else:
        shortfall = held - kept
    offload_graphs = (
        graphs >= t.graph_offload_min_gib * GiB
        and release is not None
        and release >= 32
        and not f["sleep_offload_cudagraph"]
        and is_valid(f, _OFFLOAD_GRAPHS, True)
    )
    tp_pp = f["tp_pp"]
    nccl = (
        tp_pp is not None
        and tp_pp > 1
        and release is not None
        and release >= 30
        and not f["sleep_nccl_suspend"]
        and held - graphs > slack
        and is_valid(f, _NCCL_SUSPEND, True)
    )
    level = f["sleep_level"]

    words = (
        f"The engine is asleep{f' (level {level})' if level else ''} ({na(f['sleep_source'])}), yet still holds"
        f" {fmt_bytes(held)} per GPU where about {fmt_bytes(kept + slack)} is expected (CUDA graphs"
        f" {fmt_bytes(graphs)}{f' + {fmt_bytes(resident)} woken on purpose' if resident else ''} + slack"
        f" {fmt_bytes(slack)}): a shortfall of {fmt_bytes(shortfall)} of the"
        f"{' ' + fmt_bytes(pool) if pool else ''} weights + KV it should have released. "
    )
    # the cuMem pool holds W and K before 0.34; on the extensible KV cache only W (the KV lives
    # outside it, released by release_physical and counted in 'Sleep mode freed' only)
    ext = bool(f["sleep_kv_extensible"])
    in_pool = f["weights_logged_bytes"] if ext else pool
    if cumem is not None and in_pool is not None and cumem < in_pool - slack:
        words += (
            f"The sleep pool itself was short (CuMemAllocator freed {fmt_bytes(cumem)}"
            f"{' of the ' + fmt_bytes(in_pool) + ' weights: the extensible KV cache is outside it' if ext else ''}):"
            " some of the engine’s memory lives outside it. "
        )
    elif cumem is not None and freed is not None and ext:
        words += (
            f"The cuMem pool released the weights ({fmt_bytes(cumem)}); the extensible KV cache"
            f" ({fmt_bytes(f['sleep_kv_bytes'])} committed) is released outside it, and the device got only"
            f" {fmt_bytes(freed)} back in all. "
        )
    elif cumem is not None and freed is not None:
        words += f"The pool released {fmt_bytes(cumem)} but the device got only {fmt_bytes(freed)} back. "
    if release is not None and 14 <= release <= 15:
        words += "vLLM 0.14–0.15 regressed here (vllm #32714; 0.13 released correctly): change version. "
    flags: dict[str, str] = {}
    if offload_graphs:
        words += f"{_OFFLOAD_GRAPHS} frees the {fmt_bytes(graphs)} of CUDA graphs. "
        flags[_OFFLOAD_GRAPHS] = ""
    if nccl:
        words += f"{_NCCL_SUSPEND} (experimental) releases the NCCL buffers. "
        flags[_NCCL_SUSPEND] = ""
    fixes = [Fix(flags=flags, why="less memory kept mapped while the engine sleeps")] if flags else []

    source = na(f["sleep_source"])
    if f["sleep_source"] == "log" and f["sleep_line"]:
        source += f" line {f['sleep_line']}"
    evidence = [Evidence("sleep state", f"asleep{f' level {level}' if level else ''}", source)]
    if freed is not None:
        evidence.append(
            Evidence(
                "freed at sleep",
                f"{fmt_bytes(freed)} ({fmt_bytes(f['sleep_in_use_bytes'])} still in use on the device)",
                "vllm.log 'Sleep mode freed … GiB memory'",
            )
        )
    if pool:
        kv_src = (
            "'Extended KV cache to N blocks (X GiB)' (the committed extensible pool)"
            if ext
            else "'Available KV cache memory'"
        )
        evidence.append(Evidence("weights + KV", fmt_bytes(pool), f"'Model loading took' + {kv_src}"))
    if cumem is not None:
        evidence.append(Evidence("pool freed", fmt_bytes(cumem), "vllm.log 'CuMemAllocator: sleep freed'"))
    if held_now:
        evidence.append(
            Evidence("held while asleep", fmt_bytes(on_gpu), "NVML / nvidia-smi per-process used memory")
        )
    return Hit(
        summary=words.rstrip(),
        evidence=evidence,
        fixes=fixes,
        gpus=_gpus(f["engine_gpus"]),
        severity="critical" if f["wake_oom"] else None,
    )


RULE = Rule(
    id="sleep-memory-not-released",
    family="P",
    severity="warning",
    title="A sleeping engine still holds its GPU memory",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    flags=(_OFFLOAD_GRAPHS, _NCCL_SUSPEND),
)
