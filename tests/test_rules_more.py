"""The rules added after the first catalogue: each fires on the facts it is about and stays quiet
on near misses, on contexts built by derive.build_contexts from small synthetic snapshots (the
realistic bundles under tests/data/bundles exercise them end to end through tests/test_cases.py).
"""

from __future__ import annotations

from kvdoctor.facts import EngineConfig, Snapshot
from kvdoctor.sources.vllm_log import parse_log
from tests.test_rules_catalogue import _gpu, _metrics, fired

GiB = 2**30
PFX = "(EngineCore pid=140) ERROR 03-10 10:12:37 [core.py:1585] "


def _series(kv: float, waiting: float, preempt_step: float, **kw) -> list[Snapshot]:
    snaps = []
    for i, t in enumerate((0.0, 20.0, 40.0)):
        m = _metrics(t, kv_cache_usage=kv, num_requests_waiting=waiting, num_requests_running=100,
                     num_preemptions_total=preempt_step * i, **kw)  # fmt: skip
        snaps.append(Snapshot(timestamp=t, metrics=[m]))
    snaps[-1].gpus = [_gpu(0, 74, util=0.9)]
    return snaps


# --------------------------------------------------------------------------- max-num-seqs-exceeds-kv


def test_max_num_seqs_exceeds_kv_is_a_warning_only_under_pressure() -> None:
    cfg = EngineConfig(model="m", max_num_seqs=512, explicit={"max_num_seqs"})
    # 20000 blocks × 16 = 320000 KV tokens; KV 95 % full with 100 running → ~3040 tokens each.
    snaps = _series(0.95, 5, 3)
    got = fired(snaps[-1], cfg, extra=snaps[:-1])["max-num-seqs-exceeds-kv"]
    assert got["severity"] == "warning"
    assert got["flags"] == {"--max-num-seqs": "105"}  # 320000 // 3040
    # The same oversized limit on a calm server (no preemptions, no queue): info.
    calm = _series(0.95, 0, 0)
    got = fired(calm[-1], cfg, extra=calm[:-1])["max-num-seqs-exceeds-kv"]
    assert got["severity"] == "info"
    # A limit the cache can hold: nothing.
    small = EngineConfig(model="m", max_num_seqs=64, explicit={"max_num_seqs"})
    assert "max-num-seqs-exceeds-kv" not in fired(snaps[-1], small, extra=snaps[:-1])


def test_max_num_seqs_single_scrape_queue_is_not_pressure() -> None:
    cfg = EngineConfig(model="m", max_num_seqs=512, explicit={"max_num_seqs"})
    one = Snapshot(timestamp=0.0, metrics=[_metrics(0.0, kv_cache_usage=0.95, num_requests_waiting=2,
                                                       num_requests_running=100)], gpus=[_gpu(0, 74)])  # fmt: skip
    assert fired(one, cfg)["max-num-seqs-exceeds-kv"]["severity"] == "info"


# --------------------------------------------------------------------------- swap-preemption-stall

V0_STATS = (
    "INFO 10-14 {t} metrics.py:349] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: {g} tokens/s, "
    "Running: {r} reqs, Swapped: {s} reqs, Pending: 9 reqs, GPU KV cache usage: 99.9%, CPU KV cache usage: 40.0%."
)
V0_SWAP = (
    "WARNING 10-14 12:01:06 scheduler.py:1481] Sequence group 7 is preempted by PreemptionMode.SWAP mode because "
    "there is not enough KV cache space. This can affect the end-to-end performance. Increase gpu_memory_utilization "
    "or tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=1"
)


def test_swap_preemption_stall_from_v0_stats_lines() -> None:
    stalled = "\n".join([V0_SWAP, V0_STATS.format(t="12:01:10", g="0.0", r=29, s=6)])
    got = fired(Snapshot(log=parse_log(stalled)), EngineConfig(model="m"))["swap-preemption-stall"]
    assert got["severity"] == "critical" and got["flags"] == {"--swap-space": "0"}
    assert "n / best_of" in got["summary"]
    # Swapped requests while tokens still flow: not a stall.
    flowing = "\n".join([V0_SWAP, V0_STATS.format(t="12:01:10", g="385.2", r=29, s=6)])
    assert "swap-preemption-stall" not in fired(Snapshot(log=parse_log(flowing)), EngineConfig(model="m"))
    # Zero throughput with nothing running and nothing swapped: idle, not a stall.
    idle = V0_STATS.format(t="12:01:10", g="0.0", r=0, s=0)
    assert "swap-preemption-stall" not in fired(Snapshot(log=parse_log(idle)), EngineConfig(model="m"))


def test_swap_preemption_stall_from_v0_metrics() -> None:
    snaps = []
    for t in (0.0, 30.0):
        m = _metrics(t, num_requests_swapped=5, num_requests_running=20, generation_tokens_total=1000.0)
        snaps.append(Snapshot(timestamp=t, metrics=[m]))
    assert "swap-preemption-stall" in fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])
    snaps[-1].metrics[0].generation_tokens_total = 9000.0
    assert "swap-preemption-stall" not in fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])
