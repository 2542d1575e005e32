"""A log read past its time budget (issue 27 items 2 and 9): the rest is counted, the latest
run's start and the file's end are parsed, and ``VllmLog.cut`` names the lines that were not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvdoctor.sources import vllm_log

STARTUP = (
    Path(__file__).resolve().parents[1] / "data" / "vllm_log" / "b17-v1-preemption-thrash-long-prompts.log"
)
OOM = (
    "(EngineCore_DP0 pid=277) ERROR 07-01 11:00:00 [core.py:700] torch.OutOfMemoryError: CUDA out of "
    "memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.20 GiB is free."
)


def _stats(i: int) -> str:
    return (
        f"(APIServer pid=1) INFO 07-01 10:{i % 60:02d}:00 [loggers.py:123] Engine 000: Avg prompt "
        f"throughput: {i}.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: {i % 9} reqs, "
        f"Waiting: 0 reqs, GPU KV cache usage: 50.0%, Prefix cache hit rate: 1.0%, Preemptions: 0"
    )


def _log(tmp_path: Path, runs: int, serving: int, oom_at_end: bool = True) -> Path:
    startup = [ln for ln in STARTUP.read_text(encoding="utf-8").splitlines() if "Engine 000" not in ln][:120]
    lines: list[str] = []
    for _ in range(runs):
        lines += startup + [_stats(i) for i in range(serving)]
    if oom_at_end:
        lines.append(OOM)
    f = tmp_path / "vllm.log"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


def test_past_the_budget_the_last_run_and_the_end_are_parsed(tmp_path: Path, small_cut: None) -> None:
    f = _log(tmp_path, runs=3, serving=400)
    full = vllm_log.parse_log_file(f, progress=False)
    cut = vllm_log.parse_log_file(f, progress=False, deadline=time.monotonic() - 1)
    assert full.cut == ""
    assert cut.line_count == full.line_count  # every line counted
    # the first chunk was parsed, then earlier runs and the middle of the last one were skipped
    assert "earlier runs" in cut.cut and "the middle of the last run" in cut.cut
    assert "time budget" in cut.cut
    # the same OOM at the same line, the same version: the current run's state is whole
    assert [e.line for e in cut.of("cuda_oom")] == [e.line for e in full.of("cuda_oom")] != []
    assert cut.vllm_version == full.vllm_version
    # every event kept is one the full read has, at the same line
    full_events = {(e.kind, e.line, e.text) for e in full.events}
    assert {(e.kind, e.line, e.text) for e in cut.events} <= full_events
    assert len(cut.of("stats")) < len(full.of("stats"))
    # the last run's startup was parsed: its version event is at the last run's banner
    assert max(e.line for e in cut.of("version")) == max(e.line for e in full.of("version"))


def test_the_ranges_named_are_the_lines_missing(tmp_path: Path, small_cut: None) -> None:
    f = _log(tmp_path, runs=3, serving=400)
    full = vllm_log.parse_log_file(f, progress=False)
    cut = vllm_log.parse_log_file(f, progress=False, deadline=time.monotonic() - 1)
    import re

    ranges = [
        (int(a.replace(",", "")), int(b.replace(",", "")))
        for a, b in re.findall(r"lines ([\d,]+)-([\d,]+)", cut.cut)
    ]
    assert len(ranges) == 2

    def skipped(line: int) -> bool:
        return any(a <= line <= b for a, b in ranges)

    kept = {(e.kind, e.line) for e in cut.events}
    # every event of the full read outside the named ranges is kept (stats are a bounded
    # history in both); none inside them is
    want = {(e.kind, e.line) for e in full.events if not skipped(e.line)}
    assert kept == want


def test_a_rest_that_fits_is_parsed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # near miss: the budget ran out, but the rest is within the kept head and tail: nothing cut
    monkeypatch.setattr(vllm_log, "_CHUNK_BYTES", 4096)
    f = _log(tmp_path, runs=2, serving=50)
    full = vllm_log.parse_log_file(f, progress=False)
    late = vllm_log.parse_log_file(f, progress=False, deadline=time.monotonic() - 1)
    assert late.cut == ""
    assert [(e.kind, e.line, e.text) for e in late.events] == [(e.kind, e.line, e.text) for e in full.events]


def test_no_deadline_no_cut(tmp_path: Path, small_cut: None) -> None:
    f = _log(tmp_path, runs=3, serving=400)
    assert vllm_log.parse_log_file(f, progress=False, deadline=time.monotonic() + 3600).cut == ""


def test_one_long_run_keeps_its_start_and_end(tmp_path: Path, small_cut: None) -> None:
    # no restart after the budget ran out: the middle of the one run is what is cut
    f = _log(tmp_path, runs=1, serving=3000)
    full = vllm_log.parse_log_file(f, progress=False)
    cut = vllm_log.parse_log_file(f, progress=False, deadline=time.monotonic() - 1)
    assert "the middle of the run" in cut.cut and "earlier runs" not in cut.cut
    assert cut.line_count == full.line_count
    assert [e.line for e in cut.of("cuda_oom")] == [e.line for e in full.of("cuda_oom")]
    assert cut.of("stats")[-1].line == full.of("stats")[-1].line
