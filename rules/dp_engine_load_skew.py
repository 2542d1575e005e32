"""## What
Two or more data-parallel engines of one model (distinct `engine` labels, or several
`Engine NNN:` stats lines) where, in every sample of the window (≥ 3 samples over ≥ 30 s),
some engines are hot (waiting ≥ 5 and KV usage ≥ 0.90) and some cold (waiting 0, KV ≤ 0.60,
running < max_num_seqs), and the hot ones hold ≥ 2/3 of all waiting requests.

It also fires in the form it usually takes in practice (vllm#48808): nothing waits anywhere, but
the running requests sit on some engines (≥ 1.5 × the fair share) while their peers run
(almost) none, in every sample of the window.

On vLLM 0.34 the balancer is unchanged; hot/cold KV thresholds are block usage at block size 64,
and MoE-DP engines share one pool size (the minimum over the world group), so equal pools do
not mean equal load.

## Why
On 0.10.2–0.26 the built-in balancer picks the engine with the least 4 × waiting + running
from counts published at most every 100 ms, and ignores KV usage: an engine full of long
requests keeps getting work. 0.27 adds `6 × waiting × max(0, kv − 0.5)` and a per-client
in-flight floor. Requests with `X-data-parallel-rank` skip it; with
`--data-parallel-external-lb` placement is outside vLLM.

## How to confirm
Per-engine `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`; the log's
`Engine 000: … Waiting: 117 reqs … GPU KV cache usage: 100.0%` lines (switched off with
`--api-server-count` > 1; `--aggregate-engine-logging` hides the skew). Not this rule: a
uniform overload (every engine hot), a skew in one or two scrapes, uneven KV without a queue.

## Fix
Upgrade to ≥ 0.27 (balancer with KV pressure); fix the outside router or the pinned requests.
No vLLM flag tunes the balancer, so `suggested_flags` stays empty. The thresholds (5 waiting,
0.90 / 0.60 KV, 2/3 share) are estimates, overridable in the user config.

## Sources
spec/rules-catalogue2.md §3.4; vllm-facts.md §1.1 "Data-parallel balancing", §1.2, §3.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdoctor.rule_functions import dp_absorb, dp_desc, dp_skew
from kvdoctor.rulekit import Evidence, Facts, Hit, Rule, na


@dataclass(frozen=True)
class Thresholds:
    # Estimates (spec/rules-catalogue2.md §6).
    #: requests waiting at which an engine counts as hot (with hot_kv)
    hot_waiting: float = 5
    #: KV cache usage (fraction) at which an engine counts as hot (with hot_waiting)
    hot_kv: float = 0.90
    #: KV cache usage (fraction) at or below which an engine with nothing waiting is cold
    cold_kv: float = 0.60
    #: share of all waiting requests the hot engines must hold in every sample
    hot_share: float = 0.6667
    #: samples the skew must hold in
    min_samples: int = 3
    #: seconds the samples must span (when their times are known)
    min_window_s: float = 30
    #: running skew with nothing waiting (vllm#48808): requests running on all engines together
    #: below which the spread means nothing
    min_running_total: float = 8
    #: an engine runs at least this many times the fair share (total ÷ engines) to count as busy
    busy_factor: float = 1.5
    #: an engine runs at most this fraction of the fair share to count as idle
    idle_factor: float = 0.25


def running_skew(samples: list[dict[str, Any]], t: Thresholds) -> dict[str, Any] | None:
    """Running requests concentrated on some engines while their peers idle, with nothing
    waiting anywhere (vllm#48808), in every sample: busy = running ≥ busy_factor × fair share,
    idle = running ≤ idle_factor × fair share, the busy ones holding ≥ hot_share of all
    running. Returns the shape of :func:`dp_skew` ('hot' = busy, 'cold' = idle, 'moves' =
    Σ_busy (running − mean running)) or None."""
    busy_all: set[str] | None = None
    idle_all: set[str] | None = None
    for smp in samples:
        eng = smp.get("engines") or {}
        if len(eng) < 2 or any((e.get("waiting") or 0) > 0 for e in eng.values()):
            return None
        total = sum((e.get("running") or 0) for e in eng.values())
        if total < t.min_running_total:
            return None
        fair = total / len(eng)
        busy = {lab for lab, e in eng.items() if (e.get("running") or 0) >= t.busy_factor * fair}
        idle = {lab for lab, e in eng.items() if (e.get("running") or 0) <= t.idle_factor * fair}
        if not busy or not idle or sum(eng[b].get("running") or 0 for b in busy) < t.hot_share * total:
            return None
        busy_all = busy if busy_all is None else busy_all & busy
        idle_all = idle if idle_all is None else idle_all & idle
    if not busy_all or not idle_all:
        return None
    last = samples[-1].get("engines") or {}
    mean = sum((e.get("running") or 0) for e in last.values()) / max(1, len(last))
    moves = sum(max(0.0, (last[b].get("running") or 0) - mean) for b in busy_all)
    key = lambda x: (int(x), x) if str(x).isdigit() else (1 << 30, str(x))  # noqa: E731
    return {
        "hot": sorted(busy_all, key=key),
        "cold": sorted(idle_all, key=key),
        "last": last,
        "moves": int(round(moves)),
        "mean_running": mean,
    }


def _placement(f: Facts) -> str:
    """Where the imbalance comes from, by version and launch (the words; no flag tunes it)."""
    release, version = f["vllm_release"], f["vllm_version"]
    pinned = " Requests sent with X-data-parallel-rank skip the balancer."
    if f["dp_external_lb"]:
        return (
            "The engines are placed by an outside router (external or hybrid data-parallel load balancing):"
            f" fix the placement there.{pinned}"
        )
    if release is not None and release <= 26:
        return (
            f"vLLM {version}’s balancer ranks engines by 4 × waiting + running and never looks at KV usage;"
            f" vLLM ≥ 0.27 adds a KV-pressure term and a per-client in-flight floor.{pinned}"
        )
    return "Check for requests pinned with the X-data-parallel-rank header, which skip the balancer."


def _running_hit(f: Facts, t: Thresholds, run: dict[str, Any]) -> Hit:
    """The finding for requests running concentrated on some engines with nothing waiting."""
    samples, window = f["dp_samples"] or [], f["dp_window_s"]
    over = f" over {window:.0f} s" if window is not None else ""
    busy, idle = dp_desc(run, "hot"), dp_desc(run, "cold")
    summary = (
        f"Across {len(samples)} samples{over} the data-parallel engines of {f['model_name'] or 'this model'}"
        f" run their requests concentrated on some engines while their peers idle, with nothing waiting"
        f" anywhere (vllm#48808): busy {busy}; idle {idle}. About {run['moves']} running requests would"
        f" move to even them out (mean {run['mean_running']:.0f} per engine): the busy engines decode"
        f" larger batches (slower tokens per request) while idle GPUs wait. {_placement(f)}"
        " GPU util is no evidence of balance (MoE engines under DP step in lockstep)."
    )
    source = na(f["dp_source"])
    evidence = [
        Evidence("busy engines", busy, f"vllm:num_requests_running by engine label ({source})"),
        Evidence("idle engines", idle, f"same ({source})"),
        Evidence(
            "requests waiting", "0 on every engine in every sample", f"vllm:num_requests_waiting ({source})"
        ),
        Evidence("requests to move", f"{run['moves']}", "Σ_busy (running − mean running)"),
    ]
    return Hit(
        summary=summary,
        evidence=evidence,
        gpus=sorted(set(f["engine_gpus"] or ())),
        title="Data-parallel engines run requests unevenly (some busy while others idle, nothing waiting)",
    )


def check(f: Facts, t: Thresholds) -> Hit | None:
    samples, window = f["dp_samples"], f["dp_window_s"]
    if not samples or len(samples) < t.min_samples or (window is not None and window < t.min_window_s):
        return None
    skew = dp_skew(samples, t.hot_waiting, t.hot_kv, t.cold_kv, t.hot_share, f["max_num_seqs"])
    if skew is None:
        run = running_skew(samples, t)
        return _running_hit(f, t, run) if run is not None else None
    absorb = dp_absorb(
        skew, f["dp_capacity_tokens"], f["max_num_seqs_effective"], f["typical_request_tokens"]
    )
    hot, cold = dp_desc(skew, "hot"), dp_desc(skew, "cold")
    over = f" over {window:.0f} s" if window is not None else ""
    take = f", and the cold engines could take {absorb} of them now" if absorb is not None else ""
    where = _placement(f)
    summary = (
        f"Across {len(samples)} samples{over} the data-parallel engines of {f['model_name'] or 'this model'}"
        f" stay skewed: hot {hot}; cold {cold}. About {skew['moves']} queued requests would move to even the"
        f" queues out (mean waiting {skew['mean_waiting']:.0f} per engine){take}. {where} GPU util is no evidence of balance (MoE engines under DP step"
        " in lockstep)."
    )
    source = na(f["dp_source"])
    evidence = [
        Evidence(
            "hot engines",
            hot,
            f"vllm:num_requests_waiting / num_requests_running / kv_cache_usage_perc by engine label ({source})",
        ),
        Evidence("cold engines", cold, f"same ({source})"),
        Evidence("requests to move", f"{skew['moves']}", "Σ_hot (waiting − mean waiting)"),
    ]
    if absorb is not None:
        evidence.append(
            Evidence(
                "cold engines can absorb",
                f"{absorb}",
                "Σ_cold min(max_num_seqs − running, KV room / typical request)",
            )
        )
    # No vLLM flag tunes the balancer: no fixes.
    return Hit(summary=summary, evidence=evidence, gpus=sorted(set(f["engine_gpus"] or ())))


RULE = Rule(
    id="dp-engine-load-skew",
    family="U",
    severity="warning",
    title="Data-parallel engines are loaded unevenly (some queue while others idle)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs_any=("metrics", "log"),
)
