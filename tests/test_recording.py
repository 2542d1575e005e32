"""Recordings: streaming replay, unchanged parts by reference, cut files, older schemas, seek."""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvdoctor.facts import (
    EngineConfig,
    EngineMetrics,
    Gpu,
    GpuProcess,
    LogEvent,
    Snapshot,
    SourceError,
    VllmLog,
)
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.recording import (
    CHECKPOINT_EVERY,
    RecordingWriter,
    open_recording,
    snapshot_to_json,
)

CASE = Path(__file__).parent / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"


def _series(n: int) -> list[Snapshot]:
    """n snapshots at 1 s like a live loop makes them: GPUs and a scrape change every read, the
    config and model stay the same objects, the log grows by one event every 10 reads."""
    full = load_bundle(CASE).snapshot
    cfg = EngineConfig(model="m", max_model_len=4096, explicit={"max_model_len"}, command="vllm serve m")
    events: list[LogEvent] = []
    log = VllmLog(origin="vllm.log", events=[], vllm_version="0.10.0")
    out = []
    for i in range(n):
        if i % 10 == 0:
            events = [*events, LogEvent(kind="stats", line=i + 1, values={"kv_cache_usage": i / n})]
            log = VllmLog(origin="vllm.log", events=events, vllm_version="0.10.0", line_count=i + 1)
        gpus = [Gpu(index=k, memory_used_bytes=2**30 * k + i, timestamp=1000.0 + i) for k in range(2)]
        ms = [EngineMetrics(timestamp=1000.0 + i, engine="0", num_preemptions_total=float(i))]
        out.append(
            Snapshot(timestamp=1000.0 + i, gpus=gpus, metrics=ms, log=log, model=full.model, configs=[cfg])
        )
    return out


def _write(path: Path, snaps: list[Snapshot]) -> None:
    with RecordingWriter(path, interval_s=1.0) as w:
        for s in snaps:
            w.write(s)


def _replay(path: Path) -> list[Snapshot]:
    feed = open_recording(path)
    out = []
    while (s := feed.next()) is not None:
        out.append(s)
    feed.close()
    return out


def _same(a: Snapshot, b: Snapshot) -> bool:
    return snapshot_to_json(a) == snapshot_to_json(b)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip_keeps_every_fact_and_writes_unchanged_parts_once(tmp_path: Path, suffix: str) -> None:
    snaps = _series(300)
    path = tmp_path / f"r{suffix}"
    _write(path, snaps)
    got = _replay(path)
    assert len(got) == 300
    assert all(_same(a, b) for a, b in zip(snaps[:-1], got[:-1], strict=True))
    last = got[-1]
    assert last.sources[-1].kind == "recording" and last.sources[-1].detail == "300 snapshot(s)"
    assert got[5].model is got[6].model and got[5].configs[0] is got[6].configs[0]
    assert got[299].log is not None and len(got[299].log.events) == 30
    if suffix == ".jsonl":
        lines = path.read_text().splitlines()
        assert json.loads(lines[0])["schema"] == "kvdoctor.recording/2"
        full = sum(len(snapshot_to_json(s)) for s in snaps)
        assert sum(map(len, lines[1:])) * 5 < full  # the model config is not repeated per line
        states = [json.loads(ln)["$"] for ln in lines[1:] if ln.startswith('{"$"')]
        assert set(states[0]) >= {"log", "model", "configs"}  # written once, at the start
        assert all(set(st) == {"log+"} for st in states[1:]) and len(states) == 30


def test_a_recording_cut_mid_line_still_replays_and_says_what_it_skipped(tmp_path: Path) -> None:
    snaps = _series(20)
    path = tmp_path / "r.jsonl"
    _write(path, snaps)
    data = path.read_bytes()
    last_line = data.count(b"\n")
    path.write_bytes(data[: len(data) - 40])  # a crash mid-line
    feed = open_recording(path)
    got = []
    while (s := feed.next()) is not None:
        got.append(s)
    assert len(got) == 19 and feed.skipped == 1
    detail = got[-1].sources[-1].detail
    assert (
        detail.startswith("19 snapshot(s), 1 unreadable line(s) skipped") and f"line {last_line}:" in detail
    )


def test_a_cut_gzip_stream_replays_what_was_flushed(tmp_path: Path) -> None:
    snaps = _series(50)
    path = tmp_path / "r.jsonl.gz"
    w = RecordingWriter(path)
    for s in snaps:
        w.write(s)
    w._fh.fileobj.flush()  # type: ignore[attr-defined]  # the process dies here: no gzip trailer
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(path.read_bytes())
    w.close()
    got = _replay(cut)
    assert len(got) == 50 and "stream cut short" in got[-1].sources[-1].detail


