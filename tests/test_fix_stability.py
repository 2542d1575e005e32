"""Issue 24 kind 1, stability: replaying the `watch --demo` recording and evaluating the pipeline
at every step, no fix value of max-num-seqs-exceeds-kv, preemption-storm or long-request-spike
flaps (A → B → A), and values change rarely. The demo is a storm of ~100k-token prompts among
~1.7k-token traffic (8 running before the trouble): no --max-num-seqs is derived from the mixed
median; the tail is capped instead."""

from __future__ import annotations

from collections import defaultdict

from kvdoctor.facts import Timeline
from kvdoctor.pipeline import Pipeline
from kvdoctor.sources.recording import open_recording
from kvdoctor.watch.command import demo_recording_path

RULES = ("max-num-seqs-exceeds-kv", "preemption-storm", "long-request-spike")


def _replay() -> tuple[int, dict[tuple[str, str], list[str]]]:
    feed = open_recording(demo_recording_path())
    pipeline = Pipeline.load()
    timeline = Timeline(max_len=3600)
    values: dict[tuple[str, str], list[str]] = defaultdict(list)
    steps = 0
    while (snap := feed.next()) is not None:
        timeline.append(snap)
        steps += 1
        for f in pipeline.evaluate(timeline, now=0).findings:
            if f.rule not in RULES:
                continue
            for fix in f.fixes:
                for flag, value in fix.flags.items():
                    seq = values[(f.rule, flag)]
                    if not seq or seq[-1] != value:
                        seq.append(value)
    return steps, values


def test_no_fix_value_flaps_over_the_watch_demo_replay() -> None:
    steps, values = _replay()
    assert steps > 100 and values, "the replay shows the storm's fixes"
    for key, seq in values.items():
        flaps = [seq[i] for i in range(len(seq) - 2) if seq[i] == seq[i + 2]]
        assert not flaps, f"{key} flaps: {seq}"
        assert len(seq) <= 3, f"{key} changes {len(seq) - 1} times over {steps} steps: {seq}"
    # never a serialising limit from the storm's mixed median (was 55 → 2 → 107)
    for (rule, flag), seq in values.items():
        if flag == "--max-num-seqs":
            assert all(int(v) >= 8 for v in seq), (rule, seq)
    # the tail is capped at a quarter of the 194,384-token cache, a multiple of the 16-token block
    assert values[("preemption-storm", "--max-model-len")] == ["48592"]


def test_seqs_step_rounds_down_by_at_most_an_eighth() -> None:
    from kvdoctor.rule_functions import seqs_step

    assert [seqs_step(n) for n in (0, 1, 2, 15, 16, 17, 31, 33, 111, 114, 178, 1000)] == [
        1, 1, 2, 15, 16, 16, 30, 32, 104, 112, 176, 960,
    ]  # fmt: skip
    assert all(seqs_step(n) <= n and seqs_step(n) >= 0.875 * n for n in range(8, 5000))


def test_concurrency_fix_refuses_a_mixed_median_and_a_serialising_value() -> None:
    from kvdoctor.rule_functions import concurrency_fix

    assert concurrency_fix(442192, 16637, None, 16000.0, 20000.0) == (26, "")
    seqs, why = concurrency_fix(442192, 16637, 33, 16000.0, 20000.0)
    assert seqs is None and "33 running before the trouble" in why
    seqs, why = concurrency_fix(194384, 69404, None, 69000.0, 100000.0)
    assert seqs == 2  # all huge (not mixed), nothing ran before: the contract decides
    seqs, why = concurrency_fix(194384, 1700, 8, 1500.0, 100000.0)
    assert seqs is None and "mixed" in why
