"""Catalogue 2 (spec/rules-catalogue2.md): its log lines and metric parse, each new rule fires on
its bundle and stays silent on its near-miss (through the pipeline), and the spec's worked
examples give the same suggested values within rounding. The bundles' expected.json are also run
by tests/test_cases.py; here the exact figures are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.derive import VARIABLES
from kvdoctor.findings import Finding
from kvdoctor.pipeline import Pipeline
from kvdoctor.rule_functions import dp_skew, spec_k_fit, spec_max_num_seqs_fit, spec_sampler_bytes
from kvdoctor.rulekit import RuleContext, evaluate, load_rules
from kvdoctor.sources import log_catalogue2
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.metrics import parse_metrics
from kvdoctor.sources.vllm_log import parse_log
from tests.conftest import all_flags, alternatives

GiB, MiB = 2**30, 2**20
BUNDLES = Path(__file__).parent / "data" / "bundles"
RULES = load_rules(plugins=False)
BY_ID = {r.id: r for r in RULES}
PIPELINE = Pipeline(rules=RULES)
NEW_IDS = {
    "cpu-offload-not-applied", "flashinfer-workspace-overflow", "triton-autotune-oom",
    "long-context-prefill-oom", "spec-decode-sampler-oom", "dp-engine-load-skew",
    "sleep-memory-not-released", "wake-up-oom",
}  # fmt: skip


def findings(bundle: str, pipeline: Pipeline = PIPELINE) -> dict[str, Finding]:
    report = pipeline.evaluate(load_bundle(BUNDLES / bundle).timeline)
    return {f.rule: f for f in report.findings}


# --------------------------------------------------------------------------- catalogue


def test_catalogue_lists_35_rules_and_explain_works_for_each() -> None:
    assert len(RULES) >= 35
    assert NEW_IDS <= set(BY_ID)
    result = CliRunner().invoke(cli, ["rules"])
    assert result.exit_code == 0
    for rid in BY_ID:
        assert rid in result.output
    for rid in NEW_IDS:
        out = CliRunner().invoke(cli, ["explain", rid])
        assert out.exit_code == 0, (rid, out.output)
        doc = BY_ID[rid].doc or ""
        assert "## Fix" in doc and "spec/rules-catalogue2.md" in doc


def test_unverified_thresholds_are_overridable_and_documented_as_estimates() -> None:
    # §6: the slack, the 1.25 factor and 64 MiB rounding, the factor 4, the DP cut-offs.
    for rid, names in {
        "sleep-memory-not-released": ("slack_min_gib", "slack_fraction"),
        "flashinfer-workspace-overflow": ("headroom_factor", "round_mib"),
        "long-context-prefill-oom": ("long_factor",),
        "dp-engine-load-skew": ("hot_waiting", "hot_kv", "cold_kv", "hot_share"),
    }.items():
        rule = BY_ID[rid]
        assert set(names) <= set(rule.threshold_values()), rid
        assert "estimate" in (rule.doc or "").lower(), rid


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize(
    ("line", "kind", "values"),
    [
        ("Using V2 Model Runner", "v2_model_runner", {}),
        ("Offloader set to UVAOffloader", "offloader_set", {"name": "UVAOffloader"}),
        ("Total CPU offloaded parameters: 12.0", "cpu_offloaded_params", {"bytes": 12 * GiB}),
        (
            "Error in function 'aligned_alloc' at /x/include/flashinfer/allocator.h:49: Buffer overflow when "
            "allocating memory for batch_prefill_tmp_v with size 536346624 and alignment 16, but only 413138944 "
            "bytes available in AlignedAllocator. Increase the workspace buffer size.",
            "flashinfer_overflow",
            {
                "buffer": "batch_prefill_tmp_v",
                "size_bytes": 536346624,
                "alignment": 16,
                "available_bytes": 413138944,
            },
        ),
        ("RuntimeError: Triton Error [CUDA]: out of memory", "triton_oom", {}),
        (
            "GDN prefill kernel warmup (T=4096) failed for layer model.layers.0.linear_attn. First inference may "
            "OOM due to autotuner.",
            "gdn_warmup_failed",
            {"tokens": 4096, "layer": "model.layers.0.linear_attn"},
        ),
        (
            "Sleep mode freed 5.59 GiB memory, 14.9 GiB memory is still in use.",
            "sleep_freed",
            {"freed_bytes": round(5.59 * GiB), "in_use_bytes": round(14.9 * GiB)},
        ),
        (
            "CuMemAllocator: sleep freed 19.50 GiB memory in total, of which 14.25 GiB is backed up in CPU and "
            "the rest 5.25 GiB is discarded directly.",
            "cumem_sleep",
            {
                "freed_bytes": round(19.5 * GiB),
                "backed_up_bytes": round(14.25 * GiB),
                "discarded_bytes": round(5.25 * GiB),
            },
        ),
        ("It took 2.104311 seconds to fall asleep.", "fell_asleep", {"seconds": 2.104311}),
        (
            "It took 0.5 seconds to wake up tags ['weights'].",
            "woke_up",
            {"seconds": 0.5, "tags": ["weights"]},
        ),
        ("wake up the engine with tags: ['kv_cache']", "wake_up_request", {"tags": ["kv_cache"]}),
        ("RuntimeError: CUDA Error: out of memory at /ws/csrc/cumem_allocator.cpp:163", "cumem_oom", {}),
        (
            "speculative_config=SpeculativeConfig(method='eagle3', model='a/b', num_spec_tokens=4), x=1",
            "speculative_config",
            {"method": "eagle3", "num_spec_tokens": 4},
        ),
        (
            "Using FLASHINFER attention backend out of potential backends: ['FLASHINFER', 'FLASH_ATTN'].",
            "attention_backend",
            {"backend": "FLASHINFER"},
        ),
        (
            "init engine (profile, create kv cache, warmup model) took 29.80 seconds",
            "engine_init_done",
            {"seconds": 29.8},
        ),
    ],
)
def test_must_match_lines(line: str, kind: str, values: dict[str, object]) -> None:
    got = log_catalogue2.match(line)
    assert [k for k, _ in got] == [kind]
    assert got[0][1] == values


def test_near_miss_lines_give_no_event() -> None:
    for line in (
        "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered",
        "GDN prefill kernel warmup (T=4096) completed for layer model.layers.0.linear_attn",
        "Buffer overflow when allocating memory for x",  # no AlignedAllocator figures
        "Sleep mode freed lots of memory",
    ):
        assert log_catalogue2.match(line) == []
    # Hostile input: a huge line that passes a gate is cut and matched in bounded time.
    junk = "Buffer overflow AlignedAllocator " + "with size 1 " * 200_000
    assert log_catalogue2.match(junk) == []


def test_errors_in_tracebacks_get_phase_and_frames() -> None:
    log = parse_log(
        "\n".join(
            [
                "(EngineCore pid=1) INFO 12-01 09:00:00 [core.py:1] init engine (profile, create kv cache, warmup model) took 3.00 seconds",
                "(EngineCore pid=1) ERROR 12-01 09:00:05 [core.py:2] Traceback (most recent call last):",
                '(EngineCore pid=1) ERROR 12-01 09:00:05 [core.py:2]   File "/v/model_executor/layers/fla/ops/chunk.py", line 1, in chunk_gated_delta_rule',
                "(EngineCore pid=1) ERROR 12-01 09:00:05 [core.py:2] RuntimeError: Triton Error [CUDA]: out of memory",
                "(EngineCore pid=1) ERROR 12-01 09:00:05 [core.py:2] RuntimeError: Triton Error [CUDA]: out of memory",
            ]
        )
    )
    tri = log.of("triton_oom")
    assert len(tri) == 1  # repeated in one block: one failure
    assert tri[0].values["phase"] == "runtime"
    assert "fla_ops" in tri[0].values["frames"]


def test_engine_sleep_state_and_spec_drafts_metrics() -> None:
    page = "\n".join(
        [
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 42.0',
        ]
    )
    (em,) = parse_metrics(page)
    assert em.sleep_state == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    assert em.spec_decode_num_drafts_total == 42.0


# --------------------------------------------------------------------------- rules on bundles


def test_cpu_offload_not_applied_worked_example_51396() -> None:
    got = findings("c2-cpu-offload-v2-runner-dsv2lite-5090")
    f = got["cpu-offload-not-applied"]
    assert f.severity == "critical"  # the engine then failed loading weights
    assert f.suggested_flags == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert "weights-not-sharded" not in got
    assert "needs ≥ 2 GiB" in f.summary  # G = 12 GiB is more than enough once it works
    assert "cpu-offload-not-applied" not in findings("c2-cpu-offload-applied-v028")


def test_flashinfer_worked_examples_40023_and_25342() -> None:
    f = findings("c2-flashinfer-overflow-b300-40023")["flashinfer-workspace-overflow"]
    assert f.suggested_flags == {"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": "671088640"}  # 640 MiB
    assert "--gpu-memory-utilization" not in f.suggested_flags  # not a CUDA OOM
    old = findings("c2-flashinfer-overflow-v011-25342")
    f = old["flashinfer-workspace-overflow"]
    assert "Upgrade to vLLM ≥ 0.12" in f.summary and "402653184" in f.summary  # 384 MiB on ≥ 0.12
    assert f.suggested_flags == {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}  # no such variable on 0.11
    for other in ("cuda-graph-capture-oom", "kv-budget-exhausted", "allocator-fragmentation"):
        assert other not in old
    assert "flashinfer-workspace-overflow" not in findings("c2-flashinfer-sparse-mla-warning-only")


def test_triton_autotune_oom_fix() -> None:
    f = findings("c2-triton-autotune-oom-qwen3next-v017-a100")["triton-autotune-oom"]
    # 0.17: gmu default 0.90, B = 72 GiB, 3.83 GiB free → Δ = 0.5 GiB: floor((72 − 0.5)/80).
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.89"}
    assert "Upgrade to vLLM ≥ 0.18" in f.summary
    assert "triton-autotune-oom" not in findings("c2-triton-illegal-access-not-memory")


def test_long_context_bundle_and_near_miss() -> None:
    got = findings("c2-long-context-prefill-oom-gh200")
    f = got["long-context-prefill-oom"]
    assert alternatives(f) == [{"--max-num-batched-tokens": "2048"}, {"--gpu-memory-utilization": "0.83"}]
    assert "allocator-fragmentation" not in got  # expandable segments already on
    assert "long-context-prefill-oom" not in findings("c2-long-context-oom-neighbour-grew")


def _worked(rule_id: str, variables: dict[str, object]) -> Finding | None:
    base = dict.fromkeys(VARIABLES)
    base.update(variables)
    result = evaluate(
        [BY_ID[rule_id]], [RuleContext(engine="e", variables=base, inputs={"log", "gpus", "metrics"})]
    )
    assert not result.errors, result.errors
    return result.findings[0] if result.findings else None


def test_long_context_worked_example_gives_gmu_091() -> None:
    # §3.3: B = 93.21 GiB (its planned torch peak stands in), E ≈ 3.1 GiB, C = 149,760,
    # max_model_len 262,144 (assumed), T ≈ 95.6 GiB → gmu 0.91, or --max-num-batched-tokens 2048.
    f = _worked(
        "long-context-prefill-oom",
        {
            "runtime_oom": True, "oom_at_runtime": True, "chunked_prefill_on": True,
            "oom_overrun_bytes": int(3.1 * GiB), "oom_requested_bytes": 128 * MiB,
            "oom_reserved_unallocated_bytes": 100 * MiB, "alloc_conf_expandable": True,
            "longest_context_tokens": 149_760, "max_num_batched_tokens": 4096, "max_model_len": 262_144,
            "context_at_oom_tokens": 149_760, "engine_budget_bytes": int(93.21 * GiB),
            "device_total_bytes": int(95.6 * GiB), "gmu": 0.975, "oom_frames_rejection_sampler": False,
            "kv_cache_memory_bytes_set": False,
        },
    )  # fmt: skip
    assert f is not None
    assert alternatives(f) == [{"--max-num-batched-tokens": "2048"}, {"--gpu-memory-utilization": "0.91"}]


def test_spec_decode_worked_example() -> None:
    # Qwen3, V = 151,936, bf16, max_num_seqs 256, max_num_batched_tokens 8192, k = 4, legacy runner.
    u = spec_sampler_bytes(151_936, 256, 8192, 4, 2)
    assert u == pytest.approx(1.52 * GiB, rel=0.01)
    assert spec_max_num_seqs_fit(0.5 * GiB, 151_936, 256, 8192, 4, 2) == 80
    u80 = spec_sampler_bytes(151_936, 80, 8192, 4, 2)
    assert u80 is not None and u80 == pytest.approx(0.48 * GiB, rel=0.02)
    assert spec_sampler_bytes(151_936, 256, 8192, 1, 2) == 0  # k = 1: the profile matches
    assert spec_k_fit(0.5 * GiB, 151_936, 256, 8192, 4, 2) == 1
    got = findings("c2-spec-decode-rejection-sampler-oom-k4")
    assert got["spec-decode-sampler-oom"].suggested_flags == {"--max-num-seqs": "80"}
    assert "logprobs-oom" not in got  # gives way on rejection-sampler frames
    near = findings("c2-spec-decode-k1-not-this-rule")
    assert "spec-decode-sampler-oom" not in near
    assert "long-context-prefill-oom" not in near


def test_spec_decode_gmu_alternative() -> None:
    # "or gmu lowered by (1.52 + 0.5 − 1.0) GiB / T" when max_num_seqs cannot be lowered enough.
    f = _worked(
        "spec-decode-sampler-oom",
        {
            "spec_on": True, "spec_k": 4, "runtime_oom": True, "runtime_oom_hints": [],
            "oom_frames_rejection_sampler": True, "vocab_size": 151_936, "max_num_seqs_effective": 8,
            "max_num_batched_tokens": 8192, "logits_dtype_bytes": 2, "spec_probabilistic": False,
            "v2_runner": False, "idle_headroom_bytes": 0, "engine_budget_bytes": 73 * GiB,
            "device_total_bytes": 80 * GiB, "gmu": 0.92,
        },
    )  # fmt: skip
    assert f is not None
    u = spec_sampler_bytes(151_936, 8, 8192, 4, 2)
    assert u is not None
    want = int((73 * GiB - (u + 0.5 * GiB)) / (80 * GiB) * 100) / 100
    assert float(all_flags(f)["--gpu-memory-utilization"]) == pytest.approx(want)


def test_dp_skew_worked_example() -> None:
    f = findings("c2-dp-engine-load-skew-dp8-v014")["dp-engine-load-skew"]
    assert f.suggested_flags == {}
    assert "About 169 queued requests" in f.summary  # (117 − 28) + (108 − 28)
    assert "engine 0 (waiting 117" in f.summary and "engine 7 (waiting 0" in f.summary
    assert "0.27" in f.summary
    assert "dp-engine-load-skew" not in findings("c2-dp-balanced-overload-not-skew")
    # A skew gone by the third scrape is a burst.
    hot = {"0": {"waiting": 50, "running": 64, "kv": 0.97}, "1": {"waiting": 0, "running": 3, "kv": 0.2}}
    calm = {"0": {"waiting": 0, "running": 30, "kv": 0.5}, "1": {"waiting": 0, "running": 3, "kv": 0.2}}
    samples = [{"t": 0, "engines": hot}, {"t": 15, "engines": hot}, {"t": 30, "engines": calm}]
    assert dp_skew(samples, 5, 0.9, 0.6, 2 / 3) is None
    assert dp_skew(samples[:2] * 2, 5, 0.9, 0.6, 2 / 3) is not None


def test_dp_threshold_override_changes_the_verdict() -> None:
    rules = [r.with_thresholds({"hot_waiting": 500}) if r.id == "dp-engine-load-skew" else r for r in RULES]
    assert "dp-engine-load-skew" not in findings("c2-dp-engine-load-skew-dp8-v014", Pipeline(rules=rules))


def test_sleep_worked_example_32714() -> None:
    f = findings("c2-sleep-not-released-v014-3090")["sleep-memory-not-released"]
    assert f.severity == "warning"
    assert "shortfall of 13.97 GiB" in f.summary  # ≈ 15 GB per GPU
    assert "change version" in f.summary
    assert "sleep-memory-not-released" not in findings("c2-sleep-released-v013-3090")


def test_wake_up_oom_and_sleep_swap_amendment() -> None:
    f = findings("c2-wake-up-oom-neighbour-awake")["wake-up-oom"]
    assert f.suggested_flags == {"--gpu-memory-utilization": "0.23"}
    assert "pid 5120" in f.summary
    assert "wake-up-oom" not in findings("c2-cumem-oom-at-startup-not-wake")
    swap = findings("c2-sleep-swap-pair-one-h100")
    assert "colocated-engines-overcommit" not in swap and "idle-preallocation" not in swap
    assert "colocated-engines-overcommit" in findings("c2-sleep-swap-pair-state-unknown")


def test_allocator_fragmentation_needs_512_mib_reserved() -> None:
    base = {
        "oom_requested_bytes": 128 * MiB, "oom_free_bytes": 60 * MiB, "oom_phase": "runtime",
        "gpu_mig": False, "alloc_conf_expandable": False, "fi_overflow": False, "engine_gpus": [0],
    }  # fmt: skip
    assert _worked("allocator-fragmentation", {**base, "oom_reserved_unallocated_bytes": 100 * MiB}) is None
    assert (
        _worked("allocator-fragmentation", {**base, "oom_reserved_unallocated_bytes": 600 * MiB}) is not None
    )
    assert (
        _worked(
            "allocator-fragmentation",
            {**base, "oom_reserved_unallocated_bytes": 600 * MiB, "alloc_conf_expandable": True},
        )
        is None
    )


def test_dp_skew_from_engine_stats_lines_without_metrics(tmp_path: Path) -> None:
    # The periodic "Engine NNN:" lines stand in for /metrics (vllm-facts §3.4).
    def stats(t: str, eng: int, run: int, wait: int, kv: float) -> str:
        return (
            f"(APIServer pid=1) INFO 12-01 10:00:{t} [loggers.py:178] Engine {eng:03d}: Avg prompt throughput: "
            f"900.0 tokens/s, Avg generation throughput: 300.0 tokens/s, Running: {run} reqs, Waiting: {wait} "
            f"reqs, GPU KV cache usage: {kv}%, Prefix cache hit rate: 0.0%"
        )

    lines = [
        "(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1839] vLLM API server version 0.14.0",
        "(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1840] non-default args: {'model': 'm', "
        "'data_parallel_size': 2, 'max_num_seqs': 64}",
    ]
    for t in ("10", "25", "40"):
        lines += [stats(t, 0, 51, 117, 100.0), stats(t, 1, 12, 0, 31.5)]
    (tmp_path / "vllm.log").write_text("\n".join(lines) + "\n")
    report = PIPELINE.evaluate(load_bundle(tmp_path).timeline)
    got = {f.rule: f for f in report.findings}
    assert "dp-engine-load-skew" in got
    assert "engine 0 (waiting 117" in got["dp-engine-load-skew"].summary
    # Two rounds of lines only: not enough samples.
    (tmp_path / "vllm.log").write_text("\n".join(lines[:-2]) + "\n")
    report = PIPELINE.evaluate(load_bundle(tmp_path).timeline)
    assert "dp-engine-load-skew" not in {f.rule for f in report.findings}


def test_offload_applied_with_less_than_g_offloaded_is_normal(tmp_path: Path) -> None:
    # G ≥ S and "Total CPU offloaded parameters" below G: the offloader ran out of weights to move.
    (tmp_path / "config.json").write_text(
        (Path(__file__).parent / "data" / "models" / "qwen3-4b.json").read_text()
    )
    pre = "(EngineCore pid=7) INFO 12-01 09:00:{} [x.py:1] "
    (tmp_path / "vllm.log").write_text(
        "\n".join(
            [
                "(APIServer pid=1) INFO 12-01 09:00:00 [api_utils.py:347] vLLM server version 0.25.1, serving model m",
                "(APIServer pid=1) INFO 12-01 09:00:00 [api_utils.py:286] non-default args: {'model': "
                "'Qwen/Qwen3-4B', 'cpu_offload_gb': 40.0}",
                pre.format("10") + "Offloader set to UVAOffloader",
                pre.format("20") + "Total CPU offloaded parameters: 7.5",
                pre.format("21") + "Model loading took 0.31 GiB memory and 20.000000 seconds",
            ]
        )
        + "\n"
    )
    report = PIPELINE.evaluate(load_bundle(tmp_path).timeline)
    assert "cpu-offload-not-applied" not in {f.rule for f in report.findings}
    # The same log without the offloader lines is the rule's evidence (b) and (c).
    text = (tmp_path / "vllm.log").read_text().splitlines()
    (tmp_path / "vllm.log").write_text(
        "\n".join(text[:2] + [pre.format("21") + "Model loading took 7.52 GiB memory and 20.000000 seconds"])
        + "\n"
    )
    got = {f.rule: f for f in PIPELINE.evaluate(load_bundle(tmp_path).timeline).findings}
    assert "cpu-offload-not-applied" in got
