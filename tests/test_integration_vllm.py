"""kvdoctor.integrations.vllm without vLLM: the base install never imports vLLM, and the stat
logger's logic (stats → Snapshots → rules → logged transitions) on stats shaped as vLLM's
(vllm-facts.md §6.3). The same code against a real vLLM: tests/integration/test_inprocess.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvdoctor.integrations import vllm as integ

ROOT = Path(__file__).resolve().parents[1]

_BLOCKER = r"""
import importlib.abc, json, pkgutil, sys
attempts = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            attempts.append(name)
            raise ImportError("vllm blocked by the test")
        return None
sys.meta_path.insert(0, Block())
import kvdoctor
skip = {"kvdoctor.integrations.vllm", "kvdoctor.__main__"}
names = [m.name for m in pkgutil.walk_packages(kvdoctor.__path__, "kvdoctor.") if m.name not in skip]
for n in names:
    try:
        __import__(n)
    except ImportError as e:
        if "vllm" in str(e):
            raise
from kvdoctor.cli import main
sys.argv = ["kvdoctor", "diagnose", "--demo", "--format", "json"]
try:
    main()
except SystemExit:
    pass
base = list(attempts)
import kvdoctor.integrations.vllm as integ
print(json.dumps({"modules": len(names), "base": base, "integration": attempts[len(base):],
                  "plugin": integ.KvdoctorStatLogger.__name__}))
