"""## What
Free memory when vLLM starts is below gpu_memory_utilization × total, or NVML shows another
process holding memory on the engine's GPU. Without a visible process the finding says the
memory is held outside vLLM, never "another process". On vLLM ≥ 0.34 with the extensible KV
cache and gmu unset, `shared-gpu-gmu-unset` owns a shared GPU.

## Why
vLLM reserves `ceil(total × gpu_memory_utilization)` bytes at startup and refuses to start when
less is free (`Free memory on device … is less than desired GPU memory utilization`, a
ValueError since 0.9). Memory held by another job (a notebook, a training run, a second engine)
is not available to it; at run time it also leaves the engine without headroom.

## How to confirm
`nvidia-smi` lists a process on the GPU that is not the engine; vLLM's log shows the error with
the free and total GiB.

## Fix
`--gpu-memory-utilization` ≤ (free − margin) / total, rounded down to 0.01; or stop the other
process (its pid and bytes are in the evidence).

## Sources
vllm-facts.md §2.1 step 1 and §3.5 ("Util below current usage").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.findings import Severity
from kvdoctor.kvmath import gmu_fitting
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, gib_text, is_valid, na

GMU = "--gpu-memory-utilization"


@dataclass(frozen=True)
class Thresholds:
    #: GiB left free beside the other process when computing the gmu that fits
    margin_gib: float = 0.5
    #: GiB another process must hold on the engine's GPU to count
    min_foreign_gib: float = 0.25
    #: GiB of KV cache a lowered gmu must still leave beside the weights
    min_kv_gib: float = 1.0


def _gmu_fit(
    f: Facts, t: Thresholds, free: float | None, total: float | None, ext_exceed: bool, ext_budget: bool
) -> float | None:
    """The gmu the card allows: with a preload daemon's weights over the budget, the gmu that
    holds them (derive's); else what is free (plus those weights when vLLM ≥ 0.32 leaves them out
    of its check) less the margin, over the total, rounded down to 0.01."""
    if ext_exceed:
        return f["external_weights_gmu"]
    if free is None or not total:
        return None
    checked = free + (f["external_weights_bytes"] or 0) if ext_budget else free
    try:
        return gmu_fitting(int(checked), int(total), int(t.margin_gib * 2**30))
    except ValueError:
        return None


def _gmu_wanted(
    f: Facts, t: Thresholds, fit: float | None, total: float | None, ext_exceed: bool, ext_budget: bool
) -> float | None:
    """The gmu worth suggesting, or None: a raise that holds the external weights, or a lower
    gmu that still holds this engine's weights (per rank) plus ``min_kv_gib`` of KV (a gmu too
    small for that is no fix: stop the other process)."""
    gmu, fbu = f["gmu"], f["free_below_util"]
    if fit is None:
        return None
    if ext_exceed:
        ok = gmu is not None and fit > gmu
    else:
        weights, tp_pp = f["weights_bytes"], f["tp_pp"]
        if fit < 0.05 or not (fbu or (gmu is not None and fit < gmu)):
            ok = False
        elif ext_budget or weights is None:
            ok = True
        else:
            ok = bool(tp_pp and total is not None and fit * total >= weights / tp_pp + t.min_kv_gib * 2**30)
    return fit if ok else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    fbu, foreign = f["free_below_util"], f["foreign_bytes"]
    seen_foreign = foreign is not None and foreign >= t.min_foreign_gib * 2**30
    # Sibling vLLM engines that overcommit the card are colocated-engines-overcommit's finding,
    # with a gmu split that fits them all; a second, different gmu here would contradict it.
    siblings_overcommit = (f["colocated_count"] or 0) >= 2 and (f["colocated_gmu_sum"] or 0) > 0.95
    if not ((fbu and not f["orphan_pids"]) or seen_foreign) or siblings_overcommit:
        return None
    # vLLM 0.34 with the extensible KV cache and gmu unset: shared-gpu-gmu-unset owns the GPU
    # shared with another process (spec/vllm-0.34.md §2, N1).
    ext = bool(f["vllm_v34"]) and f["vllm_sizing_mode"] == "extensible"
    if ext and f["gmu_explicit"] is False:
        return None
    gmu, gpu_total = f["gmu"], f["gpu_total_bytes"]
    total = f["fbu_total_bytes"] if fbu else gpu_total
    free: float | None
    if fbu:
        free = f["fbu_free_bytes"]
    else:
        free = gpu_total - foreign if gpu_total and foreign is not None else None
    # vLLM ≥ 0.32 with weights held by a `vllm preload` daemon (part of the deployment): its
    # budget is gmu × total − those weights (vllm-facts §2.1, §3.5).
    ext_exceed = bool(fbu) and f["startup_refusal_variant"] == "external_weights_exceed"
    ext_budget = bool(fbu) and f["startup_refusal_variant"] == "below_budget_excluding_external"
    fit = _gmu_fit(f, t, free, total, ext_exceed, ext_budget)
    wanted = _gmu_wanted(f, t, fit, total, ext_exceed, ext_budget)
    # One vLLM rejects or one already in effect (±0.005) is no fix, and the words must not name it.
    fix = wanted if wanted is not None and is_valid(f, GMU, wanted) else None
    current_fits = not fbu and fit is not None and gmu is not None and fit >= gmu
    pids = f["foreign_pids"]
    # a process on two GPUs is listed twice: one pid once
    kill = "kill " + " ".join(str(p) for p in dict.fromkeys(pids)) if pids else None
    # "another process" only where one is visible; else the memory is only known to be held
    # outside vLLM (issue 24 kind 3).
    other = "the other process" if seen_foreign else "whatever holds the memory outside vLLM"
    stop = [Fix(commands=(kill,), why="frees the memory the other process holds")] if kill else []

    # The words name --gpu-memory-utilization only for the value its fix sets; the gmu in effect
    # is "gmu 0.92".
    fixes: list[Fix] = []
    if ext_exceed:
        if fix is not None:
            advice = (
                f"Raise {GMU} to {flag_value(fix)} so the budget holds those weights plus at least 1 GiB"
                f" of KV cache (and a {t.margin_gib} GiB margin)."
            )
            fixes.append(
                Fix(flags={GMU: str(flag_value(fix))}, why="a budget that holds the preloaded weights")
            )
        elif wanted is not None:
            advice = "Preload a smaller or quantized model, or shard it over more GPUs."
        else:
            advice = (
                "Even gmu 0.95 cannot hold those weights plus a KV cache on this card: preload a smaller"
                " or quantized model, or shard it over more GPUs."
            )
    elif fix is not None and ext:
        # On the extensible path the gmu is a cap on this engine, not a fit to what is free now.
        advice = (
            f"Set {GMU} {flag_value(fix)} (the card less what {other} holds and a {t.margin_gib} GiB"
            " margin): it caps this engine so the other process keeps its memory and can grow; it is"
            " not a fit to the memory free now. vLLM then logs the WARNING 'gpu_memory_utilization=…"
            f" caps this instance at …', which is expected. Or stop {other} first{f' ({kill})' if kill else ''}."
        )
        fixes.append(Fix(flags={GMU: str(flag_value(fix))}, why="caps this engine beside the other process"))
        fixes += stop
    elif fix is not None:
        advice = (
            f"Lower {GMU} to {flag_value(fix)} (what is free, less a {t.margin_gib} GiB margin),"
            f" or stop {other} first{f' ({kill})' if kill else ''}."
        )
        fixes.append(
            Fix(flags={GMU: str(flag_value(fix))}, why="a budget that fits the memory free at startup")
        )
        fixes += stop
    elif wanted is not None:
        advice = f"Stop {other}{f' ({kill})' if kill else ''} first."
        fixes += stop
    elif current_fits and ext:
        advice = (
            f"The gmu {gmu} in effect caps this engine (vLLM measures after warm-up and commits up to"
            " gmu × total), so the other process keeps its room as long as it stays within what the cap"
            " leaves; vLLM's 'gpu_memory_utilization=… caps this instance at …' WARNING is expected."
        )
    elif current_fits:
        advice = (
            f"The current gmu {gmu} still fits beside it, but a restart of the engine will fail if the"
            " other process grows, and the headroom outside gmu (CUDA graphs, sampler) is shared."
        )
    else:
        advice = (
            f"Stop {other}{f' ({kill})' if kill else ''} - what it leaves free (gmu {fit}) cannot"
            " hold the model."
        )
        fixes += stop

    ext_weights = f["external_weights_bytes"]
    if ext_exceed:
        opening = (
            "vLLM refused to start: the weights held outside the engine (a vllm preload daemon, part of"
            f" this deployment) take {gib_text(ext_weights)} GiB of {gib_text(total)} GiB, more than the"
            f" budget gmu {f['fbu_gmu']} gives."
        )
    elif fbu:
        after = (
            f" after the {gib_text(ext_weights)} GiB of externally held weights"
            if ext_budget and ext_weights
            else ""
        )
        opening = (
            f"vLLM refused to start, only {gib_text(free)} GiB of {gib_text(total)} GiB is free, less than"
            f" gmu {f['fbu_gmu']} asks for{after}."
        )
    elif ext:
        opening = (
            "Memory on the engine GPU is held by another process; this vLLM 0.34 engine sizes its KV cache"
            " after warm-up within its gmu cap."
        )
    else:
        opening = (
            "Memory on the engine GPU is held by another process, which vLLM cannot use for its KV cache."
        )
    desc = f["foreign_desc"]
    summary = f"{opening} {f'Held by {desc}. ' if desc else ''}{advice}"

    evidence: list[Evidence] = []
    where = f"vllm.log line {na(f['fbu_line'])}"
    if fbu and not ext_exceed:
        evidence.append(
            Evidence(
                "free at startup / total",
                f"{gib_text(f['fbu_free_bytes'])} / {gib_text(f['fbu_total_bytes'])} GiB (gmu {na(f['fbu_gmu'])})",
                f"{where} (Free memory on device … less than desired GPU memory utilization)",
            )
        )
    if ext_exceed:
        evidence.append(
            Evidence(
                "externally held weights / total",
                f"{gib_text(ext_weights)} / {gib_text(f['fbu_total_bytes'])} GiB (gmu {na(f['fbu_gmu'])})",
                f"{where} (Externally held weights on device … exceed the desired GPU memory utilization)",
            )
        )
    if desc is not None:
        evidence.append(
            Evidence("other processes on the GPU", desc, "nvidia-smi Processes / NVML compute processes")
        )
    oom = f["oom_count"]
    severity: Severity = "critical" if fbu or (oom is not None and oom > 0) else "warning"
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(f["engine_gpus"] or ())),
        severity=severity,
        title=None if seen_foreign else "Memory on the engine's GPU is held outside vLLM",
    )


RULE = Rule(
    id="gpu-shared-with-foreign-process",
    family="K",
    severity="critical",
    title="Another process holds memory on the engine's GPU",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("log", "gpus"),
    explains=("kv-budget-exhausted", "max-model-len-exceeds-kv-capacity"),
    flags=(GMU,),
)
