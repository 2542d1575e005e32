"""The log parser's fast path (issue 8, class 9) changes no result: a chunk parsed at C speed
(``_Parser.feed_chunk``: the learnt scan regex, the skipped request/access lines, open traceback
blocks, restarts) gives the very events — kind, line, values, text, process, pid, level, time,
host — that feeding every line gives, and the learnt scan regex finds exactly the lines the
general one finds."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.sources import vllm_log

DATA = Path(__file__).resolve().parents[1] / "data"
STARTUP = DATA / "vllm_log" / "b17-v1-preemption-thrash-long-prompts.log"


def _events(log_events: list) -> list[tuple]:  # type: ignore[type-arg]
    return [
        (e.kind, e.line, repr(sorted(e.values.items())), e.text, e.process, e.pid, e.level, e.time, e.host)
        for e in log_events
    ]


def _line_by_line(text: str) -> tuple[list[tuple], int]:  # type: ignore[type-arg]
    p = vllm_log._Parser("x", bounded=True)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for ln in lines:
        p.feed(ln)
    p.finish()
    p.log.events.sort(key=lambda e: e.line)
    return _events(p.log.events), p.log.line_count


def _req(i: int, ids: str = "None", proc: str = "(APIServer pid=1) ") -> str:
    return (
        f"{proc}INFO 07-01 10:{i % 60:02d}:00 [logger.py:43] Received request cmpl-{i}: prompt: "
        f"'CUDA out of memory. api_key=sk-abc', params: SamplingParams(n=1), prompt_token_ids: {ids}, "
        "lora_request: None."
    )


def _serving(n: int, start: int = 0) -> list[str]:
    out = []
    for i in range(start, start + n):
        ids = "None" if i % 3 else f"[{', '.join(str(t) for t in range(i % 17))}]"
        out.append(_req(i, ids))
        out.append(f"(APIServer pid=1) INFO 07-01 10:{i % 60:02d}:00 [engine.py:317] Added request cmpl-{i}.")
        out.append(
            f'(APIServer pid=1) INFO:     10.0.0.{i % 250}:5{i % 999:03d} - "POST /v1/completions HTTP/1.1" 200 OK'
        )
        if i % 25 == 0:
            out.append(
                f"(APIServer pid=1) INFO 07-01 10:{i % 60:02d}:00 [loggers.py:123] Engine 000: Avg prompt "
                f"throughput: {i}.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: {i % 9} reqs, "
                f"Waiting: 0 reqs, GPU KV cache usage: 50.0%, Prefix cache hit rate: 1.0%, Preemptions: {i % 4}"
            )
    return out


def _mixed_log() -> str:
    startup = STARTUP.read_text(encoding="utf-8").splitlines()
    lines = startup + _serving(300)
    # a traceback of one process that never prints again: its block stays open while the others
    # serve; another that a later line of its own process closes
    lines += [
        "(EngineCore_DP0 pid=277) ERROR 07-01 10:05:00 [core.py:700] torch.OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.20 GiB is free.",
        '(EngineCore_DP0 pid=277)   File "/x/gpu_model_runner.py", line 1, in execute_model',
        *_serving(40, 300),
        "(Worker_TP1 pid=380) ERROR 07-01 10:06:00 [worker.py:1] RuntimeError: CUDA error: out of memory",
        *_serving(40, 340),
        "(Worker_TP1 pid=380) INFO 07-01 10:06:30 [worker.py:2] Received request cmpl-w: prompt: 'x', "
        "params: None, prompt_token_ids: None",
        *_serving(20, 380),
        # unprefixed traceback lines: a block of key None, closed by an unprefixed normal line
        "Traceback (most recent call last):",
        '  File "/x/sampler.py", line 3, in _sample(',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
        *_serving(20, 400),
        "INFO 07-01 10:07:00 [logger.py:43] Received request cmpl-u: prompt: 'x', params: None, "
        "prompt_token_ids: [1, 2, 3]",
        *_serving(20, 420),
        # colour, a progress bar's carriage returns, WARN, a Ray worker, a compose column
        "\x1b[32m(APIServer pid=1) INFO 07-01 10:08:00 [logger.py:43] Received request cmpl-c: prompt: "
        "'x', params: None, prompt_token_ids: [4, 5]\x1b[0m",
        "(APIServer pid=1) INFO 07-01 10:08:00 [logger.py:43] Added request a.\rAdded request b.",
        "(APIServer pid=1) WARN 07-01 10:08:01 [logger.py:43] Added request cmpl-w.",
        "(RayWorkerWrapper pid=380, ip=10.0.0.2) INFO 07-01 10:08:02 [logger.py:43] Added request r.",
        "vllm-1  | (APIServer pid=1) INFO 07-01 10:08:03 [logger.py:43] Added request k.",
        *_serving(30, 440),
    ]
    # a restart in the middle of serving, then serving again
    lines += startup + _serving(200, 500)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096, 977])
def test_chunked_file_parse_equals_line_by_line(
    chunk_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _mixed_log()
    want, want_lines = _line_by_line(text)
    assert any(k == "request" for k, *_ in want) and any(k == "cuda_oom" for k, *_ in want)
    got = vllm_log.parse_log(text)
    assert _events(got.events) == want
    assert got.line_count == want_lines
    f = tmp_path / "vllm.log"
    f.write_text(text, encoding="utf-8")
    monkeypatch.setattr(vllm_log, "_CHUNK_BYTES", chunk_bytes)  # chunk edges anywhere
    log = vllm_log.parse_log_file(f, progress=False)
    assert _events(log.events) == want
    assert log.line_count == want_lines == text.count("\n")


def test_request_event_counts_ids_and_keeps_no_text() -> None:
    text = "\n".join(STARTUP.read_text(encoding="utf-8").splitlines() + [_req(1, "[1, 2, 3, 4]"), _req(2)])
    req = vllm_log.parse_log(text).of("request")
    assert [e.values["prompt_tokens"] for e in req] == [4]  # "prompt_token_ids: None" is no event
    assert req[0].text == "request with a 4-token prompt"
    assert req[0].process == "APIServer" and req[0].pid == 1 and req[0].time == "07-01 10:01:00"


_POOL = [
    _req(1),
    _req(2, "[1, 2]"),
    _req(3, "None", ""),
    _req(4, "[7]", "(EngineCore_DP0 pid=9) "),
    "(APIServer pid=1) INFO 07-01 10:00:00 [engine.py:317] Added request x.",
    "(APIServer pid=2) DEBUG 07-01 10:00:00.123 [engine.py:317] Finished request x.",
    '(APIServer pid=1) INFO:     10.0.0.1:5555 - "GET /metrics HTTP/1.1" 200 OK',
    'INFO:     [::1]:5555 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    "(APIServer pid=1) INFO 07-01 10:00:00 [api_server.py:1] Starting vLLM API server 0 on http://0.0.0.0:8000",
    "(APIServer pid=1) INFO 07-01 10:00:00 [api_server.py:1] vLLM API server version 0.10.1",
    "(APIServer pid=1) INFO 07-01 10:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
    "Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 50.0%, Preemptions: 2",
    "(EngineCore_DP0 pid=9) ERROR 07-01 10:00:00 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. "
    "Tried to allocate 1.00 GiB.",
    "(EngineCore_DP0 pid=9) INFO 07-01 10:00:00 [core.py:1] Added request y.",
    "(EngineCore_DP0 pid=10) INFO 07-01 10:00:00 [core.py:1] Added request y.",
    "Traceback (most recent call last):",
    '  File "/x/y.py", line 1, in capture_model',
    "INFO 07-01 10:00:00 [logger.py:43] Added request z.",
    "(APIServer pid=1) ERROR 07-01 10:00:00 [core.py:1] EngineDeadError",
    "",
    "\x1b[31mERROR\x1b[0m something",
    "(APIServer pid=1) INFO 07-01 10:00:00 [a.py:1] Added request p.\r(APIServer pid=1) ERROR x",
    # request lines with token ids in every header form the fast path reads
    "(APIServer pid=2) DEBUG 07-01 10:00:00.123 [engine.py:317] Finished request x, prompt_token_ids: [1, 2].",
    "(APIServer pid=1) WARN 07-01 10:00:00,5 [logger.py:43] Received request w: prompt_token_ids: [1, 2, 3]",
    "INFO:     Received request u: prompt: 'x', prompt_token_ids: [9, 9]",
    "(Worker[0] pid=3) INFO 07-01 10:00:00 logger.py:43] Added request a: prompt_token_ids: [<redacted 12 tokens>]",
    "(APIServer pid=1) INFO 07-01 10:00:00 [logger.py:43] Received request big: prompt: '"
    + "y" * 70_000
    + "', prompt_token_ids: [1, 2]",
    # a stats line cut short by a request line written over it (two processes, one file)
    "(APIServer pid=1) INFO 07-01 10:00:00 [loggers.py:1] Avg prompt throughput: 1.0 tokens/s, Avg "
    "generation throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.0%, "
    "Prefix(APIServer pid=1) INFO 07-01 10:02:00 [logger.py:43] Received request c: prompt: 'x', "
    "prompt_token_ids: [1, 2]",
    # periodic stats lines in the usual form and near it
    "(APIServer pid=1) INFO 07-01 10:00:01 [loggers.py:123] Engine 001: Avg prompt throughput: 1.5 tokens/s, "
    "Avg generation throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 51.5%, "
    "Prefix cache hit rate: 3.0%, Preemptions: 4",
    "(EngineCore_DP0 pid=9) WARN 07-01 10:00:01.25 [loggers.py:123] Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%",
    "INFO 07-01 10:00:02 loggers.py:123] Avg prompt throughput: 9 tokens/s, Avg generation throughput: 1 "
    "tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 100%, Preemptions: 0",
    "(APIServer pid=1) INFO 07-01 10:00:03 [loggers.py:123] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
    "Avg generation throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.0%, "
    "Preemptions: 2 extra",
    "(APIServer pid=1) INFO 07-01 10:00:04 [loggers.py:123] Engine 000: Avg prompt throughput: "
    + "9" * 700
    + " tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache "
    "usage: 5.0%",
    "(APIServer pid=1) INFO 07-01 10:00:00 [logger.py:43] Received request long: prompt_token_ids: ["
    + ", ".join(["7"] * 20_000)
    + "]",
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_POOL), min_size=1, max_size=60), st.integers(0, 3))
def test_any_mix_of_lines_parses_as_line_by_line(lines: list[str], serve_at: int) -> None:
    # serving from the start (the fast path) or after a few lines (the startup path first)
    text = "\n".join(lines[:serve_at] + [_POOL[0]] + lines[serve_at:]) + "\n"
    want, want_lines = _line_by_line(text)
    got = vllm_log.parse_log(text)
    assert _events(got.events) == want
    assert got.line_count == want_lines


_PIECES = st.sampled_from(
    [
        "(APIServer pid=1) ",
        "(APIServer pid=12) ",
        "(EngineCore_DP0 pid=277)",
        "(bad name) ",
        "",
        "INFO ",
        "DEBUG ",
        "WARN ",
        "WARNING ",
        "ERROR ",
        "INFO:     ",
        "INFO:\t",
        "07-01 10:00:00 ",
        "07-01 10:00:00.5 ",
        "07-0x 10:00:00 ",
        "[logger.py:43] ",
        "[engine.py:317] ",
        "loggers.py:9] ",
        "[a b:1] ",
        "Received request ",
        "Added request ",
        "Aborted request ",
        '10.0.0.1:5555 - "',
        '[::1]:80 - "',
        "x",
        " ",
        "\u0661",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_PIECES, min_size=1, max_size=7).map("".join), min_size=1, max_size=30))
def test_learnt_scan_regex_finds_what_the_general_one_finds(lines: list[str]) -> None:
    text = "\n".join(lines)
    scan = vllm_log._BulkScan()
    fast = scan.pattern(text, 0)
    for _ in range(3):  # learn more than one round, as over a file's chunks
        fast = scan.pattern(text, 0)
    general = vllm_log._NOT_REQUEST_LINE_RE
    assert [m.start() for m in fast.finditer("\n" + text)] == [
        m.start() for m in general.finditer("\n" + text)
    ]


def test_scan_learns_a_bounded_set_of_prefixes() -> None:
    lines = [_req(i, "None", f"(Worker_{i} pid={i}) ") for i in range(200)]
    text = "\n".join(lines)
    scan = vllm_log._BulkScan()
    for pos in range(0, len(text) - 1000, 997):
        scan.pattern(text, text.rfind("\n", 0, pos) + 1)
    assert 0 < len(scan.procs) <= vllm_log._SCAN_MAX_PROCS
    assert scan.tags == ("[logger.py:43]",)


def test_learnt_scan_regex_does_not_backtrack() -> None:
    # the scan regex is built at run time, so the module-level hygiene scan does not see it
    scan = vllm_log._BulkScan()
    text = "\n".join(_serving(50) + ["INFO 07-01 10:00:00 [x.py:1] Added request a."])
    pattern = scan.pattern(text, 0)
    assert scan.procs and scan.tags
    for filler in ("1", "a", " ", "(", "[", ":", "\n(APIServer pid=1) ", "\nINFO 07-01 ", "0.", "-"):
        body = filler * (16_000 // len(filler))
        t0 = time.perf_counter()
        for _ in pattern.finditer("\n" + body):
            pass
        assert time.perf_counter() - t0 < 0.25, filler


def test_scan_regex_literals_are_escaped() -> None:
    # a file tag with regex metacharacters is a literal, not a pattern
    assert vllm_log._scan_re(("(A.B pid=1) ",), ("[a+b.py:1]",)).search("\n(AxB pid=1) INFO") is not None
    assert re.escape("[a+b.py:1]") in vllm_log._scan_re(("",), ("[a+b.py:1]",)).pattern


def test_requests_right_after_a_restart_mark_the_run_serving() -> None:
    # a restart's banner, then request lines before any other serving marker, then an OOM:
    # the skipped request line must still make the new run "serving" (the OOM is at run time)
    banner = "(APIServer pid=1) INFO 07-01 11:00:00 [api_server.py:1] vLLM API server version 0.10.1"
    oom = (
        "(APIServer pid=1) ERROR 07-01 11:00:05 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 1.00 GiB."
    )
    text = "\n".join([*_serving(5), banner, _req(7), _req(8), oom, *_serving(5, 10)]) + "\n"
    want, _ = _line_by_line(text)
    assert [v for k, _, v, *_ in want if k == "cuda_oom"] and "'runtime'" in next(
        v for k, _, v, *_ in want if k == "cuda_oom"
    )
    assert _events(vllm_log.parse_log(text).events) == want


_STAT_NUMS = st.one_of(
    st.integers(0, 10**6).map(str), st.floats(0, 1e5).map(lambda f: f"{f:.1f}"), st.just("007")
)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(st.none(), st.sampled_from(["000", "1", "12"])),
    st.lists(_STAT_NUMS, min_size=9, max_size=9),
    st.sampled_from(["GPU", "CPU", "XPU"]),
    st.sampled_from(["v1", "v1-preemptions-mid", "v0"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["", ", Preemptions: 3, ", " extra", "."]),
    st.booleans(),
)
def test_fast_stats_path_gives_the_field_by_field_event(
    eng: str | None,
    n: list[str],
    device: str,
    form: str,
    cpu_kv: bool,
    prefix: bool,
    pre: bool,
    tail: str,
    chunked: bool,
) -> None:
    def i(x: str) -> str:
        return x.split(".")[0]

    middle = (
        f"Swapped: {i(n[7])} reqs, Pending: {i(n[8])} reqs, "
        if form == "v0"
        else f"Waiting: {i(n[3])} reqs, "
        + (f"Preemptions: {i(n[6])}, " if form == "v1-preemptions-mid" else "")
    )
    msg = (
        (f"Engine {eng}: " if eng is not None else "")
        + f"Avg prompt throughput: {n[0]} tokens/s, Avg generation throughput: {n[1]} tokens/s, "
        + f"Running: {i(n[2])} reqs, {middle}{device} KV cache usage: {n[4]}%"
        + (f", CPU KV cache usage: {n[7]}%" if cpu_kv else "")
        + (f", Prefix cache hit rate: {n[5]}%" if prefix else "")
        + (f", Preemptions: {i(n[6])}" if pre else "")
        + tail
    )
    line = f"(APIServer pid=1) INFO 07-01 10:00:00 [loggers.py:1] {msg}"
    # no fast path at all: the line goes through the whole matcher chain to the stats branch
    slow = vllm_log._Parser("x")
    slow._match_stats_fast = lambda *a: False  # type: ignore[method-assign]
    slow.feed(line)
    if chunked:  # the chunk path of a serving log: the line read by one match, made lazily
        serving = "(APIServer pid=1) INFO 07-01 10:00:00 [api_server.py:1] Application startup complete."
        fast = vllm_log._Parser("x", bounded=True)
        fast.feed_chunk(serving + "\n" + line)
        fast.finish()
        slow2 = vllm_log._Parser("x", bounded=True)
        slow2._match_stats_fast = lambda *a: False  # type: ignore[method-assign]
        slow2.feed(serving)
        slow2.feed(line)
        slow2.finish()
        assert _events(fast.log.events) == _events(slow2.log.events)
        assert fast.log.engine_generation == slow2.log.engine_generation
        return
    fast = vllm_log._Parser("x")
    fast.feed(line)
    assert _events(fast.log.events) == _events(slow.log.events)
    assert fast.log.engine_generation == slow.log.engine_generation
    assert len(fast.log.events) == 1


def test_every_stats_form_of_the_tests_takes_the_fast_path() -> None:
    # the forms real logs have (V1 >= 0.12, V1 0.8-0.11 with Preemptions after Waiting, V0):
    # each is read by one match
    lines = [
        ln.split("] ", 1)[1]
        for p in sorted((DATA / "vllm_log").glob("*.log")) + sorted((DATA / "bundles").glob("*/vllm.log"))
        for ln in p.read_text(encoding="utf-8", errors="replace").splitlines()
        if "Avg prompt throughput" in ln and "] " in ln
    ]
    assert len(lines) > 100
    slow = [m for m in lines if vllm_log._STATS_FAST_RE.fullmatch(m) is None]
    assert len(slow) <= len(lines) // 50, slow[:3]


_IDS_REFERENCE_RE = re.compile(r"prompt_token_ids: \[(?:<redacted (\d+) tokens>\]|([^\]]*)\]?)")


def _ids_reference(message: str) -> int | None:
    # the regex form request_prompt_tokens had before it counted commas with str methods
    m = _IDS_REFERENCE_RE.search(message)
    if not m:
        return None
    if m.group(1):
        return int(m.group(1))
    body = (m.group(2) or "").strip().rstrip(",")
    return body.count(",") + 1 if body else 0


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "prompt_token_ids: [",
                "prompt_token_ids: ",
                "<redacted ",
                "12",
                " tokens>",
                "]",
                ",",
                ", ",
                " ",
                "x",
                "[",
                "\u0663",
            ]
        ),
        max_size=12,
    ).map("".join)
)
def test_prompt_token_count_matches_the_regex_form(message: str) -> None:
    from kvdoctor.sources.log_engines import request_prompt_tokens

    assert request_prompt_tokens(message) == _ids_reference(message)


def test_request_lines_past_the_history_are_kept_as_line_by_line() -> None:
    # more request lines than a run's history keeps: the fast path keeps the same head and tail
    lines = STARTUP.read_text(encoding="utf-8").splitlines()
    for i in range(2500):
        lines.append(_req(i, f"[{', '.join('1' * (1 + i % 5))}]"))
        if i == 1700:
            lines.append(
                "(EngineCore_DP0 pid=277) ERROR 07-01 10:05:00 [core.py:700] torch.OutOfMemoryError: CUDA "
                "out of memory. Tried to allocate 2.00 GiB."
            )
    text = "\n".join(lines) + "\n"
    want, want_lines = _line_by_line(text)
    got = vllm_log.parse_log(text)
    assert _events(got.events) == want
    assert got.line_count == want_lines
    pinned = vllm_log._PINNED_BEFORE_ERROR["request"]
    assert len(got.of("request")) == sum(vllm_log._HISTORY_DEFAULT) + pinned < 2500
    # the requests that led up to the OOM are kept although 800 more followed it
    oom = got.of("cuda_oom")[0].line
    before = [e.line for e in got.of("request") if e.line < oom]
    assert before[-pinned:] == list(range(oom - pinned, oom))


def test_stats_lines_past_the_history_are_kept_as_line_by_line() -> None:
    # more stats lines than a run's history keeps, preemptions among them: the fast path keeps
    # the same head and tail and hands the dropped lines' preemptions on the same way
    lines = STARTUP.read_text(encoding="utf-8").splitlines()
    n = sum(vllm_log._HISTORY_LIMITS["stats"]) + 2500
    for i in range(n):
        lines.append(
            f"(APIServer pid=1) INFO 07-01 10:{i % 60:02d}:00 [loggers.py:123] Engine 00{i % 2}: Avg prompt "
            f"throughput: {i}.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: {i % 9} reqs, "
            f"Waiting: 0 reqs, GPU KV cache usage: 50.0%, Prefix cache hit rate: 1.0%"
            + (f", Preemptions: {i % 4}" if i % 3 else "")
        )
    text = "\n".join(lines) + "\n"
    want, want_lines = _line_by_line(text)
    got = vllm_log.parse_log(text)
    assert _events(got.events) == want
    assert got.line_count == want_lines
    stats = got.of("stats")
    assert len(stats) == sum(vllm_log._HISTORY_LIMITS["stats"]) < n
    startup = sum(e.values["preemptions"] or 0 for e in vllm_log.parse_log(STARTUP.read_text()).of("stats"))
    assert sum(e.values["preemptions"] or 0 for e in stats) == startup + sum(i % 4 for i in range(n) if i % 3)


def test_pinned_requests_hold_no_line_text() -> None:
    # a request line may be 64 KiB (the prompt's text is logged): the history's tail holds a
    # thousand of them at most, and a pin (thousands over a run) holds the event alone
    lines = STARTUP.read_text(encoding="utf-8").splitlines()
    prompt = "p" * 60_000
    for i in range(1200):
        lines.append(
            f"(APIServer pid=1) INFO 07-01 10:00:00 [logger.py:43] Received request r{i}: prompt: '{prompt}', "
            f"prompt_token_ids: [1, 2, {i}]"
        )
        if i % 100 == 99:
            lines.append(
                f"(EngineCore_DP0 pid=277) ERROR 07-01 10:05:00 [core.py:700] torch.OutOfMemoryError: CUDA out "
                f"of memory. Tried to allocate {i}.00 MiB."
            )
            lines.append("(EngineCore_DP0 pid=277) INFO 07-01 10:05:01 [core.py:1] the engine goes on")
    parser = vllm_log._Parser("x", bounded=True)
    parser.feed_chunk("\n".join(lines))
    hist = parser._history["request"]
    assert len(hist.pinned) > 500
    assert all(isinstance(ev, vllm_log.LogEvent) for _, ev in hist.pinned)
    assert all(len(ev.text) < 100 for _, ev in hist.pinned)


def test_mutated_real_logs_parse_as_line_by_line() -> None:
    # a differential fuzz: real logs with serving traffic, mutated by the fuzz harness (glued
    # lines, cut lines, inserted vocabulary), read by the chunk path and line by line
    import random

    from tests import fuzz_harness

    seeds = [
        p.read_text(encoding="utf-8", errors="replace") for p in sorted((DATA / "vllm_log").glob("*.log"))
    ]
    words = [w.encode() for w in _POOL if len(w) < 2000] + [
        b"\n",
        b"Avg prompt throughput: ",
        b"prompt_token_ids: [1, 2]",
        b"Preemptions: 3",
        b"Swapped: 1 reqs, Pending: 2 reqs, ",
    ]
    rng = random.Random(27)
    for _ in range(150):
        base = rng.choice(seeds) + "\n".join(_serving(rng.randint(5, 60))) + "\n"
        text = fuzz_harness.mutate(rng, base.encode(), words).decode("utf-8", "replace")
        want, want_lines = _line_by_line(text)
        got = vllm_log.parse_log(text)
        assert _events(got.events) == want
        assert got.line_count == want_lines
