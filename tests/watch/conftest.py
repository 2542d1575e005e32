"""Factories for the watch tests: the demo recording's feed, a pipeline loaded once, an app
started paused at a fixed replay position (deterministic screens)."""

from __future__ import annotations

import asyncio
import html
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvdoctor.pipeline import Pipeline
from kvdoctor.sources.recording import RecordingFeed, open_recording
from kvdoctor.watch.command import demo_recording_path


@pytest.fixture(scope="session")
def pipeline() -> Pipeline:
    """The shipped rules, loaded once."""
    return Pipeline.load()


@pytest.fixture
def demo_feed() -> RecordingFeed:
    """A fresh feed over the bundled demo recording, labelled as ``watch --demo`` labels it."""
    feed = open_recording(demo_recording_path())
    feed.label = "demo"
    return feed


def make_app(
    feed: Any, pipeline: Pipeline, *, start_at: int | None = None, paused: bool = False, **kw: Any
) -> Any:
    """A WatchApp with a fixed host name; ``paused`` sets the loop paused before it starts, so
    a replay shows exactly snapshot ``start_at``."""
    from kvdoctor.watch.app import WatchApp

    app = WatchApp(feed, pipeline, start_at=start_at, host="test-host", **kw)
    if paused:
        app.controller.loop.paused.set()
    return app


async def wait_for(pilot: Any, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Let the app run until ``cond()`` holds (hang guard: fails after ``timeout`` s)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.05)
    await asyncio.sleep(0)


_SVG_TEXT = re.compile(
    r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="([\d.]+)" '
    r'clip-path="url\(#[\w-]*-line-(\d+)\)">([^<]*)</text>'
)


def screen_lines(svg: str) -> list[str]:
    """The text of an ``export_screenshot`` SVG, one string per terminal row (each span put
    at its column: Rich writes a cell as ``textLength / len`` units, spans may leave gaps)."""
    rows: dict[int, list[str]] = {}
    cell = None
    spans = []
    for x, length, line, raw in _SVG_TEXT.findall(svg):
        text = html.unescape(raw).replace("\xa0", " ")
        if text and cell is None:
            cell = float(length) / len(text)
        spans.append((float(x), int(line), text))
    for x, line, text in spans:
        col = round(x / (cell or 1))
        row = rows.setdefault(line, [])
        row.extend(" " * max(0, col + len(text) - len(row)))
        row[col : col + len(text)] = list(text)
    return ["".join(rows.get(i, [])).rstrip() for i in range(max(rows, default=-1) + 1)]


def flat(text: str) -> str:
    """Whitespace runs as one space (a wrapped line read back as one)."""
    return " ".join(text.split())
