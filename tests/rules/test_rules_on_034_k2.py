"""vLLM 0.34 rows of spec/vllm-0.34.md for v1-runner-env-removed (N5), unified-memory-gmu-unset
(N6), cpu-offload-not-applied, weights-not-sharded, sampler-warmup-oom, multimodal-profile-oom,
mig-defaults-fallback, mixed-gpus-in-parallel-group and invalid-kv-cache-dtype; and the advice
no rule may give on 0.34 (a test over every bundle)."""

from __future__ import annotations

from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.cpu_offload_not_applied import RULE as CPU_OFFLOAD
from kvdoctor.rules.invalid_kv_cache_dtype import RULE as INVALID_KV
from kvdoctor.rules.mig_defaults_fallback import RULE as MIG
from kvdoctor.rules.mixed_gpus_in_parallel_group import RULE as MIXED
from kvdoctor.rules.sampler_warmup_oom import RULE as SAMPLER
from kvdoctor.rules.unified_memory_gmu_unset import RULE as UNIFIED
from kvdoctor.rules.v1_runner_env_removed import RULE as V1_RUNNER
from kvdoctor.rules.weights_not_sharded import RULE as WEIGHTS

from kvdoctor import rulekit
from kvdoctor.units import GiB
from tests.rule_contexts import DATA, bundle_dirs
from tests.rules._words import facts, finding

BUNDLES = DATA / "bundles"


@cache
def _contexts(bundle: Path) -> list[tuple[str | None, dict[str, Any], frozenset[str]]]:
    import kvdoctor.derive as derive
    from kvdoctor.sources.bundle import load_bundle

    timeline = load_bundle(bundle).timeline
    configs = list(timeline.latest.configs) if timeline.latest is not None else []
    _engines, contexts, _kv = derive.build_contexts(timeline, configs)
    out = []
    for eid, variables, inputs in contexts:
        variables.pop(derive.FAILED_KEY, None)
        out.append((eid, variables, frozenset(inputs)))
    return out


def _every_bundle() -> list[Path]:
    extra = DATA / "bundles-034"
    return [*bundle_dirs(), *(d for d in sorted(extra.iterdir()) if d.is_dir())]


@lru_cache(maxsize=1)
def _rules() -> tuple[rulekit.Rule[Any], ...]:
    from kvdoctor.pipeline import Pipeline

    return tuple(Pipeline.load().rules)


def _findings(bundle: Path, rule: rulekit.Rule[Any] | None = None) -> list[tuple[dict[str, Any], Any]]:
    rules = [rule] if rule is not None else list(_rules())
    out = []
    for eid, variables, inputs in _contexts(bundle):
        ev = rulekit.evaluate(rules, [rulekit.RuleContext(eid, variables, inputs)])
        assert not ev.errors, [str(e) for e in ev.errors]
        out += [(variables, f) for f in ev.findings]
    return out


# --- no rule forwards advice that breaks a 0.34 engine (every bundle) ----------------------------


@pytest.mark.parametrize("bundle", _every_bundle(), ids=lambda p: p.name)
def test_no_finding_forces_the_v1_runner_on_034_nor_forwards_vllm_kv_memory(bundle: Path) -> None:
    for variables, f in _findings(bundle):
        for fix in f.fixes:
            if variables.get("vllm_v34"):
                assert fix.env.get("VLLM_USE_V2_MODEL_RUNNER", "1") == "1", (f.rule, fix)
                assert "Set VLLM_USE_V2_MODEL_RUNNER=0" not in f.summary, f.rule  # advice, not a quote
            value = fix.flags.get("--kv-cache-memory-bytes")
            if value is None:
                continue
            printed = [variables.get("vllm_kv_memory_fit_bytes"), variables.get("vllm_kv_memory_full_bytes")]
            # never vLLM's number itself; kvdoctor's own value (vLLM's + the graph estimate E,
            # rounded down to whole KV blocks) lies within one block of it where E = 0 (0.33 with
            # the graph estimate off: bundle k7-graph-oom-vllm-kv-memory-suggestion)
            for p in printed:
                assert p is None or int(value) != int(p), (f.rule, value, printed)


