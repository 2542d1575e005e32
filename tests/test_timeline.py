"""Windowed helpers over /metrics scrapes: rates, histogram deltas and quantiles, gauge stats."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.facts import EngineMetrics, HistogramData, Snapshot, Timeline
from kvdoctor.sources.metrics import load_metrics_dir
from kvdoctor.timeline import (
    GaugeStats,
    counter_increase,
    counter_rate,
    engine_series,
    gauge_stats,
    histogram_delta,
    histogram_latest,
    histogram_max_bucket,
    histogram_quantile,
    slope,
    window,
)

DATA = Path(__file__).resolve().parent / "data" / "metrics"
INF = math.inf


def _series(name: str) -> list[EngineMetrics]:
    series, errors = load_metrics_dir(DATA / name)
    assert errors == []
    return [ems[0] for _, ems in series]


def _per_min(series: list[EngineMetrics], seconds: float = 60.0) -> float:
    r = counter_rate(series, "num_preemptions_total", seconds)
    assert r is not None
    return r * 60


def _em(t: float | None, **kw: object) -> EngineMetrics:
    return EngineMetrics(timestamp=t, engine="0", **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- counters


def test_b17_preemption_rate_about_23_per_minute() -> None:
    s = _series("b17")
    # default 60 s window ends at the newest scrape: 35 → 58 over 60 s
    assert counter_increase(s, "num_preemptions_total") == 23.0
    assert _per_min(s) == pytest.approx(23.0)
    # the whole 70 s the scrapes span: 27 preemptions, "about 23 per minute" (case note)
    assert counter_increase(s, "num_preemptions_total", 120) == 27.0
    assert _per_min(s, 120) == pytest.approx(27 / 70 * 60)
    # never the lifetime total (58)
    assert counter_increase(s[-1:], "num_preemptions_total") is None


def test_real_cpu_preemptions_16_to_36_in_7s() -> None:
    s = _series("real-cpu-preemptions")
    burst = s[:8]
    assert counter_increase(burst, "num_preemptions_total") == 20.0
    assert counter_rate(burst, "num_preemptions_total") == pytest.approx(20 / 7)
    assert _per_min(burst) == pytest.approx(171.43, abs=0.01)
    # with the full scrape 9 s later: 16 → 48 over 16 s
    assert counter_increase(s, "num_preemptions_total") == 32.0
    assert counter_rate(s, "num_preemptions_total") == pytest.approx(2.0)
    # a 5 s window ending at the last burst scrape: 25 → 36
    assert counter_increase(burst, "num_preemptions_total", 4) == 11.0


def test_counter_reset_counts_post_reset_value() -> None:
    s = [_em(0, num_preemptions_total=10.0), _em(10, num_preemptions_total=20.0)]
    s += [_em(20, num_preemptions_total=5.0), _em(30, num_preemptions_total=8.0)]
    assert counter_increase(s, "num_preemptions_total") == 10 + 5 + 3
    assert counter_rate(s, "num_preemptions_total") == pytest.approx(18 / 30)


def test_counter_needs_two_samples_with_values_and_time() -> None:
    s = [_em(0, num_preemptions_total=1.0), _em(5), _em(10)]
    assert counter_rate(s, "num_preemptions_total") is None
    same_t = [_em(3, num_preemptions_total=1.0), _em(3, num_preemptions_total=4.0)]
    assert counter_increase(same_t, "num_preemptions_total") == 3.0
    assert counter_rate(same_t, "num_preemptions_total") is None
    assert counter_rate([], "num_preemptions_total") is None
    with pytest.raises(ValueError, match="no field"):
        counter_rate(s, "num_preemption")


def test_callable_field() -> None:
    s = [_em(0, generation_tokens_total=100.0), _em(10, generation_tokens_total=600.0)]
    assert counter_rate(s, lambda m: m.generation_tokens_total) == 50.0


# --------------------------------------------------------------------------- window


def test_window_bounds_inclusive_and_now() -> None:
    s = [_em(t, kv_cache_usage=0.1) for t in (0, 30, 60, 90, 120)]
    assert [m.timestamp for m in window(s)] == [60, 90, 120]
    assert [m.timestamp for m in window(s, 30)] == [90, 120]
    assert [m.timestamp for m in window(s, 60, now=70)] == [30, 60]
    assert window([], 60) == []


def test_window_without_timestamps_is_newest_sample() -> None:
    s = [_em(None, kv_cache_usage=0.1), _em(None, kv_cache_usage=0.2)]
    assert window(s) == [s[-1]]
    assert gauge_stats(s, "kv_cache_usage") == GaugeStats(0.2, 0.2, 0.2, 0.2, 0.2, 1)


# --------------------------------------------------------------------------- histograms


def test_b17_iteration_tokens_delta_in_window() -> None:
    s = _series("b17")
    d = histogram_delta(s, "vllm:iteration_tokens_total")
    assert d is not None
    # scrape 1753784352 → 1753784412: buckets 3740/4120/…/6255 → 3949/4329/…/6733
    assert d.count == 478.0
    assert d.sum == pytest.approx(4928101 - 4376980)
    assert d.buckets[0] == (1.0, 209.0)
    assert d.buckets[8] == (1024.0, 209.0)
    assert d.buckets[9] == (2048.0, 478.0)
    assert d.buckets[-1] == (INF, 478.0)
    # half the iterations were 1-token decode steps, the other half ≤ 2048-token prefill chunks
    assert histogram_quantile(d, 0.25) == pytest.approx(0.25 * 478 / 209)
    assert histogram_max_bucket(d) == 2048.0


def test_histogram_delta_single_sample_is_not_recent() -> None:
    s = _series("b17")[-1:]
    assert histogram_delta(s, "vllm:request_prompt_tokens") is None
    latest = histogram_latest(s, "vllm:request_prompt_tokens")
    assert latest is not None and latest.count == 5.0
    assert histogram_latest(s, "vllm:nope") is None


def test_histogram_delta_reset_aware() -> None:
    def h(c1: float, c2: float, s: float) -> dict[str, HistogramData]:
        return {"x": HistogramData(buckets=[(1.0, c1), (INF, c2)], count=c2, sum=s)}

    s = [_em(0, histograms=h(5, 10, 20)), _em(10, histograms=h(8, 15, 30)), _em(20, histograms=h(1, 2, 3))]
    d = histogram_delta(s, "x")
    assert d == HistogramData(buckets=[(1.0, 3 + 1), (INF, 5 + 2)], count=7, sum=10 + 3)


def test_prometheus_quantile_interpolation() -> None:
    h = HistogramData(buckets=[(1.0, 0), (2.0, 10), (4.0, 20), (INF, 20)], count=20)
    assert histogram_quantile(h, 0.5) == 2.0
    assert histogram_quantile(h, 0.25) == 1.5
    assert histogram_quantile(h, 0.75) == 3.0
    assert histogram_quantile(h, 1.0) == 4.0
    first = HistogramData(buckets=[(10.0, 10), (INF, 10)], count=10)
    assert histogram_quantile(first, 0.5) == 5.0  # first bucket's lower bound is 0
    with pytest.raises(ValueError):
        histogram_quantile(h, 1.5)


def test_quantile_in_inf_bucket_returns_last_finite_bound() -> None:
    h = HistogramData(buckets=[(1.0, 0), (2.0, 0), (INF, 5)], count=5)
    assert histogram_quantile(h, 0.5) == 2.0
    assert histogram_max_bucket(h) == 2.0


def test_empty_histograms() -> None:
    assert histogram_quantile(HistogramData(), 0.5) is None
    empty = HistogramData(buckets=[(1.0, 0), (INF, 0)])
    assert histogram_quantile(empty, 0.99) is None
    assert histogram_max_bucket(empty) is None
    only_inf = HistogramData(buckets=[(INF, 3)], count=3)
    assert histogram_quantile(only_inf, 0.5) is None


def test_real_pages_quantiles() -> None:
    from kvdoctor.sources.metrics import parse_metrics

    [b20] = parse_metrics((DATA / "b20-v0.txt").read_text())
    p = b20.histograms["vllm:request_prompt_tokens"]
    # rank 7105.5 lies in (10000, 20000]: 2211 below, 7729 inside
    assert histogram_quantile(p, 0.5) == pytest.approx(10000 + 10000 * (7105.5 - 2211) / 7729)
    assert histogram_quantile(p, 0.99) == 20000.0  # in the +Inf bucket
    assert histogram_max_bucket(p) == 20000.0
    b17 = _series("b17")[-1]
    # 120k-token prompts land above the last finite bucket (100000)
    assert histogram_max_bucket(b17.histograms["vllm:request_prompt_tokens"]) == 100000.0
    assert histogram_quantile(b17.histograms["vllm:request_prompt_tokens"], 0.5) == 100000.0
    real = _series("real-cpu-preemptions")[-1]
    assert histogram_max_bucket(real.histograms["vllm:request_prompt_tokens"]) == 50.0
    assert histogram_max_bucket(real.histograms["vllm:request_generation_tokens"]) == 200.0


# --------------------------------------------------------------------------- gauges


def test_real_cpu_kv_usage_stats() -> None:
    burst = _series("real-cpu-preemptions")[:8]
    g = gauge_stats(burst, "kv_cache_usage")
    assert g is not None
    assert (g.min, g.max, g.first, g.last, g.n) == (0.666667, 1.0, 1.0, 1.0, 8)
    assert g.mean == pytest.approx((7 + 0.666667) / 8)
    w = gauge_stats(burst, "num_requests_waiting")
    assert w is not None and w.n == 8
    assert gauge_stats(burst, "num_requests_swapped") is None


def test_slope_least_squares() -> None:
    s = [_em(t, num_requests_waiting=2.0 * t + 1) for t in (100, 101, 103, 110)]
    assert slope(s, "num_requests_waiting") == pytest.approx(2.0)
    noisy = [_em(0, kv_cache_usage=0.0), _em(1, kv_cache_usage=1.0), _em(2, kv_cache_usage=1.0)]
    assert slope(noisy, "kv_cache_usage") == pytest.approx(0.5)
    assert slope(s[:1], "num_requests_waiting") is None
    burst = _series("real-cpu-preemptions")[:8]
    assert slope(burst, "num_preemptions_total") == pytest.approx(20 / 7, rel=0.05)


# --------------------------------------------------------------------------- Timeline


def test_engine_series_from_timeline() -> None:
    tl = Timeline()
    for t in (10.0, 20.0, 30.0):
        tl.append(
            Snapshot(
                timestamp=t,
                metrics=[
                    EngineMetrics(engine="0", num_preemptions_total=t),
                    EngineMetrics(engine="1", num_preemptions_total=2 * t, timestamp=t - 1),
                ],
            )
        )
    tl.append(Snapshot(timestamp=40.0, metrics=[]))
    e1 = engine_series(tl, "1")
    assert [(m.timestamp, m.num_preemptions_total) for m in e1] == [(9.0, 20.0), (19.0, 40.0), (29.0, 60.0)]
    e0 = engine_series(tl, "0")
    assert [m.timestamp for m in e0] == [10.0, 20.0, 30.0]
    assert tl.snapshots[0].metrics[0].timestamp is None  # timeline untouched
    assert counter_rate(e0, "num_preemptions_total") == 1.0
    assert engine_series(tl, "7") == []


def test_engine_series_v0_and_model_name() -> None:
    tl = Timeline()
    tl.append(
        Snapshot(
            timestamp=1.0,
            metrics=[EngineMetrics(model_name="a", kv_cache_usage=0.1), EngineMetrics(model_name="b")],
        )
    )
    assert [m.model_name for m in engine_series(tl, None)] == ["a"]
    assert [m.model_name for m in engine_series(tl, "")] == ["a"]
    assert [m.model_name for m in engine_series(tl, None, model_name="b")] == ["b"]


# --------------------------------------------------------------------------- indexed windows


def _filtered(series: list[EngineMetrics], seconds: float, now: float | None) -> list[EngineMetrics]:
    """The window by definition: every timed sample in [end - seconds, end], in series order."""
    timed = [m for m in series if m.timestamp is not None]
    if not timed:
        return series[-1:]
    end = now if now is not None else max(m.timestamp for m in timed if m.timestamp is not None)
    return [m for m in timed if m.timestamp is not None and end - seconds <= m.timestamp <= end]


def test_window_matches_its_definition_in_any_order() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    stamps = st.lists(st.one_of(st.none(), st.integers(0, 40).map(float)), max_size=30)

    @settings(max_examples=300, deadline=None)
    @given(
        stamps, st.sampled_from([0.0, 1.0, 5.0, 60.0]), st.one_of(st.none(), st.integers(0, 45).map(float))
    )
    def check(ts: list[float | None], seconds: float, now: float | None) -> None:
        series = [EngineMetrics(timestamp=t, num_requests_running=float(i)) for i, t in enumerate(ts)]
        want = _filtered(series, seconds, now)
        got = window(series, seconds, now)
        assert [id(m) for m in got] == [id(m) for m in want]
        # a window of a window (how derive reads it) is the same window again
        assert [id(m) for m in window(got, seconds, now)] == [id(m) for m in want]
        for ordered in (sorted(series, key=lambda m: m.timestamp or 0.0),):
            assert [id(m) for m in window(ordered, seconds, now)] == [
                id(m) for m in _filtered(ordered, seconds, now)
            ]

    check()


def test_series_changed_in_place_is_indexed_afresh() -> None:
    series = window(
        [EngineMetrics(timestamp=float(t), num_preemptions_total=float(t)) for t in range(10)], 100
    )
    assert [m.timestamp for m in window(series, 3)] == [6.0, 7.0, 8.0, 9.0]
    series.append(EngineMetrics(timestamp=20.0, num_preemptions_total=30.0))
    assert [m.timestamp for m in window(series, 3)] == [20.0]
    series[-1] = EngineMetrics(timestamp=9.5)  # same length, another last sample
    assert [m.timestamp for m in window(series, 3)] == [7.0, 8.0, 9.0, 9.5]
    series.insert(0, EngineMetrics(timestamp=50.0))  # no longer time-ordered: filtered instead
    assert [m.timestamp for m in window(series, 3)] == [50.0]
    assert counter_increase(window(series, 100), "num_preemptions_total", 100) == 9.0


def test_counter_rate_is_increase_over_elapsed_time() -> None:
    vals = [5.0, 7.0, 2.0, 4.0]  # a reset after the second sample
    series = [EngineMetrics(timestamp=10.0 * i, num_preemptions_total=v) for i, v in enumerate(vals)]
    assert counter_increase(series, "num_preemptions_total") == 2.0 + 2.0 + 2.0
    assert counter_rate(series, "num_preemptions_total") == pytest.approx(6.0 / 30.0)


@pytest.mark.parametrize(("gap", "rate"), [(0.017, None), (0.99, None), (1.0, 3.0), (12.0, 0.25)])
def test_a_rate_needs_scrapes_a_second_apart(gap: float, rate: float | None) -> None:
    # Two reads 17 ms apart (a slow read's back-to-back retry) are one instant: "0/min" between
    # them would say there is no storm. Under a second apart there is no rate; the increase is kept.
    series = [EngineMetrics(timestamp=100.0, num_preemptions_total=7.0)]
    series.append(
        EngineMetrics(timestamp=100.0 + gap, num_preemptions_total=7.0 + (3.0 if gap >= 1 else 0.0))
    )
    assert counter_rate(series, "num_preemptions_total") == rate
    assert counter_increase(series, "num_preemptions_total") == (3.0 if gap >= 1 else 0.0)


# --------------------------------------------------------------------------- read-outs reused


def _naive_increase(vals: list[float]) -> float:
    total = 0.0
    for a, b in zip(vals, vals[1:], strict=False):
        total += b - a if b >= a else b
    return total


def _naive_slope(pts: list[tuple[float, float]]) -> float | None:
    t0 = pts[0][0]
    xs = [t - t0 for t, _ in pts]
    ys = [v for _, v in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def test_rates_and_slopes_are_bit_identical_to_their_definitions() -> None:
    import random

    rnd = random.Random(3)
    for trial in range(200):
        n = rnd.randint(2, 80)
        t, c = 1_700_000_000.0, 0.0
        samples = []
        for i in range(n):
            t += rnd.choice([0.5, 1.0, 1.0, 2.3, 1e-3])
            c = c + rnd.random() * 1e3 if trial % 3 or i != n // 2 else rnd.random()  # a reset
            samples.append(EngineMetrics(timestamp=t, generation_tokens_total=c, kv_cache_usage=rnd.random()))
        vals = [m.generation_tokens_total for m in samples]
        got = counter_increase(samples, "generation_tokens_total", 1e9)
        assert got == _naive_increase(vals)  # type: ignore[arg-type]
        pts = [(m.timestamp, m.kv_cache_usage) for m in samples]
        assert slope(samples, "kv_cache_usage", 1e9) == _naive_slope(pts)  # type: ignore[arg-type]
        stats = gauge_stats(samples, "kv_cache_usage", 1e9)
        kv = [m.kv_cache_usage for m in samples]
        assert stats is not None and stats.mean == sum(kv) / len(kv)  # type: ignore[arg-type]


def test_values_read_out_of_a_window_follow_the_list_when_it_changes() -> None:
    series = window([_em(float(t), kv_cache_usage=0.1 * t) for t in range(5)], 100)
    assert gauge_stats(series, "kv_cache_usage", 100).max == pytest.approx(0.4)  # type: ignore[union-attr]
    series.append(_em(5.0, kv_cache_usage=0.9))  # the list grew: read afresh, not the cached values
    assert gauge_stats(series, "kv_cache_usage", 100).max == pytest.approx(0.9)  # type: ignore[union-attr]
    series[-1] = _em(5.0, kv_cache_usage=0.05)
    got = gauge_stats(series, "kv_cache_usage", 100)
    assert got is not None and got.n == 6 and got.last == pytest.approx(0.05) and got.min == 0.0
    # a NaN or a missing value drops that sample only, cached or not
    series.append(_em(6.0, kv_cache_usage=math.nan))
    series.append(_em(7.0))
    for _ in range(2):
        got = gauge_stats(series, "kv_cache_usage", 100)
        assert got is not None and got.n == 6 and got.last == pytest.approx(0.05)


# --------------------------------------------------------------------------- session 8: fused window ends


def test_ends_delta_is_hist_diff_when_the_ends_do_not_reset_else_none() -> None:
    # The one-pass delta of a window's ends gives what _ends_no_reset then _hist_diff give, for
    # ends that reset in every way: a count or bucket lower, bounds changed or in another order,
    # a bound repeated, NaN counts, an empty histogram.
    import random

    from kvdoctor.timeline import _ends_delta, _ends_no_reset, _hist_diff

    rng = random.Random(8)
    nan = float("nan")

    def hist(bounds: list[float], counts: list[float], count: float) -> HistogramData:
        return HistogramData(buckets=list(zip(bounds, counts, strict=True)), count=count, sum=count * 2.5)

    def shape(h: HistogramData | None) -> Any:
        return None if h is None else (h.buckets, h.count, h.sum)

    for _ in range(3000):
        n = rng.randint(0, 5)
        bounds = sorted(rng.sample([1.0, 2.0, 4.0, 8.0, 16.0, math.inf], n))
        first = [float(rng.randint(0, 9)) for _ in bounds]
        last = [c + rng.choice((0.0, 1.0, 3.0, -1.0)) for c in first]
        b2 = list(bounds)
        kind = rng.randint(0, 6)
        if kind == 0 and b2:
            b2[rng.randrange(len(b2))] = 32.0  # a bound changed
        elif kind == 1 and len(b2) > 1:
            b2.reverse()  # another order
        elif kind == 2 and len(b2) > 1:
            bounds[1] = b2[1] = b2[0]  # a bound repeated in both
        elif kind == 3 and last:
            last[rng.randrange(len(last))] = nan
        c1 = float(rng.randint(0, 20))
        c2 = c1 + rng.choice((0.0, 2.0, -1.0))
        a, b = hist(bounds, first, c1), hist(b2, last, c2)
        want = _hist_diff(a, b) if _ends_no_reset(a, b) else None
        got = _ends_delta(a, b)
        assert shape(got) == shape(want) or (repr(shape(got)) == repr(shape(want))), (a, b)
        assert (got is b) == (want is b)


def test_shared_windows_are_memoised_per_length_and_follow_a_series_changed_in_place() -> None:
    from kvdoctor.timeline import Series

    s = Series(EngineMetrics(timestamp=float(t), num_requests_waiting=t) for t in range(10))
    whole = window(s, 60.0, shared=True)
    assert whole is s and window(s, 60.0, shared=True) is s
    tail = window(s, 3.0, shared=True)
    assert [m.timestamp for m in tail] == [6.0, 7.0, 8.0, 9.0] and window(s, 3, shared=True) is tail
    assert window(s, 3.0) is not tail and list(window(s, 3.0)) == list(tail)  # a copy unless shared
    assert gauge_stats(s, "num_requests_waiting", 3.0) == GaugeStats(
        min=6, max=9, mean=7.5, last=9, first=6, n=4
    )
    s.append(EngineMetrics(timestamp=10.0, num_requests_waiting=10))  # changed in place
    moved = window(s, 3.0, shared=True)
    assert moved is not tail and [m.timestamp for m in moved] == [7.0, 8.0, 9.0, 10.0]
    assert gauge_stats(s, "num_requests_waiting", 3.0) == GaugeStats(
        min=7, max=10, mean=8.5, last=10, first=7, n=4
    )
