"""kvdoctor inside an offline ``LLM(...)`` (which loads no plugins): :class:`LLMWatcher` polling
``llm.get_metrics()``, against the real vLLM. The ``vllm serve`` plugin path is checked on the
live server (test_live.py::test_plugin_inside_the_server_logs_the_storm)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvdoctor.rules.preemption_storm import RULE as PREEMPTION_STORM

from tests.integration import vllm_env
from tests.integration.conftest import REPO, pin
from tests.integration.server import server_env

STORM = PREEMPTION_STORM.threshold_values()


def test_llm_watcher_diagnoses_an_offline_engine(vllm: vllm_env.VllmEnv, workdir: Path) -> None:
    out = workdir / "offline.json"
    cache = workdir / "offline-cache"
    cache.mkdir(exist_ok=True)
    log = workdir / "offline.log"
    with log.open("wb") as fh:
        proc = subprocess.run(
            [str(vllm.python), str(Path(__file__).with_name("offline_llm.py")), str(vllm.model), str(out)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=server_env(vllm, cache),
            cwd=REPO,
            timeout=480,
        )
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert proc.returncode == 0, tail
    doc = json.loads(out.read_text())
    pin("offline-llm.log", log)
    assert doc["plugin_is_stat_logger"] is True
    assert doc["snapshots"] >= 2 and doc["report"] is not None
    report = doc["report"]
    (engine,) = report["engines"]
    assert engine["config"]["max_model_len"] == 256
    assert engine["kv"]["num_gpu_blocks"] == 4 and engine["kv"]["block_size"] == 128
    # vLLM's own counters decide: preemptions per minute, KV usage reaching full. The watcher
    # evaluates its own windows at other instants than this reader, so only a rate clearly on
    # one side of the threshold (a factor of 2) decides; the load is made to be far above it.
    own = [r for r in doc["own"] if "preemptions" in r and "kv" in r]
    assert len(own) >= 2, tail
    storm, rate = _storm(own)
    assert storm is not None, (
        f"vLLM's own counters: {rate:.0f} preemptions/min, too near the threshold to decide"
    )
    rules = {f["rule"] for f in report["findings"]}
    fired = {t["rule"] for t in doc["transitions"] if t["kind"] == "fired"}
    assert ("preemption-storm" in fired) == storm, (rate, fired)
    # A storm seen while generating is what the watcher logged, through the logging module.
    text = log.read_text(errors="replace")
    if storm:
        assert "kvdoctor.vllm WARNING kvdoctor: preemption-storm fired" in text
    # The final evaluation (at stop) reads the last 60 s of the run (the whole run when it was
    # shorter); the drain at its end may leave that window too near the threshold to say.
    final, rate = _storm([r for r in own if r["t"] >= own[-1]["t"] - 60])
    if final is not None:
        assert ("preemption-storm" in rules) == final, (rate, sorted(rules))


def _storm(own: list[dict[str, float]]) -> tuple[bool | None, float]:
    """Whether vLLM's own readings meet preemption-storm's thresholds (None when the rate is
    within a factor of 2 of the threshold: too near to decide from readings taken at other
    instants than kvdoctor's), and the rate per minute."""
    minutes = max((own[-1]["t"] - own[0]["t"]) / 60, 1e-9)
    rate = (own[-1]["preemptions"] - own[0]["preemptions"]) / minutes
    if max(r["kv"] for r in own) < STORM["kv_full"]:
        return False, rate
    low = STORM["min_per_min"]
    return (True if rate >= 2 * low else False if rate <= low / 2 else None), rate
