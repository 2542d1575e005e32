"""vLLM's ``/metrics`` page (Prometheus text format): parse, load a bundle's scrapes, scrape live.

Everything here follows reference/vllm-facts.md §1 (names, labels, rename history) and §7
("Scraping metrics"):

- one :class:`~kvdoctor.facts.EngineMetrics` per ``engine`` label value (data-parallel engines of
  one API server) and per ``model_name``; V0 pages have no ``engine`` label (engine None);
- new names preferred, old ones as fallbacks (``vllm:kv_cache_usage_perc`` over
  ``vllm:gpu_cache_usage_perc``, ``vllm:prefix_cache_*`` over ``vllm:gpu_prefix_cache_*``,
  ``vllm:inter_token_latency_seconds`` over ``vllm:time_per_output_token_seconds``); both are
  emitted by 0.9.2–0.10.x and only the new one is read then, so nothing is counted twice;
- counters summed over their extra labels (``request_success_total`` over ``finished_reason``);
- histograms by base name (``vllm:iteration_tokens_total`` is a histogram whose base name ends
  in ``_total``), cumulative buckets sorted with +Inf last;
- ``vllm:cache_config_info`` labels as strings;
- no ``vllm:*`` but ``http_*`` series → stats disabled (``--disable-log-stats``).

The page is first cut down, with one C-speed regex pass, to the sample lines of the families
kvdoctor reads (those of :data:`READ_HISTOGRAMS` and the gauges/counters below; no ``# HELP`` /
``# TYPE``, ``python_*``, ``process_*``, ``_created``, ``http_*``), and only those are split
into name, labels and value by a small bounded parser of the text exposition format
(:func:`_parse_sample`, compared in the tests with prometheus_client's parser over every page in
tests/data; ~3-7 µs a line where the library takes ~40), a line seen on the previous page
reused as read (``bench/sidecar.py`` prints both against the library).
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from kvdoctor.facts import EngineMetrics, HistogramData, SourceError
from kvdoctor.redact import redact_url_credentials
from kvdoctor.sources.limits import MAX_ENGINES, MAX_HTTP_BYTES, guarded, read_text
from kvdoctor.units import in_range

if TYPE_CHECKING:  # httpx costs ~60 ms to import: only the HTTP functions load it
    import httpx

__all__ = [
    "DISPLAY_HISTOGRAMS",
    "READ_HISTOGRAMS",
    "load_metrics_dir",
    "parse_metrics",
    "probe_endpoints",
    "read_sample_names",
    "scrape",
]


#: Histograms kvdoctor reads by default (vllm-facts.md §1.2): request lengths for the
#: long-request and concurrency rules (spec/rules.md), iteration tokens for prefill bursts.
#: Only these by default: each histogram is 15-25 lines to parse.
READ_HISTOGRAMS: tuple[str, ...] = (
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
)
#: READ_HISTOGRAMS plus the latencies a screen shows (``parse_metrics(histograms=…)``).
#: ``vllm:time_per_output_token_seconds`` is the pre-0.10.2 inter-token latency (§1.5).
DISPLAY_HISTOGRAMS: tuple[str, ...] = READ_HISTOGRAMS + (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)

# Gauge/counter sample name → EngineMetrics field; the first name listed for a field wins when
# both generations are on the page (vllm-facts.md §1.5, §7).
_SCALARS: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_swapped": ("vllm:num_requests_swapped",),
    "num_preemptions_total": ("vllm:num_preemptions_total",),
    "prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "generation_tokens_total": ("vllm:generation_tokens_total",),
    "request_success_total": ("vllm:request_success_total",),
    "prefix_cache_queries_total": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "spec_decode_num_drafts_total": ("vllm:spec_decode_num_drafts_total",),
}
_V0_ONLY = ("vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc")
_INFO = "vllm:cache_config_info"
#: ``vllm:engine_sleep_state{sleep_state=…}``: kept per label value, not summed (catalogue 2 §3.5).
_SLEEP = "vllm:engine_sleep_state"
_ITL, _ITL_OLD = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
_SCALAR_NAMES = frozenset(n for names in _SCALARS.values() for n in names) | frozenset(_V0_ONLY)
_HTTP_RE = re.compile(r"^http_[a-zA-Z0-9_:]*[{ \t]", re.M)
_VLLM_RE = re.compile(r"^vllm:", re.M)
_SAMPLE_LIKE_RE = re.compile(r"^(?:#|[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?[ \t]+\S+)", re.M)
_MAX_PAGE_CHARS = 64 * 1024 * 1024
#: scrape files read from one ``metrics/`` directory (a day at one scrape a second).
MAX_SCRAPE_FILES = 100_000
# Every vllm:* sample line except the _created companions (reading all histograms).
_ALL_VLLM_RE = re.compile(r"\n(vllm:[a-zA-Z0-9_:]*(?<!_created)[{ \t][^\n]*)")

#: longest sample line read (vLLM's longest, ``cache_config_info``, is ~1 KB); longer ones are
#: dropped as unparsable, so no regex ever runs over more.
_MAX_LINE_CHARS = 16 * 1024

# One sample line of the text exposition format 0.0.4 (what vLLM serves; an OpenMetrics
# exemplar after it is ignored): name, {labels}, value, optional timestamp (ms). Every
# repetition is delimited (a comma between label terms, a quote-free or escaped character in a
# value, whitespace between value and timestamp) and the match is anchored, so a failing
# line costs one linear pass.
_LNAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
_QUOTED = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # "unrolled": runs of plain characters at C speed
_TERM = rf"[ \t]*{_LNAME}[ \t]*=[ \t]*{_QUOTED}[ \t]*"
# An OpenMetrics exemplar, ` # {labels} value [timestamp]`: read past, never anything else
# after a `#` (prometheus_client and Prometheus refuse `1 #` and `1 #junk`).
_EXEMPLAR = (
    rf"[ \t]+#[ \t]+\{{(?:{_TERM}(?:,{_TERM})*(?:,[ \t]*)?|[ \t]*)\}}[ \t]+[^ \t#]+(?:[ \t]+[^ \t#]+)?"
)
_SAMPLE_RE = re.compile(
    rf"\A([a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:[ \t]*\{{((?:{_TERM}(?:,{_TERM})*(?:,[ \t]*)?)?|[ \t]*)\}}[ \t]*|[ \t]+)"
    rf"([^ \t#]+)(?:[ \t]+([^ \t#]+))?(?:{_EXEMPLAR})?"
)
# (a name starts after no name character: a search never rescans a run of them)
_LABEL_RE = re.compile(rf'(?<![a-zA-Z0-9_])({_LNAME})[ \t]*=[ \t]*"([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
# Only these three escapes exist in label values; any other backslash stays as written.
_ESCAPE_RE = re.compile(r'\\[\\n"]')
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}

_Parsed = tuple[str, dict[str, str], float]


def _parse_sample(line: str) -> _Parsed:
    """One sample line → (name, labels, value); raises ValueError for a line that is not one.

    The text format as Prometheus reads it (and prometheus_client's parser, which the tests
    compare this with over every page in tests/data): labels ``name="value"`` with ``\\``,
    ``\"`` and ``\n`` escapes, an optional trailing comma, a Go float value (``+Inf``,
    ``-Inf``, ``NaN``, exponents; no ``_``), an optional integer timestamp (ignored: the
    scrape's time is used), an exemplar ignored. Lines are bounded (:data:`_MAX_LINE_CHARS`).
    """
    if len(line) > _MAX_LINE_CHARS:
        raise ValueError("line too long")
    m = _SAMPLE_RE.fullmatch(line)
    if m is None:
        raise ValueError("not a sample line")
    name, body, value, stamp = m.groups()
    labels: dict[str, str] = {}
    if body:
        n = 0
        for lm in _LABEL_RE.finditer(body):
            k, v = lm.groups()
            if k.startswith("__"):
                raise ValueError("reserved label name")  # __name__ and kin: Prometheus's own
            labels[k] = _ESCAPE_RE.sub(lambda e: _ESCAPES[e.group(0)], v) if "\\" in v else v
            n += 1
        if n != len(labels):
            raise ValueError("duplicate label name")
    try:
        if "_" in value:
            raise ValueError
        if stamp is not None:
            float(stamp)  # a timestamp that is not a number makes the line bad, as for Prometheus
        number = float(value)
    except ValueError:
        raise ValueError("not a number") from None  # float()'s message would quote the line
    return name, labels, number


def read_sample_names(histograms: Collection[str] = READ_HISTOGRAMS) -> list[str]:
    """The sample names :func:`parse_metrics` reads with ``histograms`` (sorted): the gauges and
    counters, ``vllm:cache_config_info``, ``vllm:engine_sleep_state``, and each histogram's
    ``_bucket``/``_count``/``_sum``. Fleet mode asks Prometheus for these only."""
    hists = [h for h in histograms if h.startswith("vllm:")]
    words = set(_SCALAR_NAMES | {_INFO, _SLEEP}) | {
        h + sfx for h in hists for sfx in ("_bucket", "_count", "_sum")
    }
    return sorted(words)


@functools.lru_cache(maxsize=16)
def _filter_re(histograms: tuple[str, ...]) -> re.Pattern[str]:
    """The regex that keeps only the sample lines of the families we read (applied to
    ``"\\n" + text``; a literal first character keeps the scan at C speed). The names are one
    trie (:func:`_trie`): a line of a family we skip fails after a character or two."""
    words = [n[len("vllm:") :] for n in read_sample_names(histograms)]
    return re.compile(r"\n(vllm:" + _trie(words) + r"[{ \t][^\n]*)")


def _trie(words: list[str]) -> str:
    """A regex matching exactly ``words`` (one of them, whole), as a trie of their characters:
    ``num_(?:preemptions_total|requests_(?:running|waiting))``."""
    root: dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def emit(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + emit(node[ch]) for ch in sorted(k for k in node if k)]
        if not alts:
            return ""
        if len(alts) == 1 and "" not in node:
            return alts[0]
        return "(?:" + "|".join(alts) + ")" + ("?" if "" in node else "")

    return emit(root) if words else "(?!)"


# What parse_metrics does with a sample, decided once per line (see _Sample).
_K_OTHER, _K_INFO, _K_SLEEP, _K_SCALAR, _K_BUCKET, _K_COUNT, _K_SUM = range(7)

#: A parsed sample line and what it is: (name, labels, value, kind, (engine, model_name), the
#: histogram base name or sleep_state, the bucket's ``le`` as a number). All of it follows from
#: the line alone, so a line seen on the previous page is reused whole.
_Sample = tuple[str, dict[str, str], float, int, tuple[str | None, str | None], str, float | None]


def _classify(parsed: _Parsed) -> _Sample:
    name, labels, value = parsed
    key = (labels.get("engine"), labels.get("model_name"))
    if "@" in (key[1] or "") or "@" in (key[0] or ""):
        # a served name that is a URL with credentials becomes engines[].id in every output
        key = tuple(redact_url_credentials(k) if k else k for k in key)  # type: ignore[assignment]
    base, le = "", None
    if name == _INFO:
        kind = _K_INFO
    elif name == _SLEEP:
        kind, base = _K_SLEEP, labels.get("sleep_state") or ""
    elif name in _SCALAR_NAMES:
        kind = _K_SCALAR
    elif name.endswith("_bucket") and "le" in labels:
        kind, base, le = _K_BUCKET, name[: -len("_bucket")], _num(labels["le"])
    elif name.endswith("_count"):
        kind, base = _K_COUNT, name[: -len("_count")]
    elif name.endswith("_sum"):
        kind, base = _K_SUM, name[: -len("_sum")]
    else:
        kind = _K_OTHER  # a family we do not read (reading every histogram: any other series)
    return name, labels, value, kind, key, base, le


#: The last page's parsed sample lines, keyed by the exact line: a page scraped every second
#: repeats most of its lines (cache_config_info, idle buckets, constant gauges). Replaced by
#: each page's own lines, so it never holds more than one page (bounded, no growth).
_LINE_CACHE: dict[str, _Sample] = {}
#: The last page's samples keyed by the part of their line before the value (the line up to
#: its last space), for lines whose value is their last token: a busy engine's counters and
#: buckets change value every scrape, their names and labels never. Bounded like _LINE_CACHE.
_HEAD_CACHE: dict[str, _Sample] = {}


#: The last page's kept lines up to their values (in order) and its samples, when every line
#: parsed and had its value last, with the _HEAD_CACHE made with them: a page whose kept lines
#: have those same heads in the same order (a busy engine's next page: every value moved, no
#: series came or went) reads as those samples with its own values. None, or replaced, as the
#: caches are.
_LAST_PAGE: tuple[dict[str, _Sample], list[str], list[_Sample], int] | None = None


def _value_is_last(line: str) -> bool:
    """The line's value is its last token (no timestamp, no exemplar after it)."""
    m = _SAMPLE_RE.fullmatch(line)
    return m is not None and m.end(3) == len(line)


def _parse_lines(text: str, lines: list[str]) -> tuple[list[_Sample], int | None, str]:
    """Parse the kept sample lines (:func:`_parse_sample` and :func:`_classify`, or the
    previous page's reading of the same line, or of the same line but for its value); bad
    ones are dropped.

    Returns (samples in line order, the first bad line's number in ``text`` or None, its
    reason)."""
    global _LINE_CACHE, _HEAD_CACHE, _LAST_PAGE
    # another sampler thread may replace them meanwhile: only hits are lost
    prev, prev_heads, last = _LINE_CACHE, _HEAD_CACHE, _LAST_PAGE
    split = [ln.rpartition(" ") for ln in lines]
    line_heads = [h for h, _, _ in split]
    if last is not None and last[0] is prev_heads and last[1] == line_heads:
        samples = _same_heads(last, [v for _, _, v in split])
        if samples is not None:
            return samples, None, ""
    got: dict[str, _Sample] = {}
    heads: dict[str, _Sample] = {}
    out: list[_Sample] = []
    bad_line, reason = None, ""
    for ln, (head, _, value) in zip(lines, split, strict=True):
        hit = got.get(ln) or prev.get(ln)
        if hit is None and head and len(ln) <= _MAX_LINE_CHARS:
            known = prev_heads.get(head)
            # The same name and labels as a line of the last page whose value was its last
            # token: only the value is new. It must be what the full parse would read there: a
            # Go float token (no tab, '#' or '_', which float() would take or split on).
            if known is not None and value and not ("\t" in value or "#" in value or "_" in value):
                try:
                    number = float(value)
                except ValueError:
                    pass
                else:
                    hit = (known[0], known[1], number, *known[3:])
        if hit is None:
            try:
                hit = _classify(_parse_sample(ln))
            except ValueError as exc:
                if bad_line is None:
                    pos = text.find(ln) if len(ln) <= _MAX_LINE_CHARS else -1
                    bad_line = _line_no(text, pos) if pos >= 0 else None
                    reason = f"unparsable sample line ({exc})"
                continue
            if head and _value_is_last(ln):
                heads[head] = hit
        elif head in prev_heads:
            heads[head] = hit
        got[ln] = hit
        out.append(hit)
    _LINE_CACHE, _HEAD_CACHE = got, heads
    if bad_line is None and all(h in heads for h in line_heads):
        _LAST_PAGE = (heads, line_heads, out, max(map(len, line_heads), default=0))
    else:
        _LAST_PAGE = None
    return out, bad_line, reason


def _same_heads(
    last: tuple[dict[str, _Sample], list[str], list[_Sample], int], values: list[str]
) -> list[_Sample] | None:
    """The samples of a page whose kept lines are ``last``'s heads, in order, each followed by
    one of ``values``: ``last``'s samples with these values, or None when a value is not what
    the full parse would read there (a Go float token: no tab, '#' or '_', which float() would
    take or split on; the line not past :data:`_MAX_LINE_CHARS`)."""
    joined = " ".join(values)
    if "\t" in joined or "#" in joined or "_" in joined or "" in values:
        return None
    if last[3] + 1 + max(map(len, values), default=0) > _MAX_LINE_CHARS:
        return None
    try:
        numbers = list(map(float, values))
    except ValueError:
        return None
    return [(s[0], s[1], n, s[3], s[4], s[5], s[6]) for s, n in zip(last[2], numbers, strict=True)]


def _line_no(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@dataclass
class _Acc:
    """Accumulates one engine's samples before they become an EngineMetrics."""

    model_name: str | None
    engine: str | None
    scalars: dict[str, float] = field(default_factory=dict)
    # histogram base name → {le: cumulative count}; _count and _sum by base name
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    # vllm:engine_sleep_state: sleep_state label → value
    sleep: dict[str, float] = field(default_factory=dict)


def _num(v: Any) -> float | None:
    # a bucket's ``le`` bound: "+Inf" is one (the last bucket), NaN is none
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _histogram(acc: _Acc, base: str) -> HistogramData:
    b = acc.buckets.get(base, {})
    buckets = sorted(b.items())
    count = acc.counts.get(base)
    if buckets and not math.isinf(buckets[-1][0]):
        # Truncated page: the +Inf bucket is lost; _count is the same number.
        buckets.append((math.inf, max(count or 0.0, buckets[-1][1])))
    if count is None:
        count = buckets[-1][1] if buckets else 0.0
    return HistogramData(buckets=buckets, count=count, sum=acc.sums.get(base, 0.0))


@guarded("origin", 1)
def parse_metrics(
    text: str,
    origin: str = "",
    timestamp: float | None = None,
    *,
    histograms: Collection[str] | None = READ_HISTOGRAMS,
) -> list[EngineMetrics]:
    """Parse one vLLM ``/metrics`` page into one EngineMetrics per (engine, model_name).

    ``text`` is Prometheus text exposition (vllm-facts.md §1.1, §1.6); ``origin`` (file path or
    URL) goes into errors; ``timestamp`` (unix seconds of the scrape) is copied into every item.
    ``histograms`` names the histogram families to read (base names, default
    :data:`READ_HISTOGRAMS`; :data:`DISPLAY_HISTOGRAMS` adds latencies; ``None`` reads every
    ``vllm:*`` histogram). Each histogram costs ~0.1 ms on a page seen for the first time.

    Values keep the metric's units: ``kv_cache_usage`` is a fraction 0..1 (the gauge already is,
    despite "perc"), counters are lifetime totals, latencies seconds, lengths tokens. Items come
    in order of first appearance on the page. A page with ``http_*`` series and no ``vllm:*``
    gives one item with ``stats_enabled=False``.

    Bad lines are dropped and the rest is used. Raises SourceError("empty /metrics page") on
    empty text, and SourceError (origin, line, reason) when nothing at all could be read (binary
    data, HTML, a page without any vLLM or HTTP metrics).
    """
    if not text or not text.strip():
        raise SourceError("empty /metrics page", origin=origin or None)
    if len(text) > _MAX_PAGE_CHARS:
        text = text[:_MAX_PAGE_CHARS]
    line_re = _ALL_VLLM_RE if histograms is None else _filter_re(tuple(sorted(set(histograms))))
    lines = [ln.rstrip() for ln in line_re.findall("\n" + text)]
    samples, bad_line, reason = _parse_lines(text, lines) if lines else ([], None, "")

    if not samples:
        if _HTTP_RE.search(text) is not None and _VLLM_RE.search(text) is None:
            # --disable-log-stats: the instrumentator's http_* only (vllm-facts.md §1.1).
            return [EngineMetrics(timestamp=timestamp, stats_enabled=False)]
        if bad_line is not None:
            raise SourceError(f"no vLLM metric could be read: {reason}", origin=origin or None, line=bad_line)
        raise SourceError(_why_unreadable(text), origin=origin or None, line=1)

    hist_names = set(histograms) if histograms is not None else None
    accs: dict[tuple[str | None, str | None], _Acc] = {}
    infos: list[dict[str, str]] = []
    seen: set[str] = set()
    for name, labels, value, kind, key, base, le in samples:
        if kind == _K_INFO:
            infos.append(labels)
            continue
        if kind == _K_OTHER or not in_range(value):
            # NaN (no reading), and ±Inf or 1e309 as a sample value: corrupt, as unknown (no
            # later arithmetic overflows; kvdoctor.units.MAX_QUANTITY)
            continue
        acc = accs.get(key)
        if kind == _K_SLEEP:
            if acc is None:
                acc = accs[key] = _Acc(model_name=key[1], engine=key[0])
            acc.sleep[base] = value
            continue
        if acc is None:
            if len(accs) >= MAX_ENGINES:
                continue  # a page with thousands of engine labels is not a vLLM server's
            acc = accs[key] = _Acc(model_name=key[1], engine=key[0])
        seen.add(name)
        if kind == _K_SCALAR:
            # Counters and gauges summed over their extra labels (finished_reason, …).
            acc.scalars[name] = acc.scalars.get(name, 0.0) + value
        elif kind == _K_BUCKET:
            if le is not None:
                b = acc.buckets.get(base)
                if b is None:
                    b = acc.buckets[base] = {}
                b[le] = b.get(le, 0.0) + value
        elif kind == _K_COUNT:
            acc.counts[base] = acc.counts.get(base, 0.0) + value
        else:
            acc.sums[base] = acc.sums.get(base, 0.0) + value

    if not accs:
        # Only cache_config_info lines (e.g. before the engine's first stats): one item per engine.
        for lab in infos:
            eng = lab.get("engine")
            accs.setdefault((eng, None), _Acc(model_name=None, engine=eng))

    if any(n in seen for n in _V0_ONLY):
        generation: str | None = "v0"
    elif "vllm:kv_cache_usage_perc" in seen or any(k[0] is not None for k in accs):
        generation = "v1"
    else:
        generation = None

    out: list[EngineMetrics] = []
    for (engine, model_name), acc in accs.items():
        em = EngineMetrics(
            timestamp=timestamp, model_name=model_name, engine=engine, engine_generation=generation
        )
        for fld, names in _SCALARS.items():
            for n in names:
                if n in acc.scalars:
                    setattr(em, fld, acc.scalars[n])
                    break
        # A *_count without buckets is a histogram only when it was asked for by name.
        bases = set(acc.buckets) | {c for c in acc.counts if hist_names is not None and c in hist_names}
        for base in sorted(bases):
            em.histograms[base] = _histogram(acc, base)
        em.sleep_state = dict(acc.sleep)
        if _ITL not in em.histograms and _ITL_OLD in em.histograms:
            # Before 0.10.2 the inter-token latency was time_per_output_token (§1.5, §7).
            em.histograms[_ITL] = em.histograms[_ITL_OLD]
        for lab in infos:
            # Old pages have no engine label on cache_config_info: it applies to every engine.
            eng = lab.get("engine")
            if eng is None or eng == engine:
                em.cache_config = {k: v for k, v in lab.items() if k != "engine"}
        out.append(em)
    return out


def _why_unreadable(text: str) -> str:
    head = text[:4096]
    if "\x00" in head or sum(not (c.isprintable() or c in "\r\n\t") for c in head) > len(head) // 10:
        return "not Prometheus text: binary data"
    first = next((ln.strip() for ln in head.splitlines() if ln.strip()), "")
    if first.startswith("<") or first.startswith("{") or first.startswith("["):
        return "not Prometheus text: starts like HTML or JSON"
    if _SAMPLE_LIKE_RE.search(head):
        return "no vllm:* or http_* metrics on the page: not a vLLM /metrics endpoint"
    return "not Prometheus text: no metric sample lines"


@guarded("path", 0)
def load_metrics_dir(
    path: str | os.PathLike[str],
    *,
    histograms: Collection[str] | None = READ_HISTOGRAMS,
    confine_to: str | os.PathLike[str] | None = None,
) -> tuple[list[tuple[float, list[EngineMetrics]]], list[SourceError]]:
    """Read a bundle's ``metrics/`` directory: one scrape per ``<unix-seconds>.txt`` file
    (spec/bundle.md), oldest first.

    Returns ``(series, errors)``: ``series`` is [(unix seconds, [EngineMetrics, …])] sorted by
    time, each EngineMetrics with that timestamp; ``errors`` holds one SourceError per file that
    could not be used (bad name, unreadable, nothing parsable) — the other files are still used.
    ``confine_to`` (a bundle directory): a file whose symlink leads out of it is refused, not
    read. At most :data:`MAX_SCRAPE_FILES` files are read (the newest by name are kept).
    Raises SourceError when ``path`` is not a readable directory.
    """
    p = os.fspath(path)
    try:
        names = os.listdir(p)
    except OSError as exc:
        raise SourceError(f"cannot read metrics directory: {exc.strerror or exc}", origin=p) from None
    series: list[tuple[float, list[EngineMetrics]]] = []
    errors: list[SourceError] = []
    root = os.path.realpath(confine_to) if confine_to is not None else None
    txt = sorted(n for n in names if n.endswith(".txt"))
    if len(txt) > MAX_SCRAPE_FILES:
        errors.append(SourceError(f"more than {MAX_SCRAPE_FILES} scrapes: the oldest skipped", origin=p))
        txt = txt[-MAX_SCRAPE_FILES:]
    for name in txt:
        full = os.path.join(p, name)
        if root is not None and os.path.islink(full):
            real = os.path.realpath(full)
            if os.path.commonpath([root, real]) != root:
                errors.append(SourceError("a symlink out of the bundle: not followed", origin=full))
                continue
        if not os.path.isfile(full):
            continue
        try:
            ts = float(name[: -len(".txt")])
            if not math.isfinite(ts):
                raise ValueError
        except ValueError:
            errors.append(SourceError("file name is not <unix-seconds>.txt", origin=full))
            continue
        try:
            text = read_text(full, _MAX_PAGE_CHARS)
            series.append((ts, parse_metrics(text, origin=full, timestamp=ts, histograms=histograms)))
        except SourceError as exc:
            errors.append(exc)
    series.sort(key=lambda item: item[0])
    return series, errors


# --------------------------------------------------------------------------- live HTTP


def _redact_url(url: str) -> str:
    """Drop the userinfo (user:password@) from a URL before it goes into a message; a URL that
    does not parse (a password with "/" in it, a bad port) still loses its password."""
    from kvdoctor.redact import redact_url_credentials

    url = redact_url_credentials(url[:4096])
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for ch in "/?#":
        k = rest.find(ch)
        if k >= 0:
            end = min(end, k)
    at = rest.rfind("@", 0, end) if "@" in rest[:end] else -1
    if at < 0:
        # a password with "/" in it puts its "@" after the first "/": the last "@" still ends it
        at = rest.rfind("@")
        if at < 0 or "***" not in rest[:at]:
            return url
    return f"{scheme}://{rest[at + 1 :]}"


def _metrics_url(url: str) -> str:
    """``http://host:8000`` → ``http://host:8000/metrics``; a URL with a path is kept."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urlunsplit(parts)


def _http_error(method_url: str, exc: httpx.HTTPError, timeout: float) -> SourceError:
    import httpx

    msg = str(exc)
    if isinstance(exc, httpx.TimeoutException):
        why = f"timed out after {timeout:g} s"
    elif isinstance(exc, httpx.ConnectError):
        # the OS's reason only ("[Errno -2] Name or service not known"), nothing the peer sent
        errno_text = msg if msg.startswith("[Errno") and len(msg) < 120 else "error"
        why = "connection refused" if "refused" in msg.lower() else f"cannot connect ({errno_text})"
    else:
        # a protocol error's text quotes the bytes (headers) the server sent: the type only
        why = f"{type(exc).__name__} (the server's response is not valid HTTP)"
    return SourceError(f"{method_url}: {why}")


class _BoundedDecoder:
    """Content-Encoding (identity, gzip, deflate) decoded with a cap on each call's output:
    :meth:`decode` returns at most ``limit`` bytes and sets :attr:`pending` when the input held
    more, so a gzip bomb costs the cap, not its inflated size. Raises SourceError for another
    encoding (we ask for these two only) or a corrupt stream."""

    def __init__(self, encoding: str, label: str) -> None:
        import zlib

        codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        self._label = label
        self.pending = False
        self._z: Any = None
        if not codings:
            return
        if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
            raise SourceError(f"{label}: unsupported Content-Encoding")
        # wbits 47: a gzip or zlib header, told apart by the stream itself (deflate is zlib).
        self._z = zlib.decompressobj(47)
        self._zerror = zlib.error

    def decode(self, data: bytes, limit: int) -> bytes:
        """Up to ``limit`` (> 0) decoded bytes of ``data``."""
        if self._z is None:
            if len(data) > limit:
                self.pending = True
                return data[:limit]
            return data
        try:
            out: bytes = self._z.decompress(data, max(1, limit))
        except self._zerror:
            raise SourceError(f"{self._label}: corrupt compressed body") from None
        if self._z.unconsumed_tail:
            self.pending = True
        return out


_SCRAPE_HEADERS = {
    # Only encodings decoded here, by _BoundedDecoder (a whole network read of a gzip bomb is
    # never inflated at once).
    "Accept-Encoding": "gzip, deflate",
    "Accept": "*/*",
}
_CHARSET_RE = re.compile(r";\s*charset\s*=\s*\"?([^\";\s]+)", re.I)
# what http.client refuses in a request line (it would raise only once connected)
_BAD_URL_CHARS = re.compile(r"[\x00-\x20\x7f]")
#: idle keep-alive connections one ScrapeClient keeps (one per endpoint a sampler scrapes).
_MAX_IDLE = 8
#: the response's status line and header block, bytes: an error past it, never read unbounded.
_MAX_HEAD_BYTES = 64 * 1024
#: header lines of one response (http.client's limit).
_MAX_HEADERS = 100
#: one receive: a 55 KB page and its headers arrive in one or two.
_RECV_BYTES = 256 * 1024
_NOT_HTTP = "(the server's response is not valid HTTP)"
#: an HTML or JSON body (no copy of the page, as ``text.lstrip()`` made)
_MARKUP_RE = re.compile(r"\A\s*[<{\[]")


def _left(deadline: float) -> float:
    """Seconds to the deadline; raises TimeoutError when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline")
    return left


@functools.lru_cache(maxsize=1)
def _socket_classes() -> tuple[type, type]:
    """Socket classes whose every receive waits at most the time left to the scrape's deadline
    (``deadline`` attribute, monotonic seconds): the scrape reads the status line, headers
    and body through ``recv_into`` (and http.client a proxy's CONNECT answer), so one
    deadline bounds a drip-fed response whatever it drips (a per-recv timeout alone would
    restart on every byte)."""
    import socket
    import ssl

    class DeadlineSocket(socket.socket):
        deadline = 0.0  # set per scrape; outside one, a receive times out at once

        def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
            self.settimeout(_left(self.deadline))
            return super().recv_into(buffer, nbytes, flags)

        def recv(self, bufsize: int, flags: int = 0) -> bytes:
            self.settimeout(_left(self.deadline))
            return super().recv(bufsize, flags)

    class DeadlineSSLSocket(ssl.SSLSocket):
        deadline = 0.0

        def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
            self.settimeout(_left(self.deadline))
            return super().recv_into(buffer, nbytes, flags)  # type: ignore[arg-type]

        def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
            self.settimeout(_left(self.deadline))
            return super().recv(buflen, flags)

    return DeadlineSocket, DeadlineSSLSocket


def _create_connection(
    address: tuple[str, int], timeout: Any = None, source_address: Any = None, *, deadline: float
) -> Any:
    """socket.create_connection, the socket made a deadline-aware one (same descriptor; a proxy's
    CONNECT answer is read through it too)."""
    import socket

    plain = socket.create_connection(address, timeout, source_address)
    cls = _socket_classes()[0]
    sock = cls(plain.family, plain.type, plain.proto, fileno=plain.detach())
    sock.settimeout(timeout)
    sock.deadline = deadline
    return sock


def _basic(user: str | None, password: str | None) -> str:
    """``Basic base64(user:password)`` from a URL's (percent-encoded) userinfo, as httpx sends it."""
    import base64
    from urllib.parse import unquote

    pair = f"{unquote(user or '')}:{unquote(password or '')}"
    return "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")


class _Failed(Exception):
    """A scrape failure before any response byte on a reused connection (the server closed an
    idle keep-alive connection): retried once on a new one."""


class ScrapeClient:
    """HTTP GETs of ``/metrics`` pages, one keep-alive connection per endpoint kept between
    scrapes (uvicorn, vLLM's server, keeps them open). The standard library's ``http.client``
    only makes the connection (proxy ``CONNECT`` tunnel, TLS); the GET is written on its socket
    and the response parsed by httptools (llhttp, in C): ~0.7 ms thread CPU per 55 KB page
    scraped once a second, where http.client's reading and email-parser headers cost ~1.1 and
    httpx's pure-Python parsing ~1.5-2.

    - A connection the server closed while idle is noticed before the request (plain HTTP: the
      socket reads as ready) or by the request failing before any response byte: the scrape
      reconnects once. A connection whose response was not read to its end (an error, a
      timeout, a refused page) is closed, never reused; ``Connection: close`` and HTTP/1.0
      answers are read to their end and not kept.
    - Proxies from the environment as httpx's ``trust_env`` read them
      (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, ``NO_PROXY`` through
      ``urllib.request.proxy_bypass_environment``), read once when the client is made:
      ``http://`` targets are forwarded (absolute URL), ``https://`` ones tunnelled
      (``CONNECT``); the proxy URL's userinfo is sent as ``Proxy-Authorization: Basic``. Only
      ``http://`` proxies are spoken to (a socks or https proxy is an error, never bypassed).
    - https: one default SSL context per client (system CAs, or ``SSL_CERT_FILE`` /
      ``SSL_CERT_DIR``, as httpx reads them; certifi's bundle when installed and neither is set),
      built on the first https scrape (it costs ~40 ms).

    Idle connections are bounded (:data:`_MAX_IDLE`). Safe to share between threads (a
    connection is taken out of the pool while in use). :meth:`close` releases them all.
    """

    def __init__(self) -> None:
        import threading
        from urllib.request import getproxies_environment

        # ~9 ms to import: here, where a sampler's warm() builds the client, not in a scrape
        import httptools  # noqa: F401

        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], Any] = {}
        self._proxies: dict[str, str] = dict(getproxies_environment())
        self._ssl: Any = None

    def ssl_context(self) -> Any:
        """The client's SSL context (built once; ~40 ms)."""
        if self._ssl is None:
            import ssl

            cafile = os.environ.get("SSL_CERT_FILE") or None
            capath = None if cafile else (os.environ.get("SSL_CERT_DIR") or None)
            if cafile is None and capath is None:
                try:
                    import certifi

                    cafile = certifi.where()
                except ImportError:  # the system's CAs
                    pass
            ctx = ssl.create_default_context(cafile=cafile, capath=capath)
            ctx.sslsocket_class = _socket_classes()[1]
            self._ssl = ctx
        return self._ssl

    def _proxy_for(self, scheme: str, host: str, port: int) -> tuple[str, int, str | None] | None:
        """(host, port, Proxy-Authorization) of the environment's proxy for this target, None
        for a direct connection. Raises ValueError for a proxy this client cannot speak to."""
        if not self._proxies:
            return None
        from urllib.request import proxy_bypass_environment  # type: ignore[attr-defined]

        proxy = self._proxies.get(scheme) or self._proxies.get("all")
        if not proxy or proxy_bypass_environment(f"{host}:{port}", self._proxies):
            return None
        if "://" not in proxy:
            proxy = "http://" + proxy
        pp = urlsplit(proxy)
        if pp.scheme != "http" or not pp.hostname:
            raise ValueError("unsupported proxy")
        auth = _basic(pp.username, pp.password) if pp.username is not None else None
        return pp.hostname, pp.port or 80, auth

    def _connection(self, key: tuple[str, str, int], timeout: float) -> tuple[Any, bool]:
        """An idle connection for ``key`` (scheme, host, port), or a new one; True when reused."""
        import http.client

        with self._lock:
            conn = self._idle.pop(key, None)
        if conn is not None:
            sock = conn.sock
            if sock is not None and not hasattr(sock, "pending"):  # plain HTTP: a cheap check
                import select

                try:  # (poll, not select: a descriptor past 1023 is fine; one per connection)
                    poller = getattr(conn, "kv_poll", None)
                    if poller is None:
                        poller = conn.kv_poll = select.poll()
                        poller.register(sock, select.POLLIN)
                    ready = bool(poller.poll(0))
                except (OSError, ValueError, AttributeError):
                    ready = True
                if ready:  # EOF (the server closed it), stray bytes, an error: not usable
                    conn.close()
                    conn = None
            if conn is not None and conn.sock is not None:
                return conn, True
            if conn is not None:
                conn.close()
        scheme, host, port = key
        proxy = self._proxy_for(scheme, host, port)
        if scheme == "https":
            if proxy is not None:
                conn = http.client.HTTPSConnection(
                    proxy[0], proxy[1], timeout=timeout, context=self.ssl_context()
                )
                conn.set_tunnel(host, port, headers={"Proxy-Authorization": proxy[2]} if proxy[2] else None)
            else:
                conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self.ssl_context())
        else:
            conn = http.client.HTTPConnection(*(proxy[:2] if proxy else (host, port)), timeout=timeout)
        conn.kv_proxy = proxy
        return conn, False

    def _keep(self, key: tuple[str, str, int], conn: Any) -> None:
        with self._lock:
            old = self._idle.pop(key, None)  # another thread's, for the same endpoint
            if old is None and len(self._idle) >= _MAX_IDLE:
                old = self._idle.pop(next(iter(self._idle)))  # the oldest
            self._idle[key] = conn
        if old is not None:
            old.close()

    def _get(self, t: _Target, timeout: float, max_bytes: int) -> tuple[str, float]:
        """One scrape (see :func:`scrape`, which checks the URL and calls this): http.client
        makes the connection (proxy tunnel, TLS); the GET is written and its response read on
        the connection's socket here, parsed by httptools (:func:`_exchange`)."""
        import http.client

        label, scheme, path = t.label, t.scheme, t.path
        key = (scheme, t.host, t.port)
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            conn = None
            connected = False
            try:
                conn, reused = self._connection(key, timeout)
                if conn.kv_proxy is not None and scheme == "http":
                    # forwarded: the absolute URL, Host as the URL writes it (http.client's way)
                    request = _request(f"http://{t.hostport}{path}", t.hostport, t.auth, conn.kv_proxy[2])
                else:
                    request = _request(path, t.host_header, t.auth, None)
                if conn.sock is None:
                    conn.timeout = _left(deadline)
                    # deadline-aware sockets (see _socket_classes)
                    conn._create_connection = functools.partial(_create_connection, deadline=deadline)
                    conn.connect()
                connected = True
                sock = conn.sock
                sock.deadline = deadline
                sock.settimeout(_left(deadline))  # sendall: the whole send within it
                buf = getattr(conn, "kv_buf", None)
                if buf is None:  # one per connection: a fresh 256 KiB costs page faults every scrape
                    buf = conn.kv_buf = bytearray(_RECV_BYTES)
                text, ts, keep = _exchange(
                    sock, buf, request, label, max_bytes, retry=reused and attempt == 0
                )
                if keep:
                    self._keep(key, conn)
                else:
                    conn.close()
                conn = None
                return text, ts
            except _Failed:
                continue  # the server had closed the idle connection: once more, a new one
            except SourceError:
                raise
            except TimeoutError:
                raise SourceError(f"{label}: timed out after {timeout:g} s") from None
            except OSError as exc:  # (ssl's certificate error is a ValueError too: first)
                raise SourceError(f"{label}: {_os_error(exc, connected)}") from None
            except (http.client.HTTPException, ValueError, UnicodeError) as exc:
                if not connected:  # a host name IDNA cannot encode, a proxy we cannot speak to
                    why = "unsupported proxy" if str(exc) == "unsupported proxy" else "bad URL"
                    raise SourceError(f"{label}: {why}") from None
                # its text may quote what the server sent: the type only
                raise SourceError(f"{label}: {type(exc).__name__} {_NOT_HTTP}") from None
            finally:
                if conn is not None:
                    conn.close()  # a half-read or refused response: never reused
        raise SourceError(f"{label}: connection lost")  # not reached: attempt 1 never retries

    def close(self) -> None:
        """Close every idle connection; never raises."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conn in idle.values():
            try:
                conn.close()
            except Exception:
                pass


@functools.lru_cache(maxsize=64)
def _request(target: str, host: str, auth: str | None, proxy_auth: str | None) -> bytes:
    """The GET http.client sent: request line, ``Host``, :data:`_SCRAPE_HEADERS`, then
    ``Authorization`` and ``Proxy-Authorization`` when given (all ASCII: the target is
    percent-encoded, the host IDNA-encoded by :func:`_target`, the credentials base64)."""
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in _SCRAPE_HEADERS.items()]
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    if proxy_auth:
        lines.append(f"Proxy-Authorization: {proxy_auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


class _Stop(Exception):
    """Raised in a parser callback to stop the parse (the reason is on the :class:`_Response`)."""


class _Response:
    """One response as httptools' ``HttpResponseParser`` reports it through these callbacks:
    status and reason, the few headers read (``Content-Type``, ``Content-Encoding``, and
    whether ``Content-Length`` / chunked ``Transfer-Encoding`` frame the body), body pieces
    as they arrive (decoded by the caller after each feed). Interim 1xx responses are skipped.
    Counts the status line and header bytes against :data:`_MAX_HEAD_BYTES` and the header
    lines against :data:`_MAX_HEADERS` (``over`` set, the parse stopped)."""

    __slots__ = (
        "parser", "status", "reason", "head_bytes", "nheaders", "ctype", "cenc", "framed",
        "interim", "headers_done", "done", "over", "ts", "body", "keep_alive",
    )  # fmt: skip

    def __init__(self) -> None:
        self.parser: Any = None
        self.status = 0
        self.head_bytes = 0
        self.nheaders = 0
        self.headers_done = self.done = self.over = self.interim = self.keep_alive = False
        self.ts = 0.0
        self.body: list[bytes] = []
        self._new_message()

    def _new_message(self) -> None:
        self.reason = b""
        self.ctype: list[bytes] = []
        self.cenc: list[bytes] = []
        self.framed = False  # Content-Length or chunked: the body's end is in the message

    def _count(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > _MAX_HEAD_BYTES or self.nheaders > _MAX_HEADERS:
            self.over = True
            raise _Stop()

    def on_message_begin(self) -> None:
        if self.headers_done:  # bytes past the response: not a connection to reuse
            raise _Stop()
        self._new_message()

    def on_status(self, status: bytes) -> None:
        self._count(len(status))
        self.reason += status  # (in pieces when split between receives)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.nheaders += 1
        self._count(len(name) + len(value) + 4)
        n = name.lower()
        if n == b"content-type":
            self.ctype.append(value)
        elif n == b"content-encoding":
            self.cenc.append(value)
        elif n == b"content-length":
            self.framed = True
        elif n == b"transfer-encoding" and value.rpartition(b",")[2].strip().lower() == b"chunked":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: the answer follows
            self.interim = True
            return
        self.status = status
        self.headers_done = True
        self.ts = time.time()  # the unix time of the scrape: when the headers arrived

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        else:
            self.done = True
            # asked here: once the message is complete llhttp has reset what it knew
            self.keep_alive = bool(self.parser.should_keep_alive())


def _exchange(
    sock: Any, buf: bytearray, request: bytes, label: str, max_bytes: int, *, retry: bool
) -> tuple[str, float, bool]:
    """Send ``request`` on ``sock`` (a deadline socket, :func:`_socket_classes`) and read its
    response with httptools (MagicStack's binding of llhttp, node's and uvicorn's parser):
    ``(text, unix time of the headers, keep the connection)``, receiving into ``buf``. Every
    receive is bounded by the socket's deadline and ``len(buf)``, the status line and headers by
    :data:`_MAX_HEAD_BYTES`, the body after Content-Encoding by ``max_bytes``
    (:class:`_BoundedDecoder`, inflated as it arrives). The body ends as the message frames it
    (Content-Length, chunked) or, without either, at the server's close. Kept only after a
    complete message the parser says is keep-alive, nothing past it.

    Raises :class:`_Failed` when ``retry`` and the connection failed before any response byte
    (a reused idle connection the server closed), SourceError for a response refused (status,
    Content-Type, encoding, size, not valid HTTP: the parser's words never, they may quote the
    server's bytes), TimeoutError / OSError from the socket."""
    import httptools

    try:
        sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        if retry:
            raise _Failed() from None
        raise
    resp = _Response()
    parser = httptools.HttpResponseParser(resp)
    resp.parser = parser
    view = memoryview(buf)
    got = 0  # bytes received
    head_fed = 0  # bytes fed while the headers were not complete
    extra = False  # bytes past the response (a parse stopped after it)
    decoder: _BoundedDecoder | None = None
    parts: list[bytes] = []
    size = 0
    ctype = ""
    try:
        while True:
            try:
                n = sock.recv_into(buf)
            except ConnectionResetError:
                if retry and not got:
                    raise _Failed() from None
                raise
            if n:
                got += n
                if not resp.headers_done:
                    head_fed += n
                try:
                    parser.feed_data(view[:n])
                except httptools.HttpParserUpgrade:  # a 101: refused below as a status
                    if not resp.headers_done:
                        raise SourceError(f"{label}: InvalidHeader {_NOT_HTTP}") from None
                except httptools.HttpParserError as exc:
                    if resp.over:
                        raise SourceError(f"{label}: {_too_long(resp)}") from None
                    if not resp.done:
                        raise SourceError(f"{label}: {_parse_error(exc, resp)} {_NOT_HTTP}") from None
                    extra = True
            elif not got:
                if retry:
                    raise _Failed()
                raise SourceError(f"{label}: connection lost (RemoteDisconnected)")
            if resp.headers_done and decoder is None:
                ctype = b", ".join(resp.ctype).decode("latin-1")
                _check_head(resp, ctype, label)
                decoder = _BoundedDecoder(b", ".join(resp.cenc).decode("latin-1"), label)
            if resp.body and decoder is not None:
                for raw in resp.body:
                    out = decoder.decode(raw, max_bytes + 1 - size)
                    parts.append(out)
                    size += len(out)
                    if size > max_bytes or decoder.pending:
                        raise SourceError(f"{label}: response larger than {max_bytes >> 20} MiB")
                resp.body.clear()
            if resp.done:
                keep = resp.keep_alive and not extra
                break
            if not n:
                if resp.headers_done and not resp.framed and resp.status not in (204, 304):
                    keep = False  # read to the close: the body's end
                    break
                raise SourceError(f"{label}: IncompleteRead {_NOT_HTTP}")
            if head_fed > _MAX_HEAD_BYTES and not resp.headers_done:
                raise SourceError(f"{label}: {_too_long(resp)}")
    except BaseException:
        # the error's traceback keeps this frame alive until the sampler's next read: the body
        # read so far (up to 16 MiB) and the inflater are released now, not at a rare collection
        parts.clear()
        resp.body.clear()
        decoder = None
        raise
    finally:
        resp.parser = None  # (a cycle otherwise)
    m = _CHARSET_RE.search(ctype)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    try:
        text = body.decode(m.group(1) if m else "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = body.decode("utf-8", errors="replace")
    if _MARKUP_RE.match(text):
        raise SourceError(f"{label}: not Prometheus text (an HTML or JSON body)")
    return text, resp.ts, keep


def _too_long(resp: _Response) -> str:
    """Why a header block was refused: too many lines or too many bytes."""
    if resp.nheaders > _MAX_HEADERS:
        return f"more than {_MAX_HEADERS} response headers"
    return f"response headers larger than {_MAX_HEAD_BYTES >> 10} KiB"


def _parse_error(exc: Exception, resp: _Response) -> str:
    """What llhttp refused, by where it was (its own reason may quote the server's bytes)."""
    import httptools

    if isinstance(exc, httptools.HttpParserInvalidStatusError) or not resp.parser.get_status_code():
        return "BadStatusLine"
    return "InvalidHeader" if not resp.headers_done else "InvalidBody"


def _check_head(resp: _Response, ctype: str, label: str) -> None:
    """Refuse a status but 200 (``HTTP 404 Not Found``, the reason cut to 40 printable
    characters) and a Content-Type that is not Prometheus text; raises SourceError."""
    if resp.status != 200:
        reason = "".join(ch for ch in resp.reason.decode("latin-1").strip()[:40] if ch.isprintable())
        raise SourceError(f"{label}: HTTP {resp.status} {reason}".rstrip())
    mime = ctype.split(";", 1)[0].strip().lower()
    if mime and mime not in ("text/plain", "application/openmetrics-text"):
        raise SourceError(f"{label}: not Prometheus text (Content-Type: {mime[:40]})")


def _os_error(exc: OSError, connected: bool) -> str:
    """The reason of a socket error, in the words the messages used with httpx: the OS's
    reason only, nothing the peer sent."""
    import ssl

    msg = str(exc)
    if isinstance(exc, ssl.SSLError):
        return f"cannot connect (TLS: {str(exc.reason or 'error')[:60].lower().replace('_', ' ')})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if msg.startswith("Tunnel connection failed"):
        return "cannot connect (the proxy refused the CONNECT)"
    if not connected:
        errno_text = msg if msg.startswith("[Errno") and len(msg) < 120 else "error"
        return "connection refused" if "refused" in msg.lower() else f"cannot connect ({errno_text})"
    return f"connection lost ({type(exc).__name__})"


def scrape(
    url: str, timeout: float = 2.0, client: ScrapeClient | None = None, *, max_bytes: int = MAX_HTTP_BYTES
) -> tuple[str, float]:
    """GET vLLM's ``/metrics`` (vllm-facts.md §5) and return ``(text, unix seconds)``.

    ``url`` is the metrics URL or the server's base URL (``/metrics`` is appended when the path
    is empty; ``http://`` or ``https://``; userinfo is sent as Basic auth). ``timeout``
    (seconds) is one deadline for the whole scrape — connect, headers and body together, so a
    drip-fed response ends on time; ``max_bytes`` caps the body after Content-Encoding (a gzip
    bomb stops there). ``client`` (:class:`ScrapeClient`) lets a sampler keep one keep-alive
    connection (and SSL context) between scrapes; without one a connection is made and closed.
    Redirects are not followed (an error, like any status but 200). The unix time is taken
    when the headers arrived. Raises SourceError with one line: ``GET http://…/metrics:
    connection refused`` / ``timed out after 2 s`` / ``HTTP 404 Not Found`` / ``not Prometheus
    text (Content-Type: text/html)`` / ``response larger than 64 MiB`` / ``response headers
    larger than 64 KiB`` / ``InvalidHeader (the server's response is not valid HTTP)`` (what
    httptools refused, never its bytes) / ``bad URL``; the URL's credentials are never shown.
    """
    t = _target(url)
    if isinstance(t, str):
        raise SourceError(t)
    own = client is None
    c = client if client is not None else ScrapeClient()
    try:
        return c._get(t, timeout, max_bytes)
    finally:
        if own:
            c.close()


class _Target(NamedTuple):
    """What a scrape URL asks for, worked out once per URL (:func:`_target`)."""

    label: str  # "GET http://host:8000/metrics", credentials removed
    scheme: str  # "http" | "https"
    host: str  # lower-case, an IPv6 address without brackets
    port: int
    path: str  # path and query, percent-encoded ASCII
    hostport: str  # the URL's host[:port] as written, ASCII (an absolute URL for a proxy)
    auth: str | None  # "Basic …" from the URL's userinfo
    host_header: str  # Host as http.client wrote it: host (IDNA, [IPv6] without %zone)[:port]


@functools.lru_cache(maxsize=64)
def _target(url: str) -> _Target | str:
    """The :class:`_Target` of a scrape URL, or the one-line error for a bad one (a sampler
    scrapes the same URL every second: its parsing and redaction are done once)."""
    try:
        target = _metrics_url(url)
        parts = urlsplit(target)
        port = parts.port  # a bad port raises ValueError here
    except ValueError:
        return f"GET {_redact_url(url)}: bad URL"
    label = f"GET {_redact_url(target)}"
    scheme = parts.scheme
    if scheme not in ("http", "https") or not parts.hostname or _BAD_URL_CHARS.search(target):
        return f"{label}: bad URL"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not path.isascii():  # percent-encoded, as httpx sent it
        from urllib.parse import quote

        path = quote(path, safe="".join(map(chr, range(0x21, 0x7F))))
    auth = _basic(parts.username, parts.password) if parts.username is not None else None
    default = 443 if scheme == "https" else 80
    host = parts.hostname
    try:
        hostport = _ascii_host(parts.netloc.rpartition("@")[2])
        host_header = _ascii_host(host)
    except UnicodeError:  # a name IDNA cannot encode
        return f"{label}: bad URL"
    if ":" in host_header:  # an IPv6 address; its zone (%eth0) is the client's, not the server's
        host_header = f"[{host_header.partition('%')[0]}]"
    if port is not None and port != default:
        host_header = f"{host_header}:{port}"
    return _Target(
        label=label,
        scheme=scheme,
        host=host,
        port=port or default,
        path=path,
        hostport=hostport,
        auth=auth,
        host_header=host_header,
    )


def _ascii_host(name: str) -> str:
    """A host name as it goes into a request: ASCII as written, else IDNA (http.client's way);
    raises UnicodeError."""
    return name if name.isascii() else name.encode("idna").decode("ascii")


def probe_endpoints(
    base_url: str, timeout: float = 2.0, client: httpx.Client | None = None
) -> dict[str, Any]:
    """Best-effort read of vLLM's ``/version`` and ``/v1/models`` (vllm-facts.md §5).

    Returns ``{"version": "0.33.0" | None, "models": [{"id", "root", "max_model_len"}, …],
    "errors": ["GET …: why", …]}``; ``max_model_len`` is the effective one (after auto-fit).
    Never raises: a dead or protected endpoint only adds a line to ``errors``.
    """
    import httpx

    result: dict[str, Any] = {"version": None, "models": [], "errors": []}
    if "://" not in base_url:
        base_url = "http://" + base_url
    try:
        parts = urlsplit(base_url)
    except ValueError as exc:
        result["errors"].append(f"{_redact_url(base_url)}: bad URL ({exc})")
        return result
    root = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    own = client is None
    c = client or httpx.Client(timeout=httpx.Timeout(timeout, connect=timeout))
    try:
        for path in ("/version", "/v1/models"):
            label = f"GET {_redact_url(root + path)}"
            try:
                resp = c.get(root + path, timeout=httpx.Timeout(timeout, connect=timeout))
            except httpx.HTTPError as exc:
                result["errors"].append(str(_http_error(label, exc, timeout)))
                if isinstance(exc, (httpx.ConnectError, httpx.UnsupportedProtocol)):
                    break  # the second request would fail the same way
                continue
            except (httpx.InvalidURL, ValueError) as exc:
                result["errors"].append(f"{label}: bad URL ({exc})")
                break
            if resp.status_code != 200:
                result["errors"].append(f"{label}: HTTP {resp.status_code} {resp.reason_phrase}".rstrip())
                continue
            try:
                body = resp.json()
            except ValueError:
                result["errors"].append(f"{label}: not JSON")
                continue
            if path == "/version" and isinstance(body, dict):
                v = body.get("version")
                result["version"] = str(v) if v is not None else None
            elif path == "/v1/models" and isinstance(body, dict):
                for card in body.get("data") or []:
                    if isinstance(card, dict) and card.get("id") is not None:
                        mml = card.get("max_model_len")
                        result["models"].append(
                            {
                                "id": str(card["id"]),
                                "root": card.get("root"),
                                "max_model_len": int(mml) if isinstance(mml, (int, float)) else None,
                            }
                        )
    finally:
        if own:
            c.close()
    return result
