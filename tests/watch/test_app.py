"""Pilot tests of ``kvdoctor watch`` (App.run_test): the demo shows the expected findings, every
key works, a dead /metrics endpoint shows its error while the screen keeps updating, a slow
source never freezes the screen, replay seeks, 80×24 and 200×60 render."""

from __future__ import annotations

import re
import threading
import time

import pytest

from kvdoctor.facts import Snapshot
from kvdoctor.watch.app import DetailScreen, HelpScreen, WatchApp, plan_layout

from .conftest import make_app, wait_for


def run(coro):
    import asyncio

    return asyncio.run(coro)


def _header(app: WatchApp) -> str:
    return str(app.query_one("#header").render())


def _findings_text(app: WatchApp) -> str:
    ol = app.query_one("#findings-list")
    return "\n".join(str(ol.get_option_at_index(i).prompt) for i in range(ol.option_count))


def test_demo_shows_the_incident_findings(demo_feed, pipeline):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            await pilot.pause(0.1)
            rules = [r.finding.rule for r in app.view.findings]
            assert "preemption-storm" in rules and "gpu-shared-with-foreign-process" in rules
            text = _findings_text(app)
            assert "Fix:" in text and "--max-num-seqs" in text
            assert "REPLAY demo 151/240" in _header(app)
            assert "WARNING" in _header(app)
            gpus = str(app.query_one("#gpus").render())
            # idle GPUs of one model share a line; bars carry their parts' words
            assert "GPU0" in gpus and "GPU1,2,3" in gpus and "GPU7" in gpus
            assert "weights" in gpus and "KV" in gpus and "foreign" in gpus
            engines = str(app.query_one("#engines").render())
            assert "194,384 tok" in engines and "preempt" in engines and "/min" in engines
            assert "8.3k tok/s" in engines and "74 tok/s" in engines and "0.15 req/s" in engines
            assert "TTFT p50 12.2s p99 19.8s" in engines and "ITL p50 61ms p99 99ms" in engines

    run(go())


def test_every_key(demo_feed, pipeline, tmp_path):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True, out_dir=tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            c = app.controller
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            # ? and h: help; Esc closes it
            for key in ("question_mark", "h"):
                await pilot.press(key)
                assert isinstance(app.screen, HelpScreen)
                await pilot.press("escape")
                assert not isinstance(app.screen, HelpScreen)
            # → / ← seek (replay), shift for ten steps
            await pilot.press("right")
            await wait_for(pilot, lambda: app.view.position == 160)
            await pilot.press("left")
            await wait_for(pilot, lambda: app.view.position == 150)
            await pilot.press("shift+left")
            await wait_for(pilot, lambda: app.view.position == 50)
            await pilot.press("shift+right")
            await wait_for(pilot, lambda: app.view.position == 150)
            # [ / ] and - / + speed
            await pilot.press("right_square_bracket")
            assert c.speed == 2.0
            await pilot.press("left_square_bracket", "left_square_bracket")
            assert c.speed == 0.5
            await pilot.press("minus")
            assert c.speed == 1.0
            await pilot.press("plus")
            assert c.speed == 0.5
            await pilot.press(*["right_square_bracket"] * 4)
            assert c.speed == 8.0  # (fast, so that the waits below are short)
            # space / p: play and pause
            await pilot.press("space")
            assert not c.paused
            await wait_for(pilot, lambda: app.view.position > 150)
            await pilot.press("p")
            assert c.paused
            assert "‖ REPLAY" in _header(app)
            # j / k / down / up select; Enter opens; Esc goes back
            ol = app.query_one("#findings-list")
            assert ol.highlighted == 0
            await pilot.press("j")
            assert ol.highlighted == 1
            await pilot.press("k")
            assert ol.highlighted == 0
            await pilot.press("down")
            assert ol.highlighted == 1
            await pilot.press("up", "enter")
            assert isinstance(app.screen, DetailScreen)
            assert app.screen.row.finding.rule == app.view.findings[0].finding.rule
            await pilot.press("escape")
            assert not isinstance(app.screen, DetailScreen)
            # / filter
            await pilot.press("slash")
            await pilot.press(*"preempt")
            await pilot.pause(0.1)
            assert app.filter_text == "preempt"
            shown = {r.finding.rule for r in app._rows}
            assert "preemption-storm" in shown and "gpu-shared-with-foreign-process" not in shown
            assert "Another process" not in _findings_text(app)
            await pilot.press("escape")
            assert app.filter_text == "" and "Another process" in _findings_text(app)
            # 1..4 toggle panels
            for key, panel in (("1", "#findings-box"), ("2", "#engines"), ("3", "#gpus")):
                await pilot.press(key)
                await pilot.pause(0.05)
                assert not app.query_one(panel).display
                await pilot.press(key)
                await pilot.pause(0.05)
                assert app.query_one(panel).display
            await pilot.press("4")
            assert "✓ nvml" not in _header(app)
            await pilot.press("4")
            assert "✓ nvml" in _header(app)
            # r: record to a file, r again stops
            await pilot.press("r")
            assert c.recording
            path = c.recording_path
            await pilot.press("space")
            await wait_for(pilot, lambda: app.view.position >= 153)
            await pilot.press("p")
            await pilot.press("r")
            assert not c.recording and path is not None and path.exists() and path.parent == tmp_path
            # b: bundle (a clear notice when this build has no bundle writer)
            await pilot.press("b")
            await wait_for(pilot, lambda: bool(app._notifications))
            msgs = [n.message for n in app._notifications]
            assert any("bundle" in m for m in msgs)
            # q quits
            await pilot.press("q")
        assert app.return_code in (None, 0)

    run(go())