def test_the_every_bundle_check_has_034_engines_and_vllm_suggestions_to_hold() -> None:
    # the check above must have something to catch: 0.34 engines, and bundles where vLLM printed
    # a --kv-cache-memory= suggestion
    ctx = [v for d in _every_bundle() for _e, v, _i in _contexts(d)]
    assert sum(1 for v in ctx if v.get("vllm_v34")) >= 8
    assert sum(1 for v in ctx if v.get("vllm_kv_memory_fit_bytes")) >= 2


# --- N5 v1-runner-env-removed ----------------------------------------------------------------------


def test_v1_runner_env_removed_fires_on_the_startup_error_bundle() -> None:
    (hit,) = [f for _v, f in _findings(DATA / "bundles-034" / "v34-v1-runner-env-removed", V1_RUNNER)]
    assert hit.severity == "critical" and not hit.suggested_flags
    assert [fix.commands for fix in hit.fixes] == [("unset VLLM_USE_V2_MODEL_RUNNER",)]
    assert "cpu_offload_gb 10" in hit.summary and "applies cpu_offload_gb itself" in hit.summary


def test_v1_runner_env_removed_from_the_environment_alone() -> None:
    for value in ("0", "", "false"):
        f = finding(V1_RUNNER, facts(vllm_v34=True, vllm_version="0.34.0", v1_runner_env=value))
        assert f is not None and f.severity == "critical", value
        assert f"VLLM_USE_V2_MODEL_RUNNER={value} stops vLLM 0.34.0" in f.summary


def test_v1_runner_env_removed_near_misses() -> None:
    # 1 on 0.34: a WARNING only, info at most
    f = finding(V1_RUNNER, facts(vllm_v34=True, vllm_version="0.34.0", v1_runner_env="1"))
    assert f is not None and f.severity == "info"
    (b,) = [f for _v, f in _findings(BUNDLES / "k2-v34-v2-runner-env-1-info", V1_RUNNER)]
    assert b.severity == "info"
    # 0 on 0.25 is the old (valid there) advice: not this rule
    assert finding(V1_RUNNER, facts(vllm_v34=False, vllm_version="0.25.1", v1_runner_env="0")) is None
    assert finding(V1_RUNNER, facts(vllm_v34=True, vllm_version="0.34.0")) is None


# --- N6 unified-memory-gmu-unset -------------------------------------------------------------------


def _gb10(**values: Any) -> dict[str, Any]:
    base = dict(
        unified_memory_gpu=True,
        vllm_v34=True,
        vllm_version="0.34.0",
        vllm_sizing_mode="extensible",
        gmu_explicit=False,
        gpu_name="NVIDIA GB10",
        device_total_bytes=int(119.7 * GiB),
        weights_bytes=int(15 * GiB),
        kv_bytes_per_token=131072,
        max_model_len=131072,
        warmup_margin_bytes=GiB,
    )
    return facts(**{**base, **values})


def test_unified_memory_gmu_unset_bundle_and_value() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "k2-v34-unified-gb10-gmu-unset", UNIFIED)]
    assert hit.severity == "warning"
    # floor_0.01((119.70 − max(8, 11.97)) / 119.70) = floor_0.01(0.9) = 0.90
    assert hit.suggested_flags == {"--gpu-memory-utilization": "0.90"}
    assert not _findings(BUNDLES / "k2-v34-unified-gb10-gmu-set-near-miss", UNIFIED)


def test_unified_memory_small_device_keeps_8_gib_and_a_crash_is_critical() -> None:
    # Jetson Orin 64 GB: 0.1 × T = 6.4 GiB < 8 GiB → floor_0.01((64 − 8)/64) = 0.87
    f = finding(UNIFIED, _gb10(gpu_name="Orin", device_total_bytes=64 * GiB, max_model_len=32768))
    assert f is not None and f.suggested_flags == {"--gpu-memory-utilization": "0.87"}
    f = finding(UNIFIED, _gb10(engine_failed=True))
    assert f is not None and f.severity == "critical"


