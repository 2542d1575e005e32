"""## What
Two or more vLLM engines on one GPU (their processes on it in nvidia-smi / NVML, or command
lines in `cmdline.txt` not pinned to different devices) whose `--gpu-memory-utilization` sum
exceeds 0.95, or whose reservations (gmu × total) exceed the card; or engines that started
within each other's profiling window.

## Why
Every engine reserves gmu × the card's *total* memory, not a share of what is free: two
engines at 0.6 need 120 % of the card. The second one fails its startup check ("Free memory on
device … is less than desired GPU memory utilization") or, if it starts first and the other
later, one of them runs out at run time. Since 0.27 the profiler measures consumed memory from
the free-memory delta, so another engine allocating meanwhile is counted as this one's
non-KV memory (or trips the profiling assertion).

## How to confirm
`nvidia-smi` lists several `VLLM::EngineCore` (or python … vllm) processes on one GPU; their
launch commands give each `--gpu-memory-utilization`.

## Fix
A gmu per engine proportional to what each asked for, summing to ≤ 0.95 (each engine's own
value is its `--gpu-memory-utilization` fix), and start the engines one after another.

## Sources
vllm-facts.md §2.1 (requested memory = ceil(total × gmu), the free-memory check, the profiler's
free-memory delta and its assertion), §3.5 (the "Free memory on device" error), §4.2
(`--gpu-memory-utilization`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rule_functions import gmu_split
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, flag_value, is_valid, na
from kvdoctor.units import fmt_bytes

GMU = "--gpu-memory-utilization"


@dataclass(frozen=True)
class Thresholds:
    #: the largest sum of the engines' --gpu-memory-utilization that fits one card
    max_gmu_sum: float = 0.95
    #: seconds; engines started closer together than this profile each other's allocations
    profile_window_s: float = 60


def _own_share(split: list[float] | None, own: int | None) -> float | None:
    """This engine's gmu in the split (``colocated_self`` indexes ``colocated_gmus``)."""
    if split is None or own is None:
        return None
    try:
        return split[own]
    except IndexError:
        return None


def _split_desc(names: list[str] | None, split: list[float] | None) -> str:
    """Each engine's gmu as its fix writes it, "a 0.4, b 0.54" (the values alone when the names
    do not pair up with them; "N/A" without a split)."""
    if split is None:
        return "N/A"
    if names is None or len(names) != len(split):
        return ", ".join(str(flag_value(x)) for x in split)
    return ", ".join(f"{n} {flag_value(x)}" for n, x in zip(names, split, strict=True))


def _sleeping(f: Facts) -> list[bool] | None:
    """Per colocated engine: asleep by its gauge (derive), this engine also by its log."""
    sleeping = f["colocated_sleeping"]
    own = f["colocated_self"]
    if f["asleep"] and own is not None and f["colocated_names"]:
        sleeping = list(sleeping or [False] * len(f["colocated_names"]))
        if own < len(sleeping):
            sleeping[own] = True
    return sleeping


def _effective_bytes(f: Facts, sleeping: list[bool] | None) -> float | None:
    """Σ gmu × total of the awake engines + Σ NVML bytes of the sleeping ones (what the card
    must hold when they alternate)."""
    gmus, card = f["colocated_gmus"], f["colocated_total_bytes"]
    if sleeping is None or not gmus or not card:
        return f["colocated_effective_bytes"]
    held = f["colocated_bytes"] or [None] * len(gmus)
    eff = 0.0
    for gmu, asleep, b in zip(gmus, sleeping, held, strict=False):
        if asleep and b is not None:
            eff += b
        elif gmu is not None:
            eff += gmu * card
        else:
            return None
    return eff


