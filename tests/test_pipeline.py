"""The one pipeline: pure with respect to its input (the same Timeline twice gives the same
report, its facts untouched) and a library (no click, errors as exceptions)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor.facts import EngineConfig, EngineMetrics, Gpu, GpuProcess, Snapshot, Timeline
from kvdoctor.pipeline import Pipeline, PipelineError
from kvdoctor.report import render_json
from kvdoctor.sources.bundle import load_bundle
from tests.test_derive import BUNDLES

GiB = 2**30


def _live_like() -> Timeline:
    """Snapshots as a live loop makes them: scrapes without their own timestamps, a launch
    config per snapshot, GPUs with processes."""
    tl = Timeline()
    for t in range(8):
        m = EngineMetrics(engine="0", model_name="m", kv_cache_usage=0.5, num_requests_running=2,
                          num_requests_waiting=0, num_preemptions_total=0, generation_tokens_total=50.0 * t,
                          cache_config={"num_gpu_blocks": "1000", "block_size": "16"})  # fmt: skip
        gpu = Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GiB,
                  memory_used_bytes=(60 + t) * GiB, processes=[GpuProcess(pid=7, name="VLLM::EngineCore", used_bytes=60 * GiB)])  # fmt: skip
        cfg = EngineConfig(model="m", max_model_len=8192, explicit={"max_model_len"})
        tl.append(Snapshot(timestamp=1000.0 + t, gpus=[gpu], metrics=[m], configs=[cfg]))
    return tl


@pytest.mark.parametrize("bundle", BUNDLES[:8] + BUNDLES[-4:], ids=lambda p: p.name)
def test_evaluating_twice_gives_the_same_report_and_leaves_the_facts_alone(bundle: Path) -> None:
    timeline = load_bundle(bundle).timeline
    before = copy.deepcopy(timeline)
    pipe = Pipeline.load()
    first = render_json(pipe.evaluate(timeline, now=0))
    second = render_json(pipe.evaluate(timeline, now=0))
    assert first == second
    assert timeline == before


def test_a_live_timeline_is_not_modified_either() -> None:
    timeline = _live_like()
    before = copy.deepcopy(timeline)
    pipe = Pipeline.load()
    a, b = pipe.evaluate(timeline, now=0), pipe.evaluate(timeline, now=5)
    assert a.generated_at != b.generated_at
    a.generated_at = b.generated_at
    assert render_json(a) == render_json(b)
    assert timeline == before
    # The scrapes were stamped with their snapshot's time on copies only.
    assert all(m.timestamp is None for s in timeline.snapshots for m in s.metrics)
    # The engines the report lists come from derive, not from the facts.
    assert [e["id"] for e in a.engines] == ["m"] and timeline.latest is not None
    assert timeline.latest.engines == []


def test_pipeline_imports_no_click() -> None:
    code = (
        "import sys; from kvdoctor.pipeline import Pipeline; from kvdoctor.facts import Timeline;"
        "Pipeline.load().evaluate(Timeline()); print('click' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_bad_rule_file_is_an_exception_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad_rule.py").write_text("x = 1\ny = (\n")
    with pytest.raises(PipelineError) as err:
        Pipeline.load([tmp_path])
    assert err.value.kind == "rules" and "bad_rule.py:2: SyntaxError" in str(err.value)


_TOUCHED: set[int] = set()


class _CountingSnapshot(Snapshot):
    """A Snapshot that notes when its readings are looked at."""

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name in ("metrics", "gpus", "gpu_series", "processes"):
            _TOUCHED.add(id(self))
        return super().__getattribute__(name)


def test_one_evaluation_reads_the_window_and_a_bounded_history_not_the_whole_timeline() -> None:
    tl = Timeline(max_len=3600)
    for t in range(3600):
        m = EngineMetrics(timestamp=float(t), engine="0", kv_cache_usage=0.3, num_requests_running=1,
                          generation_tokens_total=10.0 * t)  # fmt: skip
        gpu = Gpu(index=0, memory_total_bytes=80 * GiB, memory_used_bytes=60 * GiB + t * 2**20)
        tl.append(_CountingSnapshot(timestamp=float(t), gpus=[gpu], metrics=[m]))
    _TOUCHED.clear()
    report = Pipeline(rules=Pipeline.load().rules, window_s=60.0).evaluate(tl, now=0)
    # 61 snapshots in the 60 s window, at most 60 of history for GPU memory growth, a few
    # just before the window: far from the 3,600 held.
    assert 61 <= len(_TOUCHED) <= 61 + 60 + 10
    assert report.engines and report.gpus
    # The growth over the hour is still seen, from the sampled history: 1 MiB/s = 3,600 MiB/h.
    from kvdoctor.derive import build_contexts

    _, contexts, _ = build_contexts(tl, [])
    v = contexts[0][1]
    assert v["mem_growth_bytes_per_hour"] == pytest.approx(3600 * 2**20, rel=1e-6)
    assert v["mem_growth_span_s"] == 3599 and v["mem_growth_points"] == 60