def test_unified_memory_no_gmu_that_cannot_hold_one_request() -> None:
    f = finding(UNIFIED, _gb10(device_total_bytes=24 * GiB, weights_bytes=20 * GiB))
    assert f is not None and not f.fixes and "--gpu-memory-utilization" not in f.summary


def test_unified_memory_near_misses() -> None:
    assert finding(UNIFIED, _gb10(unified_memory_gpu=False, gpu_name="NVIDIA GH200 480GB")) is None
    assert finding(UNIFIED, _gb10(gmu_explicit=True)) is None
    assert finding(UNIFIED, _gb10(vllm_sizing_mode="estimate")) is None
    assert finding(UNIFIED, _gb10(vllm_v34=False, vllm_version="0.33.1", vllm_sizing_mode="estimate")) is None


# --- cpu-offload-not-applied on 0.34 ---------------------------------------------------------------


def test_cpu_offload_on_034_is_info_with_no_flag() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "k2-v34-cpu-offload-no-offloader-lines", CPU_OFFLOAD)]
    assert hit.severity == "info" and hit.fixes == [] and "VLLM_USE_V2_MODEL_RUNNER" not in hit.summary
    assert "needs ≥" in hit.summary  # G_needed


def test_cpu_offload_v2_runner_evidence_is_dead_on_034() -> None:
    base = dict(
        offload_not_applied=True,
        cpu_offload_bytes=12 * GiB,
        offload_evidence=["v2_runner", "no_offloader_lines"],
        v2_runner_env="1",
    )
    old = finding(CPU_OFFLOAD, facts(**base, vllm_release=25, vllm_version="0.25.1", vllm_v34=False))
    assert old is not None and [x.env for x in old.fixes] == [{"VLLM_USE_V2_MODEL_RUNNER": "0"}]
    new = finding(CPU_OFFLOAD, facts(**base, vllm_release=34, vllm_version="0.34.0", vllm_v34=True))
    assert new is not None and new.fixes == [] and new.severity == "info"


def test_cpu_offload_033_bundle_keeps_its_advice() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "c2-cpu-offload-v2-runner-dsv2lite-5090", CPU_OFFLOAD)]
    assert hit.fixes[0].env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


# --- sampler-warmup-oom on 0.34 --------------------------------------------------------------------


def test_sampler_warmup_oom_from_frames_on_034_extensible_has_no_gmu_alternative() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "k2-v34-sampler-warmup-oom-frames", SAMPLER)]
    assert [x.flags for x in hit.fixes] == [{"--max-num-seqs": "256"}]
    assert "min(max_num_seqs, max_num_batched_tokens)" in hit.summary
    assert "--gpu-memory-utilization" not in hit.summary


def test_sampler_warmup_oom_on_034_estimate_keeps_the_gmu_alternative() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "k2-v34-estimate-sampler-warmup-oom-keeps-gmu", SAMPLER)]
    assert [x.flags for x in hit.fixes] == [{"--max-num-seqs": "256"}, {"--gpu-memory-utilization": "0.92"}]


def test_sampler_warmup_n_is_min_of_seqs_and_batched_tokens_on_034() -> None:
    f = finding(
        SAMPLER,
        facts(
            oom_phases=["sampler_warmup"],
            vllm_v34=True,
            vllm_sizing_mode="extensible",
            sampler_warmup_requests=512,
            max_num_seqs_effective=1024,
            gmu=1.0,
        ),
    )
    assert f is not None and f.suggested_flags == {"--max-num-seqs": "128"}
    # a run-time OOM is not the sampler warm-up
    assert finding(SAMPLER, facts(oom_phases=["runtime"], vllm_v34=True, max_num_seqs_effective=1024)) is None


# --- weights-not-sharded on 0.34 -------------------------------------------------------------------