def check(f: Facts, t: Thresholds) -> Hit | None:
    gmu_sum, reserved, card = (
        f["colocated_gmu_sum"],
        f["colocated_reserved_bytes"],
        f["colocated_total_bytes"],
    )
    gap = f["colocated_start_gap_s"]
    over = (gmu_sum is not None and gmu_sum > t.max_gmu_sum) or bool(
        reserved is not None and card and reserved > card
    )
    close_start = gap is not None and gap < t.profile_window_s
    # Sleep-swap sets (catalogue 2 §3.6): a sleeping engine counts by its measured bytes. Sleep
    # state per engine from its vllm:engine_sleep_state, and for this engine also from its log
    # ('It took … seconds to fall asleep.' with no wake after it).
    sleeping = _sleeping(f)
    effective = _effective_bytes(f, sleeping)
    sleep_fit = bool(
        sleeping is not None
        and any(sleeping)
        and effective is not None
        and card
        and effective <= t.max_gmu_sum * card
    )
    if (f["colocated_count"] or 0) < 2 or not (over or close_start) or sleep_fit:
        return None
    # vLLM 0.34, extensible, every engine with gmu unset: shared-gpu-gmu-unset gives the split
    # once (spec/vllm-0.34.md §2).
    ext = bool(f["vllm_v34"]) and f["vllm_sizing_mode"] == "extensible"
    explicit = f["colocated_gmu_explicit"]
    if ext and explicit and not any(x is not False for x in explicit):
        return None

    # A gmu per engine proportional to what each asked for, summing to at most max_gmu_sum.
    split = gmu_split(f["colocated_gmus"], t.max_gmu_sum) if gmu_sum is not None else None
    own = _own_share(split, f["colocated_self"]) if over else None
    fixes: list[Fix] = []
    if own is not None and is_valid(f, GMU, own):
        fixes.append(Fix(flags={GMU: str(flag_value(own))}, why="this engine's share of the split card"))

    head = f"{na(f['colocated_count'])} vLLM engines share GPU {na(f['colocated_gpu'])}: {na(f['colocated_desc'])}."
    if over:
        # The flag is named where this engine's value is the fix.
        with_flag = f" with {GMU} per engine" if fixes else ""
        bytes_part = f" ({fmt_bytes(reserved)} of {fmt_bytes(card)})" if reserved and card else ""
        if ext:
            # 0.34 extensible: no startup refusal; the later engine gets what the first left.
            consequence = (
                " each engine commits up to its gmu × total after its warm-up, so the later one gets only"
                ' what the first left (its "No available memory for the cache blocks" / "To serve at least'
                ' one request" after warm-up, or a small "Extended KV cache" pool), or one runs out at run'
                " time when the other's transient grows."
            )
        else:
            consequence = (
                " each engine preallocates its gmu × total, so the one that profiles last finds too little"
                ' free memory ("Free memory on device … is less than desired GPU memory utilization") or runs'
                " out at run time."
            )
        body = (
            f"Together they ask for gmu {na(gmu_sum, '.2f')} of the card{bytes_part}:{consequence}"
            f" Split the card{with_flag}: {_split_desc(f['colocated_names'], split)} (sum ≤ {t.max_gmu_sum:.2f})."
        )
    else:
        body = (
            f"Their gmu fit, but they started {na(gap, '.0f')} s apart, inside each other’s profiling window:"
            " the memory profiler counts the other engine’s allocations as its own, so one of them got a"
            " smaller KV cache than it should."
        )
    ready = "Extended KV cache to" if ext else "Starting vLLM server"
    summary = (
        f'{head} {body} Start them one after another, the next only once the previous one logs "{ready}".'
    )

    evidence = [
        Evidence(
            "engines on one GPU",
            na(f["colocated_desc"]),
            "nvidia-smi processes + ps.txt command lines / cmdline.txt",
        )
    ]
    if gmu_sum is not None:
        evidence.append(Evidence("gmu sum", f"{gmu_sum:.2f}", "--gpu-memory-utilization of each engine"))
    if reserved and card:
        evidence.append(
            Evidence(
                "memory reserved together",
                f"{fmt_bytes(reserved)} of {fmt_bytes(card)}",
                "Σ gmu × memory.total",
            )
        )
    if gap is not None:
        evidence.append(Evidence("start times apart", f"{gap:.0f} s", "process create times"))
    gpu = f["colocated_gpu"]
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=[gpu] if gpu is not None else [],
        severity=None if over else "warning",
    )


RULE = Rule(
    id="colocated-engines-overcommit",
    family="K",
    severity="critical",
    title="Engines sharing one GPU ask for more memory than the card has",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    explains=("gpu-shared-with-foreign-process", "kv-budget-exhausted", "max-model-len-exceeds-kv-capacity"),
    flags=(GMU,),
)