def test_an_older_schema_replays_and_unknown_fields_are_named(tmp_path: Path) -> None:
    snaps = load_bundle(CASE).timeline.snapshots
    path = tmp_path / "v1.jsonl"
    lines = [json.dumps({"schema": "kvdoctor.recording/1", "created": 0, "kvdoctor": "0.0.1"})]
    for s in snaps:
        obj = json.loads(snapshot_to_json(s))
        obj["retired_field"] = 1
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")
    got = _replay(path)
    assert len(got) == len(snaps)
    assert got[-1].log is not None and got[-1].log.vllm_version == snaps[-1].log.vllm_version  # type: ignore[union-attr]
    detail = got[-1].sources[-1].detail
    assert "older schema kvdoctor.recording/1" in detail and "Snapshot.retired_field" in detail


def test_keep_last_reads_a_long_recording_without_decoding_what_it_drops(tmp_path: Path) -> None:
    snaps = _series(500)
    path = tmp_path / "r.jsonl.gz"
    _write(path, snaps)
    feed = open_recording(path)
    assert feed.keep_last(40) == 460
    got = []
    while (s := feed.next()) is not None:
        got.append(s)
    assert [s.timestamp for s in got] == [s.timestamp for s in snaps[-40:]]
    assert all(_same(a, b) for a, b in zip(snaps[-40:-1], got[:-1], strict=True))
    assert got[-1].sources[-1].detail == "500 snapshot(s)"


def test_seek_backward_and_forward_gives_the_same_snapshots(tmp_path: Path) -> None:
    n = CHECKPOINT_EVERY * 2 + 50
    snaps = _series(n)
    path = tmp_path / "r.jsonl.gz"
    _write(path, snaps)
    feed = open_recording(path)
    assert len(feed) == n and feed.interval_s == 1.0
    for target in (CHECKPOINT_EVERY * 2 + 10, 5, CHECKPOINT_EVERY + 3, n - 1):
        feed.seek(target)
        assert feed.position == target
        got = feed.next()
        assert got is not None and got.timestamp == snaps[target].timestamp
        assert got.log is not None and got.log.events == snaps[target].log.events  # type: ignore[union-attr]
    assert feed.next() is None
    feed.close()


def test_not_a_recording_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text("hello\n")
    with pytest.raises(SourceError, match="not a kvdoctor recording"):
        open_recording(bad)
    with pytest.raises(SourceError, match="no such recording"):
        open_recording(tmp_path / "missing.jsonl")
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(gzip.compress(b"\x00\x01binary"))
    with pytest.raises(SourceError, match="not a kvdoctor recording"):
        open_recording(gz)


def test_zstd_round_trip_or_a_clear_error_without_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.jsonl.zst"
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(SourceError, match="zstandard"):
        RecordingWriter(path)
    monkeypatch.undo()
    pytest.importorskip("zstandard")
    snaps = _series(30)
    _write(path, snaps)
    got = _replay(path)
    assert len(got) == 30 and _same(got[10], snaps[10])


def test_gpus_and_scrapes_that_change_shape_replay_exactly(tmp_path: Path) -> None:
    base = [
        Gpu(index=k, name="NVIDIA H100", bus_id=f"0000:0{k}:00.0", memory_total_bytes=80 * 2**30)
        for k in range(4)
    ]
    snaps = []
    for i in range(40):
        gpus = [replace(g, memory_used_bytes=i * 2**20, timestamp=float(i)) for g in base]
        if 10 <= i < 20:
            gpus = gpus[:2]  # two GPUs fell off the bus
        if i >= 15:
            gpus[0] = replace(gpus[0], processes=[GpuProcess(pid=9, used_bytes=2**30)], name=None)
        if i >= 30:
            gpus = list(reversed(gpus))  # another order: most fields differ from the template
        ms = [
            EngineMetrics(timestamp=float(i), engine=str(e), cache_config={"block_size": "16"})
            for e in range(1 + i % 2)
        ]
        snaps.append(Snapshot(timestamp=float(i), gpus=gpus, metrics=ms))
    path = tmp_path / "r.jsonl"
    _write(path, snaps)
    got = _replay(path)
    assert all(_same(a, b) for a, b in zip(snaps[:-1], got[:-1], strict=True))
    assert got[16].gpus[0].name is None and got[16].gpus[1].name == "NVIDIA H100"
    text = path.read_text()
    assert text.count("NVIDIA H100") < 20  # written on template lines, not on every line