def test_weights_not_sharded_034_bundle() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "k2-v34-70b-tp1-load-oom", WEIGHTS)]
    assert hit.suggested_flags == {"--tensor-parallel-size": "2"}
    assert "lower" not in hit.summary.lower() or "gmu" not in hit.summary.split("lower", 1)[1][:40]
    assert "u 1.0" in hit.summary


def _weights(**values: Any) -> dict[str, Any]:
    # 72 GiB of weights on one 79.19 GiB GPU; a second GPU holds nothing
    base = dict(
        tp_pp=1,
        tp=1,
        pp=1,
        weights_bytes=72 * GiB,
        gpu_total_bytes=int(79.19 * GiB),
        gpu_count=2,
        gpu_used_map={"0": 0, "1": 0},
        max_model_len=None,
    )
    return facts(**{**base, **values})


def test_weights_not_sharded_budget_on_034_is_min_of_u_total_and_free_at_start() -> None:
    # 0.33 (gmu 0.92): 72.9 − 1 GiB < 72 GiB → fires
    assert finding(WEIGHTS, _weights(gmu=0.92, gmu_resolved=0.92)) is not None
    # 0.34 extensible, gmu unset (u = 1.0), all free at start: 79.19 − 1 ≥ 72 → no finding
    ext = dict(gmu=1.0, gmu_resolved=1.0, vllm_v34=True, startup_free_bytes=int(79.0 * GiB))
    assert finding(WEIGHTS, _weights(**ext)) is None
    # 0.34 with only 70 GiB free at the engine's start: min(u × T, F0) − 1 GiB = 69 GiB < 72 → fires
    f = finding(WEIGHTS, _weights(**{**ext, "startup_free_bytes": 70 * GiB}))
    assert f is not None and "70.0 GiB free at the engine's start" in f.summary


def test_weights_not_sharded_033_bundle_unchanged() -> None:
    (hit,) = [f for _v, f in _findings(BUNDLES / "log-only-70b-tp1-load-oom", WEIGHTS)]
    assert "gmu 0.9" in hit.summary


# --- unchanged on 0.34: invalid-kv-cache-dtype, mig-defaults-fallback, mixed-gpus-in-parallel-group -


@pytest.mark.parametrize(
    ("rule", "bundle"),
    [
        (INVALID_KV, "r15-fp8-kv-on-v100"),
        (MIG, "k5-mig-slice-at-cap"),
        (MIXED, "k7-mixed-cards-pp-partition"),
    ],
    ids=["invalid-kv-cache-dtype", "mig-defaults-fallback", "mixed-gpus-in-parallel-group"],
)
def test_unchanged_rules_give_the_same_finding_on_a_034_engine(rule: rulekit.Rule[Any], bundle: str) -> None:
    def one(variables: dict[str, Any], inputs: frozenset[str]) -> Any:
        ev = rulekit.evaluate([rule], [rulekit.RuleContext("e", variables, inputs)])
        assert not ev.errors
        return ev.findings[0] if ev.findings else None

    hits = 0
    for _e, variables, inputs in _contexts(BUNDLES / bundle):
        on34 = {**variables, "vllm_v34": True, "vllm_version": "0.34.0", "vllm_sizing_mode": "extensible"}
        a, b = one(dict(variables), inputs), one(on34, inputs)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            hits += 1
            assert [x.flags for x in a.fixes] == [x.flags for x in b.fixes]
    assert hits >= 1


# --- multimodal-profile-oom on 0.34: warm-up frames ------------------------------------------------


def test_multimodal_oom_in_the_034_sizing_warmup_is_startup_not_runtime() -> None:
    from kvdoctor.rules.multimodal_profile_oom import RULE as MM

    ((variables, hit),) = _findings(BUNDLES / "k2-v34-mm-warmup-oom", MM)
    assert variables["oom_phases"] == ["kv_sizing_warmup"] and variables["startup_failed"]
    assert hit.suggested_flags == {"--limit-mm-per-prompt": '{"image":1}'}
    assert "warm-up before it sized the KV cache" in hit.summary
    # the 0.33 profile-run OOM keeps its words
    ((_v, old),) = _findings(BUNDLES / "r27-qwen2vl-mm-profile-oom-l4", MM)
    assert "while profiling the multimodal encoder" in old.summary