"""


def test_base_install_never_imports_vllm() -> None:
    # Every kvdoctor module and a whole diagnose run, with any import of vllm recorded (and
    # refused): none may try. The integration module then tries, and still imports.
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKER], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["modules"] > 20
    assert got["base"] == []
    assert got["integration"] and got["integration"][0].startswith("vllm")
    assert got["plugin"] == "KvdoctorStatLogger"


def test_entry_point_names_the_stat_logger() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = data["project"]["entry-points"]["vllm.stat_logger_plugins"]["kvdoctor"]
    module, attr = target.split(":")
    import importlib

    cls = getattr(importlib.import_module(module), attr)
    for method in ("record", "log", "log_engine_initialized", "record_sleep_state"):
        assert callable(getattr(cls, method))
    assert "vllm" in data["project"]["optional-dependencies"]
    assert not any(d.startswith("vllm") for d in data["project"]["dependencies"])


# --------------------------------------------------------------------------- shaped like vLLM 0.32


def _vllm_config(*, max_model_len: int = 256, num_gpu_blocks: int = 4) -> Any:
    cache = SimpleNamespace(
        block_size=128,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
        num_gpu_blocks=num_gpu_blocks,
        num_gpu_blocks_override=num_gpu_blocks,
        kv_cache_memory_bytes=None,
    )
    cache.metrics_info = lambda: {k: str(v) for k, v in vars(cache).items() if k != "metrics_info"}
    hf = SimpleNamespace(
        to_dict=lambda: {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_hidden_layers": 2,
            "vocab_size": 1000,
            "torch_dtype": "float32",
        }
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="/m/tiny",
            served_model_name="tiny",
            max_model_len=max_model_len,
            dtype="torch.float32",
            quantization=None,
            enforce_eager=False,
            hf_config=hf,
        ),
        cache_config=cache,
        scheduler_config=SimpleNamespace(
            max_num_seqs=256, max_num_batched_tokens=2048, enable_chunked_prefill=True
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
        ),
    )


def _step(usage: float, running: int, waiting: int, preempted: int, finished: int = 0) -> tuple[Any, Any]:
    sched = SimpleNamespace(
        kv_cache_usage=usage,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        prefix_cache_stats=SimpleNamespace(queries=10, hits=2),
    )
    fin = [SimpleNamespace(num_prompt_tokens=40, num_generation_tokens=96) for _ in range(finished)]
    it = SimpleNamespace(
        num_preempted_reqs=preempted,
        num_prompt_tokens=40 * finished,
        num_generation_tokens=running,
        finished_requests=fin,
    )
    return sched, it


def test_engine_config_from_vllm_config_keeps_the_engines_values() -> None:
    cfg = integ.engine_config_from_vllm(_vllm_config(), "0.32.0")
    assert (cfg.model, cfg.served_model_name, cfg.max_model_len) == ("/m/tiny", "tiny", 256)
    assert (cfg.block_size, cfg.gpu_memory_utilization, cfg.dtype) == (128, 0.9, "float32")
    assert cfg.num_gpu_blocks_override == 4 and cfg.max_num_seqs == 256
    # The engine's own gmu and block size survive vLLM's version defaults.
    from kvdoctor.vllm_flags import apply_defaults

    applied = apply_defaults(cfg, "0.32.0")
    assert (applied.gpu_memory_utilization, applied.block_size) == (0.9, 128)
    arch = integ.model_from_vllm(_vllm_config())
    assert arch is not None and (arch.num_key_value_heads, arch.head_dim) == (2, 32)


def test_accumulator_counts_like_the_metrics_page() -> None:
    acc = integ.StatsAccumulator("0", "tiny", max_model_len=256)
    for _ in range(3):
        acc.record(*_step(1.0, 3, 29, preempted=2, finished=1))
    acc.record(None, None)
    m = acc.metrics(100.0)
    assert (m.kv_cache_usage, m.num_requests_running, m.num_requests_waiting) == (1.0, 3.0, 29.0)
    assert (m.num_preemptions_total, m.request_success_total, m.prompt_tokens_total) == (6.0, 3.0, 120.0)
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (30.0, 6.0)
    h = m.histograms["vllm:request_generation_tokens"]
    assert h.count == 3 and h.buckets[-1] == (float("inf"), 3.0)
    # 96 generated tokens: counted from the 100 bucket on, not in 50.
    assert dict(h.buckets)[50.0] == 0 and dict(h.buckets)[100.0] == 3
    assert [e for e, _ in h.buckets[:-1]] == [1, 2, 5, 10, 20, 50, 100, 200]
    # A later step does not change a Snapshot's facts already taken.
    acc.record(*_step(0.5, 1, 0, preempted=5))
    assert m.num_preemptions_total == 6.0 and acc.metrics(101.0).num_preemptions_total == 11.0


class _Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def test_stat_logger_fires_then_clears_preemption_storm(caplog: pytest.LogCaptureFixture) -> None:
    plugin = integ.KvdoctorStatLogger(_vllm_config(), engine_index=0)
    clock = _Clock()
    plugin._clock = clock
    plugin.log_engine_initialized()
    assert plugin.stats.cache_config["num_gpu_blocks"] == "4"
    caplog.set_level(logging.INFO, logger="kvdoctor.vllm")
    # 60 s of a full cache with 2 preemptions a second (120/min), steps every 0.5 s.
    for _ in range(120):
        clock.t += 0.5
        plugin.record(*_step(1.0, 3, 29, preempted=1), None, 0)
    fired = [t for t in plugin.doctor.transitions if t.rule == "preemption-storm"]
    assert fired and fired[0].kind == "fired" and fired[0].after == "warning"
    assert any(
        "preemption-storm fired" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
    # Then the load goes away: the storm clears once the window no longer holds preemptions.
    for _ in range(80):
        clock.t += 1.0
        plugin.log()
    assert any(t.kind == "cleared" and t.rule == "preemption-storm" for t in plugin.doctor.transitions)
    assert plugin.doctor.report is not None
    assert "preemption-storm" not in {f.rule for f in plugin.doctor.report.findings}
    assert any("preemption-storm cleared" in r.getMessage() for r in caplog.records)


def test_stat_logger_never_raises_into_vllm(caplog: pytest.LogCaptureFixture) -> None:
    plugin = integ.KvdoctorStatLogger(_vllm_config(), engine_index=0)
    caplog.set_level(logging.ERROR, logger="kvdoctor.vllm")
    bad = SimpleNamespace(kv_cache_usage="not a number")
    plugin.record(bad, None)
    plugin.record(*_step(1.0, 1, 0, 0))  # quiet after the first error, still no exception
    errors = [r for r in caplog.records if "disabled after an internal error" in r.getMessage()]
    assert len(errors) == 1


@dataclass
class Counter:
    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Gauge:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Histogram:
    name: str
    labels: dict[str, str]
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)


def test_get_metrics_items_read_as_a_scrape() -> None:
    # The dataclasses of vllm/v1/metrics/reader.py, as llm.get_metrics() returns them.
    labels = {"engine": "0", "model_name": "tiny"}
    items = [
        Gauge("vllm:kv_cache_usage_perc", labels, 0.97),
        Gauge("vllm:num_requests_running", labels, 3),
        Gauge("vllm:num_requests_waiting", labels, 29),
        Counter("vllm:num_preemptions", labels, 17),
        Counter("vllm:request_success", {**labels, "finished_reason": "length"}, 5),
        Gauge("vllm:cache_config_info", {**labels, "block_size": "128", "num_gpu_blocks": "4"}, 1),
        Histogram("vllm:request_prompt_tokens", labels, 5, 200.0, {"10": 0, "50": 5, "+Inf": 5}),
    ]
    (m,) = integ.metrics_from_vllm_snapshot(items, 5.0)
    assert (m.engine, m.kv_cache_usage, m.num_requests_waiting) == ("0", 0.97, 29.0)
    assert (m.num_preemptions_total, m.request_success_total) == (17.0, 5.0)
    assert m.cache_config["num_gpu_blocks"] == "4"
    assert m.histograms["vllm:request_prompt_tokens"].count == 5
