"""Snapshot tests: the main screen of the demo and of a multi-engine (DP=2) bundle at 80×24,
120×40 and 200×50, and a finding's detail screen, as SVG screenshots compared with the saved
ones in ``tests/watch/snapshots/``; each main screen shows every finding's whole first line.

Volatile parts are fixed: the demo replay is paused at one snapshot (times are the recording's),
the host name is given, and Rich's per-export ``terminal-NNN`` class ids are normalised. After an
intended change of the screen, regenerate with ``KVDOCTOR_UPDATE_SNAPSHOTS=1 pytest tests/watch``
and look at the SVGs; a mismatch writes ``NAME.actual.svg`` next to the saved one.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
from textual.widgets import Footer

from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.watch.app import DetailScreen, WatchApp
from kvdoctor.watch.panels import SEVERITY_SHORT

from .conftest import flat, make_app, screen_lines, wait_for

BUNDLE = Path(__file__).parents[1] / "data" / "bundles" / "r04-dp2-engines-preempting"

SNAPSHOTS = Path(__file__).parent / "snapshots"


def normalise(svg: str) -> str:
    """Drop what changes between identical screens: Rich's ``terminal-<hash>`` ids."""
    return re.sub(r"terminal-\d+", "terminal", svg)


def check(name: str, svg: str) -> None:
    saved = SNAPSHOTS / f"{name}.svg"
    got = normalise(svg)
    if os.environ.get("KVDOCTOR_UPDATE_SNAPSHOTS"):
        saved.write_text(got, encoding="utf-8")
        return
    if not saved.exists():
        (SNAPSHOTS / f"{name}.actual.svg").write_text(got, encoding="utf-8")
        pytest.fail(f"no saved snapshot {saved.name}; run with KVDOCTOR_UPDATE_SNAPSHOTS=1")
    if saved.read_text(encoding="utf-8") != got:
        (SNAPSHOTS / f"{name}.actual.svg").write_text(got, encoding="utf-8")
        pytest.fail(f"screen differs from {saved.name}; see {name}.actual.svg")


async def _main_and_detail(feed, pipeline, size):
    app = make_app(feed, pipeline, start_at=150, paused=True)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
        await wait_for(pilot, lambda: bool(app.query_one(Footer).children))  # composed late
        await pilot.pause(0.3)
        main = app.export_screenshot()
        idx = next(i for i, r in enumerate(app.view.findings) if r.finding.rule == "preemption-storm")
        app.query_one("#findings-list").highlighted = idx
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        await wait_for(pilot, lambda: bool(app.screen.query_one(Footer).children))
        await pilot.pause(0.3)
        detail = app.export_screenshot()
    return main, detail


def test_main_and_detail_screens_match_saved_svgs(demo_feed, pipeline):
    main, detail = asyncio.run(_main_and_detail(demo_feed, pipeline, (120, 40)))
    check("main-120x40", main)
    check("detail-120x40", detail)


async def _main(app, size, ready):
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, ready)
        await wait_for(pilot, lambda: bool(app.query_one(Footer).children))
        await pilot.pause(0.3)
        return app.export_screenshot()


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)])
@pytest.mark.parametrize("source", ["demo", "bundle"])
def test_main_screens_at_three_sizes(demo_feed, pipeline, source, size):
    if source == "demo":
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        svg = asyncio.run(_main(app, size, lambda: app.view is not None and app.view.position == 150))
    else:
        app = WatchApp(open_feed(InputOptions(bundle=BUNDLE)), pipeline, host="test-host")
        svg = asyncio.run(_main(app, size, lambda: app.view is not None and app.controller.ended))
    text = flat("\n".join(screen_lines(svg)))
    for row in app.view.findings:
        f = row.finding
        assert flat(f"{SEVERITY_SHORT[f.severity]} {f.title}") in text, f"{f.rule} cut at {size}"
    check(f"{source}-{size[0]}x{size[1]}", svg)


def test_screens_are_deterministic(pipeline):
    """The same input gives the same SVG (what makes the comparison above meaningful)."""
    from kvdoctor.sources.recording import open_recording
    from kvdoctor.watch.command import demo_recording_path

    def feed():
        f = open_recording(demo_recording_path())
        f.label = "demo"
        return f

    a = asyncio.run(_main_and_detail(feed(), pipeline, (80, 24)))
    b = asyncio.run(_main_and_detail(feed(), pipeline, (80, 24)))
    assert normalise(a[0]) == normalise(b[0]) and normalise(a[1]) == normalise(b[1])
