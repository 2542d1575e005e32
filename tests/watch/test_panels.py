"""Panel renderers on their own: the fix line (``suggested_flags`` today, the first of
``fixes`` alternatives when a finding has them), wrapping that never cuts a title, the bar's
words, the header clock."""

from __future__ import annotations

from types import SimpleNamespace

from kvdoctor.breakdown import GpuBreakdown, MemoryPart
from kvdoctor.findings import Finding
from kvdoctor.watch.controller import FindingRow
from kvdoctor.watch.panels.findings import finding_lines, fix_text, rows_needed
from kvdoctor.watch.panels.gpus import memory_bar

GiB = 2**30


def _finding(**kw) -> Finding:
    base = dict(
        rule="r", severity="warning", family="K", title="t", summary="s", engine="org/model", gpus=[0]
    )
    base.update(kw)
    return Finding(**base)


def test_fix_line_from_the_first_alternative_or_the_flags():
    from kvdoctor.findings import Fix

    f = _finding(suggested_flags={"--max-num-seqs": "26", "--enforce-eager": ""})
    assert fix_text(f) == "--max-num-seqs 26 --enforce-eager"  # a report/1 finding
    f.fixes = [
        Fix({"--kv-cache-dtype": "fp8"}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        Fix({"--max-num-seqs": "26"}),
    ]
    assert fix_text(f) == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --kv-cache-dtype fp8"
    f.fixes = [Fix(commands=("kill 4242",), why="frees the memory")]
    assert fix_text(f) == "kill 4242"
    # an alternative that is not a Fix (a dict, an object) reads the same way
    f.fixes = [{"flags": {"--max-num-seqs": "26"}, "commands": ["kill 1"]}]  # type: ignore[list-item]
    assert fix_text(f) == "kill 1; then relaunch with --max-num-seqs 26"
    f.fixes = [SimpleNamespace(flags={}, env={}, commands=["kill 4242"], why="")]  # type: ignore[list-item]
    assert fix_text(f) == "kill 4242"
    assert fix_text(_finding()) == ""


def test_a_long_title_wraps_whole_and_levels_order_the_rows():
    title = "A title long enough to need two lines at forty columns, never cut"
    row = FindingRow(_finding(title=title, summary="word " * 60, suggested_flags={"--x": "1"}), 0.0)
    lines = [str(t) for t in finding_lines(row, 0.0, 40, level=0)]
    assert all(len(x) <= 40 for x in lines)
    assert " ".join(" ".join(lines).split()).startswith(f"WARN {title}")
    assert "…" not in " ".join(lines[:2])
    counts = [rows_needed([row], 0.0, 40, lv) for lv in range(5)]
    assert counts == sorted(counts) and counts[3] > counts[2] > counts[1]


def test_bar_names_its_parts():
    b = GpuBreakdown(
        0,
        "L40S",
        45 * GiB,
        38 * GiB,
        parts=[MemoryPart("foreign", 38 * GiB, "nvml"), MemoryPart("free", 7 * GiB, "nvml")],
    )
    assert "foreign" in memory_bar(b, 40).plain
    assert "foreign" not in memory_bar(b, 8).plain  # no room: the legend and colour carry it


def test_level_rows_are_the_rows_each_level_draws(demo_feed, pipeline):
    """The layout's row counts (two wraps per finding) equal what each level draws."""
    from kvdoctor.watch.controller import Controller
    from kvdoctor.watch.panels.findings import LEVELS, level_rows

    views = []
    c = Controller(demo_feed, pipeline, views.append)
    c.loop.paused.set()
    c.seek(150)
    rows = views[-1].findings + [FindingRow(_finding(title="resolved", summary="x " * 90), 0.0, 1.0)]
    rows.append(FindingRow(_finding(engine=None, gpus=[], summary="no scope " * 30), 0.0))
    for width in (40, 77, 117, 197):
        for r in rows:
            drawn = tuple(len(finding_lines(r, 0.0, width, lv)) for lv in LEVELS)
            assert level_rows(r, 0.0, width) == drawn, (width, r.finding.rule)
    c.stop()


def test_detail_lists_every_fix_alternative():
    from kvdoctor.findings import Fix
    from kvdoctor.watch.app import DetailScreen

    f = _finding(suggested_flags={"--max-num-seqs": "26"})
    f.fixes = [
        Fix({"--max-num-seqs": "26"}, why="fewer sequences, each with its KV"),
        Fix({"--kv-cache-dtype": "fp8"}, why="about 2x the tokens"),
    ]
    text = "\n".join(str(p) for p in DetailScreen(FindingRow(f, 0.0), None, None)._parts())
    assert "Fix: --max-num-seqs 26  — fewer sequences" in text and "  or --kv-cache-dtype fp8" in text


def test_header_marks_a_source_read_in_part():
    """A bundle whose log the time budget cut (``SourceStatus.cut`` with "ok"): the header says
    it was read in part, beside a file not read at all and one read whole."""
    from kvdoctor.facts import Snapshot, SourceStatus
    from kvdoctor.sources.bundle import NOT_READ_OUT_OF_TIME
    from kvdoctor.watch.controller import SourceRow, View
    from kvdoctor.watch.panels.header import Mode, render

    sources = [
        SourceStatus("nvidia-smi", "b/nvidia-smi.txt", "ok", "1 GPU(s)"),
        SourceStatus("cmdline", "b/cmdline.txt", "error", NOT_READ_OUT_OF_TIME, cut=NOT_READ_OUT_OF_TIME),
        SourceStatus(
            "log", "b/vllm.log", "ok", "9 lines; time budget ran out: …", cut="time budget ran out: …"
        ),
    ]
    view = View(index=1, now=0.0, snapshot=Snapshot(), report=None, sources=[SourceRow(s) for s in sources])
    mode = Mode(live=False, replay=False, paused=False, recording=False, interval_s=1.0, static=True)
    text = render(view, mode, "host", 200).plain
    assert "✓ nvidia-smi" in text
    assert "◐ log (read in part: the time budget ran out)" in text
    assert "✗ cmdline" in text and "not read: the time budget" in text
