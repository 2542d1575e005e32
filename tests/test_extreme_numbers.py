"""Numbers out of range in any input (NaN, ±Inf, 1e309, a 400-digit integer) are read as unknown
by the parsers, and a derive family that still fails on one costs only its own variables.

Before: a ``+Inf`` KV gauge, a ``num_gpu_blocks="inf"`` label, ``--cpu-offload-gb inf`` or a
config.json ``1e309`` ended ``diagnose`` with "internal error (OverflowError); nothing was
diagnosed" (found by the end-to-end fuzz below).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from kvdoctor import derive
from kvdoctor.facts import SourceError
from kvdoctor.feeds import read_to_end
from kvdoctor.inputs import InputError, InputOptions, open_feed
from kvdoctor.pipeline import Pipeline, PipelineError
from kvdoctor.report import Report, render_json
from kvdoctor.sources import cmdline, metrics, model_config
from kvdoctor.units import MAX_QUANTITY, in_range

DATA = Path(__file__).resolve().parent / "data"
STORM = DATA / "bundles" / "r04-dp2-engines-preempting"
OUT_OF_RANGE = ["+Inf", "-Inf", "Inf", "NaN", "1e309", "-1e309", "1" + "0" * 400]


def _diagnose(bundle: Path) -> Report:
    feed = open_feed(InputOptions(bundle=bundle))
    timeline = read_to_end(feed) if hasattr(feed, "next") else feed
    return Pipeline.load().evaluate(timeline)


def _rules(report: Report) -> set[str]:
    return {f.rule for f in report.findings}


def test_in_range() -> None:
    assert in_range(0) and in_range(-1.5) and in_range(2**53) and in_range(MAX_QUANTITY)
    for x in (float("nan"), float("inf"), -float("inf"), 2**53 + 1, 10**400, -(10**400)):
        assert not in_range(x)


@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_metrics_sample_out_of_range_is_unknown(value: str) -> None:
    page = (
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} ' + value + "\n"
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3\n'
    )
    (m,) = metrics.parse_metrics(page)
    assert m.kv_cache_usage is None and m.num_requests_running == 3


def test_metrics_large_but_real_counter_is_kept() -> None:
    # Near miss: a lifetime token counter of 10^15 is a big number, not a corrupt one.
    page = '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{engine="0"} 1e15\n'
    (m,) = metrics.parse_metrics(page)
    assert m.prompt_tokens_total == 1e15


def test_cache_config_label_out_of_range_is_unknown() -> None:
    assert derive.base.num("inf") is None and derive.base.num("1e309") is None
    assert derive.base.num("NaN") is None and derive.base.num("27165") == 27165.0


@pytest.mark.parametrize("value", ["1e309", "-1e309", "1" + "0" * 400])
def test_model_config_number_out_of_range_is_absent(value: str) -> None:
    text = '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "num_attention_heads": 32,'
    text += ' "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "hidden_size": ' + value + "}"
    arch = model_config.parse_model_config(text)
    assert arch.num_hidden_layers == 32 and arch.vocab_size == 128256
    assert arch.hidden_size in (None, 0)  # absent, as if the key were missing


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "1" + "0" * 25])
def test_flag_out_of_range_is_a_one_line_error_without_the_value(value: str) -> None:
    with pytest.raises(SourceError) as ei:
        cmdline.parse_argv(["vllm", "serve", "m", "--cpu-offload-gb", value], origin="cmdline.txt")
    msg = str(ei.value)
    assert "--cpu-offload-gb" in msg and "out of range" in msg and value not in msg.lower().split(": ", 1)[1]


def test_flag_in_range_near_miss() -> None:
    cfg = cmdline.parse_argv(["vllm", "serve", "m", "--cpu-offload-gb", "1e3"], origin="cmdline.txt")
    assert cfg.cpu_offload_gb == 1000.0
    # a 64-bit seed is a valid vLLM value, past 2**53 but not out of range for a flag
    cfg = cmdline.parse_argv(["vllm", "serve", "m", "--seed", "12345678901234567890"], origin="cmdline.txt")
    assert cfg.args["seed"] == 12345678901234567890


def _copy(tmp_path: Path, src: Path = STORM) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_bundle_with_inf_kv_gauge_still_diagnoses(tmp_path: Path) -> None:
    # Fires: every scrape's KV gauge is +Inf; the preemption storm (counters) is still found.
    bundle = _copy(tmp_path)
    for page in (bundle / "metrics").glob("*.txt"):
        text = page.read_text()
        page.write_text(re.sub(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$", r"\1 +Inf", text, flags=re.M))
    report = _diagnose(bundle)
    assert "preemption-storm" in _rules(report)
    assert not [s for s in report.sources if s.kind == "derive"]
    doc = json.loads(render_json(report))
    assert all(e["kv"]["usage"] is None for e in doc["engines"] if e["kv"])


def test_bundle_with_inf_blocks_label_still_diagnoses(tmp_path: Path) -> None:
    bundle = _copy(tmp_path)
    for page in (bundle / "metrics").glob("*.txt"):
        page.write_text(re.sub(r'num_gpu_blocks="\d+"', 'num_gpu_blocks="inf"', page.read_text()))
    report = _diagnose(bundle)
    assert "preemption-storm" in _rules(report)
    assert not [s for s in report.sources if s.kind == "derive"]


def test_a_failing_family_costs_its_variables_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The safety net: a family that still raises on some input leaves its own variables
    # unknown, says so as a "derive" source error, and every other rule still runs.
    def boom(scope: object, v: object) -> None:
        raise OverflowError("cannot convert float infinity to integer")

    families = tuple(
        derive.base.Family(f.name, f.writes, f.reads, boom) if f.name == "growth" else f
        for f in derive.FAMILIES
    )
    monkeypatch.setattr(derive, "FAMILIES", families)
    report = _diagnose(STORM)
    assert "preemption-storm" in _rules(report)
    (err,) = [s for s in report.sources if s.kind == "derive"]
    assert (err.origin, err.status) == ("growth", "error") and "OverflowError" in err.detail
    assert "infinity" not in err.detail  # the exception's text is not passed on


# --------------------------------------------------------------------------- end to end

_NUM = re.compile(r"(?<![\w.])\d{1,30}(?:\.\d{1,30})?(?![\w.])")
_WORDS = [*OUT_OF_RANGE, "inf", "nan", "Infinity", "-1", "0", "1e300", "99999999999999999999"]


def _bundles() -> list[Path]:
    roots = [DATA / "bundles", DATA / "cases"]
    return sorted(p for r in roots for p in r.iterdir() if (p / "expected.json").is_file())


def test_end_to_end_extreme_numbers_never_break_diagnose(tmp_path: Path) -> None:
    """Seeded: numbers in a bundle's artifacts replaced by extreme ones; diagnose gives a report
    (or a one-line input error) and no derive family fails: the parsers caught them all."""
    rng = random.Random(10)
    bundles = _bundles()
    failures: list[str] = []
    for i in range(30):
        src = rng.choice(bundles)
        dst = tmp_path / f"{i}-{src.name}"
        shutil.copytree(src, dst)
        files = [p for p in dst.rglob("*") if p.is_file() and p.name != "expected.json"]
        target = rng.choice(files)
        text = target.read_text(errors="replace")
        spots = list(_NUM.finditer(text))
        if not spots:
            continue
        # a fifth of the file's numbers: enough that a value some family computes with is hit
        for m in sorted(rng.sample(spots, max(1, len(spots) // 5)), key=lambda m: -m.start()):
            text = text[: m.start()] + rng.choice(_WORDS) + text[m.end() :]
        target.write_text(text)
        where = f"{src.name}/{target.relative_to(dst)}"
        try:
            report = _diagnose(dst)
        except (InputError, PipelineError, SourceError):
            continue
        except Exception as e:  # noqa: BLE001 - the contract under test
            failures.append(f"{where}: {type(e).__name__}")
            continue
        failures += [f"{where}: derive {s.origin} {s.detail}" for s in report.sources if s.kind == "derive"]
    assert not failures, failures[:5]


# --------------------------------------------------------------------------- recordings


def _recording(tmp_path: Path) -> Path:
    from kvdoctor.facts import EngineMetrics, Gpu, Snapshot
    from kvdoctor.sources.recording import RecordingWriter

    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, interval_s=1.0) as w:
        for i in range(10):
            gpus = [
                Gpu(index=0, memory_used_bytes=2**30 + i, memory_total_bytes=80 * 2**30, timestamp=1000.0 + i)
            ]
            ms = [
                EngineMetrics(
                    timestamp=1000.0 + i, engine="0", kv_cache_usage=0.5, num_preemptions_total=float(i)
                )
            ]
            w.write(Snapshot(timestamp=1000.0 + i, gpus=gpus, metrics=ms))
    return path


def _replayed(path: Path) -> tuple[int, int, Report]:
    from kvdoctor.sources.recording import open_recording

    feed = open_recording(path)
    timeline = read_to_end(feed)
    skipped = feed.skipped
    feed.close()
    return len(timeline.snapshots), skipped, Pipeline.load().evaluate(timeline)


def test_recording_near_miss_every_line_decodes(tmp_path: Path) -> None:
    n, skipped, report = _replayed(_recording(tmp_path))
    assert (n, skipped) == (10, 0) and not [s for s in report.sources if s.kind == "derive"]


def test_recording_with_a_64_bit_seed_decodes(tmp_path: Path) -> None:
    # Near miss: a launch flag's number past 2**53 (a --seed) is a valid value, kept as it was.
    from kvdoctor.facts import EngineConfig, Snapshot
    from kvdoctor.sources.recording import RecordingWriter, open_recording

    path = tmp_path / "seed.jsonl"
    cfg = EngineConfig(model="m", args={"seed": 12345678901234567890})
    with RecordingWriter(path, interval_s=1.0) as w:
        for i in range(3):
            w.write(Snapshot(timestamp=1000.0 + i, configs=[cfg]))
    feed = open_recording(path)
    timeline = read_to_end(feed)
    assert feed.skipped == 0 and len(timeline.snapshots) == 3
    assert timeline.snapshots[-1].configs[0].args["seed"] == 12345678901234567890


@pytest.mark.parametrize(
    ("pattern", "replacement"),
    [
        (r'"num_preemptions_total":\d+\.0', '"num_preemptions_total":Infinity'),
        (r'"num_preemptions_total":\d+\.0', '"num_preemptions_total":NaN'),
        (r'"num_preemptions_total":\d+\.0', '"num_preemptions_total":"+Inf"'),
        (r'"num_preemptions_total":\d+\.0', '"num_preemptions_total":1e309'),
        (r'"memory_used_bytes":\d+', '"memory_used_bytes":"+Inf"'),
        (r'"memory_used_bytes":\d+', '"memory_used_bytes":1' + "0" * 400),
        (r'"memory_used_bytes":\d+', '"memory_used_bytes":[1]'),
    ],
)
def test_recording_line_with_a_number_out_of_range_is_skipped(
    tmp_path: Path, pattern: str, replacement: str
) -> None:
    path = _recording(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    bad = [i for i, ln in enumerate(lines) if re.search(pattern, ln)][2:5]  # three snapshot lines
    assert len(bad) == 3
    for i in bad:
        lines[i] = re.sub(pattern, replacement, lines[i])
    path.write_text("".join(lines))
    n, skipped, report = _replayed(path)
    assert (n, skipped) == (7, 3)
    assert not [s for s in report.sources if s.kind == "derive"]
    detail = next(s.detail for s in report.sources if s.kind == "recording")
    assert "3 unreadable line(s) skipped" in detail and "Inf" not in detail and "000000" not in detail
