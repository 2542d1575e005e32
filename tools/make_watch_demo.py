"""Generate ``kvdoctor/data/demo/watch-demo.jsonl.gz``: the recording behind ``kvdoctor watch --demo``.

A real-shaped incident on an 8 × L40S node, one Snapshot per second for 240 s:

- GPU 0: the vLLM engine of case b17 (Llama-3.1-8B, V1 0.10.0, gmu 0.9) — its real log, launch
  command and config.json, and /metrics pages parsed from b17's real scrape with the counters
  and gauges moved along the incident: healthy traffic (0–60 s), long prompts arrive, KV usage
  climbs to 1.0, requests wait and preempt each other (60–170 s), load drops again (170–240 s,
  so preemption-storm resolves near the end). A Jupyter kernel (a foreign process) holds 3.2 GiB
  beside it.
- GPUs 4–7: a training job (foreign to vLLM, busy); GPUs 1–3 empty.

Facts are built from the real formats (``parse_metrics`` on a real page; Gpu/GpuProcess as NVML
gives them), written with :class:`~kvdoctor.sources.recording.RecordingWriter`. Deterministic
(fixed seed, fixed clock): re-running gives the same Snapshots. Run from the repository root:

    python tools/make_watch_demo.py [--check]

``--check`` also replays the file through the pipeline and prints the findings at a few points.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import sys
from pathlib import Path

from kvdoctor.facts import Gpu, GpuProcess, HistogramData, HostProcess, Snapshot, SourceStatus, Timeline
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.metrics import READ_HISTOGRAMS, parse_metrics
from kvdoctor.sources.recording import RecordingWriter, open_recording

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "tests" / "data" / "cases" / "b17-v1-preemption-thrash-long-prompts"
OUT = ROOT / "kvdoctor" / "data" / "demo" / "watch-demo.jsonl.gz"

#: what the rules read, plus TTFT for the engine panel (the other latencies would only add bytes)
#: the latencies watch shows; b17's page has the pre-0.10.2 name of the inter-token latency
#: (time_per_output_token), which the parser files under vllm:inter_token_latency_seconds
HISTOGRAMS = (
    *READ_HISTOGRAMS,
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
)
START = 1753785600.0  # 2025-07-29 10:40:00 UTC, after b17's log
STEPS = 240
MIB = 2**20
GIB = 2**30
L40S_TOTAL = 46068 * MIB
ENGINE_PID = 4242
JUPYTER_PID = 51234
TRAIN_PIDS = (61001, 61002, 61003, 61004)


def _phase(t: int) -> str:
    if t < 60:
        return "healthy"
    if t < 170:
        return "pressure"
    return "calm"


def _scale_hist(h: HistogramData, add: list[float], values_sum: float) -> HistogramData:
    """Add per-bucket observation counts (non-cumulative ``add``) to a cumulative histogram."""
    buckets = []
    running = 0.0
    for (le, cum), extra in zip(h.buckets, add, strict=False):
        running += extra
        buckets.append((le, cum + running))
    return HistogramData(buckets=buckets, count=h.count + running, sum=h.sum + values_sum)


def _bucket_adds(h: HistogramData, value: float, n: float) -> list[float]:
    """``n`` observations of ``value`` as per-bucket increments."""
    adds = [0.0] * len(h.buckets)
    for i, (le, _) in enumerate(h.buckets):
        if value <= le:
            adds[i] = n
            break
    return adds


def build() -> list[Snapshot]:
    """The 240 Snapshots of the incident, oldest first."""
    rng = random.Random(9)
    loaded = load_bundle(CASE)
    base = loaded.snapshot
    # The log as it stood before this incident: startup lines only (b17's own stats lines
    # belong to its earlier run; the incident's state comes from /metrics).
    log = (
        dataclasses.replace(
            base.log, origin="vllm.log", events=[e for e in base.log.events if e.kind != "stats"]
        )
        if base.log
        else None
    )
    cmd = ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--no-enable-prefix-caching"]
    host = [
        HostProcess(4200, 1, "vllm", cmd, 12.0, 3 * GIB, [8000], "api_server", START - 2400),
        HostProcess(
            ENGINE_PID, 4200, "VLLM::EngineCore", cmd, 96.0, 6 * GIB, [], "engine_core", START - 2390
        ),
        HostProcess(JUPYTER_PID, 1, "python3.11", ["/opt/conda/bin/python3.11", "-m", "ipykernel"], 0.5, GIB),
    ] + [HostProcess(p, 1, "torchrun", ["torchrun", "train.py"], 100.0, 8 * GIB) for p in TRAIN_PIDS]
    page = sorted((CASE / "metrics").glob("*.txt"))[0].read_text()
    template = parse_metrics(page, origin="http://127.0.0.1:8000/metrics", histograms=HISTOGRAMS)[0]
    gmu = 0.9
    engine_bytes = int(gmu * L40S_TOTAL) - 3 * GIB // 10  # what vLLM's EngineCore holds on the card
    preempt = template.num_preemptions_total or 0.0
    prompt_tok = template.prompt_tokens_total or 0.0
    gen_tok = template.generation_tokens_total or 0.0
    success = template.request_success_total or 0.0
    hists = {k: copy.deepcopy(v) for k, v in template.histograms.items()}
    # one inter-token latency series, under today's name
    hists.pop("vllm:time_per_output_token_seconds", None)
    kv = 0.35
    waiting = 0.0
    snaps: list[Snapshot] = []
    for t in range(STEPS):
        ts = START + t
        phase = _phase(t)
        if phase == "healthy":
            kv = min(0.55, max(0.25, kv + rng.uniform(-0.03, 0.03)))
            running, waiting = float(rng.randint(4, 8)), 0.0
            new_pre, prompt_len, n_done = 0.0, rng.choice([900, 1500, 2400]), rng.uniform(0.5, 2.0)
            ttft = rng.uniform(0.08, 0.25)
        elif phase == "pressure":
            kv = min(1.0, kv + 0.02) if kv < 0.97 else rng.uniform(0.95, 1.0)
            waiting = min(14.0, waiting + rng.choice([0, 0, 1]))
            running = float(rng.randint(2, 3))
            new_pre = 1.0 if (kv > 0.9 and rng.random() < 0.45) else 0.0
            prompt_len, n_done = rng.choice([1500, 60000, 120000]), rng.uniform(0.0, 0.3)
            ttft = rng.uniform(4.0, 18.0)
        else:
            kv = max(0.3, kv - 0.02)
            waiting = max(0.0, waiting - 1.0)
            running = float(rng.randint(3, 6))
            new_pre, prompt_len, n_done = 0.0, rng.choice([900, 1500, 2400]), rng.uniform(0.5, 2.0)
            ttft = rng.uniform(0.1, 0.4)
        preempt += new_pre
        prompt_tok += prompt_len * n_done
        gen_step = running * rng.uniform(20, 40)
        gen_tok += gen_step
        success += n_done
        for name, value in (
            ("vllm:request_prompt_tokens", prompt_len),
            ("vllm:time_to_first_token_seconds", ttft),
            ("vllm:request_generation_tokens", rng.choice([128, 256, 512])),
        ):
            h = hists.get(name)
            if h is not None:
                hists[name] = _scale_hist(h, _bucket_adds(h, value, n_done), value * n_done)
        # Inter-token latency: one observation per generated token, slower while long prefills
        # and preemptions share the steps (no random draw: the rest of the demo stays as it was).
        itl = 0.018 + 0.004 * ttft
        h = hists.get("vllm:inter_token_latency_seconds")
        if h is not None:
            hists["vllm:inter_token_latency_seconds"] = _scale_hist(
                h, _bucket_adds(h, itl, gen_step), itl * gen_step
            )
        m = dataclasses.replace(
            template,
            timestamp=ts,
            kv_cache_usage=round(kv, 3),
            num_requests_running=running,
            num_requests_waiting=waiting,
            num_preemptions_total=preempt,
            prompt_tokens_total=round(prompt_tok),
            generation_tokens_total=round(gen_tok),
            request_success_total=round(success, 3),
            histograms=copy.deepcopy(hists),
        )
        busy = 0.97 if phase == "pressure" else rng.uniform(0.55, 0.85)
        gpus = [
            Gpu(
                index=0,
                uuid="GPU-7f1c2d3e-0000-4a5b-8c9d-000000000000",
                name="NVIDIA L40S",
                bus_id="00000000:01:00.0",
                memory_total_bytes=L40S_TOTAL,
                memory_used_bytes=engine_bytes + int(3.2 * GIB) + 512 * MIB,
                utilization_gpu=round(busy, 2),
                utilization_memory=round(busy * 0.6, 2),
                temperature_c=float(round(58 + 20 * busy + 3 * math.sin(t / 20))),
                power_w=round(110 + 230 * busy, 1),
                power_limit_w=350.0,
                clock_event_reasons=["sw_power_cap"] if phase == "pressure" else [],
                processes=[
                    GpuProcess(ENGINE_PID, "VLLM::EngineCore", engine_bytes, "C"),
                    GpuProcess(JUPYTER_PID, "/opt/conda/bin/python3.11 -m ipykernel", int(3.2 * GIB), "C"),
                ],
            )
        ]
        for i in range(1, 8):
            train = i >= 4
            u = rng.uniform(0.88, 0.99) if train else 0.0
            gpus.append(
                Gpu(
                    index=i,
                    uuid=f"GPU-7f1c2d3e-000{i}-4a5b-8c9d-00000000000{i}",
                    name="NVIDIA L40S",
                    bus_id=f"00000000:{0x01 + i * 0x10:02X}:00.0",
                    memory_total_bytes=L40S_TOTAL,
                    memory_used_bytes=(int(38.5 * GIB) + rng.randint(0, 64) * MIB) if train else 3 * MIB,
                    utilization_gpu=round(u, 2),
                    utilization_memory=round(u * 0.7, 2),
                    temperature_c=float(round(70 + 8 * u if train else 31)),
                    power_w=round(300 * u + 30, 1),
                    power_limit_w=350.0,
                    processes=[GpuProcess(TRAIN_PIDS[i - 4], "torchrun train.py", int(38.5 * GIB), "C")]
                    if train
                    else [],
                )
            )
        sources = [
            SourceStatus("nvml", "NVML", "ok", "8 GPUs"),
            SourceStatus("metrics", "http://127.0.0.1:8000/metrics", "ok", "engine 0"),
            SourceStatus("log", "vllm.log", "ok", f"{base.log.line_count if base.log else 0} lines"),
            SourceStatus("processes", "psutil", "ok", f"{len(host)} processes"),
        ]
        snaps.append(
            Snapshot(
                timestamp=ts,
                gpus=gpus,
                metrics=[m],
                model=base.model,
                log=log,
                processes=host,
                process_table_known=True,
                sources=sources,
                configs=list(loaded.configs),
            )
        )
    return snaps


def main() -> None:
    """Write the recording; with ``--check`` replay it through the pipeline and print findings."""
    snaps = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with RecordingWriter(OUT) as w:
        for s in snaps:
            w.write(s)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(snaps)} snapshots, {OUT.stat().st_size / 1024:.0f} KiB")
    if "--check" in sys.argv:
        from kvdoctor.pipeline import Pipeline

        pipe = Pipeline.load()
        feed = open_recording(OUT)
        tl = Timeline(max_len=3600)
        for i in range(len(feed)):
            snap = feed.next()
            assert snap is not None
            tl.append(snap)
            if i in (30, 59, 100, 169, 200, 239):
                rep = pipe.evaluate(tl)
                print(i, rep.health, [f"{f.severity}:{f.rule}" for f in rep.findings])


if __name__ == "__main__":
    main()
