"""kvdoctor's own text-exposition parser (``kvdoctor.sources.metrics._parse_sample``) against
prometheus_client's, over every /metrics page in tests/data, and on hostile lines."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvdoctor.facts import SourceError
from kvdoctor.sources import metrics as M

DATA = Path(__file__).resolve().parent.parent / "data"
PAGES = sorted(
    p
    for p in DATA.rglob("*")
    if p.is_file() and p.suffix in (".txt", ".prom", "") and "\nvllm:" in "\n" + p.read_text(errors="replace")
)


def _library(line: str) -> tuple[str, dict[str, str], float] | None:
    """prometheus_client's reading of one sample line (no # TYPE: one untyped family), None
    when it refuses the line."""
    try:
        fams = list(text_string_to_metric_families(line))
    except Exception:  # noqa: BLE001 - the library raises ValueError, IndexError, …
        return None
    if len(fams) != 1 or len(fams[0].samples) != 1:
        return None
    s = fams[0].samples[0]
    return s.name, dict(s.labels), float(s.value)


def _ours(line: str) -> tuple[str, dict[str, str], float] | None:
    try:
        return M._parse_sample(line)
    except ValueError:
        return None


def _same(a: tuple[str, dict[str, str], float] | None, b: tuple[str, dict[str, str], float] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a[:2] == b[:2] and (a[2] == b[2] or (math.isnan(a[2]) and math.isnan(b[2])))


def test_pages_found() -> None:
    # bundles, cases, real vLLM 0.32 captures, the bench page
    assert len(PAGES) > 100
    assert any("real-vllm" in str(p) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DATA)) for p in PAGES])
def test_every_vllm_line_reads_as_prometheus_client_reads_it(page: Path) -> None:
    text = page.read_text(errors="replace")
    lines = [ln.rstrip() for ln in M._ALL_VLLM_RE.findall("\n" + text)]
    assert lines
    for ln in lines:
        assert _same(_ours(ln), _library(ln)), ln[:200]


def _library_parse(monkeypatch: pytest.MonkeyPatch, text: str, **kw: object) -> list[object]:
    def lib(line: str) -> tuple[str, dict[str, str], float]:
        got = _library(line)
        if got is None:
            raise ValueError("refused")
        return got

    with monkeypatch.context() as m:
        m.setattr(M, "_parse_sample", lib)
        m.setattr(M, "_LINE_CACHE", {})  # no line read by our parser before
        got = list(M.parse_metrics(text, **kw))  # type: ignore[arg-type]
    monkeypatch.setattr(M, "_LINE_CACHE", {})  # nor by the library, for the comparison
    return got


@pytest.mark.parametrize("page", PAGES[::7], ids=[str(p.relative_to(DATA)) for p in PAGES[::7]])
@pytest.mark.parametrize("histograms", [M.READ_HISTOGRAMS, M.DISPLAY_HISTOGRAMS, None])
def test_pages_give_the_same_engine_metrics_as_with_the_library(
    page: Path, histograms: tuple[str, ...] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = page.read_text(errors="replace")
    try:
        want = _library_parse(monkeypatch, text, timestamp=1.0, histograms=histograms)
    except SourceError:
        with pytest.raises(SourceError):
            M.parse_metrics(text, timestamp=1.0, histograms=histograms)
        return
    assert M.parse_metrics(text, timestamp=1.0, histograms=histograms) == want


EDGE_LINES = [
    'vllm:a{x="1",y="2",} 3',  # trailing comma
    'vllm:a { x = "1" , y="2" } 3',  # spaces around everything
    "vllm:a{} 1",
    "vllm:a\t2",
    "vllm:a 1 1712345678000",  # a timestamp (ms)
    "vllm:a 1 abc",  # a timestamp that is not a number
    "vllm:a +Inf",
    "vllm:a -Inf",
    "vllm:a NaN",
    "vllm:a 1e-3",
    "vllm:a -0.5E+2",
    "vllm:a 1_000",  # Python's float() takes it; Prometheus does not
    "vllm:a 0x10",
    'vllm:a{x="a\\"b"} 1',  # escaped quote
    'vllm:a{x="a\\\\"} 1',  # escaped backslash, then the closing quote
    'vllm:a{x="a\\\\\\"} 1',  # \\ then \" : unterminated
    'vllm:a{x="line\\nbreak"} 1',
    'vllm:a{x="tab\\tkept"} 1',  # an unknown escape stays as written
    'vllm:a{x="1",x="2"} 1',  # duplicate label
    'vllm:a{x="1} 1',  # unterminated quote
    'vllm:a{x="1"',  # unterminated labels
    "vllm:a{x=1} 1",  # unquoted value
    'vllm:a{="1"} 1',
    'vllm:a{1x="1"} 1',
    "vllm:a",
    "vllm:a ",
    "vllm:a 1 2 3",
    'vllm:a{x="1"}2',
    'vllm:a{x="é ü 中"} 4',
]


#: malformed lines the library reads anyway and Prometheus (its Go parser) refuses: we refuse them
#: (after the value, a `#` starts an OpenMetrics exemplar, `# {labels} value [timestamp]`, or
#: nothing: the library takes `1 # 2` for a value and a timestamp)
STRICTER = ["vllm:a 1 2 3", "vllm:a 1 # 2"]

#: an OpenMetrics exemplar after the value (an application/openmetrics-text page): read past
EXEMPLARS = {
    'vllm:a 1 # {a="b"} 7': 1.0,
    'vllm:a{x="#"} 5 123 # {} 0.5 17': 5.0,
    'vllm:a 2 # {t="x y"} 1': 2.0,
}
#: junk after a `#`, refused by both (hypothesis found `vllm:a 1 #`, which we once read as 1)
EDGE_LINES += [
    "vllm:a 1 #",
    "vllm:a 1 #x",
    "vllm:a 1 # ",
    "vllm:a 1 # {",
    'vllm:a 1 # {a="b"}',
    *STRICTER[1:],
    *EXEMPLARS,
]


@pytest.mark.parametrize("line", EDGE_LINES)
def test_edge_lines_read_as_prometheus_client_reads_them(line: str) -> None:
    if line in STRICTER:
        assert _ours(line) is None and _library(line) is not None
    else:
        assert _same(_ours(line), _library(line))


@pytest.mark.parametrize(("line", "value"), EXEMPLARS.items())
def test_an_exemplar_is_read_past(line: str, value: float) -> None:
    ours = _ours(line)
    assert ours is not None and ours[2] == value


_VALUE_CHARS = st.sampled_from(list("ab ,}{=#\t中") + ['\\"', "\\\\", "\\n", "\\t"])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True).filter(
                lambda k: not k.startswith("__")  # reserved: refused by both
            ),
            st.lists(_VALUE_CHARS, max_size=6).map("".join),
        ),
        max_size=4,
        unique_by=lambda kv: kv[0],
    ),
    st.sampled_from(["1", "2.5", "+Inf", "-Inf", "NaN", "-1e3", "7E+2"]),
    st.sampled_from(["", " 123", "\t-5", ",", " , "]),
)
def test_generated_well_formed_lines_read_alike(pairs: list[tuple[str, str]], value: str, sep: str) -> None:
    # escapes in values well formed, label names unique, a real number: a sample line
    labels = ",".join(f'{k}="{v}"' for k, v in pairs)
    trail = sep if sep.strip() == "," and pairs else ""
    stamp = sep if sep.strip() not in (",", "") else ""
    line = f"vllm:gen{{{labels}{trail}}} {value}{stamp}"
    ours = _ours(line)
    assert ours is not None, line
    assert _same(ours, _library(line)), line


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet='vlm:a{}="\\, \t#1.e+-_nNIf', max_size=40))
def test_junk_never_reads_where_the_library_refuses(tail: str) -> None:
    # never laxer than prometheus_client: what we read, it reads the same
    line = ("vllm:a" + tail).rstrip()
    ours = _ours(line)
    if ours is not None:
        assert _same(ours, _library(line)), line


@pytest.mark.parametrize(
    "line",
    [
        'vllm:a{x="' + "a" * 200_000 + '"} 1',  # far past the line bound
        'vllm:a{x="' + "\\" * 15_000 + " 1",  # backslashes, unterminated
        "vllm:a{" + 'x="1",' * 2_500 + " 1",  # many terms, no closing brace
        "vllm:a{" + 'x="' * 5_000 + "} 1",
        "vllm:a" + " " * 15_000 + "x y z",
        "vllm:a{" + "=" * 15_000 + "} 1",
    ],
)
def test_hostile_lines_are_bounded_and_refused(line: str) -> None:
    t0 = time.process_time()
    assert _ours(line) is None
    assert time.process_time() - t0 < 0.5  # a hang guard: linear is ~1 ms
    page = "# TYPE vllm:a gauge\n" + line + "\nvllm:num_requests_running 2\n"
    (em,) = M.parse_metrics(page)  # the good line is still read
    assert em.num_requests_running == 2.0


def test_bad_line_reports_line_number_never_its_bytes() -> None:
    secret = "hf_" + "S3CRET" * 4
    page = '# HELP vllm:num_requests_running x\nvllm:num_requests_running{token="' + secret + "} 1\n"
    with pytest.raises(SourceError) as err:
        M.parse_metrics(page, origin="http://x/metrics")
    msg = str(err.value)
    assert ":2:" in msg and "unparsable sample line" in msg
    assert secret not in msg and "S3CRET" not in msg
    page = "vllm:num_requests_running 1 " + secret + "\n"
    with pytest.raises(SourceError) as err:
        M.parse_metrics(page)
    assert "S3CRET" not in str(err.value)


def test_page_parse_is_fast_without_a_line_cache() -> None:
    # hang guard, not a benchmark: the 55 KB bench page with every line new each time
    page = (DATA / "bench" / "vllm-0.33.0-metrics-sample.txt").read_text()
    t0 = time.process_time()
    for i in range(20):
        M.parse_metrics(page.replace("} ", f"}} {i}", 1), histograms=None)
    assert time.process_time() - t0 < 5.0


@pytest.mark.parametrize("histograms", [M.READ_HISTOGRAMS, M.DISPLAY_HISTOGRAMS, ()])
def test_the_line_filter_keeps_exactly_the_families_read(histograms: tuple[str, ...]) -> None:
    """The one-regex filter (a trie of the names) keeps a line iff its metric name is one we
    read, whole, followed by ``{``, a space or a tab: as a plain Python filter over every page."""
    rx = M._filter_re(tuple(sorted(histograms)))
    wanted = set(M._SCALAR_NAMES) | {M._INFO, M._SLEEP}
    wanted |= {h + s for h in histograms for s in ("_bucket", "_count", "_sum")}
    # near misses: a longer name, a shorter one, a prefix of a kept one
    extra = "".join(f'{n}x 1\n{n[:-1]} 1\n{n}_total 1\n{n}{{a="1"}} 2\n{n}\t3\n' for n in sorted(wanted))
    for text in [p.read_text(errors="replace") for p in PAGES[::5]] + [extra]:
        want = []
        for line in text.split("\n"):
            i = next((k for k, ch in enumerate(line) if ch in "{ \t"), -1)
            if i > 0 and line[:i] in wanted:
                want.append(line)
        assert rx.findall("\n" + text) == want


def test_the_name_trie_matches_exactly_its_words() -> None:
    import re

    words = ["ab", "a", "abc", "b", "x.y"]
    rx = re.compile("(?:" + M._trie(words) + r")\Z")
    probes = ["", "a", "ab", "abc", "abcd", "ac", "b", "ba", "x.y", "xzy", "c"]
    assert [w for w in probes if rx.match(w)] == ["a", "ab", "abc", "b", "x.y"]


# --- the previous page's names and labels reused for a line whose value moved -------------


def _fresh(line: str, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    monkeypatch.setattr(M, "_LINE_CACHE", {})
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    return M._parse_lines(line, [line])[0]


def _after(first: str, line: str, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    monkeypatch.setattr(M, "_LINE_CACHE", {})
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    M._parse_lines(first, [first])
    return M._parse_lines(line, [line])[0]


def _alike(a: list[object], b: list[object]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        assert isinstance(x, tuple) and isinstance(y, tuple)
        vx, vy = x[2], y[2]
        if x[:2] != y[:2] or x[3:] != y[3:] or not (vx == vy or (math.isnan(vx) and math.isnan(vy))):
            return False
    return True


@pytest.mark.parametrize(
    ("first", "line"),
    [
        ('vllm:a_bucket{engine="0",le="5.0"} 3', 'vllm:a_bucket{engine="0",le="5.0"} 4'),
        ("vllm:num_requests_running 1", "vllm:num_requests_running 2"),
        ('vllm:a 5 # {a="b"} 1', 'vllm:a 5 # {a="b"} 2'),  # an exemplar: the value is 5
        ("vllm:a 0 0", "vllm:a 0 7"),  # a timestamp after the value
        ("vllm:a 1", "vllm:a 1_000"),  # float() would take it, Prometheus does not
        ("vllm:a 1", "vllm:a 0x10"),
        ("vllm:a 1", "vllm:a \t2"),
        ("vllm:a 1", "vllm:a NaN"),
        ("vllm:a 1", "vllm:a +Inf"),
        ('vllm:a{x="} 5 }"} 3', 'vllm:a{x="} 5 }"} 4'),
        ("vllm:a  1", "vllm:a  2"),  # two spaces before the value
    ],
)
def test_a_moved_value_reads_as_a_fresh_parse(first: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _alike(_after(first, line, monkeypatch), _fresh(line, monkeypatch)), (first, line)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(
        [
            "vllm:a",
            'vllm:a{x="1"}',
            'vllm:a_bucket{le="2.0",engine="0"}',
            "vllm:a 5 #",
            'vllm:a 5 # {t="1"}',
            "vllm:a 3",
        ]
    ),
    st.text(alphabet="0123456789.e+-_xINnaf#\t ", max_size=8),
    st.text(alphabet="0123456789.e+-_xINnaf#\t ", max_size=8),
)
def test_any_second_line_reads_as_a_fresh_parse(head: str, v1: str, v2: str) -> None:
    first, line = f"{head} {v1}", f"{head} {v2}"
    saved = (M._LINE_CACHE, M._HEAD_CACHE)
    try:
        M._LINE_CACHE, M._HEAD_CACHE = {}, {}
        want = M._parse_lines(line, [line])[0]
        M._LINE_CACHE, M._HEAD_CACHE = {}, {}
        M._parse_lines(first, [first])
        got = M._parse_lines(line, [line])[0]
    finally:
        M._LINE_CACHE, M._HEAD_CACHE = saved
    assert _alike(got, want), (first, line)


def test_a_busy_page_reads_as_with_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # every counter, bucket and gauge of the bench page moved: the same EngineMetrics either way
    page = (DATA / "bench" / "vllm-0.33.0-metrics-sample.txt").read_text()
    moved = "\n".join(
        ln if ln.startswith("#") or not ln.strip() else ln.rsplit(" ", 1)[0] + " " + str(i + 0.5)
        for i, ln in enumerate(page.splitlines())
    )
    monkeypatch.setattr(M, "_LINE_CACHE", {})
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    want = M.parse_metrics(moved, timestamp=1.0)
    monkeypatch.setattr(M, "_LINE_CACHE", {})
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    M.parse_metrics(page, timestamp=1.0)
    assert M._HEAD_CACHE  # the first page's heads are known
    assert M.parse_metrics(moved, timestamp=1.0) == want


@pytest.mark.parametrize(
    ("first", "line", "reused"),
    [
        ('vllm:a_bucket{engine="0",le="5.0"} 3', 'vllm:a_bucket{engine="0",le="5.0"} 4', True),
        ('vllm:a 5 # {a="b"} 1', 'vllm:a 5 # {a="b"} 2', False),
        ("vllm:a 0 0", "vllm:a 0 7", False),
        ("vllm:a 1", "vllm:a 1_000", False),
    ],
)
def test_only_a_line_whose_value_ends_it_is_reused(
    first: str, line: str, reused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(M, "_LINE_CACHE", {})
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    M._parse_lines(first, [first])
    calls: list[str] = []
    real = M._parse_sample

    def counted(ln: str) -> tuple[str, dict[str, str], float]:
        calls.append(ln)
        return real(ln)

    monkeypatch.setattr(M, "_parse_sample", counted)
    M._parse_lines(line, [line])
    assert (calls == []) is reused


# --- a page whose kept lines have the last page's heads, in order ---------------------------

_BENCH_PAGE = DATA / "bench" / "vllm-0.33.0-metrics-sample.txt"


def _with_values(page: str, values: list[str]) -> str:
    """``page`` with the value of its n-th vllm:* sample line replaced by ``values[n % len]``."""
    out, n = [], 0
    for ln in page.splitlines():
        if ln.startswith("vllm:") and " " in ln:
            ln = ln.rsplit(" ", 1)[0] + " " + values[n % len(values)]
            n += 1
        out.append(ln)
    return "\n".join(out) + "\n"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(["0", "1.5", "-0.0", "7e3", "NaN", "+Inf", "1e309", "2", "1_0", "0x1", "9" * 40]),
        min_size=1,
        max_size=12,
    )
)
def test_a_page_with_the_last_pages_heads_reads_as_a_fresh_parse(values: list[str]) -> None:
    """Differential: the page after a busy one (same series, every value moved, some to NaN,
    ±Inf, out of range or not a Prometheus float) reads as it does with no cache at all."""
    page = _BENCH_PAGE.read_text()
    moved = _with_values(page, values)
    saved = (M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE)
    try:
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE = {}, {}, None
        try:
            want: object = M.parse_metrics(moved, timestamp=1.0)
        except SourceError as e:
            want = str(e)
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE = {}, {}, None
        M.parse_metrics(_with_values(page, ["3"]), timestamp=1.0)
        assert M._LAST_PAGE is not None  # every line read, each with its value last
        try:
            got: object = M.parse_metrics(moved, timestamp=1.0)
        except SourceError as e:
            got = str(e)
    finally:
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE = saved
    assert repr(got) == repr(want)


def test_the_last_pages_samples_are_reused_only_with_its_own_head_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reset head cache (another endpoint's page, a test's fresh parse) is a fresh parse."""
    page = _BENCH_PAGE.read_text()
    M.parse_metrics(page, timestamp=1.0)
    plan = M._LAST_PAGE
    assert plan is not None
    calls = []
    real = M._same_heads
    monkeypatch.setattr(M, "_same_heads", lambda *a: calls.append(1) or real(*a))
    M.parse_metrics(_with_values(page, ["4"]), timestamp=2.0)
    assert calls == [1]
    monkeypatch.setattr(M, "_HEAD_CACHE", {})
    M.parse_metrics(_with_values(page, ["5"]), timestamp=3.0)
    assert calls == [1]


def _two_pages_vs_fresh(first: str, second: str) -> tuple[object, object, int]:
    """(second parsed after first, second parsed with no cache, whether the second parse
    after first read it as the first page's samples with new values)."""
    saved = (M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE, M._same_heads)
    calls = [0]
    real = M._same_heads

    def counting(*a: object) -> object:
        calls[0] += 1
        return real(*a)  # type: ignore[arg-type]

    try:
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE = {}, {}, None
        want = M.parse_metrics(second, timestamp=1.0)
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE = {}, {}, None
        M.parse_metrics(first, timestamp=1.0)
        M._same_heads = counting  # type: ignore[assignment]
        got = M.parse_metrics(second, timestamp=1.0)
    finally:
        M._LINE_CACHE, M._HEAD_CACHE, M._LAST_PAGE, M._same_heads = saved  # type: ignore[assignment]
    return got, want, calls[0]


def test_the_last_pages_samples_keep_the_engine_cap_sleep_states_and_repeated_series() -> None:
    """A page of the last page's shape, read through its samples: past MAX_ENGINES engines,
    sleep states (assigned, not summed; they pass the cap), a series given twice (summed), an
    info line and a bucket without a number for le, as a fresh parse reads them."""
    from kvdoctor.sources.limits import MAX_ENGINES

    def page(v: int) -> str:
        lines = []
        for e in range(MAX_ENGINES + 3):
            lines.append(f'vllm:num_requests_running{{engine="{e}"}} {v + e}')
            lines.append(f'vllm:engine_sleep_state{{engine="{e}",sleep_state="awake"}} {v % 2}')
        lines.append(f'vllm:engine_sleep_state{{engine="x",sleep_state="awake"}} {v}')
        lines.append(f'vllm:engine_sleep_state{{engine="x",sleep_state="awake"}} {v + 1}')
        lines.append(f'vllm:num_requests_waiting{{engine="0"}} {v}')
        lines.append(f'vllm:num_requests_waiting{{engine="0"}} {v * 3}')
        lines.append(f'vllm:request_prompt_tokens_bucket{{engine="0",le="oops"}} {v}')
        lines.append(f'vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf"}} {v}')
        lines.append('vllm:cache_config_info{engine="0",block_size="16"} 1')
        return "\n".join(lines) + "\n"

    got, want, calls = _two_pages_vs_fresh(page(2), page(5))
    assert calls == 1
    assert repr(got) == repr(want)
