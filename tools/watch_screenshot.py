"""Make ``docs/watch.png``, the README's screenshot of ``kvdoctor watch --demo``.

Replays the bundled demo recording paused at snapshot 150 (the engine under KV pressure,
preempting), saves Textual's SVG screenshot and converts it with ``rsvg-convert`` (Debian
``librsvg2-bin``). Run from the repository root: ``python tools/watch_screenshot.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from textual.widgets import Footer

from kvdoctor.pipeline import Pipeline
from kvdoctor.sources.recording import open_recording
from kvdoctor.watch.app import WatchApp
from kvdoctor.watch.command import demo_recording_path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "watch.png"


async def _svg(size: tuple[int, int], position: int) -> str:
    feed = open_recording(demo_recording_path())
    feed.label = "demo"
    app = WatchApp(feed, Pipeline.load(), start_at=position, host="gpu-node-7")
    app.controller.loop.paused.set()
    async with app.run_test(size=size) as pilot:
        for _ in range(400):
            if app.view is not None and app.query_one(Footer).children:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        return app.export_screenshot(title="kvdoctor watch --demo")


def main() -> None:
    """Write docs/watch.png (and keep the SVG next to it)."""
    svg = asyncio.run(_svg((120, 40), 150))
    # rsvg-convert drops leading spaces of text runs unless whitespace is preserved.
    svg = svg.replace('<svg class="rich-terminal"', '<svg xml:space="preserve" class="rich-terminal"', 1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "watch.svg"
        src.write_text(svg, encoding="utf-8")
        try:
            subprocess.run(["rsvg-convert", str(src), "-o", str(OUT)], check=True)
        except FileNotFoundError:
            sys.exit("rsvg-convert not found: apt-get install librsvg2-bin")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
