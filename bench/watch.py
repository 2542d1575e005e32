#!/usr/bin/env python3
"""CPU used by ``kvdoctor watch --demo`` headless against the same pipeline without the UI.

Both runs replay the bundled demo recording (8 GPUs, one engine going into KV pressure) from the
snapshot ``watch --demo`` starts at, one snapshot per second (1 Hz, the recording's pace), for
``--seconds`` (default 60), in this one process:

1. baseline: ``LiveLoop(feed, pipeline).run(..., pace_finite=True)`` — reading and evaluating
   only, what any face pays;
2. watch: ``WatchApp`` on the same feed and pipeline, ``run(headless=True)``: the same loop on
   its worker thread plus the breakdown, engine figures, and drawing every second.

CPU is ``time.process_time()`` (all threads of this process) over each run's wall window
(watch: from its first View; its start-up is printed on its own).
Printed: CPU seconds and percent of one core for each, the UI's extra, and the ratio. Budget
(issue 9): watch ≤ 5 % of one core in total. Figures, not pass/fail.
usage: .venv/bin/python bench/watch.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import threading
import time


def baseline(seconds: float) -> tuple[float, float, int]:
    """(cpu_s, wall_s, cycles) of the loop + pipeline alone."""
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sampler import LiveLoop
    from kvdoctor.sources.recording import open_recording
    from kvdoctor.watch.command import DEMO_START, demo_recording_path

    feed = open_recording(demo_recording_path())
    pipe = Pipeline.load()
    loop = LiveLoop(feed, pipe, interval_s=feed.interval_s or 1.0)
    for _ in range(DEMO_START):
        snap = feed.next()
        assert snap is not None
        loop.timeline.append(snap)
    n = 0

    def on_cycle(_c: object) -> None:
        nonlocal n
        n += 1

    c0, w0 = time.process_time(), time.monotonic()
    loop.run(on_cycle, threading.Event(), duration_s=seconds, pace_finite=True)
    return time.process_time() - c0, time.monotonic() - w0, n


def watch(seconds: float) -> tuple[float, float, int]:
    """(cpu_s, wall_s, views drawn) of WatchApp headless on the demo, from its first View."""
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.recording import open_recording
    from kvdoctor.watch.app import WatchApp
    from kvdoctor.watch.command import DEMO_START, demo_recording_path

    feed = open_recording(demo_recording_path())
    feed.label = "demo"
    app = WatchApp(feed, Pipeline.load(), start_at=DEMO_START, host="bench")
    marks: dict[str, float] = {"s0": time.process_time()}
    first_views: list[int] = []
    apply = app.apply_view

    def apply_view(view: object) -> None:
        apply(view)  # type: ignore[arg-type]
        if not first_views:
            # Steady state starts at the first View (start-up and the demo's seek are before).
            first_views.append(app.views_seen)
            marks["c0"], marks["w0"] = time.process_time(), time.monotonic()
            app.set_timer(seconds, stop)

    def stop() -> None:
        marks["c1"], marks["w1"] = time.process_time(), time.monotonic()
        app.exit()

    app.apply_view = apply_view  # type: ignore[method-assign]
    app.run(headless=True, size=(120, 40))
    print(
        f"watch start-up (imports excluded, seek to the demo start included): {marks['c0'] - marks['s0']:.2f} s CPU"
    )
    return marks["c1"] - marks["c0"], marks["w1"] - marks["w0"], app.views_seen - first_views[0]


def main() -> None:
    """Run both and print the figures."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    b_cpu, b_wall, b_n = baseline(args.seconds)
    w_cpu, w_wall, w_n = watch(args.seconds)
    for name, cpu, wall, n, what in (
        ("pipeline only", b_cpu, b_wall, b_n, "cycles"),
        ("watch --demo ", w_cpu, w_wall, w_n, "views"),
    ):
        print(
            f"{name} : {cpu:6.2f} s CPU over {wall:5.1f} s = {100 * cpu / wall:5.1f} % of one core "
            f"({n} {what}, {1000 * cpu / max(n, 1):5.1f} ms CPU each)"
        )
    # On a loaded machine a cycle can come late; CPU per cycle × 1 Hz is the steady figure.
    b_1hz, w_1hz = 100 * b_cpu / max(b_n, 1), 100 * w_cpu / max(w_n, 1)
    print(
        f"at 1 Hz       : pipeline {b_1hz:4.1f} %, watch {w_1hz:4.1f} % of one core; UI extra {w_1hz - b_1hz:4.1f} %"
    )
    print(f"ratio         : watch / pipeline = {w_1hz / max(b_1hz, 1e-9):.2f}x")
    print("budget        : watch ≤ 5 % of one core in total")


if __name__ == "__main__":
    main()