def test_warmup_frames_after_serving_stay_runtime() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of"
        " 22.05 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 21.00 GiB memory in"
        " use. Of the allocated memory 20.00 GiB is allocated by PyTorch, and 120.00 MiB is reserved by PyTorch"
        " but unallocated."
    )
    frames = [
        "ERROR 12-07 10:00:09 [core.py:1585] Traceback (most recent call last):",
        'ERROR 12-07 10:00:09 [core.py:1585]   File "/x/vllm/v1/worker/gpu/warmup.py", line 214, in'
        " run_kv_cache_sizing_warmup",
        'ERROR 12-07 10:00:09 [core.py:1585]   File "/x/vllm/v1/worker/gpu/model_runner.py", line 1602, in'
        " execute_model",
        f"ERROR 12-07 10:00:09 [core.py:1585] {oom}",
    ]
    start = ["INFO 12-07 10:00:01 [api_server.py:1] vLLM API server version 0.34.0"]
    serving = ["INFO 12-07 10:00:05 [api_server.py:1] Starting vLLM server on http://0.0.0.0:8000"]
    before = parse_log("\n".join([*start, *frames]) + "\n")
    after = parse_log("\n".join([*start, *serving, *frames]) + "\n")
    assert [e.values["phase"] for e in before.events if e.kind == "cuda_oom"] == ["kv_sizing_warmup"]
    assert [e.values["phase"] for e in after.events if e.kind == "cuda_oom"] == ["runtime"]


# --- issue 24 kind 6: fp8 KV cache by compute capability -------------------------------------------