def test_mouse_click_opens_a_finding(demo_feed, pipeline):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            await pilot.pause(0.1)
            await pilot.click("#findings-list", offset=(10, 0))
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
            await pilot.pause(0.1)
            assert app.screen.row.finding.rule == app.view.findings[0].finding.rule
            assert "Evidence" in app.export_screenshot()

    run(go())


def test_detail_shows_evidence_sources_and_the_rule_documentation(demo_feed, pipeline):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        async with app.run_test(size=(120, 60)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            idx = next(i for i, r in enumerate(app.view.findings) if r.finding.rule == "preemption-storm")
            app.query_one("#findings-list").highlighted = idx
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
            await pilot.pause(0.1)
            svg = app.export_screenshot()
            assert "Evidence" in svg and "Sources" in svg
            assert "preemption-storm" in svg.replace("&#160;", " ")
            # the same documentation as `kvdoctor explain`
            assert "How&#160;to&#160;confirm" in svg or "How to confirm" in svg

    run(go())


class _LiveFeed:
    """A live feed of empty snapshots, counting reads; ``delay`` makes each read slow."""

    live = True
    label = "live"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.reads = delay, 0

    def next(self) -> Snapshot:
        if self.delay:
            time.sleep(self.delay)
        self.reads += 1
        return Snapshot(timestamp=time.time())

    def close(self) -> None:
        pass


def test_slow_source_never_freezes_the_screen(pipeline):
    async def go():
        feed = _LiveFeed(delay=3.0)
        app = WatchApp(feed, pipeline, interval_s=0.25, host="test-host")
        async with app.run_test(size=(80, 24)) as pilot:
            t0 = time.monotonic()
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert time.monotonic() - t0 < 2.0  # the read in flight takes 3 s
            assert app.view is None  # nothing read yet, and the UI still answered
            await pilot.press("q")

    run(go())


def test_dead_metrics_endpoint_shows_error_while_screen_updates(pipeline):
    from kvdoctor.inputs import InputOptions, open_feed

    async def go():
        feed = open_feed(InputOptions(metrics=["http://127.0.0.1:9/metrics"], no_nvml=True, timeout_s=0.3))
        feed._sampler.opts.use_processes = False  # the host's own processes are not the point here
        app = WatchApp(feed, pipeline, interval_s=0.25, host="test-host")
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.views_seen >= 1, timeout=30)
            first = app.view.index
            header = _header(app)
            assert "✗ metrics" in header and "127.0.0.1:9" in header
            await wait_for(pilot, lambda: app.view.index >= first + 2, timeout=30)
            assert "✗ metrics" in _header(app)
            assert "LIVE" in _header(app)
            await pilot.press("q")

    run(go())


def test_failing_source_recovers_by_itself(pipeline):
    """A live source that errors and then answers: the header shows the error, then ok with the
    last error kept."""
    from kvdoctor.facts import SourceStatus

    class Flaky(_LiveFeed):
        def next(self) -> Snapshot:
            snap = super().next()
            bad = self.reads <= 2
            snap.sources = [
                SourceStatus(
                    "metrics", "http://h:8000/metrics", "error" if bad else "ok", "timed out" if bad else ""
                )
            ]
            return snap

    async def go():
        app = WatchApp(Flaky(), pipeline, interval_s=0.25, host="test-host")
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and "✗ metrics" in _header(app))
            await wait_for(pilot, lambda: app.controller.feed.reads >= 4 and "✓ metrics" in _header(app))
            assert "last error" in _header(app) and "timed out" in _header(app)
            await pilot.press("q")

    run(go())


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_sizes_render_without_overflow(demo_feed, pipeline, size):
    async def go():
        app = make_app(demo_feed, pipeline, start_at=150, paused=True)
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.view.position == 150)
            await pilot.pause(0.1)
            w, h = size
            gp = app.query_one("#gpus")
            lines = str(gp.render()).split("\n")
            assert len(lines) <= gp.size.height  # collapsed, not cut
            assert all(len(line) <= w for line in lines)
            shown = {i for grp in re.findall(r"GPU([\d,]+)\b", "\n".join(lines)) for i in grp.split(",")}
            assert shown == {str(i) for i in range(8)}
            box = app.query_one("#findings-box")
            assert box.region.bottom <= h - 1 and box.size.height >= 4
            assert app.query_one("#engines").size.height >= 2

    run(go())


