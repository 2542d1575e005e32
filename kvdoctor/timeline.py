"""Windowed helpers over a time-ordered series of one engine's /metrics scrapes.

Rules that speak of "recent" state read a window of the timeline, default 60 s ending at the
newest sample (spec/rules.md "Windows"). Counter rates and histogram quantiles come from deltas
inside the window, never from lifetime totals (vllm-facts.md §7 "Interpreting preemption":
``rate(vllm:num_preemptions_total)``).

``series`` is a list of :class:`~kvdoctor.facts.EngineMetrics` of ONE engine, oldest first, each
with ``.timestamp`` (unix seconds); :func:`engine_series` extracts it from a
:class:`~kvdoctor.facts.Timeline`. Values keep the metric's units (counts, tokens, seconds,
fractions); rates are per second.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvdoctor.facts import EngineMetrics, HistogramData, Timeline

__all__ = [
    "DEFAULT_WINDOW_S",
    "GaugeStats",
    "Series",
    "counter_increase",
    "counter_rate",
    "engine_series",
    "gauge_stats",
    "has_value",
    "histogram_delta",
    "histogram_latest",
    "histogram_max_bucket",
    "histogram_quantile",
    "sample_values",
    "slope",
    "window",
]

#: spec/rules.md "Windows": default length of a "recent" window, seconds.
DEFAULT_WINDOW_S = 60.0

#: Seconds two scrapes must be apart for a rate between them: closer, they are reads of one
#: instant (a slow read's back-to-back retry), whose "0 per minute" would say nothing.
MIN_RATE_SPAN_S = 1.0

#: An EngineMetrics field name ("num_preemptions_total", "kv_cache_usage", …) or a function of
#: one sample returning a number or None.
FieldRef = str | Callable[[EngineMetrics], float | None]


class Series(list[EngineMetrics]):
    """One engine's scrapes, oldest first (a ``list``), with their timestamps indexed once.

    :func:`engine_series` and :func:`window` return one; any plain list works as well (it is
    indexed on first use: one pass). A live Timeline appends a snapshot a second and every rule
    variable reads a window of it, so the index makes each further :func:`window` a bisection
    on the timestamps instead of a scan of every sample, and the values of a field are read out
    of the samples once per Series (every helper asked about the same window reuses them). The
    index is checked against the list's length and last item on each use, so a list changed in
    place is indexed afresh.
    """

    __slots__ = ("_cols", "_ordered", "_source", "_times", "_tail")

    def __init__(self, items: Iterable[EngineMetrics] = ()) -> None:
        super().__init__(items)
        self._times: list[float | None] | None = None
        self._tail: EngineMetrics | None = None
        self._ordered = False
        #: field name (or histogram name) → what was read out of the samples, for this index.
        self._cols: dict[Any, Any] = {}
        #: (reader, offset): sample j is position offset + j of a source whose
        #: ``reader(field, lo, hi)`` gives the (times, values) of positions lo … hi - 1 as
        #: :func:`_read_points` would read them out of the samples (a Timeline's per-snapshot
        #: columns, ``kvdoctor.derive.engines.engine_series_at``); None: read the samples.
        self._source: tuple[SourceReader, int] | None = None


#: ``reader(field, lo, hi)`` → (times, values) of one field over positions lo … hi - 1 of a
#: source; ``reader(("histogram", name), lo, hi)`` → the histograms ``name`` there, of the
#: samples that carry it. None: read the samples instead.
SourceReader = Callable[[Any, int, int], Any]


def sourced_series(
    items: list[EngineMetrics], times: list[float | None], reader: SourceReader, offset: int
) -> Series:
    """A :class:`Series` of ``items`` (timestamps ``times``) whose field values ``reader``
    gives for positions ``offset …`` (columns kept across evaluations): what the helpers would
    read out of the samples, without reading them. ``reader`` may answer None (read them)."""
    out = Series(items)
    out._times, out._tail = times, (items[-1] if items else None)
    out._ordered = None not in times and all(map(operator.le, times, itertools.islice(times, 1, None)))  # type: ignore[arg-type]
    out._source = (reader, offset)
    return out


def _index(series: list[EngineMetrics]) -> tuple[list[float | None], bool]:
    """(timestamps, True when every sample is timed and they never decrease). O(1) for a
    :class:`Series` already indexed, else one pass."""
    if isinstance(series, Series):
        times = series._times
        if times is not None and len(times) == len(series) and (not series or series[-1] is series._tail):
            return times, series._ordered
    times = [m.timestamp for m in series]
    # map(operator.le) runs at C speed: the check costs about as much as the list above.
    ordered = None not in times and all(map(operator.le, times, itertools.islice(times, 1, None)))  # type: ignore[arg-type]
    if isinstance(series, Series):
        series._times, series._tail, series._ordered = times, (series[-1] if series else None), ordered
        series._cols, series._source = {}, None  # changed in place: read the samples
    return times, ordered


def indexed_times(series: list[EngineMetrics]) -> tuple[list[float | None], bool]:
    """The samples' timestamps (unix seconds, None where a sample has none; a shared list: do
    not modify) and whether every sample is timed and they never decrease. O(1) for a
    :class:`Series` already indexed."""
    return _index(series)


def _indexed(
    items: list[EngineMetrics],
    times: list[float | None],
    ordered: bool,
    source: tuple[SourceReader, int] | None = None,
) -> Series:
    out = Series(items)
    out._times, out._tail, out._ordered = times, (items[-1] if items else None), ordered
    out._source = source
    return out


def engine_series(timeline: Timeline, engine: str | None, model_name: str | None = None) -> Series:
    """One engine's scrapes from a Timeline, oldest first (``Snapshot.metrics`` per snapshot).

    ``engine`` is the ``engine`` label ("0", "1", …); None and "" both mean a page without one
    (V0). ``model_name`` narrows the match when one page serves several models. A scrape without
    its own timestamp takes its snapshot's (a copy; the timeline is not modified). Returns a
    :class:`Series` (a list). Raises nothing.
    """
    want = engine or None
    out = Series()
    for snap in timeline.snapshots:
        for m in snap.metrics:
            if (m.engine or None) != want:
                continue
            if model_name is not None and m.model_name != model_name:
                continue
            if m.timestamp is None and snap.timestamp is not None:
                m = dataclasses.replace(m, timestamp=snap.timestamp)
            out.append(m)
            break
    return out


def window(
    series: list[EngineMetrics],
    seconds: float = DEFAULT_WINDOW_S,
    now: float | None = None,
    *,
    shared: bool = False,
) -> Series:
    """The samples of the last ``seconds`` (inclusive) ending at ``now`` (default: the newest
    sample's timestamp), oldest first, as a :class:`Series` (a new list; with ``shared``, a
    :class:`Series` the window covers whole is returned itself: read it, do not modify it, and
    the helpers below reuse what was read out of it).

    Samples without a timestamp are skipped; if none has one, the window is the newest sample
    alone ("a single snapshot is a window of one"). A time-ordered series (what a Timeline
    gives) is cut by bisection on its indexed timestamps; any other order is filtered sample
    by sample, with the same result. Raises nothing.
    """
    return _window(series, seconds, now, copy=not shared)


def _window(series: list[EngineMetrics], seconds: float, now: float | None, *, copy: bool) -> Series:
    """:func:`window`; with ``copy`` False, a :class:`Series` the window covers whole is
    returned itself (the helpers below only read it, and reuse the values it has read out)."""
    if not series:
        return Series()
    times, ordered = _index(series)
    memo = series._cols if not copy and now is None and isinstance(series, Series) else None
    if memo is not None:
        # the shared windows of this series by length (float keys: no field or histogram key
        # is one); _WHOLE: the series itself (not held by itself)
        hit = memo.get(float(seconds))
        if hit is _WHOLE:
            return series  # type: ignore[return-value]
        if hit is not None:
            return hit  # type: ignore[no-any-return]
    if ordered:
        ts: list[Any] = times  # ordered: every sample is timed
        end = now if now is not None else ts[-1]
        lo = bisect.bisect_left(ts, end - seconds)
        hi = len(ts) if now is None else bisect.bisect_right(ts, end)
        src = series._source if isinstance(series, Series) else None
        if lo == 0 and hi == len(ts):
            if memo is not None:
                memo[float(seconds)] = _WHOLE
                return series  # type: ignore[return-value]
            return _indexed(series, ts, True, src)
        got = _indexed(series[lo:hi], ts[lo:hi], True, (src[0], src[1] + lo) if src is not None else None)
        if memo is not None:
            memo[float(seconds)] = got
        return got
    timed = [(m, t) for m, t in zip(series, times, strict=True) if t is not None]
    if not timed:
        return Series(series[-1:])
    end = now if now is not None else max(t for _, t in timed)
    start = end - seconds
    return Series(m for m, t in timed if start <= t <= end)


#: a memoised window that is the whole series.
_WHOLE: Any = object()

_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineMetrics))


def _getter(field: FieldRef) -> Callable[[EngineMetrics], float | None]:
    if callable(field):
        return field
    if field not in _FIELDS:
        raise ValueError(f"EngineMetrics has no field {field!r}")
    return operator.attrgetter(field)


def _points(series: list[EngineMetrics], field: FieldRef, seconds: float) -> tuple[list[float], list[float]]:
    """(times, values) of the samples of the window that have the value, oldest first. Read out
    of the samples once per window :class:`Series` and field name (a callable field is read
    each time: it is known by nothing stable)."""
    win = _window(series, seconds, None, copy=False)
    if not isinstance(field, str):
        return _read_points(win, _getter(field), field)
    cols = win._cols
    hit = cols.get(field)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    got = None
    if win._ordered and win._source is not None:
        # _window's answer is indexed: the source's columns, as _read_points would ask them
        reader, offset = win._source
        got = reader(field, offset, offset + len(win))
    if got is None:
        got = _read_points(win, _getter(field), field)
    cols[field] = got
    return got  # type: ignore[no-any-return]


def _read_points(
    win: Series, get: Callable[[EngineMetrics], float | None], field: FieldRef = ""
) -> tuple[list[float], list[float]]:
    times, ordered = _index(win)
    if ordered and win._source is not None and isinstance(field, str):
        reader, offset = win._source
        got = reader(field, offset, offset + len(win))
        if got is not None:
            return got
    raw = list(map(get, win))
    # The common case at C speed: every sample timed and every value present (v == v drops NaN).
    if ordered and None not in raw and all(map(operator.eq, raw, raw)):
        return list(times), list(map(float, raw))  # type: ignore[arg-type]
    # Untimed samples only come as a window of one, where time does not matter: 0.0 stands in.
    ts: list[float] = []
    vs: list[float] = []
    for m, v in zip(win, raw, strict=True):
        if v is not None and v == v:
            ts.append(m.timestamp if m.timestamp is not None else 0.0)
            vs.append(float(v))
    return ts, vs


def has_value(series: list[EngineMetrics], field: str) -> bool:
    """Whether any sample of ``series`` has ``field`` (an EngineMetrics field name, e.g.
    "spec_decode_num_drafts_total": not None; NaN counts as a value). A :class:`Series` of a
    Timeline's columns answers from a per-snapshot column, without reading the samples.
    Raises ValueError for an unknown field name."""
    get = _getter(field)
    if isinstance(series, Series) and series:
        _index(series)  # a list changed in place reads its samples
        if series._source is not None:
            reader, offset = series._source
            got = reader(("present", field), offset, offset + len(series))
            if got is not None:
                return bool(got)
    return any(get(m) is not None for m in series)


def sample_values(series: list[EngineMetrics], fn: Callable[[EngineMetrics], Any]) -> list[Any]:
    """``[fn(m) for m in series]``, one answer per sample in order (a shared list: do not modify
    it). ``fn`` is a function of the sample alone, known by its identity (a module-level
    function): a :class:`Series` of a Timeline's columns asks it once per snapshot in its life,
    and any Series once per window. Raises what ``fn`` raises."""
    if not isinstance(series, Series) or not series:
        return list(map(fn, series))
    _index(series)  # a list changed in place reads its samples
    cols = series._cols
    key = ("sample_fn", fn)
    hit = cols.get(key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    got = None
    if series._source is not None:
        reader, offset = series._source
        got = reader(key, offset, offset + len(series))
    if got is None:
        got = list(map(fn, series))
    cols[key] = got
    return got  # type: ignore[no-any-return]


def _increase(vals: list[float]) -> float:
    rest = itertools.islice(vals, 1, None)
    if not any(map(operator.lt, rest, vals)):
        # No reset: the sum of consecutive deltas, added in the same order as below (reduce
        # keeps the plain left-to-right float additions on every Python version).
        return functools.reduce(operator.add, map(operator.sub, itertools.islice(vals, 1, None), vals), 0.0)
    total = 0.0
    prev = vals[0]
    for b in itertools.islice(vals, 1, None):
        total += b - prev if b >= prev else b
        prev = b
    return total


def counter_increase(
    series: list[EngineMetrics], field: FieldRef, seconds: float = DEFAULT_WINDOW_S
) -> float | None:
    """Increase of a lifetime counter inside the window (Prometheus ``increase()`` without
    extrapolation to the window edges): the sum of sample-to-sample deltas, where a drop means
    the counter was reset (engine restart) and the new value counts as the increase.

    ``field`` e.g. "num_preemptions_total" (``vllm:num_preemptions_total``),
    "generation_tokens_total", "request_success_total". None with fewer than two samples that
    have the value. Raises ValueError for an unknown field name.
    """
    _, vals = _points(series, field, seconds)
    if len(vals) < 2:
        return None
    return _increase(vals)


def counter_rate(
    series: list[EngineMetrics], field: FieldRef, seconds: float = DEFAULT_WINDOW_S
) -> float | None:
    """Per-second rate of a lifetime counter over the window: :func:`counter_increase` divided
    by the time between the first and last sample used (Prometheus ``rate()`` semantics, reset
    aware, never the lifetime total). Preemptions per minute = ``60 * counter_rate(series,
    "num_preemptions_total")``. None with fewer than two samples or under
    :data:`MIN_RATE_SPAN_S` between the first and the last. Raises ValueError for an unknown
    field name.
    """
    times, vals = _points(series, field, seconds)
    if len(vals) < 2:
        return None
    dt = times[-1] - times[0]
    if dt < MIN_RATE_SPAN_S:
        return None
    return _increase(vals) / dt


# --------------------------------------------------------------------------- histograms


def _with_hist(series: list[EngineMetrics], name: str) -> list[HistogramData]:
    """The histograms ``name`` of the samples that carry it, oldest first (read out once per
    :class:`Series`: do not modify the list)."""
    cols = series._cols if isinstance(series, Series) and series._times is not None else None
    key = ("histogram", name)
    if cols is not None:
        hit = cols.get(key)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
    got: list[HistogramData] | None = None
    if isinstance(series, Series) and series._ordered and series._source is not None:
        reader, offset = series._source
        got = reader(key, offset, offset + len(series))  # type: ignore[assignment]
    if got is None:
        got = [m.histograms[name] for m in series if name in m.histograms]
    if cols is not None:
        cols[key] = got
    return got


def _hist_diff(prev: HistogramData, cur: HistogramData) -> HistogramData:
    """cur − prev bucket-wise; a reset (count fell, a bucket fell, bucket bounds changed) gives cur."""
    pb = dict(prev.buckets)
    bounds = list(map(_FIRST, cur.buckets))
    if cur.count < prev.count or set(pb) != set(bounds):
        return cur
    # c < pb[le] and c - pb[le] bucket by bucket, mapped at C speed
    counts, before = list(map(_SECOND, cur.buckets)), list(map(pb.__getitem__, bounds))
    if any(map(operator.lt, counts, before)):
        return cur
    return HistogramData(
        buckets=list(zip(bounds, map(operator.sub, counts, before), strict=True)),
        count=cur.count - prev.count,
        sum=cur.sum - prev.sum,
    )


def _no_reset(hs: list[HistogramData]) -> bool:
    """No sample of ``hs`` resets against the one before: the count (the +Inf bucket) never
    drops, the bucket bounds stay those of the first sample and no bucket ends below where it
    started. Under it :func:`_hist_diff` of consecutive samples never falls back to the current
    sample, so their deltas telescope to last − first. O(samples + buckets), at C speed."""
    counts = list(map(_COUNT, hs))
    if any(map(operator.lt, itertools.islice(counts, 1, None), counts)):
        return False
    n = len(hs[0].buckets)
    sizes = list(map(len, map(_BUCKETS, hs)))
    if sizes.count(n) != len(sizes):
        return False
    return _ends_no_reset(hs[0], hs[-1])


def histogram_step_ok(prev: HistogramData, cur: HistogramData) -> bool:
    """``cur`` does not reset against ``prev`` as :func:`_no_reset` checks neighbours: its
    count is not below ``prev``'s and it has as many buckets. A window whose every step is ok
    has no reset when :func:`_ends_no_reset` of its first and last sample holds too (a Timeline
    keeps these flags per snapshot: ``kvdoctor.derive.engines.engine_series_at``)."""
    return not cur.count < prev.count and len(cur.buckets) == len(prev.buckets)


def _ends_no_reset(first: HistogramData, last: HistogramData) -> bool:
    """The part of :func:`_no_reset` that reads only the window's ends: same bucket bounds, no
    bucket lower at the end than at the start."""
    if list(map(_FIRST, first.buckets)) != list(map(_FIRST, last.buckets)):
        return False
    # b >= a bucket by bucket, mapped at C speed
    return all(map(operator.ge, map(_SECOND, last.buckets), map(_SECOND, first.buckets)))


def _ends_delta(first: HistogramData, last: HistogramData) -> HistogramData | None:
    """``_hist_diff(first, last)`` when :func:`_ends_no_reset` holds for them, else None: the
    two in one pass over the buckets (each bucket's bound and count read once)."""
    fb, lb = first.buckets, last.buckets
    bounds = list(map(_FIRST, lb))
    if list(map(_FIRST, fb)) != bounds:
        return None
    counts, before = list(map(_SECOND, lb)), list(map(_SECOND, fb))
    if not all(map(operator.ge, counts, before)):
        return None
    if len(set(bounds)) != len(bounds):
        return _hist_diff(first, last)  # a bound repeated: _hist_diff's dict keeps its last count
    # Same bounds in the same order, none repeated, no bucket lower: _hist_diff's dict lookups
    # are these positions and none of its bucket checks fails.
    if last.count < first.count:
        return last
    return HistogramData(
        buckets=list(zip(bounds, map(operator.sub, counts, before), strict=True)),
        count=last.count - first.count,
        sum=last.sum - first.sum,
    )


def histogram_delta(
    series: list[EngineMetrics], name: str, seconds: float = DEFAULT_WINDOW_S
) -> HistogramData | None:
    """The observations a histogram gained inside the window: bucket-wise difference between
    consecutive samples summed over the window (reset aware), as cumulative buckets.

    ``name`` is the base name, e.g. "vllm:request_prompt_tokens" (tokens per finished request),
    "vllm:iteration_tokens_total" (tokens per engine step), "vllm:time_to_first_token_seconds".
    None with fewer than two samples carrying it: a lifetime histogram is not "recent" (see
    :func:`histogram_latest`). Raises nothing.
    """
    win = _window(series, seconds, None, copy=False)
    cols = win._cols if win._times is not None else None
    key = ("histogram_delta", name)
    if cols is not None:
        hit = cols.get(key, _NO_MEMO)
        if hit is not _NO_MEMO:
            return hit  # type: ignore[no-any-return]
    got = _histogram_delta(win, name)
    if cols is not None:
        cols[key] = got
    return got


#: a memo entry not made yet (None is an answer).
_NO_MEMO: Any = object()


def _histogram_delta(win: Series, name: str) -> HistogramData | None:
    if win._ordered and win._source is not None and len(win) >= 2:
        # The source knows the first and last histograms of a window whose every step is ok
        # (each pair of neighbours checked once in its life): the window's other samples are
        # not read. None: some sample lacks it, or a step resets: every sample is read below.
        reader, offset = win._source
        ends = reader(("histogram_ends", name), offset, offset + len(win))
        if ends is not None:
            got = _ends_delta(ends[0], ends[1])
            if got is not None:
                return got
    hs = _with_hist(win, name)
    if len(hs) < 2:
        return None
    if _no_reset(hs):
        # Consecutive deltas telescope: without a reset the window's increase is last − first.
        return _hist_diff(hs[0], hs[-1])
    acc: HistogramData | None = None
    for prev, cur in itertools.pairwise(hs):
        d = _hist_diff(prev, cur)
        if acc is None:
            acc = HistogramData(buckets=list(d.buckets), count=d.count, sum=d.sum)
            continue
        ab = dict(acc.buckets)
        if set(ab) != {le for le, _ in d.buckets}:
            acc = HistogramData(buckets=list(d.buckets), count=d.count, sum=d.sum)  # bounds changed
            continue
        acc = HistogramData(
            buckets=[(le, ab[le] + c) for le, c in d.buckets],
            count=acc.count + d.count,
            sum=acc.sum + d.sum,
        )
    return acc


def histogram_latest(series: list[EngineMetrics], name: str) -> HistogramData | None:
    """The newest sample's lifetime histogram ``name`` (since engine start), for callers that
    accept it when no window delta exists (a single scrape). None when absent."""
    for m in reversed(series):
        h = m.histograms.get(name)
        if h is not None:
            return h
    return None


_COUNT = operator.attrgetter("count")
_BUCKETS = operator.attrgetter("buckets")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)

