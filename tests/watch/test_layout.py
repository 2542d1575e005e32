"""The findings lead the screen at every size: at 80×24, 120×40 and 200×50, of the demo and of a
multi-engine bundle, every finding's whole first line (severity and title), its fix line and
its engine and GPUs are on the screen; the footer keeps its keys at 80×24; the header clock is
whole; a static bundle shows no play/seek keys; a replay says when it has ended."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.widgets import Footer

from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.watch.app import WatchApp, plan_layout
from kvdoctor.watch.panels.findings import fix_text, scope_text

from .conftest import flat, make_app, screen_lines, wait_for

BUNDLE = Path(__file__).parents[1] / "data" / "bundles" / "r04-dp2-engines-preempting"
SIZES = [(80, 24), (120, 40), (200, 50)]


def _bundle_app(pipeline):
    return WatchApp(open_feed(InputOptions(bundle=BUNDLE)), pipeline, host="test-host")


async def _screen(app, size, ready):
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, ready)
        await wait_for(pilot, lambda: bool(app.query_one(Footer).children))
        await pilot.pause(0.3)
        return app, screen_lines(app.export_screenshot())


def _check_findings_visible(app, lines, size):
    w, h = size
    assert len(lines) == h and all(len(line) <= w for line in lines)
    text = flat("\n".join(lines))
    active = [r for r in app.view.findings if r.resolved_at is None]
    assert active, "the input has findings"
    for row in active:
        f = row.finding
        sev = {"critical": "CRIT", "warning": "WARN", "info": "INFO"}[f.severity]
        assert flat(f"{sev} {f.title}") in text, f"{f.rule}: first line not whole at {size}"
        if fix_text(f):
            assert flat(f"Fix: {fix_text(f)}") in text, f"{f.rule}: fix cut at {size}"
        assert f"[{scope_text(f)}]" in text, f"{f.rule}: engine/GPU not shown at {size}"
    # The findings come first, right under the header.
    assert lines[2].startswith("─[1] Findings")
    # Header: the clock is whole at the right.
    assert lines[0].rstrip().endswith("Z") and ":" in lines[0][-10:]
    # Footer keeps the keys a session needs.
    footer = lines[-1]
    for key in ("q Quit", "? Help", "/ Filter", "b Bundle", "t Procs"):
        assert key in footer, f"{key!r} not in footer at {size}: {footer!r}"


@pytest.mark.parametrize("size", SIZES)
def test_demo_findings_lead_at_every_size(demo_feed, pipeline, size):
    app = make_app(demo_feed, pipeline, start_at=150, paused=True)
    app, lines = asyncio.run(_screen(app, size, lambda: app.view is not None and app.view.position == 150))
    _check_findings_visible(app, lines, size)
    text = "\n".join(lines)
    assert "foreign" in text  # the foreign GPUs' bars say so in a word, not only in red
    assert "‖ REPLAY demo 151/240" in lines[0] and "10:42:30Z" in lines[0]
    for key in ("p Pause", "←→ Seek", "[] Speed"):
        assert key in lines[-1]
    if size == (200, 50):
        # rows to spare: whole summaries, then the evidence, rather than empty rows
        assert "· max_num_seqs: 256" in text and "parallelism (--tensor-parallel-size 2)." in text
        findings_rows = lines[3 : next(i for i, x in enumerate(lines) if x.startswith("─[2] Engines"))]
        assert sum(1 for x in findings_rows if not x.strip()) <= 2


@pytest.mark.parametrize("size", SIZES)
def test_bundle_findings_lead_and_no_replay_keys(pipeline, size):
    app = _bundle_app(pipeline)
    app, lines = asyncio.run(_screen(app, size, lambda: app.view is not None and app.controller.ended))
    _check_findings_visible(app, lines, size)
    assert app.controller.static and not app.controller.replay
    assert "■ bundle r04-dp2-engines-preempting" in lines[0] and "▶" not in lines[0]
    for key in ("Seek", "Speed", "Pause", "Play", "Rec", "Interval"):
        assert key not in lines[-1], f"a static bundle offers {key}"
    # Two DP engines, each with throughput and latency figures.
    text = "\n".join(lines)
    assert text.count("tok/s") >= 2 and text.count("req/s") >= 2
    # Only what the bundle's end shows: no finding "resolved" on the way there.
    assert all(r.resolved_at is None for r in app.view.findings)


def test_replay_says_when_it_has_ended(demo_feed, pipeline):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=230)
        async with app.run_test(size=(120, 40)) as pilot:
            app.controller.change_speed(10)  # 16×
            await wait_for(pilot, lambda: app.controller.ended and app.view is not None, timeout=30)
            await pilot.pause(0.2)
            header = screen_lines(app.export_screenshot())[0]
            assert "END of replay 240/240" in header and "▶" not in header
            await pilot.press("p")  # again, from the start
            await wait_for(pilot, lambda: not app.controller.ended and app.view.position < 100)
            assert "END" not in screen_lines(app.export_screenshot())[0]

    asyncio.run(go())


def test_plan_gives_findings_their_rows_before_cards_grow():
    shown = dict.fromkeys(("gpus", "engines", "findings", "sources"), True)
    # 6 cards (8 GPUs, 3 idle ones on one line), one engine, findings needing 10/16/20/26/30 rows
    need = (10, 16, 20, 26, 30)
    small = plan_layout(80, 24, [True, False, True, True, True, True], 1, shown, need)
    assert small.gpu_lines == 1 and small.findings_level == 0
    assert 24 - 1 - small.header_height - small.gpu_height - small.engine_height >= need[0] + 1
    mid = plan_layout(120, 40, [True, False, True, True, True, True], 1, shown, need)
    assert mid.findings_level == 2  # summaries before bigger cards
    assert 40 - 1 - mid.header_height - mid.gpu_height - mid.engine_height >= need[2] + 1
    # Room to spare: cards at full size, and the whole summaries and evidence too.
    big = plan_layout(200, 80, [True, False, True, True, True, True], 1, shown, need)
    assert big.gpu_lines == 4 and big.engine_lines == 4 and big.findings_level == 4
    just = plan_layout(200, 60, [True, False, True, True, True, True], 1, shown, (10, 16, 20, 22, 60))
    assert just.gpu_lines == 4 and just.findings_level == 3
    # Not even titles fit: one-line cards, and the findings still get their rows.
    tight = plan_layout(80, 24, [True, False, True, True, True, True], 1, shown, (40, 40, 40, 40, 40))
    assert tight.gpu_lines == 1 and tight.findings_level == 0
    assert 24 - 1 - tight.header_height - tight.gpu_height - tight.engine_height >= 5
    # No findings: the cards and engines take the rows.
    none = plan_layout(120, 40, [True, False, True, True, True, True], 1, shown, (1, 1, 1, 1, 1))
    assert none.gpu_lines >= 3
