"""The rules added after the first catalogue: each fires on the facts it is about and stays quiet
on near misses, on the pipeline over small synthetic snapshots (the
realistic bundles under tests/data/bundles exercise them end to end through tests/test_cases.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor.facts import EngineConfig, Gpu, GpuProcess, HistogramData, Snapshot, SourceError
from kvdoctor.sources.vllm_log import parse_log
from tests.test_rules_catalogue import _gpu, _metrics, fired

GiB = 2**30
PFX = "(EngineCore pid=140) ERROR 03-10 10:12:37 [core.py:1585] "


def _series(kv: float, waiting: float, preempt_step: float, **kw) -> list[Snapshot]:
    snaps = []
    for i, t in enumerate((0.0, 20.0, 40.0)):
        m = _metrics(t, kv_cache_usage=kv, num_requests_waiting=waiting, num_requests_running=100,
                     num_preemptions_total=preempt_step * i, **kw)  # fmt: skip
        snaps.append(Snapshot(timestamp=t, metrics=[m]))
    snaps[-1].gpus = [_gpu(0, 74, util=0.9)]
    return snaps


# --------------------------------------------------------------------------- max-num-seqs-exceeds-kv


def test_max_num_seqs_exceeds_kv_is_a_warning_only_under_pressure() -> None:
    cfg = EngineConfig(model="m", max_num_seqs=512, explicit={"max_num_seqs"})
    # 20000 blocks × 16 = 320000 KV tokens; KV 95 % full with 100 running → ~3040 tokens each.
    snaps = _series(0.95, 5, 3)
    got = fired(snaps[-1], cfg, extra=snaps[:-1])["max-num-seqs-exceeds-kv"]
    assert got["severity"] == "warning"
    assert got["flags"] == {"--max-num-seqs": "104"}  # 320000 // 3040 = 105, a step down (multiples of 8)
    # The same oversized limit on a calm server (no preemptions, no queue): info.
    calm = _series(0.95, 0, 0)
    got = fired(calm[-1], cfg, extra=calm[:-1])["max-num-seqs-exceeds-kv"]
    assert got["severity"] == "info"
    # A limit the cache can hold: nothing.
    small = EngineConfig(model="m", max_num_seqs=64, explicit={"max_num_seqs"})
    assert "max-num-seqs-exceeds-kv" not in fired(snaps[-1], small, extra=snaps[:-1])


def test_max_num_seqs_single_scrape_queue_is_not_pressure() -> None:
    cfg = EngineConfig(model="m", max_num_seqs=512, explicit={"max_num_seqs"})
    one = Snapshot(timestamp=0.0, metrics=[_metrics(0.0, kv_cache_usage=0.95, num_requests_waiting=2,
                                                       num_requests_running=100)], gpus=[_gpu(0, 74)])  # fmt: skip
    assert fired(one, cfg)["max-num-seqs-exceeds-kv"]["severity"] == "info"


# --------------------------------------------------------------------------- swap-preemption-stall

V0_STATS = (
    "INFO 10-14 {t} metrics.py:349] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: {g} tokens/s, "
    "Running: {r} reqs, Swapped: {s} reqs, Pending: 9 reqs, GPU KV cache usage: 99.9%, CPU KV cache usage: 40.0%."
)
V0_SWAP = (
    "WARNING 10-14 12:01:06 scheduler.py:1481] Sequence group 7 is preempted by PreemptionMode.SWAP mode because "
    "there is not enough KV cache space. This can affect the end-to-end performance. Increase gpu_memory_utilization "
    "or tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=1"
)


def test_swap_preemption_stall_from_v0_stats_lines() -> None:
    stalled = "\n".join([V0_SWAP, V0_STATS.format(t="12:01:10", g="0.0", r=29, s=6)])
    got = fired(Snapshot(log=parse_log(stalled)), EngineConfig(model="m"))["swap-preemption-stall"]
    assert got["severity"] == "critical" and got["flags"] == {"--swap-space": "0"}
    assert "n / best_of" in got["summary"]
    # Swapped requests while tokens still flow: not a stall.
    flowing = "\n".join([V0_SWAP, V0_STATS.format(t="12:01:10", g="385.2", r=29, s=6)])
    assert "swap-preemption-stall" not in fired(Snapshot(log=parse_log(flowing)), EngineConfig(model="m"))
    # Zero throughput with nothing running and nothing swapped: idle, not a stall.
    idle = V0_STATS.format(t="12:01:10", g="0.0", r=0, s=0)
    assert "swap-preemption-stall" not in fired(Snapshot(log=parse_log(idle)), EngineConfig(model="m"))


def test_swap_preemption_stall_from_v0_metrics() -> None:
    snaps = []
    for t in (0.0, 30.0):
        m = _metrics(t, num_requests_swapped=5, num_requests_running=20, generation_tokens_total=1000.0)
        snaps.append(Snapshot(timestamp=t, metrics=[m]))
    assert "swap-preemption-stall" in fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])
    snaps[-1].metrics[0].generation_tokens_total = 9000.0
    assert "swap-preemption-stall" not in fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])


# --------------------------------------------------------------------------- run-time OOMs by code path

OOM_MSG = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the "
    "allocated memory 74.20 GiB is allocated by PyTorch, with 1.12 GiB allocated in private pools (e.g., CUDA Graphs), "
    "and 402.00 MiB is reserved by PyTorch but unallocated."
)
STARTED = [
    "(APIServer pid=1) INFO 03-10 10:00:11 [api_utils.py:347] vLLM server version 0.33.0, serving model m",
    "(APIServer pid=1) INFO 03-10 10:00:17 [scheduler.py:246] Chunked prefill is enabled with max_num_batched_tokens=16384.",
    "(EngineCore pid=140) INFO 03-10 10:00:58 [kv_cache_utils.py:1147] GPU KV cache size: 434,640 tokens, Maximum concurrency for 8,192 tokens per request: 53.06x",
    "(APIServer pid=1) INFO 03-10 10:01:00 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000",
    "(APIServer pid=1) INFO 03-10 10:05:00 [loggers.py:335] Engine 000: Avg prompt throughput: 9120.0 tokens/s, Avg generation throughput: 660.2 tokens/s, Running: 12 reqs, Waiting: 0 reqs, GPU KV cache usage: 41.0%, Prefix cache hit rate: 8.5%",
]  # fmt: skip


def _oom_log(frames: list[tuple[str, str, str]], before: list[str] | None = None) -> str:
    lines = list(before if before is not None else STARTED)
    lines += [PFX + "EngineCore encountered a fatal error.", PFX + "Traceback (most recent call last):"]
    for path, func, code in frames:
        lines.append(
            PFX + f'  File "/usr/local/lib/python3.12/dist-packages/vllm/{path}", line 100, in {func}'
        )
        lines.append(PFX + f"    {code}")
    lines.append(PFX + OOM_MSG)
    return "\n".join(lines)


PREFILL_FRAMES = [
    ("v1/worker/gpu_model_runner.py", "execute_model", "hidden_states = self.model("),
    ("v1/attention/backends/flash_attn.py", "forward", "if attn_metadata.prefill_metadata is not None:"),
]
LOGPROBS_FRAMES = [
    ("v1/worker/gpu_model_runner.py", "_get_prompt_logprobs_dict", "prompt_logprobs = self.sampler.compute_logprobs(logits)"),
    ("v1/sample/sampler.py", "compute_logprobs", "return logits.log_softmax(dim=-1, dtype=torch.float32)"),
]  # fmt: skip
PLAIN_FRAMES = [("model_executor/layers/activation.py", "forward_cuda", "out = torch.empty(output_shape)")]


def test_prefill_burst_oom_from_the_traceback() -> None:
    got = fired(Snapshot(log=parse_log(_oom_log(PREFILL_FRAMES))), EngineConfig(model="m"))
    f = got["prefill-burst-oom"]
    assert f["severity"] == "critical"
    assert f["flags"] == {"--max-num-batched-tokens": "4096"}  # chunked prefill is on (V1)
    assert "logprobs-oom" not in got


def test_prefill_burst_oom_from_the_iteration_histogram() -> None:
    les = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")]

    def hist(top: float) -> HistogramData:
        counts = [0.0] * len(les)
        counts[les.index(512)] = 50.0
        counts[les.index(top)] += 3.0
        cum, buckets = 0.0, []
        for le, c in zip(les, counts, strict=True):
            cum += c
            buckets.append((float(le), cum))
        return HistogramData(buckets=buckets, count=cum)

    log = parse_log(_oom_log(PLAIN_FRAMES))
    snap = Snapshot(
        timestamp=0.0,
        log=log,
        metrics=[_metrics(0.0, histograms={"vllm:iteration_tokens_total": hist(16384)})],
    )
    assert "prefill-burst-oom" in fired(snap, EngineConfig(model="m"))
    snap.metrics = [_metrics(0.0, histograms={"vllm:iteration_tokens_total": hist(2048)})]
    assert "prefill-burst-oom" not in fired(snap, EngineConfig(model="m"))


def test_prefill_burst_oom_needs_a_runtime_oom() -> None:
    # The same prefill frames during the profiling run (before serving) are a startup problem.
    startup = _oom_log(PREFILL_FRAMES, before=STARTED[:2])
    got = fired(Snapshot(log=parse_log(startup)), EngineConfig(model="m"))
    assert "prefill-burst-oom" not in got and "logprobs-oom" not in got


def test_logprobs_oom() -> None:
    got = fired(Snapshot(log=parse_log(_oom_log(LOGPROBS_FRAMES))), EngineConfig(model="m"))
    f = got["logprobs-oom"]
    assert f["severity"] == "critical" and f["flags"] == {"--max-num-batched-tokens": "4096"}
    assert "prompt_logprobs" in f["summary"]
    assert "prefill-burst-oom" not in got
    plain = fired(Snapshot(log=parse_log(_oom_log(PLAIN_FRAMES))), EngineConfig(model="m"))
    assert "logprobs-oom" not in plain and "prefill-burst-oom" not in plain


# --------------------------------------------------------------------------- multimodal-profile-oom

MM_FRAMES = [
    ("v1/worker/gpu_model_runner.py", "profile_run", "dummy_encoder_outputs = self.model.embed_multimodal(**batched_dummy_mm_inputs)"),
    ("model_executor/models/qwen2_vl.py", "_process_image_input", "image_embeds = self.visual(pixel_values, grid_thw=grid_thw)"),
]  # fmt: skip
LOADED = [
    "(APIServer pid=1) INFO 03-10 10:00:11 [api_utils.py:347] vLLM server version 0.33.0, serving model Qwen/Qwen2-VL-7B-Instruct",
    "(EngineCore pid=140) INFO 03-10 10:00:41 [gpu_model_runner.py:5089] Model loading took 15.52 GiB memory and 9.11 seconds",
]  # fmt: skip
TOO_SHORT = (
    "WARNING 10-14 11:58:44 profiling.py:188] The sequence length used for profiling (max_num_batched_tokens / "
    "max_num_seqs = 32) is too short to hold the multi-modal embeddings in the worst case (16384 tokens in total, out "
    "of which {'image': 16384} are reserved for multi-modal embeddings). This may cause certain multi-modal inputs to "
    "fail during inference, even when the input text is short. To avoid this, you should increase `max_model_len`, "
    "reduce `max_num_seqs`, and/or reduce `mm_counts`."
)


def test_multimodal_profile_oom() -> None:
    cfg = EngineConfig(model="Qwen/Qwen2-VL-7B-Instruct")
    got = fired(Snapshot(log=parse_log(_oom_log(MM_FRAMES, before=LOADED))), cfg)
    f = got["multimodal-profile-oom"]
    # Every flag the remediation names is emitted (issue 7 item 7).
    assert f["severity"] == "critical" and f["flags"] == {
        "--limit-mm-per-prompt": '{"image":1}',
        "--mm-processor-kwargs": '{"max_pixels":802816}',
        "--max-num-seqs": "8",
        "--enforce-eager": "",  # a switch: no value
    }
    assert "max_pixels" in f["summary"] and "--enforce-eager" in f["summary"]
    # Already eager: the switch is not suggested again.
    eager = EngineConfig(model="Qwen/Qwen2-VL-7B-Instruct", enforce_eager=True, explicit={"enforce_eager"})
    got_eager = fired(Snapshot(log=parse_log(_oom_log(MM_FRAMES, before=LOADED))), eager)
    assert "--enforce-eager" not in got_eager["multimodal-profile-oom"]["flags"]
    assert "kv-budget-exhausted" not in got and "prefill-burst-oom" not in got
    # The warning alone on a running engine: a warning, not critical.
    warn = fired(Snapshot(log=parse_log(TOO_SHORT)), cfg)["multimodal-profile-oom"]
    assert warn["severity"] == "warning"
    # A text model's profile-run OOM is not multimodal.
    plain = fired(Snapshot(log=parse_log(_oom_log(PLAIN_FRAMES, before=LOADED))), cfg)
    assert "multimodal-profile-oom" not in plain


# --------------------------------------------------------------------------- gpu-hardware-errors

DMESG = """[Tue Mar 10 14:20:01 2026] nvidia-nvlink: Nvlink Core is being initialized
[Tue Mar 10 14:21:40 2026] NVRM: Xid (PCI:0000:86:00): 13, pid=4121, name=python3, Graphics Exception: ESR 0x50df30=0x10f
[Tue Mar 10 14:22:05 2026] NVRM: Xid (PCI:0000:07:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
"""


def test_dmesg_parser_reads_xids_and_refuses_binary(tmp_path: Path) -> None:
    from kvdoctor.sources.dmesg import parse_dmesg, parse_dmesg_file

    xids = parse_dmesg(DMESG, origin="dmesg.txt")
    assert [(x["xid"], x["bus_id"], x["hardware"], x["line"]) for x in xids] == [
        (13, "00000000:86:00.0", False, 2),
        (79, "00000000:07:00.0", True, 3),
    ]
    assert xids[0]["pid"] == 4121 and xids[0]["name"] == "python3"
    assert xids[1]["pid"] is None and xids[1]["message"] == "GPU has fallen off the bus."
    assert parse_dmesg("[    1.0] Linux version 6.8.0\n") == []
    binary = tmp_path / "dmesg.txt"
    binary.write_bytes(b"\x7fELF\x00\x01\x02")
    with pytest.raises(SourceError, match="binary"):
        parse_dmesg_file(binary)


def _bus_gpu(i: int, bus: str, ecc: int | None = 0) -> Gpu:
    g = _gpu(i, 70)
    g.bus_id, g.ecc_uncorrectable = bus, ecc
    return g


def test_gpu_hardware_errors_from_xids_and_ecc() -> None:
    from kvdoctor.sources.dmesg import parse_dmesg

    gpus = [_bus_gpu(0, "00000000:86:00.0"), _bus_gpu(1, "00000000:07:00.0")]
    got = fired(Snapshot(gpus=gpus, xid_events=parse_dmesg(DMESG)))["gpu-hardware-errors"]
    assert got["severity"] == "critical" and got["flags"] == {}
    assert "GPU 1" in got["summary"] and "Drain the node" in got["summary"]
    # Only an application XID (13): the program's fault, info naming the process the driver names.
    app = parse_dmesg(DMESG.splitlines()[1])
    got = fired(Snapshot(gpus=gpus, xid_events=app))["gpu-hardware-errors"]
    assert got["severity"] == "info" and "pid 4121 python3" in got["summary"]
    assert "Drain the node" not in got["summary"]
    # Uncorrectable ECC on GPU 0, no kernel log.
    bad = [_bus_gpu(0, "00000000:86:00.0", ecc=3), _bus_gpu(1, "00000000:07:00.0")]
    got = fired(Snapshot(gpus=bad))["gpu-hardware-errors"]
    assert "GPU 0: 3 uncorrectable ECC" in got["summary"]
    assert "gpu-hardware-errors" not in fired(Snapshot(gpus=gpus))


@pytest.mark.parametrize(
    ("line", "hardware", "application"),
    [
        # Blackwell logs the recovery action alone (rules.md): hardware, and it asks for a reset.
        ("NVRM: Xid (PCI:0000:07:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", True, False),
        ("NVRM: Xid (PCI:0000:07:00): 123, pid=0, name=<unknown>, SPI PMU RPC read fail", True, False),
        ("NVRM: Xid (PCI:0000:07:00): 120, pid=1, name=x, GSP task timeout", True, False),
        ("NVRM: Xid (PCI:0000:07:00): 31, pid=4121, name=python3, Ch 00000008, intr 00000000. MMU Fault", False, True),
        ("NVRM: Xid (PCI:0000:07:00): 43, pid=4121, name=python3, Ch 00000008", False, True),
        ("NVRM: Xid (PCI:0000:07:00): 45, pid=4121, name=python3, Ch 00000008", False, True),
        # Neither list: no finding either way.
        ("NVRM: Xid (PCI:0000:07:00): 8, pid=4121, name=python3, timeout", False, False),
    ],
)  # fmt: skip
def test_xid_lists_as_rules_md(line: str, hardware: bool, application: bool) -> None:
    from kvdoctor.sources.dmesg import parse_dmesg

    xids = parse_dmesg(line)
    assert (xids[0]["hardware"], xids[0]["application"]) == (hardware, application)
    got = fired(Snapshot(gpus=[_bus_gpu(0, "00000000:07:00.0")], xid_events=xids)).get("gpu-hardware-errors")
    if hardware:
        assert got is not None and got["severity"] == "critical" and "GPU 0" in got["summary"]
        assert ("asks for a GPU reset" in got["summary"]) == ("154" in line)
    elif application:
        assert got is not None and got["severity"] == "info" and "pid 4121 python3" in got["summary"]
    else:
        assert got is None


# --------------------------------------------------------------------------- gpu-memory-growth


def _readings(used_gib: list[float], step_s: float = 600.0) -> Snapshot:
    moments = []
    for i, u in enumerate(used_gib):
        g = _gpu(0, u)
        g.timestamp = 1_700_000_000.0 + i * step_s
        moments.append([g])
    return Snapshot(gpus=moments[-1], gpu_series=moments)


def test_gpu_memory_growth_steady_is_a_warning_with_time_to_full() -> None:
    steady = _readings([60 + 0.5 * i for i in range(13)])  # +0.5 GiB / 10 min = 3 GiB/h over 2 h
    got = fired(steady)["gpu-memory-growth"]
    assert got["severity"] == "warning" and got["flags"] == {}
    assert "3.00 GiB/h" in got["summary"] and "full in about 4.7 h" in got["summary"]  # (80 − 66) / 3


def test_gpu_memory_growth_plateau_is_info_and_flat_or_short_is_nothing() -> None:
    plateau = _readings([60, 62, 64, 66, 66.02, 66.01, 66.02, 66.03, 66.02])
    got = fired(plateau)["gpu-memory-growth"]
    assert got["severity"] == "info" and "warm-up" in got["summary"]
    assert "gpu-memory-growth" not in fired(_readings([70.0, 70.01, 70.0, 70.02, 70.01]))
    # A fast rise over two minutes (startup) is too short to judge.
    assert "gpu-memory-growth" not in fired(_readings([10, 30, 50, 70], step_s=40))
    # One reading: no series at all.
    assert "gpu-memory-growth" not in fired(Snapshot(gpus=[_gpu(0, 70)]))


def test_bundle_keeps_the_nvidia_smi_loop_and_the_kernel_log() -> None:
    from kvdoctor.sources.bundle import load_bundle

    data = Path(__file__).parent / "data" / "bundles"
    snap = load_bundle(data / "r29-steady-memory-growth-csv-loop").snapshot
    assert len(snap.gpu_series) == 13 and snap.gpus[0].memory_used_bytes == 79537 * 2**20
    snap = load_bundle(data / "r28-xid79-gpu-fell-off-bus").snapshot
    assert [x["xid"] for x in snap.xid_events] == [79, 45]
    assert not snap.gpu_series  # one nvidia-smi table: no series


# --------------------------------------------------------------------------- colocated-engines-overcommit


def _two_engines(
    gmu_a: float, gmu_b: float, start_b: float | None = None
) -> tuple[Snapshot, list[EngineConfig]]:
    from kvdoctor.sources.cmdline import parse_cmdline_text
    from kvdoctor.sources.processes import host_process_from_strings

    cmd_a = f"vllm serve meta-llama/Llama-3.1-8B-Instruct --port 8000 --gpu-memory-utilization {gmu_a}"
    cmd_b = f"vllm serve Qwen/Qwen3-4B --port 8001 --gpu-memory-utilization {gmu_b}"
    procs = [
        host_process_from_strings(
            5011, "vllm", "/opt/venv/bin/python /opt/venv/bin/vllm " + cmd_a[5:], ppid=1
        ),
        host_process_from_strings(5120, "VLLM::EngineCore", "VLLM::EngineCore", ppid=5011),
        host_process_from_strings(
            5301, "vllm", "/opt/venv/bin/python /opt/venv/bin/vllm " + cmd_b[5:], ppid=1
        ),
        host_process_from_strings(5388, "VLLM::EngineCore", "VLLM::EngineCore", ppid=5301),
    ]
    if start_b is not None:
        procs[0].create_time, procs[2].create_time = 1000.0, 1000.0 + start_b
    on_gpu = [
        GpuProcess(pid=5120, name="VLLM::EngineCore", used_bytes=int(gmu_a * 80 * GiB)),
        GpuProcess(pid=5388, name="VLLM::EngineCore", used_bytes=int(min(gmu_b, 0.99 - gmu_a) * 80 * GiB)),
    ]
    snap = Snapshot(gpus=[_gpu(0, 79, procs=on_gpu)], processes=procs, process_table_known=True)
    return snap, parse_cmdline_text(cmd_a + "\n" + cmd_b)


def _fired_all(snap: Snapshot, cfgs: list[EngineConfig]) -> list[dict]:
    from kvdoctor.facts import Timeline
    from tests.test_rules_catalogue import PIPELINE

    tl = Timeline()
    snap.configs = list(cfgs)
    tl.append(snap)
    result = PIPELINE.evaluate(tl, now=0)
    return [
        {"engine": f.engine, "severity": f.severity, "flags": f.suggested_flags, "summary": f.summary}
        for f in result.findings
        if f.rule == "colocated-engines-overcommit"
    ]


def test_colocated_engines_overcommit_splits_the_card() -> None:
    found = _fired_all(*_two_engines(0.6, 0.5))
    assert {f["severity"] for f in found} == {"critical"}
    flags = {f["engine"]: f["flags"].get("--gpu-memory-utilization") for f in found}
    # 0.6 and 0.5 scaled to sum 0.95: 0.518 → 0.51 and 0.432 → 0.43.
    assert flags == {"meta-llama/Llama-3.1-8B-Instruct": "0.51", "Qwen/Qwen3-4B": "0.43"}
    assert "one after another" in found[0]["summary"]
    # 0.45 + 0.45 = 0.90 fits: a planned co-location, nothing to say.
    assert _fired_all(*_two_engines(0.45, 0.45)) == []


def test_colocated_engines_started_inside_each_others_profiling() -> None:
    found = _fired_all(*_two_engines(0.45, 0.45, start_b=20.0))
    assert found and {f["severity"] for f in found} == {"warning"} and found[0]["flags"] == {}
    assert _fired_all(*_two_engines(0.45, 0.45, start_b=300.0)) == []


def test_colocated_engines_from_command_lines_alone() -> None:
    from kvdoctor.sources.cmdline import parse_cmdline_text

    both = "vllm serve a --gpu-memory-utilization 0.7\nvllm serve b --gpu-memory-utilization 0.5\n"
    snap = Snapshot(gpus=[_gpu(0, 0.5), _gpu(1, 0.5)])
    assert _fired_all(snap, parse_cmdline_text(both))
    pinned = "CUDA_VISIBLE_DEVICES=0 vllm serve a --gpu-memory-utilization 0.7\nCUDA_VISIBLE_DEVICES=1 vllm serve b --gpu-memory-utilization 0.5\n"
    assert _fired_all(snap, parse_cmdline_text(pinned)) == []


def test_cuda_oom_hints_name_the_code_in_the_traceback() -> None:
    def hints(frames: list[tuple[str, str, str]]) -> list[str]:
        return parse_log(_oom_log(frames)).last("cuda_oom").values["hints"]  # type: ignore[union-attr]

    assert hints(LOGPROBS_FRAMES) == ["logprobs", "sampler"]
    assert hints(PREFILL_FRAMES) == ["prefill"]
    assert hints(MM_FRAMES) == ["multimodal"]
    assert hints(PLAIN_FRAMES) == []


def test_every_spec_rule_exists_as_a_module() -> None:
    rules_dir = Path(__file__).resolve().parent.parent / "rules"
    for rid in ("max-num-seqs-exceeds-kv", "swap-preemption-stall", "prefill-burst-oom", "logprobs-oom",
                "multimodal-profile-oom", "gpu-hardware-errors", "gpu-memory-growth", "colocated-engines-overcommit"):  # fmt: skip
        assert (rules_dir / f"{rid.replace('-', '_')}.py").is_file(), rid