def test_fp8_kv_forms_by_compute_capability() -> None:
    from kvdoctor.devices import architecture_name, fp8_kv_cache_dtypes

    assert fp8_kv_cache_dtypes((7, 0)) == () and fp8_kv_cache_dtypes((7, 5)) == ()
    assert fp8_kv_cache_dtypes((8, 0)) == ("fp8_e5m2",) and fp8_kv_cache_dtypes((8, 6)) == ("fp8_e5m2",)
    assert fp8_kv_cache_dtypes((8, 9))[0] == "fp8" and "fp8_e4m3" in fp8_kv_cache_dtypes((9, 0))
    assert [architecture_name(c) for c in ((7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (10, 0))] == [
        "Volta",
        "Turing",
        "Ampere",
        "Ada",
        "Hopper",
        "Blackwell",
    ]


def test_fp8_kv_on_a100_is_e5m2_and_on_t4_none() -> None:
    from kvdoctor.fix_validity import valid_fix

    (a100,) = [v for _e, v, _i in _contexts(BUNDLES / "k2-fp8-kv-a100-e4m3-use-e5m2")]
    assert (a100["fp8_kv_dtype"], a100["fp8_supported"], a100["gpu_architecture"]) == (
        "fp8_e5m2",
        False,  # the plain fp8 (e4m3) other rules suggest: no
        "Ampere",
    )
    assert (
        valid_fix("--kv-cache-dtype", "fp8", a100)
        == "Ampere (compute capability 8.0) backends take fp8 KV only as fp8_e5m2"
    )
    (t4,) = [v for _e, v, _i in _contexts(BUNDLES / "k2-fp8-kv-t4-refused")]
    assert t4["fp8_kv_dtypes"] == [] and t4["fp8_kv_dtype"] is None and t4["fp8_supported"] is False
    assert "no fp8 KV-cache kernel" in str(valid_fix("--kv-cache-dtype", "fp8_e5m2", t4))
    # a rule's fp8 advice on a T4 is dropped; on an H100 it stands
    h100 = {**t4, "fp8_kv_dtypes": ["fp8", "fp8_e4m3", "fp8_e5m2"], "fp8_kv_dtype": "fp8"}
    assert valid_fix("--kv-cache-dtype", "fp8", h100) is None


def test_invalid_kv_dtype_names_the_backend_and_the_capability() -> None:
    ((_v, a100),) = _findings(BUNDLES / "k2-fp8-kv-a100-e4m3-use-e5m2", INVALID_KV)
    assert a100.suggested_flags == {"--kv-cache-dtype": "fp8_e5m2"}
    assert "Ampere, compute capability 8.0" in a100.summary and "no fp8 support" not in a100.summary
    assert not _findings(BUNDLES / "k2-fp8-kv-a100-e5m2-near-miss", INVALID_KV)
    ((_v, t4),) = _findings(BUNDLES / "k2-fp8-kv-t4-refused", INVALID_KV)
    assert (
        t4.suggested_flags == {"--kv-cache-dtype": "auto"} and "Turing, compute capability 7.5" in t4.summary
    )
    ((_v, v100),) = _findings(BUNDLES / "r15-fp8-kv-on-v100", INVALID_KV)
    assert "the TRITON_ATTN attention backend has no fp8 KV-cache kernel" in v100.summary


# --- issue 24 kind 3: the gmu in effect, the version as known ---------------------------------------


def test_v0_namespace_gmu_is_the_one_in_effect() -> None:
    ((variables, hit),) = _findings(BUNDLES / "k2-v0-namespace-gmu-70b-unsharded", WEIGHTS)
    assert variables["gmu"] == 0.85  # args: Namespace(… gpu_memory_utilization=0.85 …), not 0.6.3's 0.9
    assert "gmu 0.85 × 80.0 GiB" in hit.summary and "foreign" not in hit.summary
    (k1,) = [v for _e, v, _i in _contexts(BUNDLES / "k1-v0-engine-pid-foreign-job")]
    assert k1["gmu"] == 0.8


def test_weights_not_sharded_says_when_the_version_and_its_gmu_were_assumed() -> None:
    f = finding(
        WEIGHTS,
        _weights(gmu=0.92, gmu_resolved=0.92, vllm_version_known=False, vllm_defaults_version="0.33"),
    )
    assert f is not None and "vLLM version unknown: vLLM 0.33's default gmu assumed" in f.summary
    f = finding(WEIGHTS, _weights(gmu=0.92, gmu_resolved=0.92, gmu_explicit=True, vllm_version_known=False))
    assert f is not None and "unknown" not in f.summary


def test_int8_on_ampere_before_int8_per_token_head_suggests_e5m2(tmp_path: Path) -> None:
    # vLLM 0.15 has no int8_per_token_head: the nearest value is fp8, which an A100 takes only as e5m2
    src = BUNDLES / "k2-v34-int8-kv-dtype"
    for name in ("cmdline.txt", "config.json", "nvidia-smi.txt"):
        (tmp_path / name).write_text((src / name).read_text())
    (tmp_path / "vllm.log").write_text(
        "(APIServer pid=1) INFO 11-27 09:41:02 [api_server.py:1] vLLM API server version 0.15.1\n"
    )
    (variables,) = [v for _e, v, _i in _contexts(tmp_path)]
    assert (variables["invalid_kv_dtype"], variables["suggested_kv_dtype"]) == (True, "fp8_e5m2")
    ((_v, hit),) = _findings(tmp_path, INVALID_KV)
    assert hit.suggested_flags == {"--kv-cache-dtype": "fp8_e5m2"}


def test_invalid_kv_dtype_on_a_034_bundle() -> None:
    ((variables, hit),) = _findings(BUNDLES / "k2-v34-int8-kv-dtype", INVALID_KV)
    assert variables["vllm_v34"] and hit.suggested_flags == {"--kv-cache-dtype": "int8_per_token_head"}


def test_sampler_warmup_oom_033_case_keeps_both_alternatives() -> None:
    ((_v, hit),) = _findings(DATA / "cases" / "b23-sampler-warmup-oom-qwen3-32b", SAMPLER)
    assert [x.flags for x in hit.fixes] == [{"--max-num-seqs": "256"}, {"--gpu-memory-utilization": "0.92"}]
