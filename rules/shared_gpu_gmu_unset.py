"""## What
A vLLM ≥ 0.34 engine that ran with the extensible KV cache and `--gpu-memory-utilization`
unset (u = 1.0) shares its GPU with another process: a second vLLM engine, a notebook, a
training job, or a left-over engine process (≥ 0.25 GiB on the same GPU).

## Why
With the extensible KV cache vLLM 0.34 sizes the KV pool from the memory it measures free
after its own warm-up and CUDA-graph capture, and with gmu unset it commits all of it but the
margin μ plus the transient it measured (μ + kept, about 1-3 GiB). A process that started first
leaves the engine less (it can end with `No available memory for the cache blocks. The extensible
KV cache already takes all device memory left after the model, its activations, CUDA graphs and
warmup; …`); a process that starts or grows later finds only μ + kept free and runs out of
memory (its torch OOM lists the engine's pid). The startup free-memory check of 0.33 is skipped
on this path, so nothing warns at start. The gmu docstring names exactly this case as the reason
to set the flag: vLLM then logs `gpu_memory_utilization=… caps this instance at …`.

## How to confirm
`nvidia-smi` lists another process on the engine's GPU; the launch has no
`--gpu-memory-utilization` (or `vllm:cache_config_info{gpu_memory_utilization="None"}`); the
log has `Memory after warmup: …` (extensible). Critical evidence: the engine's after-warm-up
KV error, a run-time OOM with under 1 GiB free, or `GPU driver error 2: out of memory` at wake.

## Fix
`--gpu-memory-utilization` = floor_0.01((T − Σ other processes' memory − 0.5 GiB) / T), only
when it still holds the engine's non-KV memory, one max_model_len request and the transient it
kept. Two or more vLLM engines, all unset: a gmu split summing to ≤ 0.95 (the
colocated-engines-overcommit split, given here once). Otherwise move the other process to an idle
GPU (`CUDA_VISIBLE_DEVICES=k`) or stop it (its pid).

## Sources
spec/vllm-0.34.md §3.1 (N1); vllm-facts.md §9.2 (sizing after warm-up, μ + kept), §9.3 (gmu
1.0 when unset), §9.4 (the H3 hint), `config/cache.py:229-234` (gmu docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdoctor.findings import Severity
from kvdoctor.kvmath import gmu_fitting
from kvdoctor.rule_functions import gmu_split, gpus_under
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na

GMU = "--gpu-memory-utilization"
CAP_WARNING = "gpu_memory_utilization=… caps this instance at …"


@dataclass(frozen=True)
class Thresholds:
    #: GiB a process must hold on the engine's GPU to count (monitoring tools' contexts do not)
    min_other_gib: float = 0.25
    #: GiB left free beside the other processes when computing the gmu
    margin_gib: float = 0.5
    #: the largest sum of the engines' gmu when several gmu-unset engines share the card
    max_gmu_sum: float = 0.95
    #: GiB free in a run-time OOM below which another process took the headroom (critical)
    oom_free_gib: float = 1.0
    #: GiB; a GPU holding less than this, with no process listed, is idle (a place to move to)
    empty_max_gib: float = 1.0


@dataclass(frozen=True)
class _Other:
    desc: str
    nbytes: int
    vllm: bool


def _others(f: Facts, t: Thresholds) -> list[_Other]:
    """The processes beside this engine on its GPU that hold ≥ ``min_other_gib``: non-vLLM
    processes (derive's foreign ones), awake vLLM engines (colocation; a sleeping neighbour of a
    sleep-swap set is wake-up-oom's), and left-over engine processes on the engine's GPUs."""
    floor = t.min_other_gib * 2**30
    out: list[_Other] = []
    foreign = f["foreign_bytes"]
    if foreign is not None and foreign >= floor:
        out.append(_Other(f["foreign_desc"] or "another process", int(foreign), False))
    own, names = f["colocated_self"], f["colocated_names"] or []
    held, asleep = f["colocated_bytes"] or [], f["colocated_sleeping"] or []
    if own is not None:
        for i, name in enumerate(names):
            b = held[i] if i < len(held) else None
            if i == own or (i < len(asleep) and asleep[i]) or (b is not None and b < floor):
                continue
            what = f"{gib_text(b)} GiB" if b is not None else "its gmu"
            out.append(_Other(f"vLLM engine {name} ({what})", int(b or 0), True))
    orphans, orphan_gpus = f["orphan_bytes"], set(f["orphan_gpus"] or ())
    if orphans and orphans >= floor and orphan_gpus & set(f["engine_gpus"] or ()):
        out.append(_Other(f"left-over vLLM processes: {na(f['orphan_desc'])}", int(orphans), True))
    return out


def _needs_bytes(f: Facts) -> int | None:
    """What a gmu must still hold for this engine: its non-KV memory U (from ``Memory after
    warmup``: used − committed KV − the other processes; else the weights + 1 GiB), one
    max_model_len request plus the null block, and the transient it kept."""
    b, mml, bs = f["kv_block_bytes"], f["max_model_len"], f["block_size"]
    if not b or not mml or not bs:
        return None
    request = b * (math.ceil(mml / bs) + 1)
    weights = f["weights_logged_bytes"]
    total, f1, c = f["gpu_total_bytes"], f["warmup_free_bytes"], f["warmup_committed_bytes"]
    if total and f1 is not None and c is not None:
        u = total - f1 - c - sum(o.nbytes for o in _others(f, Thresholds()))
        if weights is not None:
            u = max(u, weights)
    elif weights is not None:
        u = weights + 2**30
    else:
        return None
    return int(u + request + (f["warmup_kept_bytes"] or 0))


def _critical(f: Facts, t: Thresholds) -> str | None:
    """Why this is critical (the engine or a process beside it failed on that GPU), or None."""
    if f["kv_error_after_warmup"] or f["kv_hint"] == "H3":
        return (
            "the engine failed after warm-up: the KV cache got only what the other process left"
            f" (vllm.log line {na(f['kv_hint_line'])})"
        )
    free = f["oom_free_bytes"]
    if f["oom_at_runtime"] and free is not None and free < t.oom_free_gib * 2**30:
        return (
            f"a run-time CUDA OOM with only {gib_text(free)} GiB free on the GPU"
            f" (vllm.log line {na(f['oom_line'])})"
        )
    if f["vmm_driver_oom_line"] is not None:
        return (
            "the KV cache could not be mapped back ('GPU driver error 2: out of memory',"
            f" vllm.log line {f['vmm_driver_oom_line']})"
        )
    return None


def check(f: Facts, t: Thresholds) -> Hit | None:
    if not f["vllm_v34"] or f["vllm_sizing_mode"] != "extensible" or f["gmu_explicit"] is not False:
        return None
    others = _others(f, t)
    total = f["gpu_total_bytes"]
    if not others or not total:
        return None
    held = sum(o.nbytes for o in others)
    all_vllm_unset = (
        all(o.vllm for o in others)
        and f["colocated_self"] is not None
        and not any(f["colocated_gmu_explicit"] or [True])
    )
    explicit = f["colocated_gmu_explicit"] or []
    if all(o.vllm for o in others) and any(x is not False for x in explicit):
        # Only vLLM engines beside it and one of them has an explicit gmu:
        # colocated-engines-overcommit's split over their gmu (this one's resolved to 1.0) owns it.
        return None
    fixes: list[Fix] = []
    if all_vllm_unset:
        split = gmu_split(f["colocated_gmus"], t.max_gmu_sum)
        me = f["colocated_self"]
        own = split[me] if split and me is not None and me < len(split) else None
        shares = ", ".join(
            f"{n} {flag_value(x)}" for n, x in zip(f["colocated_names"] or [], split or [], strict=False)
        )
        if own is not None and is_valid(f, GMU, own):
            fixes.append(Fix(flags={GMU: str(flag_value(own))}, why="this engine's share of the split card"))
            advice = (
                f"Give every engine on the GPU an explicit share summing to ≤ {t.max_gmu_sum:.2f}"
                f" ({shares}): set {GMU} {flag_value(own)} on this one, and start the next engine only"
                " once the previous one logs 'Extended KV cache to'."
            )
        else:
            advice = f"Give every engine on the GPU an explicit gmu share summing to ≤ {t.max_gmu_sum:.2f}."
    else:
        try:
            gmu = gmu_fitting(int(total - held), int(total), int(t.margin_gib * 2**30))
        except ValueError:
            gmu = None
        need = _needs_bytes(f)
        fits = gmu is not None and gmu > 0 and (need is None or gmu * total >= need)
        if fits and gmu is not None and is_valid(f, GMU, gmu):
            fixes.append(
                Fix(
                    flags={GMU: str(flag_value(gmu))},
                    why="caps this engine so the other process keeps its memory and can grow",
                )
            )
            advice = (
                f"Set {GMU} {flag_value(gmu)} (the card less the {gib_text(held)} GiB the other"
                f" process(es) hold and a {t.margin_gib} GiB margin): it caps this engine and leaves the"
                " rest to them."
            )
        else:
            advice = (
                "No gmu leaves room for both: this engine's model, one max_model_len request and its"
                f" transient need more than the card less the {gib_text(held)} GiB held beside it."
            )
        empty = gpus_under(f["gpu_used_map"], t.empty_max_gib * 2**30, f["gpus_without_processes"])
        if empty:
            fixes.append(
                Fix(
                    env={"CUDA_VISIBLE_DEVICES": str(empty[0])},
                    why=f"the other process on idle GPU {empty[0]}, each on its own card",
                )
            )
            advice += f" {'Or s' if fixes[:-1] else 'S'}tart the other process on idle GPU {empty[0]} (CUDA_VISIBLE_DEVICES={empty[0]})."
        pids = f["foreign_pids"]
        if pids:
            kill = "kill " + " ".join(str(p) for p in dict.fromkeys(pids))
            fixes.append(Fix(commands=(kill,), why="frees the memory the other process holds"))
            advice += f" {'Or s' if fixes[:-1] else 'S'}top it ({kill})."
    if fixes and fixes[0].flags:
        advice += (
            f" vLLM then logs the WARNING '{CAP_WARNING}': expected, and the documented reason to keep"
            " the flag."
        )
    idle = f["idle_headroom_design_bytes"]
    headroom = f" ({gib_text(idle)} GiB here)" if idle is not None else ""
    gpus = sorted(set(f["engine_gpus"] or ()))
    why_critical = _critical(f, t)
    summary = (
        f"gpu_memory_utilization is unset, so this vLLM 0.34 engine (extensible KV cache) takes all the"
        f" memory it measures free after its warm-up and leaves only μ + kept{headroom}, while"
        f" memory on its GPU is also held by {'; '.join(o.desc for o in others)}."
        f" {'Critical: ' + why_critical + '. ' if why_critical else 'A process that starts or grows there later runs out of memory. '}"
        f"{advice}"
    )
    evidence = [
        Evidence("other processes on the GPU", "; ".join(o.desc for o in others), "nvidia-smi / NVML"),
        Evidence(
            "gmu in effect", na(f["gmu_assumption"]), "command line / non-default args / cache_config_info"
        ),
        Evidence(
            "KV sizing mode", f"{na(f['vllm_sizing_mode'])} ({na(f['vllm_sizing_mode_source'])})", "vllm.log"
        ),
    ]
    if idle is not None:
        evidence.append(
            Evidence(
                "free left at idle by design (μ + kept)",
                f"{gib_text(idle)} GiB",
                f"vllm.log line {na(f['warmup_line'])} (Memory after warmup)",
            )
        )
    if why_critical:
        evidence.append(Evidence("failure", why_critical, "vllm.log"))
    severity: Severity = "critical" if why_critical else "warning"
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=gpus, severity=severity)


RULE = Rule(
    id="shared-gpu-gmu-unset",
    family="K",
    severity="warning",
    title="vLLM 0.34 with gmu unset shares its GPU with another process",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("gpus", "log"),
    explains=("kv-budget-exhausted", "max-model-len-exceeds-kv-capacity"),
    flags=(GMU, "CUDA_VISIBLE_DEVICES"),
)
