"""## What
GPU memory is held by processes named like vLLM workers (`VLLM::EngineCore`, `VLLM::Worker_TP0`,
`VllmWorkerProcess`) with no live API server, or by pids that no longer exist in the host's
process table.

## Why
When the API server is SIGKILLed (OOM killer, a supervisor's hard stop), its engine-core and
worker children can survive and keep their KV cache. The restart then fails the startup
free-memory check (before 0.34, and 0.34 without the extensible KV cache); a 0.34 extensible
restart has no such check and fails after warm-up, or gets a small pool
(`shared-gpu-gmu-unset`, which this finding explains). An engine whose API server still answers
while its KV cache is released (sleep, `/release_kv_cache_memory`, checkpoint `prepared`) is not
orphaned.

## How to confirm
`nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv` lists VLLM:: processes;
`ps -p PID -o ppid,args` shows them re-parented to 1, with no `vllm serve` running.

## Fix
`kill PID` for each (the evidence names them and their bytes), then restart.

## Sources
spec/rules.md family P; vllm-facts.md §3.1 (process names).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, na


@dataclass(frozen=True)
class Thresholds:
    """None: any orphaned vLLM process holding GPU memory is a finding."""


def check(f: Facts, t: Thresholds) -> Hit | None:
    pids = f["orphan_pids"]
    if not pids:
        return None
    # An API server answered /metrics (the sleep-state gauge was read): "no vLLM API server is
    # running" is wrong; the engine is asleep or its KV released (sleep, /release_kv_cache_memory,
    # checkpoint prepared), not orphaned (spec/vllm-0.34.md §2).
    if (
        f["orphan_reason"] == "no vLLM API server is running"
        and f["sleep_source"] == "vllm:engine_sleep_state"
    ):
        return None
    kill = "kill " + " ".join(str(p) for p in dict.fromkeys(pids))
    gpus = f["orphan_gpus"]
    summary = (
        f"Free the memory with `{kill}` (then `kill -9` if they linger) before restarting the server:"
        f" {len(pids)} vLLM engine/worker process(es) hold {gib_text(f['orphan_bytes'])} GiB"
        f" on GPU(s) {na(gpus)} with no live server to serve from them ({na(f['orphan_reason'])})"
        f" - {na(f['orphan_desc'])}."
    )
    evidence = [
        Evidence(
            "orphaned processes", na(f["orphan_desc"]), "nvidia-smi Processes / --query-compute-apps / NVML"
        ),
        Evidence("why orphaned", na(f["orphan_reason"]), "vllm.log / host process table"),
    ]
    if f["free_below_util"]:
        evidence.append(
            Evidence(
                "restart refused",
                f"free {gib_text(f['fbu_free_bytes'])} of {gib_text(f['fbu_total_bytes'])} GiB",
                f"vllm.log line {na(f['fbu_line'])}",
            )
        )
    fixes = [
        Fix(
            commands=(kill,), why="frees the GPU memory the orphaned processes hold; restart the server after"
        )
    ]
    return Hit(summary=summary, evidence=evidence, fixes=fixes, gpus=sorted(set(gpus or ())))


RULE = Rule(
    id="orphaned-engine-processes",
    family="P",
    severity="critical",
    title="Orphaned vLLM engine processes still hold GPU memory",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    explains=(
        "kv-budget-exhausted",
        "max-model-len-exceeds-kv-capacity",
        "gpu-shared-with-foreign-process",
        "shared-gpu-gmu-unset",
    ),
)