#: (histogram, its _monotonic buckets) of the last call: one window's quantiles and largest
#: bucket ask about the same histogram in turn. Holds the histogram (its id is not reused).
_MONOTONIC_LAST: tuple[HistogramData | None, list[tuple[float, float]], list[float]] = (None, [], [])


def _monotonic_counts(h: HistogramData) -> list[float]:
    """The counts of :func:`_monotonic`'s buckets, in order (shared: do not modify)."""
    last = _MONOTONIC_LAST  # one read: another thread may replace it
    if last[0] is h:
        return last[2]
    return list(map(_SECOND, _monotonic(h)))


def _monotonic(h: HistogramData) -> list[tuple[float, float]]:
    """Sorted cumulative buckets with +Inf last, counts forced non-decreasing (as Prometheus
    does for float noise). Shared with the next caller asking about ``h``: do not modify."""
    global _MONOTONIC_LAST
    last_h, last_out, _ = _MONOTONIC_LAST
    if last_h is h:
        return last_out
    buckets = sorted(h.buckets)
    if not buckets or not math.isinf(buckets[-1][0]):
        last = buckets[-1][1] if buckets else 0.0
        buckets.append((math.inf, max(h.count, last)))
    # hi = max(hi, c) from 0.0, bucket after bucket (accumulate calls max(hi, c) in that order)
    his = itertools.accumulate([c for _, c in buckets], max, initial=0.0)
    next(his)
    counts = list(his)
    out = list(zip([le for le, _ in buckets], counts, strict=True))
    _MONOTONIC_LAST = (h, out, counts)
    return out


