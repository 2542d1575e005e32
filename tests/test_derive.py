"""derive as a package of families: declarations hold (every variable written by one family,
reads declared and ordered), derive imports no source module, and the decisions that used to
hide in Python are rule thresholds whose override changes the verdict."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest

import kvdoctor.derive as derive
from kvdoctor.derive import FAMILIES, ORDER, VARIABLES, build_contexts
from kvdoctor.derive.base import Family
from kvdoctor.facts import EngineConfig, EngineMetrics, Gpu, GpuProcess, HistogramData, Snapshot, Timeline
from kvdoctor.pipeline import Pipeline
from kvdoctor.sources.bundle import load_bundle

GiB = 2**30
DATA = Path(__file__).parent / "data"
BUNDLES = [
    p
    for root in (DATA / "cases", DATA / "bundles")
    for p in sorted(root.iterdir())
    if (p / "expected.json").is_file()
]
DERIVE_DIR = Path(derive.__file__).parent


def test_no_module_under_derive_imports_a_source() -> None:
    offenders = []
    for path in sorted(DERIVE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("kvdoctor.sources")]
    assert offenders == []
    # The scan sees the package's modules (a renamed directory would pass vacuously).
    assert {"config.py", "attribution.py", "colocation.py"} <= {p.name for p in DERIVE_DIR.glob("*.py")}


def test_every_variable_is_written_by_one_family_and_reads_come_from_earlier_ones() -> None:
    owner: dict[str, str] = {}
    for fam in FAMILIES:
        for name in fam.writes:
            assert name not in owner, f"{name} written by {owner.get(name)} and {fam.name}"
            owner[name] = fam.name
    assert set(owner) == set(VARIABLES)
    for i, fam in enumerate(FAMILIES):
        earlier = {n for f in FAMILIES[:i] for n in f.writes}
        assert fam.reads <= earlier, (fam.name, sorted(fam.reads - earlier))
        assert not fam.reads & set(fam.writes), fam.name
    for desc in VARIABLES.values():
        assert ";" in desc  # "unit; meaning and source"
    assert ORDER[0] == "config" and len(ORDER) == len(set(ORDER)) == len(FAMILIES)


class _Tracked(dict):  # type: ignore[type-arg]
    """The variables as one family sees them: reads and writes outside its declaration fail."""

    def __init__(self, fam: Family, backing: dict[str, Any], log: list[str]) -> None:
        super().__init__()
        self.fam, self.backing, self.log = fam, backing, log

    def _check_read(self, key: str) -> None:
        if key not in self.fam.writes and key not in self.fam.reads:
            self.log.append(f"{self.fam.name} reads undeclared {key}")

    def __getitem__(self, key: str) -> Any:
        self._check_read(key)
        return self.backing[key]

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self._check_read(key)
        return self.backing.get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.fam.writes:
            self.log.append(f"{self.fam.name} writes undeclared {key}")
        self.backing[key] = value


def _timelines() -> list[Timeline]:
    out = [load_bundle(p).timeline for p in BUNDLES]
    # A metrics timeline with DP engines and scrapes without their own timestamps.
    tl = Timeline()
    for t in range(5):
        snap = Snapshot(
            timestamp=1000.0 + t, gpus=[Gpu(index=0, memory_total_bytes=80 * GiB, memory_used_bytes=70 * GiB)]
        )
        snap.metrics = [
            EngineMetrics(engine=e, kv_cache_usage=0.95, num_requests_waiting=3, num_requests_running=8,
                          num_preemptions_total=float(t), generation_tokens_total=100.0 * t)
            for e in ("0", "1")
        ]  # fmt: skip
        tl.append(snap)
    out.append(tl)
    return out


def test_families_read_and_write_only_what_they_declare(monkeypatch: pytest.MonkeyPatch) -> None:
    problems: list[str] = []
    monkeypatch.setattr(derive, "_view", lambda fam, v: _Tracked(fam, v, problems))
    contexts = 0
    for tl in _timelines():
        latest = tl.latest or Snapshot()
        _, ctxs, _ = build_contexts(tl, list(latest.configs))
        contexts += len(ctxs)
    assert contexts >= len(BUNDLES)
    assert sorted(set(problems)) == []


def _stacked(used_gpu1_gib: float) -> Timeline:
    two = [
        GpuProcess(pid=10, name="VLLM::EngineCore", used_bytes=30 * GiB),
        GpuProcess(pid=20, name="VLLM::EngineCore", used_bytes=30 * GiB),
    ]
    gpus = [
        Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GiB, memory_used_bytes=61 * GiB, processes=two),
        Gpu(index=1, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GiB, memory_used_bytes=int(used_gpu1_gib * GiB)),
    ]  # fmt: skip
    tl = Timeline()
    tl.append(Snapshot(timestamp=1.0, gpus=gpus))
    return tl


def _rules_fired(tl: Timeline, config: Path | None) -> set[str]:
    return {f.rule for f in Pipeline.load(None, config).evaluate(tl, now=0).findings}


def test_overriding_the_empty_gpu_threshold_changes_the_verdict(tmp_path: Path) -> None:
    # GPU 1 holds 1.5 GiB and no process: not "empty" under the default 1 GiB, so no finding.
    no_config = tmp_path / "none.yaml"
    no_config.write_text("{}\n")
    assert "engines-stacked-on-one-gpu" not in _rules_fired(_stacked(1.5), no_config)
    assert "engines-stacked-on-one-gpu" in _rules_fired(_stacked(0.2), no_config)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("thresholds:\n  engines-stacked-on-one-gpu:\n    empty_max_gib: 2.0\n")
    assert "engines-stacked-on-one-gpu" in _rules_fired(_stacked(1.5), cfg)


def _pressured(kv: float) -> tuple[Timeline, list[EngineConfig]]:
    """An engine whose max_num_seqs × typical request exceeds the KV cache, with requests
    waiting at KV usage ``kv`` in every scrape and no preemption."""
    tl = Timeline()
    for t in range(6):
        m = EngineMetrics(timestamp=1000.0 + 5 * t, engine="0", model_name="m", kv_cache_usage=kv,
                          num_requests_running=100, num_requests_waiting=4, num_preemptions_total=0,
                          generation_tokens_total=1000.0 * t, prompt_tokens_total=4000.0 * t,
                          request_success_total=float(t), cache_config={"num_gpu_blocks": "2000", "block_size": "16"})  # fmt: skip
        snap = Snapshot(timestamp=m.timestamp, metrics=[m])
        snap.gpus = [
            Gpu(
                index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GiB, memory_used_bytes=74 * GiB
            )
        ]
        tl.append(snap)
    cfg = EngineConfig(
        model="m", max_num_seqs=512, max_model_len=4096, explicit={"max_num_seqs", "max_model_len"}
    )
    return tl, [cfg]


def test_overriding_the_kv_pressure_threshold_changes_the_severity(tmp_path: Path) -> None:
    tl, cfgs = _pressured(0.85)
    for snap in tl.snapshots:
        snap.configs = cfgs
    none = tmp_path / "none.yaml"
    none.write_text("{}\n")

    def severity(config: Path) -> str | None:
        rep = Pipeline.load(None, config).evaluate(tl, now=0)
        got = [f.severity for f in rep.findings if f.rule == "max-num-seqs-exceeds-kv"]
        return got[0] if got else None

    # KV at 85 % with a queue: under the default kv_full 0.9 that is no pressure (info).
    assert severity(none) == "info"
    cfg = tmp_path / "config.yaml"
    cfg.write_text("thresholds:\n  max-num-seqs-exceeds-kv:\n    kv_full: 0.8\n")
    assert severity(cfg) == "warning"


@pytest.mark.parametrize(
    ("gpu_name", "version"),
    [
        ("H100", "0.33.0"),
        ("H100", "0.9.2"),
        ("A100-80GB", "0.33.0"),
        ("L4", "0.19.1"),
        ("H200", None),
        ("H100", "0.34.0"),
        ("L4", "0.34.1"),
    ],
)
def test_plan_and_diagnose_agree_on_vllms_defaults(gpu_name: str, version: str | None) -> None:
    from kvdoctor import catalog
    from kvdoctor.plan import build_plan, resolve_model
    from kvdoctor.vllm_defaults import UNKNOWN_VERSION_ASSUMED

    spec = catalog.gpu(gpu_name)
    # an engine of unknown version is read with 0.33's defaults (stated); plan models a version it
    # is given (its own default is the newest, 0.34)
    plan = build_plan(
        resolve_model("meta-llama/Llama-3.1-8B-Instruct"),
        gpu=spec,
        vllm_version=version or UNKNOWN_VERSION_ASSUMED,
        grid=False,
    )
    snap = Snapshot(
        gpus=[Gpu(index=0, name=spec.name, memory_total_bytes=spec.memory_bytes, memory_used_bytes=GiB)]
    )
    snap.configs = [EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", vllm_version=version)]
    tl = Timeline()
    tl.append(snap)
    _, contexts, _ = build_contexts(tl, snap.configs)
    v = contexts[0][1]
    assert v["max_num_seqs_effective"] == plan["max_num_seqs"]
    assert v["gmu"] == plan["gpu_memory_utilization"]


def test_overriding_the_plateau_ratio_changes_the_severity(tmp_path: Path) -> None:
    # r29: used memory climbs at 1 GiB/h over 6 h, the later half as fast as the whole.
    tl = load_bundle(DATA / "bundles" / "r29-steady-memory-growth-csv-loop").timeline
    none = tmp_path / "none.yaml"
    none.write_text("{}\n")

    def severity(config: Path) -> str:
        rep = Pipeline.load(None, config).evaluate(tl, now=0)
        return next(f.severity for f in rep.findings if f.rule == "gpu-memory-growth")

    assert severity(none) == "warning"
    cfg = tmp_path / "config.yaml"
    # "Levelled off" now means: the later half grows at under 1.5× the overall slope.
    cfg.write_text("thresholds:\n  gpu-memory-growth:\n    plateau_ratio: 1.5\n")
    assert severity(cfg) == "info"


# --------------------------------------------------------------------------- block size from the log

_KV_LINE = "INFO 12-01 12:24:08 [kv_cache_utils.py:2327] {dev} KV cache size: {tokens:,} tokens, Maximum concurrency for {mml:,} tokens per request: 2.00x"
_OVERRIDE = "INFO 12-01 12:24:08 [kv_cache_utils.py:2619] Overriding num_gpu_blocks=8192 with num_gpu_blocks_override={n}"
_VERSION = "INFO 12-01 12:22:07 [api_server.py:1] vLLM API server version {v}"


@pytest.mark.parametrize(
    ("version", "blocks", "tokens", "mml", "expected"),
    [
        ("0.32.0", 4, 512, 256, 128),  # the real CPU run: cdiv(256, 128) = 2 blocks a request
        ("0.32.0", 10, 500, 200, 64),  # L not a multiple of B: int(10 / cdiv(200, 64) × 200) = 500
        ("0.11.0", 100, 1600, 100, 16),  # before 0.21: tokens = blocks × block_size
        ("0.32.0", 100, 1600, 100, None),  # the same numbers fit no block size from 0.21 on
        ("0.32.0", 4, 400, 100, None),  # L=100: B=128 and B=256 both give 1 block a request
        ("0.32.0", 4, 999, 256, None),  # no block size fits: no guess
    ],
)
def test_block_size_from_the_logs_kv_lines(
    version: str, blocks: int, tokens: int, mml: int, expected: int | None
) -> None:
    from kvdoctor.derive.engines import block_size_from_log
    from kvdoctor.sources.vllm_log import parse_log

    text = "\n".join(
        [
            _VERSION.format(v=version),
            _OVERRIDE.format(n=blocks),
            _KV_LINE.format(dev="CPU", tokens=tokens, mml=mml),
        ]
    )
    log = parse_log(text + "\n")
    assert block_size_from_log(log, mml, log.vllm_version) == expected


# --------------------------------------------------------------------------- per-snapshot memo


def test_timeline_columns_ask_each_snapshot_once_and_follow_appends_drops_and_rewrites() -> None:
    import gc

    from kvdoctor.derive.base import _COLUMNS, timeline_columns

    calls: list[float | None] = []

    def stamp(snap: Snapshot) -> float | None:
        calls.append(snap.timestamp)
        return snap.timestamp

    tl = Timeline(max_len=5)
    for t in range(5):
        tl.append(Snapshot(timestamp=float(t)))
    cols = timeline_columns(tl)
    assert cols.pick("t", stamp, [0, 4]) == [0.0, 4.0] and calls == [0.0, 4.0]  # only those read
    tl.append(Snapshot(timestamp=5.0))  # the oldest drops, one is appended
    assert timeline_columns(tl) is cols
    assert cols.pick("t", stamp, range(5)) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert calls == [0.0, 4.0, 1.0, 2.0, 3.0, 5.0]  # 4.0 was kept, not asked again
    calls.clear()
    assert cols.span("w", stamp, 2, 5) == [3.0, 4.0, 5.0] and calls == [3.0, 4.0, 5.0]
    tl.append(Snapshot(timestamp=6.0))
    timeline_columns(tl)
    assert cols.span("w", stamp, 1, 5) == [3.0, 4.0, 5.0, 6.0] and calls[3:] == [6.0]  # the new one
    assert cols.span("w", stamp, 0, 5) == [2.0, 3.0, 4.0, 5.0, 6.0] and calls[4:] == [2.0]
    assert cols.span("w", stamp, 0, 5) == [2.0, 3.0, 4.0, 5.0, 6.0] and len(calls) == 5
    tl.snapshots[2] = Snapshot(timestamp=9.0)  # changed in place: the columns start afresh
    timeline_columns(tl)
    want = [2.0, 3.0, 9.0, 5.0, 6.0]
    assert cols.pick("t", stamp, range(5)) == want and calls[-5:] == want
    other = Timeline(snapshots=list(tl.snapshots))  # another Timeline object: columns of its own
    assert timeline_columns(other) is not cols
    n = len(_COLUMNS)
    del other
    gc.collect()
    assert len(_COLUMNS) == n - 1  # dropped with its Timeline


def test_contexts_over_a_rolling_timeline_match_a_fresh_evaluation_of_the_same_snapshots() -> None:
    # What the memos keep from one cycle to the next never shows: each cycle's variables equal
    # those of the same snapshots evaluated in a Timeline seen for the first time (copies).
    import copy

    tl = Timeline(max_len=90)
    for i in range(200):
        gpus = [
            Gpu(index=j, memory_total_bytes=80 * GiB, memory_used_bytes=60 * GiB + (i * (j + 1) << 20),
                clock_event_reasons=["sw_thermal_slowdown"] if (i // 15) % 2 and j == 0 else [],
                processes=[GpuProcess(pid=10 + j, name="VLLM::Worker", used_bytes=50 * GiB)])
            for j in range(2)
        ]  # fmt: skip
        m = EngineMetrics(timestamp=float(i), engine="0", kv_cache_usage=(i % 10) / 10, num_requests_running=i % 7,
                          generation_tokens_total=float(37 * i), num_preemptions_total=float(i // 9))  # fmt: skip
        tl.append(Snapshot(timestamp=float(i), gpus=gpus, metrics=[m]))
        if i % 23 == 0 or i > 190:
            _, got, _ = build_contexts(tl, [])
            _, fresh, _ = build_contexts(Timeline(snapshots=copy.deepcopy(tl.snapshots), max_len=90), [])
            assert got == fresh, i


def _hist(count: float, bounds: tuple[float, ...] = (128.0, 1024.0)) -> HistogramData:
    # cumulative buckets: a quarter, then three quarters, then all of the observations
    fr = (0.25, 0.5, 0.75) if len(bounds) > 2 else (0.25, 0.75)
    return HistogramData(buckets=[*((le, count * f) for le, f in zip(bounds, fr, strict=False)), (math.inf, count)],
                         count=count, sum=count * 300.0)  # fmt: skip


def test_histogram_windows_over_a_rolling_timeline_match_the_samples_read_afresh() -> None:
    # The reset flags kept per pair of neighbouring snapshots never show: through evictions,
    # column trims, a reset, changed bucket bounds, samples without the histogram or without a
    # timestamp of their own, each cycle's histogram deltas (and every variable) equal those of
    # the same snapshots seen for the first time, and those of the plain samples.
    import copy

    from kvdoctor import timeline as tlm
    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import engine_series, engine_series_at, recent_snapshots

    names = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total")
    tl = Timeline(max_len=40)
    count = 0.0
    for i in range(260):
        count += i % 5
        # resets the window's ends do not show: a restart's dip, bucket bounds changed a while
        dip = i in (70, 71, 150) or 180 <= i < 190
        bounds = (64.0, 512.0, 4096.0) if 100 <= i < 103 else (128.0, 1024.0)
        hists = {n: _hist(3.0 if dip else count * (k + 1), bounds) for k, n in enumerate(names)}
        if i % 37 == 5:
            hists.pop(names[0])  # one scrape lacks one histogram
        m = EngineMetrics(timestamp=None if i % 11 == 3 else float(i), engine="0", histograms=hists,
                          num_requests_running=i % 4, generation_tokens_total=float(7 * i))  # fmt: skip
        tl.append(Snapshot(timestamp=float(i), metrics=[m]))
        recent, _ = recent_snapshots(tl.snapshots, 12.0)
        end = len(tl.snapshots)
        sourced = engine_series_at(timeline_columns(tl), end - len(recent), end, "0")
        plain = list(engine_series(recent, "0"))  # a plain list: every sample read
        for name in names:
            for seconds in (12.0, 5.0, 1.0):
                want = tlm.histogram_delta(plain, name, seconds)
                got = tlm.histogram_delta(sourced, name, seconds)
                assert (got and (got.buckets, got.count, got.sum)) == (
                    want and (want.buckets, want.count, want.sum)
                ), (i, name, seconds)
        if i % 17 == 0 or i > 250:
            _, ctx, _ = build_contexts(tl, [], window_s=12.0)
            _, fresh, _ = build_contexts(
                Timeline(snapshots=copy.deepcopy(tl.snapshots), max_len=40), [], window_s=12.0
            )
            assert ctx == fresh, i


def test_timeline_columns_trim_the_dropped_entries_and_keep_pairs_of_neighbours() -> None:
    from kvdoctor.derive import base
    from kvdoctor.derive.base import timeline_columns

    asked: list[tuple[float | None, float | None]] = []

    def step(prev: Snapshot | None, snap: Snapshot) -> float | None:
        asked.append((prev.timestamp if prev else None, snap.timestamp))
        return None if prev is None else (snap.timestamp or 0.0) - (prev.timestamp or 0.0)

    tl = Timeline(max_len=7)
    cols = timeline_columns(tl)
    for t in range(3 * base._TRIM + 5):  # past several trims
        tl.append(Snapshot(timestamp=float(t * t)))
        assert timeline_columns(tl) is cols
        n = len(tl.snapshots)
        assert cols.span("t", lambda s: s.timestamp, 0, n) == [s.timestamp for s in tl.snapshots]
        got = cols.span_steps("d", step, max(0, n - 3), n)
        want = [None if p == 0 else tl.snapshots[p].timestamp - tl.snapshots[p - 1].timestamp  # type: ignore[operator]
                for p in range(max(0, n - 3), n)]  # fmt: skip
        assert got == want
        assert cols.pick("t", lambda s: s.timestamp, [n - 1, 0]) == [
            tl.snapshots[-1].timestamp,
            tl.snapshots[0].timestamp,
        ]
        assert cols._base < base._TRIM
    # each pair of neighbours was asked once: the newest step each cycle (two at the start)
    assert len(asked) == len(set(asked)) == 3 * base._TRIM + 5
    tl.snapshots.reverse()  # not append-only: everything asked afresh, in the new order
    timeline_columns(tl)
    n = len(tl.snapshots)
    assert cols.span_steps("d", step, 1, n) == [b.timestamp - a.timestamp  # type: ignore[operator]
                                                for a, b in zip(tl.snapshots, tl.snapshots[1:], strict=False)]  # fmt: skip
    assert asked[-(n - 1) :] == [
        (a.timestamp, b.timestamp) for a, b in zip(tl.snapshots, tl.snapshots[1:], strict=False)
    ]


def test_recent_snapshots_cut_by_bisection_match_the_scan_from_the_end() -> None:
    # Through evictions, untimed snapshots, clocks that step back, windows longer than the tail
    # read first: the same window and the same "a scrape before it" as the scan.
    import random

    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import _RECENT_TAIL, recent_snapshots

    rnd = random.Random(7)
    tl = Timeline(max_len=3 * _RECENT_TAIL)
    t = 0.0
    for i in range(5 * _RECENT_TAIL):
        t += rnd.choice([1.0, 1.0, 0.5, 0.0, 2.0]) if i != 300 else -30.0  # a clock stepped back
        ts = None if i in (100, 101, 450) else t
        metrics = [EngineMetrics(timestamp=ts)] if i % 3 else []
        # a snapshot without a time of its own takes its scrape's
        tl.append(Snapshot(timestamp=ts if i % 5 or not metrics else None, metrics=metrics))
        cols = timeline_columns(tl)
        for w in (0.0, 1.0, 60.0, 2.5 * _RECENT_TAIL, 1e9):
            want = recent_snapshots(tl.snapshots, w)
            got = recent_snapshots(tl.snapshots, w, cols)
            assert got[1] == want[1] and len(got[0]) == len(want[0]), (i, w)
            assert all(a is b for a, b in zip(got[0], want[0], strict=True))


def test_growth_slope_is_bit_identical_to_its_definition() -> None:
    import random

    from kvdoctor.derive.growth import slope_per_hour

    rnd = random.Random(11)
    for _ in range(200):
        n = rnd.randint(2, 70)
        pts = sorted((1.7e9 + rnd.random() * 600, float(rnd.randint(0, 80 * GiB))) for _ in range(n))
        mt = sum(t for t, _ in pts) / n
        my = sum(y for _, y in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        want = None if var <= 0 else sum((t - mt) * (y - my) for t, y in pts) / var * 3600.0
        assert slope_per_hour(pts) == want
    assert slope_per_hour([(5.0, 1.0), (5.0, 2.0)]) is None and slope_per_hour([(1.0, 1.0)]) is None


def test_has_value_of_a_timeline_window_matches_the_samples() -> None:
    # From the per-snapshot presence column or from the samples: the same answer, NaN a value.
    from kvdoctor import timeline as tlm
    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import engine_series_at

    tl = Timeline(max_len=20)
    for i in range(60):
        drafts = math.nan if i == 31 else (float(i) if 40 <= i < 43 else None)
        tl.append(Snapshot(timestamp=float(i), metrics=[EngineMetrics(timestamp=float(i), engine="0",
                                                                       spec_decode_num_drafts_total=drafts)]))  # fmt: skip
        n = len(tl.snapshots)
        for lo in (0, n // 2, n - 1):
            sourced = engine_series_at(timeline_columns(tl), lo, n, "0")
            want = any(m.spec_decode_num_drafts_total is not None for m in sourced)
            assert tlm.has_value(sourced, "spec_decode_num_drafts_total") is want
            assert tlm.has_value(list(sourced), "spec_decode_num_drafts_total") is want
    with pytest.raises(ValueError):
        tlm.has_value([], "no_such_field")


def test_nothing_throttled_shortcut_writes_what_the_readings_would(monkeypatch: pytest.MonkeyPatch) -> None:
    # The shortcut for a history without slowdown gives every variable the readings would, the
    # newest snapshot throttled or not, untimed snapshots among them, the GPUs without readings.
    from kvdoctor.derive import hardware

    def contexts(tl: Timeline) -> list[Any]:
        return [ctx for _, ctx, _ in build_contexts(tl, [])[1]]

    tl = Timeline(max_len=30)
    for i in range(90):
        hot = i in (40, 41) or i >= 85
        gpus = [Gpu(index=j, memory_total_bytes=80 * GiB, memory_used_bytes=60 * GiB,
                    clock_event_reasons=["sw_power_cap"] if hot and j == 0 else ["gpu_idle"],
                    processes=[GpuProcess(pid=10 + j, name="VLLM::Worker", used_bytes=50 * GiB)])
                for j in range(2)] if i % 13 != 4 else []  # fmt: skip
        m = EngineMetrics(timestamp=float(i), engine="0", num_requests_running=1 + i % 3,
                          generation_tokens_total=float(50 * i))  # fmt: skip
        tl.append(Snapshot(timestamp=None if i % 7 == 3 else float(i), gpus=gpus, metrics=[m]))
        got = contexts(tl)
        with monkeypatch.context() as mp:
            mp.setattr(hardware, "_nothing_throttled", lambda *a: False)
            want = contexts(tl)
        assert got == want, i


# --------------------------------------------------------------------------- session 8: cycle memos


def test_sliding_span_reads_only_the_newest_entry_and_matches_a_fresh_read() -> None:
    # A window slid on by one snapshot cycle after cycle asks only the appended snapshot (or
    # its step); its answers equal a fresh Columns' through drops, trims, an entry a pick
    # already filled, and a window that reaches the first snapshot (a step of None before it).
    from kvdoctor.derive import base
    from kvdoctor.derive.base import Columns, timeline_columns

    asked: list[float | None] = []

    def stamp(snap: Snapshot) -> float | None:
        asked.append(snap.timestamp)
        return snap.timestamp

    def step(prev: Snapshot | None, snap: Snapshot) -> float | None:
        return None if prev is None else (snap.timestamp or 0.0) - (prev.timestamp or 0.0)

    tl = Timeline(max_len=20)
    cols = timeline_columns(tl)
    for t in range(2 * base._TRIM + 30):
        tl.append(Snapshot(timestamp=float(t * 3 % 17 + t)))
        timeline_columns(tl)
        n = len(tl.snapshots)
        lo = max(0, n - 6)
        if t % 9 == 4:
            cols.pick("w", stamp, [n - 1])  # the newest entry filled before the span reads it
        before = len(asked)
        got = cols.span("w", stamp, lo, n)
        fresh = Columns()
        fresh.sync(tl.snapshots)
        assert (
            got == fresh.span("w", lambda s: s.timestamp, lo, n) == [s.timestamp for s in tl.snapshots[lo:n]]
        )
        assert cols.span_steps("d", step, lo, n) == fresh.span_steps("d", step, lo, n)
        if t > 6:
            assert len(asked) - before == (0 if t % 9 == 4 else 1), t  # only the appended one


def test_build_engines_reuses_its_answer_while_the_inputs_stay_and_follows_them() -> None:
    # Same launch configs, same log (as many events), equal cache_config: the same engines (new
    # objects each call); a log that grew, another config, another cache_config: worked out
    # again, as a call with nothing remembered gives.
    from kvdoctor.derive import engines as eng_mod
    from kvdoctor.derive.engines import build_engines
    from kvdoctor.sources.vllm_log import parse_log

    log = parse_log("INFO 01-01 00:00:00 api_server.py:1] vLLM API server version 0.10.1\n")
    cfg = EngineConfig(model="m", block_size=32, explicit={"block_size"})

    def snap(blocks: str, lg: Any = log) -> Snapshot:
        m = EngineMetrics(
            timestamp=1.0, model_name="m", cache_config={"num_gpu_blocks": blocks, "block_size": "32"}
        )
        return Snapshot(timestamp=1.0, log=lg, metrics=[m], configs=[cfg])

    def fresh(s: Snapshot, configs: list[EngineConfig]) -> list[Any]:
        eng_mod._ENGINES_MEMO.clear()
        return [(e.id, e.config, e.pids, e.gpus) for e in build_engines(s, configs)]

    first = build_engines(snap("100"), [cfg])
    again = build_engines(snap("100"), [cfg])
    assert again[0] is not first[0] and again[0].config is first[0].config  # reused, new engines
    again[0].pids.append(7)
    assert build_engines(snap("100"), [cfg])[0].pids == []  # a caller's change does not stay
    other = EngineConfig(model="m", block_size=64, explicit={"block_size"})
    for s, configs in ((snap("200"), [cfg]), (snap("100"), [other]), (snap("100"), [])):
        got = [(e.id, e.config, e.pids, e.gpus) for e in build_engines(s, configs)]
        assert got == fresh(s, configs)
    grown = parse_log("INFO 01-01 00:00:00 api_server.py:1] vLLM API server version 0.10.1\n")
    s = snap("100", grown)
    assert build_engines(s, [])[0].config.vllm_version == "0.10.1"
    grown.events.clear()  # the same log object with other events: worked out again
    grown.vllm_version = None
    assert build_engines(s, [])[0].config.vllm_version is None


def test_gpu_spec_is_the_catalogues_answer() -> None:
    from kvdoctor import catalog
    from kvdoctor.derive.base import gpu_spec

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"):
        assert gpu_spec(name) is catalog.gpu(name) or vars(gpu_spec(name)) == vars(catalog.gpu(name))
    with pytest.raises(KeyError):
        gpu_spec("no such card 123")


def test_sample_values_from_the_columns_match_the_samples_through_a_rolling_timeline() -> None:
    # A function of the sample asked once per snapshot of the Timeline's columns gives, window
    # after window, what it gives applied to each sample of a plain list: through evictions,
    # trims, scrapes without a timestamp of their own (stamped copies), values absent or NaN.
    from kvdoctor import timeline as tlm
    from kvdoctor.derive import pressure
    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import engine_series, engine_series_at, recent_snapshots

    asked: list[float | None] = []

    def stamp_and_waiting(m: EngineMetrics) -> tuple[float | None, int | None]:
        asked.append(m.timestamp)
        return m.timestamp, m.num_requests_waiting

    tl = Timeline(max_len=30)
    for i in range(150):
        m = EngineMetrics(timestamp=None if i % 7 == 2 else float(i), engine="0",
                          num_requests_waiting=None if i % 5 == 1 else i % 3,
                          kv_cache_usage=math.nan if i % 11 == 4 else (None if i % 13 == 6 else (i % 10) / 10))  # fmt: skip
        tl.append(Snapshot(timestamp=float(i), metrics=[m]))
        recent, _ = recent_snapshots(tl.snapshots, 9.0)
        end = len(tl.snapshots)
        sourced = engine_series_at(timeline_columns(tl), end - len(recent), end, "0")
        plain = list(engine_series(recent, "0"))
        before = len(asked)
        got = tlm.sample_values(sourced, stamp_and_waiting)
        assert got == [stamp_and_waiting(x) for x in plain], i
        if i > 10:
            assert len(asked) - before == 1 + len(plain)  # the appended scrape, and the plain list
        assert tlm.sample_values(sourced, stamp_and_waiting) is got  # memoised per window
        want = [float(x.kv_cache_usage or 0.0) for x in plain if (x.num_requests_waiting or 0) > 0]
        marks = tlm.sample_values(sourced, pressure._queued_kv)
        queued = [kv for q, kv in marks if q]
        assert repr(queued) == repr(want), i


def test_describe_processes_memo_follows_every_field_it_shows() -> None:
    from kvdoctor.derive.base import describe_processes

    a = GpuProcess(pid=7, name="python3", used_bytes=3 * GiB)
    assert describe_processes([(a, 0)]) == "pid 7 (python3) 3.00 GiB on GPU 0"
    assert describe_processes([(GpuProcess(pid=7, name="python3", used_bytes=3 * GiB), 0)]) == (
        "pid 7 (python3) 3.00 GiB on GPU 0"
    )
    assert describe_processes([(GpuProcess(pid=7, name="python3", used_bytes=GiB), 0)]) == (
        "pid 7 (python3) 1.00 GiB on GPU 0"
    )
    assert describe_processes([(GpuProcess(pid=8, name="", used_bytes=None), 1), (a, 2)]) == (
        "pid 8 (?) N/A on GPU 1, pid 7 (python3) 3.00 GiB on GPU 2"
    )
    assert describe_processes([]) == ""


def test_pick_of_a_sampled_history_matches_the_snapshots_through_drops_and_trims() -> None:
    # The sampled history (one index tuple, cycle after cycle) is picked by one itemgetter per
    # shift of the columns: the same answers as asking each snapshot, past several trims, with
    # the index tuple recreated equal, and after the columns start afresh.
    from kvdoctor.derive import base
    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import history_positions

    tl = Timeline(max_len=40)
    cols = timeline_columns(tl)
    for t in range(3 * base._TRIM + 11):
        tl.append(Snapshot(timestamp=float(t)))
        timeline_columns(tl)
        n = len(tl.snapshots)
        index = history_positions(n, 12) if t % 5 else tuple(history_positions(n, 12))  # equal, not the same
        want = [tl.snapshots[i].timestamp for i in index]
        assert cols.pick("t", lambda s: s.timestamp, index) == want, t
    tl.snapshots.reverse()  # not append-only: afresh
    timeline_columns(tl)
    index = history_positions(len(tl.snapshots), 12)
    assert cols.pick("t", lambda s: s.timestamp, index) == [tl.snapshots[i].timestamp for i in index]


def test_vllm_holders_are_each_gpus_own_and_leave_the_weights_daemon_out() -> None:
    from kvdoctor.derive.base import vllm_holders

    procs = [GpuProcess(pid=1, name="VLLM::Worker_TP0", used_bytes=40 * GiB),
             GpuProcess(pid=2, name="python3", used_bytes=40 * GiB),
             GpuProcess(pid=3, name="VLLM::EngineCore", used_bytes=GiB // 2),
             GpuProcess(pid=4, name="vllm preload", used_bytes=20 * GiB)]  # fmt: skip
    g = Gpu(index=0, processes=procs)
    assert [p.pid for p in vllm_holders(g, frozenset())] == [1, 4]
    assert [p.pid for p in vllm_holders(g, frozenset({4}))] == [1]
    assert [p.pid for p in vllm_holders(g, frozenset())] == [1, 4]  # asked again: the same
    other = Gpu(index=0, processes=procs[1:])  # another GPU object: its own processes
    assert [p.pid for p in vllm_holders(other, frozenset())] == [4]


def test_growth_of_one_gpu_from_its_columns_matches_the_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one-GPU shortcut (per-snapshot point and total columns) writes every variable the
    # readings would: through evictions and trims, snapshots without GPUs or without a time
    # (a GPU's own time then counts), totals unknown or zero, a table listing the GPU twice.
    from kvdoctor.derive import growth

    def contexts(tl: Timeline) -> list[Any]:
        return [ctx for _, ctx, _ in build_contexts(tl, [])[1]]

    taken: list[int] = []
    one_gpu = growth._one_gpu

    def counted(*a: Any) -> Any:
        got = one_gpu(*a)
        if got is not None and got[0]:
            taken.append(len(next(iter(got[0].values()))))
        return got

    monkeypatch.setattr(growth, "_one_gpu", counted)
    tl = Timeline(max_len=150)
    for i in range(260):
        used = 60 * GiB + (i * i % 97) * (1 << 24)
        g0 = Gpu(index=0, memory_total_bytes=None if i % 17 == 3 else (0 if i % 19 == 5 else 80 * GiB),
                 memory_used_bytes=None if i % 23 == 7 else used, timestamp=float(i) if i % 7 == 3 else None,
                 processes=[GpuProcess(pid=10, name="VLLM::Worker", used_bytes=50 * GiB)])  # fmt: skip
        gpus = [g0, Gpu(index=1, memory_total_bytes=80 * GiB, memory_used_bytes=GiB)]
        if i == 140:
            gpus.append(
                Gpu(index=0, memory_total_bytes=80 * GiB, memory_used_bytes=used + GiB)
            )  # listed twice
        m = EngineMetrics(timestamp=float(i), engine="0", num_requests_running=1)
        tl.append(
            Snapshot(
                timestamp=None if i % 7 == 3 else float(i), gpus=gpus if i % 13 != 4 else [], metrics=[m]
            )
        )
        if i % 9 == 0 or i > 250:
            got = contexts(tl)
            with monkeypatch.context() as mp:
                mp.setattr(growth, "_one_gpu", lambda *a: None)
                want = contexts(tl)
            assert repr(got) == repr(want), i
    assert taken and max(taken) > 40  # the shortcut ran, over the sampled history


def test_sampled_history_and_recent_count_read_what_the_lists_hold() -> None:
    from kvdoctor.derive.base import timeline_columns
    from kvdoctor.derive.engines import (
        SampledHistory,
        bounded_history,
        history_positions,
        recent_count,
        recent_snapshots,
    )

    tl = Timeline(max_len=300)
    for i in range(260):
        m = [EngineMetrics(timestamp=float(i), engine="0")] if i % 5 else []
        tl.append(
            Snapshot(timestamp=None if i in (3, 250) else float(i) - (2.0 if i == 100 else 0.0), metrics=m)
        )
        if i % 11 == 0 or i > 245:
            snaps = tl.snapshots
            hist = SampledHistory(snaps, history_positions(len(snaps)))
            want = bounded_history(snaps)
            assert list(hist) == want and len(hist) == len(want) and bool(hist) is bool(want)
            assert hist[-1] is want[-1] and hist[1:4] == want[1:4] and list(reversed(hist)) == want[::-1]
            for window_s in (0.0, 7.0, 60.0, 1e9):
                recent, older = recent_snapshots(snaps, window_s)
                assert recent_count(snaps, window_s, timeline_columns(tl)) == (len(recent), older), (
                    i,
                    window_s,
                )
    assert not SampledHistory([], history_positions(0))
