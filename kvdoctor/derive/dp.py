"""Family dp: the data-parallel engines of one model side by side, sample by sample
(``dp-engine-load-skew``, spec/rules-catalogue2.md §3.4).

Reads every engine's ``vllm:num_requests_waiting`` / ``num_requests_running`` /
``kv_cache_usage_perc`` (``engine`` label) in the window, else the log's ``Engine NNN:`` stats
lines. Hot / cold are the rule's thresholds (rule function ``dp_skew``); this family only lines
the figures up. The figures are written in one context only (the lowest engine label), so the
skew is reported once per model."""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars, num, stats_engine
from kvdoctor.lazyre import lazy_re

WRITES: dict[str, str] = {
    "dp_samples": "list[dict]; one per sample time, oldest first: {'t': seconds or None, 'engines': {label: {'waiting', 'running', 'kv'}}} (metrics by engine label, else 'Engine NNN:' stats lines)",
    "dp_window_s": "seconds; span of dp_samples (None when the times are unknown)",
    "dp_source": "str; 'metrics' or 'log'",
    "dp_capacity_tokens": "dict[str, tokens]; per engine: cache_config_info kv_cache_size_tokens, else num_gpu_blocks ÷ dp × block_size",
    "dp_external_lb": "bool; --data-parallel-external-lb / --data-parallel-hybrid-lb / --data-parallel-rank given: placement is an outside router's",
}
READS: frozenset[str] = frozenset({"dp_engine", "block_size"})

_TIME_RE = lazy_re(r"^(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})")


def _seconds(t: str | None) -> float | None:
    m = _TIME_RE.match(t or "")
    if not m:
        return None
    mo, d, hh, mm, ss = (int(x) for x in m.groups())
    return float((((mo * 31 + d) * 24 + hh) * 60 + mm) * 60 + ss)


def derive(s: Scope, v: Vars) -> None:
    """Per-sample waiting / running / KV usage of every DP engine, once per model."""
    args = s.cfg.args
    v["dp_external_lb"] = bool(
        args.get("data_parallel_external_lb") or args.get("data_parallel_hybrid_lb")
        or args.get("data_parallel_rank") is not None
    )  # fmt: skip
    if len(s.peer_series) >= 2:
        if v["dp_engine"] != min(s.peer_series, key=lambda x: (len(x), x)):
            return
        _from_metrics(s, v)
    elif s.log is not None and v["dp_engine"] is None:
        _from_log(s, v)


def _from_metrics(s: Scope, v: Vars) -> None:
    by_t: dict[Any, dict[str, dict[str, float | None]]] = {}
    caps: dict[str, int] = {}
    dp = max(1, s.cfg.data_parallel_size or len(s.peer_series))
    for label, series in s.peer_series.items():
        for m in series:
            by_t.setdefault(m.timestamp, {})[label] = {
                "waiting": m.num_requests_waiting,
                "running": m.num_requests_running,
                "kv": m.kv_cache_usage,
            }
        if series:
            cc = series[-1].cache_config
            tokens = num(cc.get("kv_cache_size_tokens"))
            blocks = num(cc.get("num_gpu_blocks"))
            bs = num(cc.get("block_size")) or v["block_size"] or 16
            if tokens is not None:
                caps[label] = int(tokens)
            elif blocks is not None:
                # Before 0.24 the frontend sums blocks over its engines (vllm-facts §1.3).
                caps[label] = int(blocks / dp * bs)
    samples = [
        {"t": t, "engines": e}
        for t, e in sorted(by_t.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        if len(e) >= 2
    ]
    _finish(v, samples, "metrics")
    v["dp_capacity_tokens"] = caps


def _from_log(s: Scope, v: Vars) -> None:
    assert s.log is not None
    per: dict[str, list[Any]] = {}
    for e in s.log.of("stats"):
        if e.values.get("engine") in (None, "aggregated"):
            continue
        per.setdefault(str(stats_engine(e)), []).append(e)
    if len(per) < 2:
        return
    rounds = min(len(x) for x in per.values())
    samples = []
    for i in range(rounds):
        row = {lab: evs[-rounds + i] for lab, evs in per.items()}
        ts = [_seconds(e.time) for e in row.values()]
        samples.append(
            {
                "t": max(t for t in ts if t is not None) if any(t is not None for t in ts) else None,
                "engines": {
                    lab: {
                        "waiting": (e.values.get("waiting") or 0) + (e.values.get("pending") or 0),
                        "running": e.values.get("running"),
                        "kv": e.values.get("kv_usage"),
                    }
                    for lab, e in row.items()
                },
            }
        )
    _finish(v, samples, "log")


def _finish(v: Vars, samples: list[dict[str, Any]], source: str) -> None:
    if not samples:
        return
    v["dp_samples"], v["dp_source"] = samples, source
    ts = [x["t"] for x in samples if x["t"] is not None]
    v["dp_window_s"] = (max(ts) - min(ts)) if len(ts) == len(samples) and ts else None


FAMILY = Family("dp", WRITES, READS, derive)
