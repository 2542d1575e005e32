"""Accuracy on incidents the handed cases do not cover (issue 7), one section per kind of fault.

The bundles under ``tests/data/bundles/k<kind>-…`` run through ``tests/test_cases.py`` with their
``expected.json`` (a fire bundle and a near-miss per kind); the tests here pin the mechanism each
kind relies on, on the facts and variables between the sources and the rules.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.log_prefixes import strip_prefixes
from kvdoctor.sources.vllm_log import parse_line, parse_log

BUNDLES = Path(__file__).parent / "data" / "bundles"

# --------------------------------------------------------------------------- kind 4: log formats


@pytest.mark.parametrize(
    ("raw", "process", "pid", "host"),
    [
        (
            "\x1b[36mvllm-1  |\x1b[0m (Worker_TP1 pid=312) INFO 03-10 08:00:41 [m.py:1] Model loading",
            "Worker_TP1",
            312,
            None,
        ),
        (
            "vllm_server_1 | 2025-07-01T09:12:43.1Z (APIServer pid=1) INFO 07-01 09:12:43 [a.py:1] up",
            "APIServer",
            1,
            None,
        ),
        (
            "[pod/vllm-7d9c/vllm] (EngineCore_DP0 pid=5) INFO 07-01 09:12:43 [core.py:1] x",
            "EngineCore_DP0",
            5,
            None,
        ),
        (
            "Jul 01 09:12:43 gpu-node-2 vllm[1234]: (EngineCore pid=7) INFO 07-01 09:12:43 [c.py:1] y",
            "EngineCore",
            7,
            "gpu-node-2",
        ),
        (
            "2025-07-01T09:12:43+0000 gpu-node-3 vllm[1234]: INFO 07-01 09:12:43 [c.py:1] y",
            None,
            None,
            "gpu-node-3",
        ),
        (
            "(RayWorkerWrapper pid=380, ip=10.0.0.2) INFO 07-01 09:12:43 [w.py:1] z",
            "RayWorkerWrapper",
            380,
            "10.0.0.2",
        ),
    ],
)
def test_multiplexing_prefixes_are_stripped(
    raw: str, process: str | None, pid: int | None, host: str | None
) -> None:
    pl = parse_line(raw)
    assert (pl.process, pl.pid, pl.host) == (process, pid, host)
    assert pl.level == "INFO" and pl.time is not None


@pytest.mark.parametrize(
    "text",
    [
        "Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:03<00:03,  3.1s/it]",
        "Processed prompts:   0%|          | 0/512 [00:00<?, ?it/s]",
        "| 0  NVIDIA A100 | 75690MiB / 81920MiB |",
        "key=value | other",
    ],
)
def test_text_with_bars_is_not_a_compose_column(text: str) -> None:
    assert strip_prefixes(text) == (text, None)


def test_compressed_log_in_a_bundle_is_read_not_missing(tmp_path: Path) -> None:
    line = (
        "(EngineCore pid=9) INFO 03-10 08:00:41 [m.py:1] Model loading took 7.51 GiB memory and 9.1 seconds\n"
    )
    (tmp_path / "vllm.log.gz").write_bytes(gzip.compress(line.encode()))
    snap = load_bundle(tmp_path).snapshot
    assert snap.log is not None and snap.log.of("model_loading")
    log_status = [s for s in snap.sources if s.kind == "log"]
    assert log_status and all(s.status == "ok" for s in log_status)


_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total "
    "capacity of 22.05 GiB of which 1.12 GiB is free."
)


def _phase_and_hints(text: str) -> tuple[str, list[str]]:
    ooms = parse_log(text).of("cuda_oom")
    assert len(ooms) == 1
    return ooms[0].values["phase"], ooms[0].values["hints"]


def test_offline_generate_oom_is_runtime_and_profile_run_is_not() -> None:
    startup = "INFO 10-14 11:58:44 gpu_executor.py:122] # GPU blocks: 2227, # CPU blocks: 2048\n"
    run = (
        'Traceback (most recent call last):\n  File "llm.py", line 390, in generate\n'
        '  File "llm_engine.py", line 1386, in step\n  File "model_runner.py", line 1654, in execute_model\n'
        f"{_OOM}\n"
    )
    assert _phase_and_hints(startup + run)[0] == "runtime"
    prof = (
        'Traceback (most recent call last):\n  File "worker.py", line 229, in determine_num_available_blocks\n'
        '  File "model_runner.py", line 1654, in execute_model\n'
        f"{_OOM}\n"
    )
    assert _phase_and_hints(prof)[0] == "profile_run"


def test_cudagraph_memory_profiling_line_makes_a_graph_capture_oom() -> None:
    pre = "(EngineCore pid=8) INFO 04-02 10:00:40 [r.py:1] Model loading took 27.52 GiB memory and 24.1 seconds\n"
    gp = "(EngineCore pid=8) INFO 04-02 10:00:52 [r.py:2] Profiling CUDA graph memory: PIECEWISE=51 (largest=512)\n"
    err = f"(EngineCore pid=8) ERROR 04-02 10:00:55 [core.py:3] {_OOM}\n"
    assert _phase_and_hints(pre + gp + err)[0] == "cuda_graph_capture"
    assert _phase_and_hints(pre + err)[0] != "cuda_graph_capture"


def test_request_parameters_are_no_oom_hint() -> None:
    req = (
        "INFO 10-14 12:01:06 logger.py:37] Received request c1: prompt: 'a\n"
        "b', params: SamplingParams(n=1, logprobs=None, prompt_logprobs=None), prompt_token_ids: [1, 2]\n"
    )
    tb = f'ERROR 10-14 12:01:07 e.py:63] Traceback (most recent call last):\nERROR 10-14 12:01:07 e.py:63]   File "sampler.py", line 9, in _get_prompt_logprob\nERROR 10-14 12:01:07 e.py:63] {_OOM}\n'
    plain = f"ERROR 10-14 12:01:07 e.py:63] Traceback (most recent call last):\nERROR 10-14 12:01:07 e.py:63] {_OOM}\n"
    assert "logprobs" not in _phase_and_hints(req + plain)[1]
    assert "logprobs" in _phase_and_hints(req + tb)[1]


def test_kind4_bundles_have_fire_and_near_miss() -> None:
    kinds = {p.name for p in BUNDLES.glob("k4-*")}
    expected = [json.loads((BUNDLES / k / "expected.json").read_text()) for k in kinds]
    assert any(e["fires"] for e in expected) and any(not e["fires"] or e.get("max_health") for e in expected)


# --------------------------------------------------------------------------- kind 1: engine identity


@pytest.mark.parametrize(
    ("message", "want"),
    [
        ("Started engine process with PID 4113", (4113, "started_engine_process")),
        ("Started server process [1]", (1, "server_process")),
        ("vLLM engine worker pid=2231 started", (2231, "application")),
        ("Process 3371 has 15.25 GiB memory in use", None),
        ("Using pid file /run/x.pid", None),
    ],
)
def test_lines_naming_engine_pids(message: str, want: tuple[int, str] | None) -> None:
    from kvdoctor.sources.log_engines import engine_pid_line

    assert engine_pid_line(message) == want


def test_the_oom_names_the_raising_process() -> None:
    one = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 546.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which 514.19 MiB is free. Process 3371 has 15.25 GiB memory in use."
    two = one.replace(
        "Process 3371 has 15.25 GiB memory in use.",
        "Process 3371 has 12.25 GiB memory in use. Process 9120 has 3.00 GiB memory in use.",
    )
    assert (
        parse_log(f"ERROR 04-03 09:57:26 [core.py:343] {one}\n").of("cuda_oom")[0].values["engine_pid"]
        == 3371
    )
    assert (
        parse_log(f"ERROR 04-03 09:57:26 [core.py:343] {two}\n").of("cuda_oom")[0].values["engine_pid"]
        is None
    )


def _variables(bundle: str) -> dict:
    from kvdoctor.derive import build_contexts
    from kvdoctor.facts import Timeline

    loaded = load_bundle(BUNDLES / bundle)
    timeline = Timeline(snapshots=[loaded.snapshot])
    _engines, contexts, _kv = build_contexts(timeline, loaded.configs)
    return contexts[0][1]


def test_small_display_context_is_no_engine() -> None:
    v = _variables("k1-stacked-idle-gpu-with-xorg")
    assert v["gpus_without_processes"] == [1]
    assert _variables("k1-stacked-near-miss-job-on-gpu1")["gpus_without_processes"] == []


def test_tp_engine_spans_tp_gpus_and_its_driver_rank_is_not_foreign() -> None:
    v = _variables("k1-v0-tp2-driver-rank-not-foreign")
    assert v["engine_gpus"] == [0, 1] and v["foreign_pids"] == []
    job = _variables("k1-v0-engine-pid-foreign-job")
    assert job["foreign_pids"] == [9120]


# --------------------------------------------------------------------------- kind 2: one log, several engines


def test_a_log_is_split_per_engine_with_pids_phase_outcome_and_start() -> None:
    log = parse_log((BUNDLES / "k2-oom-while-other-engine-captures" / "vllm.log").read_text())
    a, b = log.engines
    assert a.pids == [5011, 5120, 5130] and b.pids == [6201, 6310, 6320]
    assert a.args["model"] == "meta-llama/Llama-3.1-8B-Instruct" and b.args["model"] == "Qwen/Qwen3-4B"
    assert (a.phase, a.failed) == ("ready", False) and (b.phase, b.failed) == ("profiling", True)
    assert a.start_s is not None and b.start_s is not None and b.start_s - a.start_s == 14
    # The other engine was capturing graphs: this OOM is the Qwen engine's own profiling OOM.
    assert [e.values["phase"] for e in log.of("cuda_oom")] == ["profile_run"]


def test_one_engine_log_has_no_split() -> None:
    log = parse_log((BUNDLES / "r11-tp2-foreign-process-on-rank1" / "vllm.log").read_text())
    assert log.engines == []


def test_a_second_server_in_the_log_is_not_a_restart() -> None:
    from kvdoctor.derive.base import log_runs

    two = parse_log((BUNDLES / "k2-two-engines-one-log-apart" / "vllm.log").read_text())
    assert len(log_runs(two).starts) == 1
    restart = parse_log((BUNDLES / "r17-restart-old-failure-current-healthy" / "vllm.log").read_text())
    assert len(log_runs(restart).starts) >= 2


def test_start_gap_from_the_log_times() -> None:
    assert _variables("k2-two-engines-one-log-close-start")["colocated_start_gap_s"] == 20
    assert _variables("k2-two-engines-one-log-apart")["colocated_start_gap_s"] == 900


# --------------------------------------------------------------------------- kind 7: fixes always valid


def _flags(bundle: str, rule: str) -> dict[str, str]:
    from tests.test_cases import diagnose_json

    _code, report = diagnose_json(BUNDLES / bundle)
    f = next(f for f in report["findings"] if f["rule"] == rule)
    return {k: v for fix in reversed(f["fixes"]) for k, v in {**fix["flags"], **fix["env"]}.items()}


def test_a_value_already_in_effect_is_not_suggested() -> None:
    assert _flags("k7-mm-profile-oom-every-flag", "multimodal-profile-oom")["--max-num-seqs"] == "8"
    assert "--max-num-seqs" not in _flags("k7-mm-profile-oom-seqs-already-small", "multimodal-profile-oom")


class _Arch:
    max_position_embeddings = 32768
    num_hidden_layers = 32


@pytest.mark.parametrize(
    ("flag", "value", "names", "ok"),
    [
        ("--max-model-len", "16384", {"max_model_len": 32768}, True),
        ("--max-model-len", "32768", {"max_model_len": 32768}, False),
        ("--max-model-len", "65536", {"max_model_len": None, "arch": _Arch()}, False),
        ("--gpu-memory-utilization", "0.9", {"gmu": 0.9}, False),
        ("--gpu-memory-utilization", "1.05", {"gmu": 0.9}, False),
        ("--gpu-memory-utilization", "0.85", {"gmu": 0.9}, True),
        ("--tensor-parallel-size", "3", {"num_attention_heads": 32, "tp": 1}, False),
        ("--tensor-parallel-size", "4", {"num_attention_heads": 32, "tp": 1}, True),
        ("--tensor-parallel-size", "2", {"num_attention_heads": 32, "tp": 2}, False),
        ("--pipeline-parallel-size", "64", {"arch": _Arch(), "pp": 1}, False),
        ("--kv-cache-dtype", "fp8", {"kv_cache_dtype": "auto", "vllm_version": None}, True),
        ("--kv-cache-dtype", "int8_per_token_head", {"kv_cache_dtype": "auto", "vllm_version": None}, False),
        (
            "--kv-cache-dtype",
            "int8_per_token_head",
            {"kv_cache_dtype": "auto", "vllm_version": "0.33.0"},
            True,
        ),
        ("--kv-cache-dtype", "fp8", {"kv_cache_dtype": "fp8", "vllm_version": "0.33.0"}, False),
        ("--max-num-seqs", "256", {"max_num_seqs": 256}, False),
        ("--max-num-seqs", "256", {"max_num_seqs": None}, True),
        ("--enforce-eager", "", {"enforce_eager": True}, False),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", {"expandable_segments_on": True}, False),
        ("CUDA_VISIBLE_DEVICES", "1", {}, True),
    ],
)
def test_fix_validity(flag: str, value: str, names: dict, ok: bool) -> None:
    from kvdoctor.fix_validity import valid_fix

    assert (valid_fix(flag, value, names) is None) is ok


# --------------------------------------------------------------------------- kind 8: quiet wrong answers


def test_traffic_is_judged_in_the_window_not_from_old_log_lines() -> None:
    assert _variables("k8-idle-now-traffic-earlier")["traffic"] is False
    # The same log without scrapes: its stats lines are all there is to judge by.
    from kvdoctor.derive import build_contexts
    from kvdoctor.facts import Snapshot, Timeline

    loaded = load_bundle(BUNDLES / "k8-idle-now-traffic-earlier")
    snap = Snapshot(log=loaded.snapshot.log, gpus=loaded.snapshot.gpus)
    _e, contexts, _kv = build_contexts(Timeline(snapshots=[snap]), loaded.configs)
    assert contexts[0][1]["traffic"] is True


# --------------------------------------------------------------------------- kind 5: device facts


def test_query_gpu_csv_without_identity_column_uses_row_order() -> None:
    from kvdoctor.sources.nvidia_smi import parse_query_gpu_csv

    text = "name, memory.total [MiB], memory.used [MiB]\nNVIDIA A100-SXM4-80GB, 81920 MiB, 75000 MiB\nNVIDIA A100-SXM4-80GB, 81920 MiB, 3 MiB\n"
    (moment,) = parse_query_gpu_csv(text)
    assert [(g.index, g.memory_used_bytes) for g in moment] == [(0, 75000 * 2**20), (1, 3 * 2**20)]


def test_insufficient_permissions_is_no_permission_not_na() -> None:
    denied = load_bundle(BUNDLES / "k5-insufficient-permissions").snapshot.gpus[0]
    na = load_bundle(BUNDLES / "k5-memory-na-near-miss").snapshot.gpus[0]
    assert denied.no_permission and denied.memory_used_bytes is None
    assert not na.no_permission and na.memory_used_bytes is None
    v = _variables("k5-insufficient-permissions")
    assert v["gpu_no_permission"] and not v["gpu_mig"] and v["gpu_total_bytes"] is not None


def test_mig_uuid_in_the_environment_is_mig() -> None:
    assert _variables("k5-mig-uuid-in-env")["gpu_mig"] is True
    assert _variables("k5-gpu-uuid-in-env-near-miss")["gpu_mig"] is False


# --------------------------------------------------------------------------- kind 3: several nodes


def test_ranks_are_keyed_by_node_and_index() -> None:
    v = _variables("k3-two-nodes-heavy-stage0")
    assert (v["rank_heavy_node"], v["rank_heavy_gpu"], v["rank_heavy_stage"]) == ("gpu-node-a", 0, 0)
    assert v["rank_spread_bytes"] == (75600 - 70000) * 2**20
    assert _variables("k3-two-nodes-balanced-near-miss")["rank_spread_bytes"] <= 200 * 2**20


@pytest.mark.parametrize(
    ("layers", "pp", "stage", "excess_layers", "want"),
    [(32, 2, 1, 4, "18,14"), (32, 2, 0, 4, "14,18"), (30, 4, 3, 2, "9,9,7,5"), (32, 2, 1, 0.2, "17,15")],
)
def test_pp_layer_partition(layers: int, pp: int, stage: int, excess_layers: float, want: str) -> None:
    from kvdoctor.facts import ModelArch
    from kvdoctor.rule_functions import pp_layer_partition

    per_layer = 2**29
    got = pp_layer_partition(
        ModelArch(num_hidden_layers=layers), pp, stage, excess_layers * per_layer, layers * per_layer
    )
    assert got == want


# --------------------------------------------------------------------------- kind 6: every clause


@pytest.mark.parametrize(
    ("message", "want"),
    [
        (
            "Received request c1: prompt: '<redacted 9 chars>', params: SamplingParams(n=1), prompt_token_ids: [<redacted 28113 tokens>], lora_request: None",
            28113,
        ),
        (
            "Received request c2: prompt: 'x', params: None, prompt_token_ids: [128000, 9906, 1917], lora_request: None",
            3,
        ),
        ("Received request c3: prompt: 'x', params: None, prompt_token_ids: [128000, 9906, 19", 3),
        ("Received request c4: prompt: 'x', params: None, lora_request: None", None),
    ],
)
def test_request_prompt_length(message: str, want: int | None) -> None:
    log = parse_log(f"INFO 10-14 12:00:10 logger.py:37] {message}\n")
    got = [e.values["prompt_tokens"] for e in log.of("request")]
    assert got == ([] if want is None else [want])


def test_the_prompt_being_prefilled_at_the_oom() -> None:
    v = _variables("k6-oom-while-long-prompt-prefilled")
    assert v["oom_prompt_tokens"] == 28113 and v["log_request_count"] == 8
    assert 800 <= v["log_prompt_tokens_median"] <= 1000
    assert _variables("k6-oom-usual-prompts-near-miss")["oom_prompt_tokens"] == 1210