def histogram_quantile(h: HistogramData, q: float) -> float | None:
    """The ``q``-quantile (0..1) of a histogram, Prometheus ``histogram_quantile`` style: find
    the bucket holding rank q × count and interpolate linearly inside it (lower bound 0 for the
    first bucket). A rank in the +Inf bucket returns the upper bound of the last finite bucket.

    Units as the metric's (tokens, seconds). None when the histogram is empty or has no finite
    bucket. Raises ValueError when ``q`` is outside 0..1.
    """
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"quantile must be within 0..1, got {q}")
    buckets = _monotonic(h)
    total = buckets[-1][1]
    if total <= 0 or len(buckets) < 2:
        return None
    rank = q * total
    i = bisect.bisect_left(_monotonic_counts(h), rank)
    i = min(i, len(buckets) - 1)
    if i == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[i]
    if i == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = buckets[i - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return lower
    return lower + (upper - lower) * ((rank - below) / in_bucket)


def histogram_max_bucket(h: HistogramData) -> float | None:
    """Upper bound of the highest non-empty finite bucket: the largest observation is at most
    this. When observations lie only above the last finite bound (+Inf bucket), that bound is
    returned (the largest observation is at least it; consistent with
    :func:`histogram_quantile`). None when the histogram is empty. Raises nothing.
    """
    buckets = _monotonic(h)
    if buckets[-1][1] <= 0 or len(buckets) < 2:
        return None
    best: float | None = None
    prev = 0.0
    for le, c in buckets:
        if c > prev:
            best = le
        prev = c
    if best is None:
        return None
    if math.isinf(best):
        return buckets[-2][0]
    return best


# --------------------------------------------------------------------------- gauges


@dataclass(frozen=True)
class GaugeStats:
    """Summary of a gauge over a window, in the gauge's unit (e.g. ``kv_cache_usage`` fraction
    from ``vllm:kv_cache_usage_perc``, ``num_requests_waiting`` requests). ``n`` samples."""

    min: float
    max: float
    mean: float
    last: float
    first: float
    n: int


def gauge_stats(
    series: list[EngineMetrics], field: FieldRef, seconds: float = DEFAULT_WINDOW_S
) -> GaugeStats | None:
    """min / max / mean / first / last of a gauge over the window (samples lacking the value are
    skipped). A single sample is a window of one. None when no sample has it. Raises ValueError
    for an unknown field name."""
    _, vals = _points(series, field, seconds)
    if not vals:
        return None
    return GaugeStats(
        min=min(vals), max=max(vals), mean=sum(vals) / len(vals), last=vals[-1], first=vals[0], n=len(vals)
    )


def slope(series: list[EngineMetrics], field: FieldRef, seconds: float = DEFAULT_WINDOW_S) -> float | None:
    """Least-squares slope of a value over the window, in its unit per second (e.g. waiting
    requests per second, KV usage fraction per second). None with fewer than two samples at
    distinct times. Raises ValueError for an unknown field name."""
    times, ys = _points(series, field, seconds)
    if len(ys) < 2:
        return None
    t0 = times[0]
    xs = [t - t0 for t in times]
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    dx = [x - mx for x in xs]
    # The same float operations as sum((x - mx) ** 2 …) and sum((x - mx) * (y - my) …), in
    # the same order, mapped at C speed.
    sxx = sum(map(pow, dx, itertools.repeat(2)))
    if sxx == 0:
        return None
    return sum(map(operator.mul, dx, [y - my for y in ys])) / sxx
