"""Issue 7 items 5-7, second pass: device facts (XIDs, throttling cost, GPU names, compute
capability), pooling models, and fixes that are always valid. Bundles for each kind live under
``tests/data/bundles/k5-…`` / ``k7-…`` and run through ``tests/test_cases.py``; the tests here pin
the mechanism on facts built in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor.derive.config import _pooling_architecture
from kvdoctor.facts import EngineConfig, EngineMetrics, Gpu, Snapshot
from kvdoctor.units import GiB
from tests.test_rules_catalogue import fired

# --------------------------------------------------------------------------- throttling cost


def _busy(ts: float, gen: float, running: float = 30.0) -> EngineMetrics:
    return EngineMetrics(
        timestamp=ts,
        engine="0",
        model_name="m",
        kv_cache_usage=0.4,
        num_requests_running=running,
        num_requests_waiting=0,
        num_preemptions_total=0,
        prompt_tokens_total=3 * gen,
        generation_tokens_total=gen,
        request_success_total=gen / 300,
    )


def _gpu(reasons: list[str], util: float = 0.88) -> Gpu:
    return Gpu(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * GiB,
        memory_used_bytes=74 * GiB,
        utilization_gpu=util,
        clock_event_reasons=reasons,
    )


def _throttle_series(hot_rate: float, reason: str, hot_running: float = 30.0) -> dict[str, dict]:
    """Live snapshots every 15 s: 3,000 tokens/s unthrottled, then ``hot_rate`` with ``reason``."""
    snaps: list[Snapshot] = []
    gen = 1e6
    for i in range(12):
        hot = i >= 6
        if i:
            gen += 15 * (hot_rate if hot else 3000.0)
        running = hot_running if hot else 30.0
        snaps.append(Snapshot(timestamp=1000.0 + 15 * i, metrics=[_busy(1000.0 + 15 * i, gen, running)],
                              gpus=[_gpu([reason] if hot else [])]))  # fmt: skip
    return fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])


def test_throttling_that_costs_throughput_is_a_warning() -> None:
    got = _throttle_series(2100.0, "hw_thermal_slowdown")["gpu-clock-throttled"]
    assert got["severity"] == "warning"
    assert "30% lost" in got["summary"] and "2,100 tokens/s" in got["summary"]


def test_a_power_cap_that_costs_nothing_is_info() -> None:
    got = _throttle_series(2990.0, "sw_power_cap")["gpu-clock-throttled"]
    assert got["severity"] == "info" and "nothing to fix" in got["summary"]


def test_throughput_is_compared_only_at_comparable_load() -> None:
    # Throttled readings at 8 running requests have no unthrottled reading near that load: the
    # lower throughput is the lighter load, not the clocks; no cost can be shown → info.
    got = _throttle_series(800.0, "hw_thermal_slowdown", hot_running=8.0)["gpu-clock-throttled"]
    assert got["severity"] == "info" and "no unthrottled readings at comparable load" in got["summary"]


def test_an_idle_throttled_gpu_costs_nothing() -> None:
    # A single reading, no traffic, GPU-Util 0: a power cap on an idle card is no warning.
    got = fired(Snapshot(gpus=[_gpu(["sw_power_cap"], util=0.0)]))["gpu-clock-throttled"]
    assert got["severity"] == "info"


# --------------------------------------------------------------------------- pooling models


@pytest.mark.parametrize(
    ("archs", "pooling"),
    [
        (["BertModel"], True),
        (["XLMRobertaModel"], True),  # BAAI/bge-m3
        (["MistralModel"], True),  # intfloat/e5-mistral-7b-instruct
        (["Qwen2ForRewardModel"], True),
        (["Qwen3ForSequenceClassification"], True),
        (["JinaVLForRanking"], False),  # unknown suffix: no claim
        (["LlamaForCausalLM"], False),
        (["Qwen3ForCausalLM"], False),  # Qwen3-Embedding ships this: only --task/--runner says so
        (["Gemma3ForConditionalGeneration"], False),
        (["InternVLChatModel"], False),  # a registered generating model named …Model
        (["ChatGLMModel"], False),
        ([], False),
    ],
)
def test_pooling_from_the_architecture(archs: list[str], pooling: bool) -> None:
    assert _pooling_architecture(archs) is pooling


def _v0_page(ts: float, gen: float, swapped: float = 0) -> EngineMetrics:
    return EngineMetrics(timestamp=ts, engine=None, model_name="m", kv_cache_usage=1.0, num_requests_running=12,
                         num_requests_waiting=5, num_requests_swapped=swapped, num_preemptions_total=0,
                         prompt_tokens_total=1e8 + 1e5 * ts, generation_tokens_total=gen, request_success_total=1e4 + 100 * ts)  # fmt: skip


def _saturated(gen0: float, gen1: float, swapped: float = 0) -> dict[str, dict]:
    snaps = [Snapshot(timestamp=t, metrics=[_v0_page(t, g, swapped)]) for t, g in ((0.0, gen0), (30.0, gen1))]
    snaps[-1].gpus = [_gpu([], util=0.31)]
    return fired(snaps[-1], EngineConfig(model="m"), extra=snaps[:-1])


def test_pooling_traffic_makes_the_kv_gauge_a_placeholder() -> None:
    # Prompt tokens and finished requests, not one generated token in the engine's life: pooling.
    assert "low-util-kv-saturated" not in _saturated(0.0, 0.0)
    # The same page from an engine that generates: the full cache with a queue is real.
    assert "low-util-kv-saturated" in _saturated(1e6, 1e6 + 9e4)
    # A stalled generating engine (generated before, now flat) is not taken for pooling.
    assert "low-util-kv-saturated" in _saturated(1e6, 1e6)
    # Swapped requests only happen on a generating engine.
    assert "low-util-kv-saturated" in _saturated(0.0, 0.0, swapped=3)


def test_an_explicit_generate_task_is_not_overridden() -> None:
    snaps = [Snapshot(timestamp=t, metrics=[_v0_page(t, 0.0)]) for t in (0.0, 30.0)]
    snaps[-1].gpus = [_gpu([], util=0.31)]
    cfg = EngineConfig(model="m", task="generate", explicit={"task"})
    assert "low-util-kv-saturated" in fired(snaps[-1], cfg, extra=snaps[:-1])


# --------------------------------------------------------------------------- GPU names, capability


@pytest.mark.parametrize(
    ("name", "canon", "sm"),
    [
        ("NVIDIA H100 PCIe", "H100-80GB", "9.0"),
        ("NVIDIA H100 NVL 94GB", "H100-NVL", "9.0"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "H100-80GB", "9.0"),  # a MIG profile after the name
        ("NVIDIA B200 SXM 180GB HBM3e", "B200", "10.0"),
        ("NVIDIA DGX Station GB300", "GB300", "10.3"),
        ("NVIDIA DGX Display", "DGX Display", "7.5"),  # DGX Station A100's display card
        ("NVIDIA A800 80GB PCIe", "A800-80GB", "8.0"),
        ("NVIDIA GeForce RTX 5090 D", "RTX 5090", "12.0"),  # China-market board
        ("NVIDIA GeForce RTX 4060 Laptop GPU", "RTX 4060", "8.9"),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 Blackwell", "12.0"),
        ("NVIDIA L40S OEM", "L40S", "8.9"),
        ("Tesla V100S-PCIE-32GB", "V100S-32GB", "7.0"),
        ("NVIDIA GeForce RTX 5070 Ti", "RTX 5070 Ti", "12.0"),  # Ti is a card, not a variant word
    ],
)
def test_gpu_names_by_family_and_board_variant(name: str, canon: str, sm: str) -> None:
    from kvdoctor import catalog

    spec = catalog.gpu(name)
    assert (spec.name, spec.sm) == (canon, sm)


@pytest.mark.parametrize("name", ["NVIDIA GH200 144G HBM3e", "NVIDIA h1000", "NVIDIA Graphics Device"])
def test_a_name_the_catalogue_cannot_place_is_unknown_not_a_wrong_card(name: str) -> None:
    from kvdoctor import catalog

    with pytest.raises(KeyError):
        catalog.gpu(name)  # "144G" contradicts the 96 GB GH200: unknown beats wrong


def test_compute_capability_from_the_log_decides_fp8() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    dtype_error = (
        "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
        "Your Tesla V100-SXM2-32GB GPU has compute capability 7.0. You can use float16 instead."
    )
    cfg = EngineConfig(model="m", kv_cache_dtype="fp8", explicit={"kv_cache_dtype"})
    got = fired(Snapshot(log=parse_log(dtype_error)), cfg)["invalid-kv-cache-dtype"]
    assert got["flags"] == {"--kv-cache-dtype": "auto"} and "compute capability 7.0" in got["summary"]
    torch_warning = (
        "UserWarning: NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the "
        "current PyTorch installation."
    )
    assert "invalid-kv-cache-dtype" not in fired(Snapshot(log=parse_log(torch_warning)), cfg)
    # The log's capability wins over a catalogue name that says otherwise.
    snap = Snapshot(log=parse_log(torch_warning), gpus=[Gpu(index=0, name="Tesla V100-SXM2-16GB")])
    assert "invalid-kv-cache-dtype" not in fired(snap, cfg)


# --------------------------------------------------------------------------- prefill burst inferred

BURST = Path(__file__).parent / "data" / "bundles" / "k6-prefill-burst-inferred-no-batch-logged"


def _burst_rules(keep_requests: int, frames_mlp: bool = True) -> dict[str, dict]:
    from kvdoctor.sources.vllm_log import parse_log

    lines = (BURST / "vllm.log").read_text().splitlines()
    reqs = [i for i, line in enumerate(lines) if "Received request" in line]
    drop = set(reqs[: len(reqs) - keep_requests])
    if not frames_mlp:
        drop |= {
            i for i, line in enumerate(lines) if "mlp" in line or "act_fn" in line or "activation.py" in line
        }
    text = "\n".join(line for i, line in enumerate(lines) if i not in drop)
    cfg = EngineConfig(
        model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=16384, explicit={"max_model_len"}
    )
    return fired(Snapshot(log=parse_log(text)), cfg)


def test_prefill_burst_is_inferred_from_requests_admitted_before_a_forward_pass_oom() -> None:
    got = _burst_rules(6)["prefill-burst-oom"]
    assert got["flags"]["--max-num-batched-tokens"] == "4096"
    assert "6 requests" in got["summary"] and "13,312 tokens" in got["summary"]
    # Two requests are no burst; an OOM outside the model's forward pass is no prefill.
    assert "prefill-burst-oom" not in _burst_rules(2)
    assert "prefill-burst-oom" not in _burst_rules(6, frames_mlp=False)


# --------------------------------------------------------------------------- fixes always valid


@pytest.mark.parametrize(
    ("flag", "value", "names", "ok"),
    [
        # 8 KV heads: TP 4 divides them, TP 16 replicates them (a multiple), TP 6 does neither.
        ("--tensor-parallel-size", "4", {"num_attention_heads": 32, "num_kv_heads": 8}, True),
        ("--tensor-parallel-size", "16", {"num_attention_heads": 64, "num_kv_heads": 8}, True),
        ("--tensor-parallel-size", "6", {"num_attention_heads": 48, "num_kv_heads": 8}, False),
        ("--tensor-parallel-size", "8", {"num_attention_heads": 32, "gpu_count": 4}, False),
        ("--tensor-parallel-size", "2", {"num_attention_heads": 32, "gpu_count": 4, "pp": 2}, True),
        ("--kv-cache-memory-bytes", "3274912563", {"vllm_version": "0.33.0"}, True),
        ("--kv-cache-memory-bytes", "3274912563", {"vllm_version": "0.9.2"}, False),
        ("--kv-cache-memory-bytes", "0", {}, False),
    ],
)
def test_fix_validity_second_pass(flag: str, value: str, names: dict, ok: bool) -> None:
    from kvdoctor.fix_validity import valid_fix

    assert (valid_fix(flag, value, names) is None) is ok


def test_every_flag_a_remediation_names_is_suggested() -> None:
    """A flag spelled in a rule's summary is a key of its ``fix`` (spec: every flag a remediation
    names is emitted), except flags the summary quotes as context, not as the fix."""
    import re

    import yaml

    context_only = {
        "cpu-offload-not-applied": {"--cpu-offload-gb"},  # the flag that was given and ignored
        "dp-engine-load-skew": {"--data-parallel-external-lb", "--data-parallel-rank"},  # the router's
    }
    rules = Path(__file__).resolve().parents[1] / "rules"
    missing = {}
    for path in sorted(rules.glob("*.yaml")):
        rule = yaml.safe_load(path.read_text())
        named = set(re.findall(r"--[a-z][a-z0-9-]+", rule["summary"]))
        fix = set((rule.get("fix") or {}).keys())
        gap = named - fix - context_only.get(rule["id"], set())
        if gap:
            missing[rule["id"]] = sorted(gap)
    assert missing == {}


def test_external_weights_raise_gmu_and_budget_refusal_lowers_it() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    exceed = (
        "ValueError: Externally held weights on device cuda:0 (20.00/79.19 GiB) exceed the desired GPU memory "
        "utilization (0.2, 15.84 GiB)."
    )
    cfg = EngineConfig(model="m", gpu_memory_utilization=0.2, explicit={"gpu_memory_utilization"})
    got = fired(Snapshot(log=parse_log(exceed)), cfg)["gpu-shared-with-foreign-process"]
    assert got["flags"] == {"--gpu-memory-utilization": "0.28"} and "Raise" in got["summary"]
    # Free 30 GiB < the budget after 10 GiB of external weights (0.6 × 79.19 − 10 = 37.51 GiB):
    # requested = gmu × total must fit free + external, less the margin → (30 + 10 − 0.5)/79.19.
    below = (
        "ValueError: Free memory on device cuda:0 (30.00/79.19 GiB) on startup is less than the engine's budget "
        "after excluding external process's weights (0.6, 37.51 GiB)."
    )
    cfg = EngineConfig(model="m", gpu_memory_utilization=0.6, explicit={"gpu_memory_utilization"})
    got = fired(Snapshot(log=parse_log(below)), cfg)["gpu-shared-with-foreign-process"]
    assert got["flags"] == {"--gpu-memory-utilization": "0.49"}


def test_mixed_cards_get_pipeline_stages_proportional_to_card_sizes() -> None:
    from tests.test_rules_catalogue import _gpu as card

    cfg = EngineConfig(
        model="meta-llama/Llama-3.1-8B-Instruct", tensor_parallel_size=2, explicit={"tensor_parallel_size"}
    )
    got = fired(Snapshot(gpus=[card(0, 40, total_gib=80), card(1, 40, total_gib=48)]), cfg)[
        "mixed-gpus-in-parallel-group"
    ]
    # 32 layers in proportion 80 : 48 → 20 and 12; every flag the summary names is suggested.
    assert got["flags"] == {
        "--tensor-parallel-size": "1",
        "--pipeline-parallel-size": "2",
        "VLLM_PP_LAYER_PARTITION": "20,12",
    }
    assert "VLLM_PP_LAYER_PARTITION=20,12" in got["summary"]
    # Already one stage per card (TP 1 × PP 2): only the partition changes something.
    cfg = EngineConfig(
        model="meta-llama/Llama-3.1-8B-Instruct",
        pipeline_parallel_size=2,
        explicit={"pipeline_parallel_size"},
    )
    got = fired(Snapshot(gpus=[card(0, 40, total_gib=80), card(1, 40, total_gib=48)]), cfg)[
        "mixed-gpus-in-parallel-group"
    ]
    assert got["flags"] == {"VLLM_PP_LAYER_PARTITION": "20,12"}


def test_max_model_len_bound_is_the_derived_maximum() -> None:
    from kvdoctor.fix_validity import valid_fix
    from kvdoctor.sources.model_config import parse_model_config

    arch = parse_model_config(
        {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 1000, "max_position_embeddings": 32768,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    )  # fmt: skip
    names = {"arch": arch, "max_model_len": 262144}
    assert valid_fix("--max-model-len", "100000", names) is None  # YaRN ×4: 131,072 allowed
    assert valid_fix("--max-model-len", "200000", names) == "above the model's maximum"
    assert valid_fix("--max-model-len", "262144", names) == "not below the max model length in effect"


def test_unknown_version_suggests_a_kv_dtype_every_version_accepts() -> None:
    cfg = EngineConfig(model="m", kv_cache_dtype="int8", explicit={"kv_cache_dtype"})
    got = fired(Snapshot(), cfg)["invalid-kv-cache-dtype"]
    assert got["flags"] == {"--kv-cache-dtype": "fp8"}


def test_long_request_cap_falls_back_to_the_usual_traffic_p99() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    k6 = Path(__file__).parent / "data" / "bundles" / "k6-oom-while-long-prompt-prefilled" / "vllm.log"
    cfg = EngineConfig(
        model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=32768, explicit={"max_model_len"}
    )
    got = fired(Snapshot(log=parse_log(k6.read_text())), cfg)["long-request-spike"]
    # 2,227 blocks × 16 = 35,632 tokens: a quarter (8,896) is above every usual prompt.
    assert got["flags"]["--max-model-len"] == "8896"
    # 200 blocks = 3,200 tokens: a quarter (800) would cut the usual traffic (p99 of the prompts
    # under 4 × the 912-token median: 1,210), so the cap is that p99 rounded up to a block.
    small = k6.read_text().replace("# GPU blocks: 2227", "# GPU blocks: 200")
    got = fired(Snapshot(log=parse_log(small)), cfg)["long-request-spike"]
    assert got["flags"]["--max-model-len"] == "1216" and "p99 of the usual traffic" in got["summary"]
    assert got["flags"]["--max-num-batched-tokens"] == "2048"