def test_plan_layout_collapses_before_overflowing():
    shown = dict.fromkeys(("gpus", "engines", "findings", "sources"), True)
    big = plan_layout(120, 60, [True] * 8, 1, shown)
    small = plan_layout(80, 24, [True] * 8, 1, shown)
    assert big.gpu_lines >= small.gpu_lines and small.gpu_lines == 1
    for lay, h in ((big, 60), (small, 24)):
        assert lay.header_height + lay.gpu_height + lay.engine_height + 5 + 1 <= h
    wide = plan_layout(200, 60, [True] * 8, 1, shown)
    assert wide.wide and wide.gpu_columns == 2
    idle = plan_layout(80, 24, [True, False, False, False], 1, shown)
    assert idle.gpu_lines >= 2  # idle cards take one line, so the busy one gets more


def test_watch_demo_command_line(monkeypatch):
    """`kvdoctor watch --demo` builds the app on the bundled recording (run() is stubbed)."""
    from click.testing import CliRunner

    from kvdoctor.cli import cli

    seen = {}

    def fake_run(self):
        seen["feed"] = self.controller.feed
        seen["start"] = self.controller._start_at

    monkeypatch.setattr(WatchApp, "run", fake_run)
    res = CliRunner().invoke(cli, ["watch", "--demo"])
    assert res.exit_code == 0, res.output
    assert len(seen["feed"]) == 240 and seen["feed"].label == "demo" and seen["start"] == 45
    res = CliRunner().invoke(cli, ["watch", "--recording", "/nonexistent.jsonl"])
    assert res.exit_code == 3 and "no such recording" in res.output
    res = CliRunner().invoke(cli, ["watch", "--help"])
    assert "--demo" in res.output and "q quit" in res.output


def test_watch_help_does_not_import_textual_for_other_commands():
    import subprocess
    import sys

    code = "import sys; from kvdoctor.cli import cli; cli.get_command(None, 'watch'); print('textual' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    _ = threading  # (threads are the controller's)


def test_bundle_input_reads_to_the_end_and_shows_its_findings(pipeline):
    """--bundle: a finite feed read to its end; DP engines each get an engine line."""
    from pathlib import Path

    from kvdoctor.inputs import InputOptions, open_feed

    bundle = Path(__file__).parents[1] / "data" / "bundles" / "r04-dp2-engines-preempting"

    async def go():
        feed = open_feed(InputOptions(bundle=bundle))
        app = WatchApp(feed, pipeline, host="test-host")
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.controller.ended and app.view is not None)
            await pilot.pause(0.1)
            assert app.view.report is not None and app.view.report.findings
            assert "preemption-storm" in {r.finding.rule for r in app.view.findings}
            assert len(app.view.engines) == 2  # DP=2: one line per engine label
            assert "bundle" in _header(app)
            await pilot.press("right")  # not a replay: seeking does nothing, raises nothing
            await pilot.press("q")

    run(go())


def test_no_nvidia_driver_is_shown_as_unavailable(pipeline):
    """A host without the driver: the sources line and the GPU panel say NVML is unavailable
    (the sampler reports it "missing" once and does not retry it: tests/test_sampler.py)."""
    from kvdoctor.facts import SourceStatus

    why = "NVML unavailable: NVML Shared Library Not Found"

    class NoDriver(_LiveFeed):
        def next(self) -> Snapshot:
            snap = super().next()
            snap.sources = [SourceStatus("nvml", "NVML", "missing", why)]
            return snap

    async def go():
        app = WatchApp(NoDriver(), pipeline, interval_s=0.25, host="test-host")
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.views_seen >= 2)
            assert f"– nvml ({why})" in _header(app) and "✗" not in _header(app)
            assert str(app.query_one("#gpus").render()) == f"No GPUs: {why}"
            assert app.query_one("#gpus").outer_size.height == 2  # the rest goes to the findings
            await pilot.press("q")

    run(go())
