"""vLLM 0.34 below the rules: the defaults table and sizing-mode decision (kvdoctor.vllm_defaults),
the 0.34 log lines (kvdoctor.sources.log_v034, built here from reference/vllm-facts.md §9's format
strings), the derive family ``extensible`` on the bundles of tests/data/bundles-034 (written by
its build.py from the same format strings), 0.33 engines unchanged, and the memory breakdown."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor import vllm_defaults as vd
from kvdoctor.breakdown import PARTS, gpu_breakdown
from kvdoctor.derive import VARIABLES, build_contexts
from kvdoctor.derive.extensible import WRITES
from kvdoctor.facts import EngineConfig
from kvdoctor.pipeline import Pipeline
from kvdoctor.sources import log_v034
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.vllm_log import parse_log
from kvdoctor.vllm_flags import apply_defaults, default_gpu_memory_utilization
from tests.check_cases import check

DATA = Path(__file__).parent / "data"
B034 = DATA / "bundles-034"
BUNDLES_034 = sorted(p for p in B034.iterdir() if (p / "expected_vars.json").is_file())
GiB = 2**30

# --- vllm-facts §9 format strings, verbatim -------------------------------------------------------
AFTER_WARMUP = (
    "Memory after warmup: %s GiB free, %s GiB committed to the KV cache, %s GiB kept for transient "
    "activations (%s GiB allocated at peak, %s GiB of torch reservation growth); %d KV cache blocks (%s GiB) "
    "fit within the requested %s GiB. Torch may reserve up to %s GiB."
)
EXTENDED = "Extended KV cache to %d blocks (%.2f GiB)."
REMAP = "Remapping the KV cache from %d to %d blocks to fit the measured budget."
GMU_CAP = (
    "gpu_memory_utilization=%s caps this instance at %s GiB, keeping %s GiB of free device memory out of the "
    "KV cache. The extensible KV cache is sized from the memory measured after warmup and CUDA graph capture, "
    "so vLLM's own use needs no headroom below 1.0."
)
FIT_TENTATIVE_FULL = (
    "Auto-fit max_model_len: full model context length %d fits in available KV cache memory (%s); the final "
    "length is set after CUDA graph capture and warmup"
)
FIT_TENTATIVE_REDUCED = (
    "Auto-fit max_model_len: reduced from %d to %d to fit in available KV cache memory (%s); the final length "
    "is set after CUDA graph capture and warmup"
)
FIT_FINAL_USING = (
    "Auto-fit max_model_len: using max_model_len=%d, which fits in the KV cache memory left after CUDA graph "
    "capture and warmup (%s)."
)
FIT_FINAL_REDUCED = (
    "--max-model-len auto reduced max_model_len from %d to %d (%s left for the KV cache after CUDA graph "
    "capture and warmup)."
)
FIT_FINAL_SHORT = (
    "--max-model-len auto reduced max_model_len from %d to %d (%s left for the KV cache after CUDA graph "
    "capture and warmup). Requests longer than %d tokens will be rejected. %s"
)
FIT_NONEXT_REDUCED = (
    "--max-model-len auto reduced max_model_len from %d to %d (%s available for the KV cache)."
)
DISABLING = (
    "Disabling the extensible KV cache: %s. The KV cache will be sized from profiling estimates instead of "
    "measured memory."
)
IMEX_OFF = (
    "Extensible KV cache off: without an IMEX channel, KV transfers within a host (e.g. NIXL) would lose NVLink "
    "and fall back to RDMA or TCP. If transfers only cross hosts, pass --enable-extensible-kv-cache."
)
H1 = (
    "Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
    "reservation on the CPU backend, despite its name)."
)
H2 = (
    "The KV cache gets what is left after %s within `gpu_memory_utilization`=%s; increase it (with the "
    "extensible KV cache it defaults to 1.0) or decrease `max_model_len` or `max_num_seqs`.%s"
)
H3 = (
    "The extensible KV cache already takes all device memory left after %s; decrease `max_model_len` or "
    "`max_num_seqs`, or the model needs a device with more memory.%s"
)
U_BEFORE, U_AFTER = "the model and its activations", "the model, its activations, CUDA graphs and warmup"
G_AFTER = " CUDA graphs take less with fewer or smaller capture sizes in the compilation config."
DOCS = "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
NO_KV = "No available memory for the cache blocks. %s " + DOCS
TO_SERVE = (
    "To serve at least one request with the model's max seq len (%d), (%s GiB KV cache is needed, which is "
    "larger than the available KV cache memory (%s GiB). Based on the available memory, the estimated maximum "
    "model length is %d. %s Decreasing `max_model_len` also reduces what is needed. " + DOCS
)
AUTOFIT_NONE = (
    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. %s"
)
AUTOFIT_AFTER = (
    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. CUDA graph "
    "capture and warmup left no memory for the KV cache. Increase `gpu_memory_utilization`, reduce the memory "
    "CUDA graphs take (fewer or smaller capture sizes in the compilation config), or use more GPUs."
)
V1_REMOVED = "VLLM_USE_V2_MODEL_RUNNER=%s is no longer supported: Model Runner V1 has been removed. Unset this variable."
V1_REDUNDANT = "VLLM_USE_V2_MODEL_RUNNER=1 is redundant and can be unset: Model Runner V1 has been removed."
CONFIG_ERROR = "ValueError: enable_extensible_kv_cache: %s."
KV_LOAN = "Releasing the emptied KV cache's memory for a weight update: %s GiB free, about %s GiB needed."
NO_ROOM = (
    "Updating weights layer by layer needs about %s GiB of free device memory, at least %s GiB for the largest "
    "layer alone, but only %s GiB is free beside the extensible KV cache. Pause generation with the cache "
    "cleared first, or release it with release_kv_cache_memory(), so that the update can borrow its memory; or "
    "leave headroom by setting gpu_memory_utilization."
)
CG_DISABLED_034 = (
    "CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). The KV cache may "
    "take memory CUDA graphs need. Consider re-enabling it (the default as of v0.21.0)."
)


# --------------------------------------------------------------------------- the table


def test_defaults_table_by_version_and_mode() -> None:
    assert default_gpu_memory_utilization("0.19.1") == 0.9
    assert default_gpu_memory_utilization("0.33.0") == 0.92
    assert default_gpu_memory_utilization("0.34.0") == 1.0  # extensible, 0.34's default
    assert default_gpu_memory_utilization("0.34.0", "extensible") == 1.0
    assert default_gpu_memory_utilization("0.34.0", "estimate") == 0.92
    assert vd.default_block_size("0.33") == 16 and vd.default_block_size("0.34.1") == 64
    assert vd.default_max_num_seqs("0.34", 80 * GiB, "NVIDIA H100 80GB HBM3") == 1024
    assert vd.default_max_num_batched_tokens("0.34", 80 * GiB, "NVIDIA H100 80GB HBM3") == 8192
    ext = vd.defaults_for("0.34", "extensible").defaults
    assert not ext.startup_free_check and ext.torch_capped and not ext.reservation_is_pool
    est = vd.defaults_for("0.34", "estimate").defaults
    assert est.startup_free_check and not est.torch_capped and est.reservation_is_pool


@pytest.mark.parametrize("version", [None, "", "main", "0.35.0", "1.2", "nightly"])
def test_unknown_version_is_unknown_with_the_assumption_stated(version: str | None) -> None:
    r = vd.defaults_for(version)
    assert not r.known and r.version == vd.UNKNOWN_VERSION_ASSUMED
    assert r.defaults.gpu_memory_utilization == 0.92 and r.defaults.block_size == 16
    assert r.assumption is not None and "assumed 0.33" in r.assumption
    assert not vd.is_v034(version)
    assert vd.decide_sizing_mode(version) is None  # never "newest" by default


def test_apply_defaults_034_by_mode_and_033_unchanged() -> None:
    cfg = EngineConfig(model="m")
    assert (
        apply_defaults(cfg, "0.33.0").gpu_memory_utilization,
        apply_defaults(cfg, "0.33.0").block_size,
    ) == (0.92, 16)
    assert (apply_defaults(cfg, None).gpu_memory_utilization, apply_defaults(cfg, None).block_size) == (
        0.92,
        16,
    )
    ext = apply_defaults(cfg, "0.34.0", "extensible")
    assert (ext.gpu_memory_utilization, ext.block_size) == (1.0, 64)
    est = apply_defaults(cfg, "0.34.0", "estimate")
    assert (est.gpu_memory_utilization, est.block_size) == (0.92, 64)
    mine = EngineConfig(
        model="m",
        gpu_memory_utilization=0.8,
        block_size=16,
        explicit={"gpu_memory_utilization", "block_size"},
    )
    kept = apply_defaults(mine, "0.34.0", "extensible")
    assert (kept.gpu_memory_utilization, kept.block_size) == (0.8, 16)


def test_sizing_mode_decision_order() -> None:
    d = vd.decide_sizing_mode
    # 1. the log wins over everything
    got = d("0.34.0", log_ran_extensible=True, args={"kv_cache_memory_bytes": 1}, label="False")
    assert got is not None and got.mode == "extensible" and not got.assumed
    got = d("0.34.0", log_disabled_reason="another rank cannot use it", label="True")
    assert got is not None and got.mode == "estimate" and "another rank" in got.source
    # 2. the launch flags
    for args in (
        {"enable_extensible_kv_cache": False},
        {"kv_cache_memory_bytes": 8 * GiB},
        {"num_gpu_blocks_override": 1000},
        {"enable_elastic_ep": True},
        {"kv_transfer_config": '{"kv_connector": "LMCacheMPConnector"}'},
    ):
        got = d("0.34.0", args=args, label="True")
        assert got is not None and got.mode == "estimate", args
    got = d("0.34.0", platform="cpu")
    assert got is not None and got.mode == "estimate"
    # 3. the label: configured value, not proof
    got = d("0.34.0", label="True")
    assert got is not None and got.mode == "extensible" and got.assumed and got.configured is True
    got = d(None, label="False")
    assert got is not None and got.mode == "estimate" and got.configured is False
    # 4. assumed
    got = d("0.34.2")
    assert got is not None and got.mode == "extensible" and got.assumed and "assumed" in got.source
    assert d("0.33.1", log_ran_extensible=True) is None


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (NO_KV % H1, ("H1", None, None)),
        (NO_KV % (H2 % (U_BEFORE, "0.9", "")), ("H2", False, 0.9)),
        (NO_KV % (H3 % (U_AFTER, G_AFTER)), ("H3", True, None)),
        (TO_SERVE % (40960, "5.62", "5.33", 38848, H3 % (U_AFTER, G_AFTER)), ("H3", True, None)),
        (AUTOFIT_NONE % (H2 % (U_BEFORE, "0.85", "")), ("H2", False, 0.85)),
        (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.",
            ("H1", None, None),
        ),
        (
            "To serve at least one request … Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend)",
            None,
        ),
    ],
)
def test_classify_kv_hint(text: str, want: tuple | None) -> None:
    assert vd.classify_kv_hint(text) == want


def test_kv_memory_hint_reproduces_the_three_forms() -> None:
    assert vd.kv_memory_hint("estimate", 1.0) == H1
    assert vd.kv_memory_hint("extensible", 0.9, after_warmup=False) == H2 % (U_BEFORE, "0.9", "")
    assert vd.kv_memory_hint("extensible", 1.0, after_warmup=True) == H3 % (U_AFTER, G_AFTER)


# --------------------------------------------------------------------------- the log lines


def _one(msg: str) -> tuple[str, dict]:
    out = log_v034.match(msg)
    assert len(out) == 1, out
    return out[0]


def test_memory_after_warmup_and_extended() -> None:
    kind, v = _one(AFTER_WARMUP % ("62.25", "0.06", "1.86", "1.66", "1.86", 7576, "59.19", "79.19", "18.34"))
    assert kind == "memory_after_warmup"
    assert (
        v["blocks"] == 7576
        and v["free_bytes"] == round(62.25 * GiB)
        and v["torch_cap_bytes"] == round(18.34 * GiB)
    )
    assert v["kept_bytes"] == v["torch_growth_bytes"] == round(1.86 * GiB) and v["requested_bytes"] == round(
        79.19 * GiB
    )
    # format_gib drops trailing zeros: "1" and "0" are numbers too
    kind, v = _one(AFTER_WARMUP % ("3", "0", "1", "1", "0.5", 12, "1", "24", "20"))
    assert kind == "memory_after_warmup" and v["committed_bytes"] == 0 and v["blocks"] == 12
    assert _one(EXTENDED % (7576, 59.19)) == ("kv_extended", {"blocks": 7576, "bytes": round(59.19 * GiB)})
    assert _one(REMAP % (7584, 7576)) == ("kv_remapped", {"from_blocks": 7584, "to_blocks": 7576})


def test_gmu_cap_warning() -> None:
    kind, v = _one(GMU_CAP % ("0.9", "71.27", "6.13"))
    assert kind == "gmu_cap_warning" and v == {
        "gmu": 0.9,
        "cap_bytes": round(71.27 * GiB),
        "withheld_bytes": round(6.13 * GiB),
    }


def test_autofit_lines() -> None:
    assert _one(FIT_TENTATIVE_FULL % (131072, "62.19 GiB GPU"))[1] == {
        "phase": "tentative", "from": 131072, "to": 131072, "kv_bytes": round(62.19 * GiB), "short": False, "extensible": True,
    }  # fmt: skip
    assert _one(FIT_TENTATIVE_REDUCED % (131072, 65536, "8.1 GiB GPU"))[1]["to"] == 65536
    v = _one(FIT_FINAL_USING % (131072, "59.18 GiB GPU"))[1]
    assert (v["phase"], v["to"], v["from"]) == ("final", 131072, None)
    v = _one(FIT_FINAL_REDUCED % (131072, 38848, "5.33 GiB GPU"))[1]
    assert (v["phase"], v["from"], v["to"], v["short"], v["extensible"]) == (
        "final",
        131072,
        38848,
        False,
        True,
    )
    v = _one(
        FIT_FINAL_SHORT
        % (40960, 4096, "0.56 GiB GPU", 4096, "Use more GPUs or set --max-model-len explicitly.")
    )[1]
    assert v["to"] == 4096 and v["short"] is True
    v = _one(FIT_NONEXT_REDUCED % (131072, 65536, "8.0 GiB GPU"))[1]
    assert v["extensible"] is False and v["to"] == 65536
    # 0.33's forms are the 0.33 matcher's, not 0.34 events
    assert (
        log_v034.match(
            "Auto-fit max_model_len: reduced from 131072 to 65536 to fit in available KV cache memory (8.0 GiB GPU)"
        )
        == []
    )
    assert (
        log_v034.match(
            "Auto-fit max_model_len: full model context length 131072 fits in available KV cache memory (62.19 GiB GPU)"
        )
        == []
    )


def test_extensible_off_and_config_error() -> None:
    reason = "cuMemCreate failed: CUDA_ERROR_NOT_SUPPORTED (operation not supported)"
    assert _one(DISABLING % reason) == ("extensible_disabled", {"reason": reason, "at": "runtime"})
    assert _one(DISABLING % "the model has no KV cache")[1]["reason"] == "the model has no KV cache"
    assert _one(IMEX_OFF) == ("extensible_disabled", {"reason": "no IMEX channel", "at": "config"})
    why = "it sizes the KV cache from measured memory, which kv_cache_memory_bytes overrides"
    assert _one(CONFIG_ERROR % why) == ("extensible_config_error", {"reason": why})
    # the non-default args dict names the flag but is no error
    assert log_v034.match("non-default args: {'model': 'm', 'enable_extensible_kv_cache': False}") == []


def test_kv_fit_errors_get_their_hint() -> None:
    assert _one(NO_KV % (H3 % (U_AFTER, G_AFTER))) == (
        "kv_hint", {"error": "no_available_kv_memory", "hint": "H3", "after_warmup": True, "gmu": None},
    )  # fmt: skip
    assert _one(TO_SERVE % (32768, "10.0", "5.45", 17856, H2 % (U_BEFORE, "0.9", ""))) == (
        "kv_hint", {"error": "max_seq_len_exceeds_kv", "hint": "H2", "after_warmup": False, "gmu": 0.9},
    )  # fmt: skip
    assert _one(NO_KV % H1)[1]["hint"] == "H1"
    got = log_v034.match(AUTOFIT_AFTER)
    assert got == [("autofit_failed_after_warmup", {})]
    # 0.33's own "To serve" text carries none of the 0.34 hints
    old = (
        "To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (0.49 GiB). Based on the available memory, the estimated maximum "
        "model length is 4080. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU "
        "backend) or decreasing `max_model_len` when initializing the engine. " + DOCS
    )
    assert log_v034.match(old) == []


def test_runner_driver_and_other_lines() -> None:
    assert _one(V1_REMOVED % "0") == ("v1_runner_removed", {"value": "0"})
    assert _one(V1_REMOVED % "") == ("v1_runner_removed", {"value": ""})
    assert _one(V1_REDUNDANT) == ("v1_runner_redundant", {})
    assert _one("RuntimeError: GPU driver error 2: out of memory") == (
        "vmm_driver_error", {"code": 2, "message": "out of memory", "oom": True},
    )  # fmt: skip
    assert _one("GPU driver error 101: invalid device ordinal")[1]["oom"] is False
    assert _one(KV_LOAN % ("1.2", "3.5")) == (
        "kv_loan",
        {"free_bytes": round(1.2 * GiB), "needed_bytes": round(3.5 * GiB)},
    )
    assert _one(NO_ROOM % ("9.6", "3.2", "1.1"))[0] == "weight_update_no_room"
    assert _one(
        "Applying persisted startup plan (fingerprint 3f2a9c): kv_cache_memory_bytes=65435336704 (free memory 78.6 GiB ≥ baseline)"
    ) == ("startup_plan_applied", {"kv_cache_memory_bytes": 65435336704})
    assert _one(CG_DISABLED_034) == ("cudagraph_profiling_disabled", {})
    old_cg = CG_DISABLED_034.replace(
        "(the default as of v0.21.0).",
        "(the default as of v0.21.0) and increasing --gpu-memory-utilization from 0.9000 to 0.9213.",
    )
    assert log_v034.match(old_cg) == []
    assert _one("Setting kv cache block size to 128 for CUTLASS_MLA backend(s).") == (
        "backend_block_size", {"block_size": 128, "backends": "CUTLASS_MLA"},
    )  # fmt: skip
    assert _one(
        "torch.OutOfMemoryError: CUDA out of memory. Allocation was preemptively rejected because it would exceed per_process_memory_fraction limit."
    ) == ("torch_cap_rejected", {})
    assert _one("Restoring from a process checkpoint") == ("checkpoint_restore", {})


@pytest.mark.parametrize(
    "gate",
    [
        "Memory after warmup:",
        "Extended KV cache to",
        "caps this instance at",
        "Auto-fit max_model_len",
        "--max-model-len auto reduced max_model_len",
        "Disabling the extensible KV cache:",
        "enable_extensible_kv_cache: ",
        "To serve at least one request with the model",
        "VLLM_USE_V2_MODEL_RUNNER=",
        "GPU driver error",
        "Applying persisted startup plan",
        "Setting kv cache block size to",
    ],
)
def test_hostile_lines_past_the_gates_are_cheap_and_quiet(gate: str) -> None:
    # past the substring gate, a long run of a pattern's own pieces: no event, no backtracking
    for filler in ("1.1 ", "(", "9", " GiB ", "a", ". ", "= "):
        msg = gate + filler * 20_000
        t = time.perf_counter()
        out = log_v034.match(msg)
        assert time.perf_counter() - t < 0.5
        assert all(isinstance(k, str) and isinstance(v, dict) for k, v in out)


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=400),
    st.sampled_from(
        [
            "Memory after warmup: ",
            "Extended KV cache to ",
            "GPU driver error ",
            "Disabling the extensible KV cache: ",
            "VLLM_USE_V2_MODEL_RUNNER=",
            "--max-model-len auto reduced max_model_len from ",
            "",
        ]
    ),
)
def test_fuzz_match_never_raises(text: str, gate: str) -> None:
    for kind, values in log_v034.match(gate + text):
        assert kind and isinstance(values, dict)
        for x in values.values():
            assert x is None or isinstance(x, (int, float, str, bool))


def test_parser_keeps_the_033_events_and_adds_the_034_ones_once() -> None:
    log = (B034 / "v34-ext-70b-fp8-after-warmup-no-kv" / "vllm.log").read_text()
    parsed = parse_log(log)
    kinds = [e.kind for e in parsed.events]
    # the 0.33 matcher's event and the 0.34 hint; the API server's re-raise is the same failure
    assert kinds.count("max_seq_len_exceeds_kv") == 1 and kinds.count("kv_hint") == 1
    assert kinds.count("memory_after_warmup") == 1
    assert parsed.last("max_seq_len_exceeds_kv").values["estimated_max_len"] == 17856


# --------------------------------------------------------------------------- derive


def _vars(bundle: Path) -> dict:
    loaded = load_bundle(bundle)
    _engines, ctxs, _kv = build_contexts(loaded.timeline, loaded.configs)
    return ctxs[0][1]


def test_every_new_variable_is_declared_with_unit_and_source() -> None:
    for name, desc in WRITES.items():
        assert VARIABLES[name] == desc
        assert "; " in desc, name


@pytest.mark.parametrize("bundle", BUNDLES_034, ids=[p.name for p in BUNDLES_034])
def test_bundle_034_derive_variables(bundle: Path) -> None:
    v = _vars(bundle)
    want = json.loads((bundle / "expected_vars.json").read_text())
    got = {k: v.get(k) for k in want}
    assert got == want


@pytest.mark.parametrize("bundle", BUNDLES_034, ids=[p.name for p in BUNDLES_034])
def test_bundle_034_existing_rules_agree(bundle: Path) -> None:
    # expected.json is the spec's (spec/vllm-0.34.md); rules that exist today must already agree
    # with it, the new 0.34 rules are checked once they are registered
    expected = json.loads((bundle / "expected.json").read_text())
    report = Pipeline.load().evaluate(load_bundle(bundle).timeline).to_dict()
    known = {f["rule"] for f in report.get("findings", [])} | _rule_ids()
    expected["fires"] = [r for r in expected.get("fires", []) if r in known]
    expected["not_fires"] = [r for r in expected.get("not_fires", []) if r in known]
    expected["flags"] = {r: f for r, f in expected.get("flags", {}).items() if r in known}
    assert check(report, expected) == []


def _rule_ids() -> set[str]:
    return {r.id for r in Pipeline.load().rules}


def test_033_engines_keep_their_values() -> None:
    v = _vars(DATA / "bundles" / "healthy-idle-gmu092")
    assert v["vllm_version"].startswith("0.33")
    assert (v["gmu"], v["block_size"], v["vllm_sizing_mode"], v["vllm_v34"]) == (0.92, 16, "estimate", False)
    assert v["kv_reservation_bytes"] is None  # estimate mode: "Available KV cache memory" is the pool
    assert v["log_available_kv_bytes"] is not None and v["kv_pool_bytes"] == max(
        0, v["log_available_kv_bytes"]
    )
    assert v["vllm_assumption"] is None


def test_unknown_version_engine_says_what_it_assumed() -> None:
    v = _vars(DATA / "bundles" / "k5-generating-kv-saturated-near-miss")
    assert v["vllm_version"] is None and v["vllm_sizing_mode"] is None and v["vllm_v34"] is False
    assert v["gmu"] == 0.92 and v["block_size"] == 16
    assert "assumed 0.33" in v["vllm_assumption"] and "version unknown" in v["gmu_assumption"]


def test_reservation_is_never_the_pool_on_extensible() -> None:
    v = _vars(B034 / "v34-ext-gmu09-explicit-cap-warning")
    assert v["kv_reservation_bytes"] == v["log_available_kv_bytes"]
    assert v["kv_pool_bytes"] < v["kv_reservation_bytes"]
    assert v["kv_pool_source"].endswith("Extended KV cache to N blocks (X GiB)")
    # torch may grow by H_torch after startup: F1 − (pool − c) − 0.5 GiB, and L − H_torch is torch's reserved memory
    assert (
        v["torch_headroom_bytes"]
        == v["warmup_free_bytes"] - (v["kv_pool_bytes"] - v["warmup_committed_bytes"]) - GiB // 2
    )
    assert v["idle_headroom_design_bytes"] == v["warmup_margin_bytes"] + v["warmup_kept_bytes"]


# --------------------------------------------------------------------------- breakdown


def test_breakdown_034_from_the_committed_pool_graphs_and_headroom() -> None:
    bundle = B034 / "v34-ext-gmu09-explicit-cap-warning"
    timeline = load_bundle(bundle).timeline
    report = Pipeline.load().evaluate(timeline)
    (b,) = gpu_breakdown(timeline.latest, report)
    v = _vars(bundle)
    assert [p.part for p in b.parts] == [p for p in PARTS if b.part(p) is not None]
    assert b.part("kv_cache") == v["kv_pool_bytes"]  # the committed pool, never the reservation
    assert b.part("kv_cache") != v["kv_reservation_bytes"]
    assert b.part("cuda_graphs") == v["graph_capture_bytes"]
    assert b.part("transient_headroom") == min(
        v["idle_headroom_design_bytes"], timeline.latest.gpus[0].memory_free_bytes
    )
    assert b.torch_cap_bytes == v["torch_cap_bytes"] and b.kv_reservation_bytes == v["kv_reservation_bytes"]
    assert b.gmu == 0.9
    assert sum(p.bytes for p in b.parts) == b.total_bytes


def test_breakdown_033_unchanged_parts() -> None:
    timeline = load_bundle(DATA / "bundles" / "healthy-idle-gmu092").timeline
    (b,) = gpu_breakdown(timeline.latest, Pipeline.load().evaluate(timeline))
    assert (
        b.part("cuda_graphs") is None and b.part("transient_headroom") is None and b.torch_cap_bytes is None
    )


TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %s. GPU 0 has a total capacity of 79.19 GiB of "
    "which %s is free. Including non-PyTorch memory, this process has 76.10 GiB memory in use. %s allowed; Of "
    "the allocated memory %s is allocated by PyTorch, and %s is reserved by PyTorch but unallocated. If reserved "
    "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation."
)


def _log_vars(text: str) -> dict:
    from kvdoctor.facts import Snapshot, Timeline

    snap = Snapshot(log=parse_log(text, origin="vllm.log"))
    tl = Timeline()
    tl.append(snap)
    _engines, ctxs, _kv = build_contexts(tl, [])
    return ctxs[0][1]


def test_runtime_oom_at_the_torch_cap() -> None:
    # the §9.2 engine serving, then a step past torch's cap L = 18.34 GiB (spec N4: Δ > 0)
    head = (
        (B034 / "v34-ext-gmu09-explicit-cap-warning" / "vllm.log")
        .read_text()
        .replace("--gpu-memory-utilization 0.9", "")
    )
    warm = "(EngineCore pid=2187) INFO 12-07 11:00:00 [extensible_kv_cache.py:693] " + AFTER_WARMUP % (
        "62.25",
        "0.06",
        "1.86",
        "1.66",
        "1.86",
        7576,
        "59.19",
        "79.19",
        "18.34",
    )
    oom = "(EngineCore pid=2187) ERROR 12-07 11:30:00 [core.py:1] " + TORCH_OOM % (
        "2.00 GiB",
        "3.05 GiB",
        "18.34 GiB",
        "16.90 GiB",
        "0.80 GiB",
    )
    v = _log_vars(head + warm + "\n" + oom + "\n")
    assert v["vllm_sizing_mode"] == "extensible"
    assert v["torch_cap_bytes"] == round(18.34 * GiB)
    assert v["oom_allowed_bytes"] == round(18.34 * GiB)
    assert v["torch_cap_overrun_bytes"] == round(16.90 * GiB) + round(0.80 * GiB) + 2 * GiB - round(
        18.34 * GiB
    )
    assert v["torch_cap_overrun_bytes"] > 0


def test_sizing_mode_from_the_log_beats_the_assumption() -> None:
    base = "(APIServer pid=1) INFO 12-07 10:00:00 [api_server.py:1] vLLM API server version 0.34.0\n"
    assert _log_vars(base)["vllm_sizing_mode_assumed"] is True
    off = (
        base
        + "(EngineCore pid=9) WARNING 12-07 10:00:01 [abstract.py:175] "
        + DISABLING % "another rank cannot use it"
        + "\n"
    )
    v = _log_vars(off)
    assert (v["vllm_sizing_mode"], v["vllm_sizing_mode_assumed"], v["gmu"], v["block_size"]) == (
        "estimate",
        False,
        0.92,
        64,
    )
    assert v["extensible_disabled_reason"] == "another rank cannot use it"


def _diagnose(bundle: Path, fmt: str) -> str:
    from click.testing import CliRunner

    from kvdoctor.cli import cli

    res = CliRunner().invoke(
        cli, ["diagnose", "--bundle", str(bundle), "--format", fmt], env={"COLUMNS": "300"}
    )
    return res.stdout


def test_report_says_the_mode_and_what_it_assumed() -> None:
    rep = json.loads(_diagnose(B034 / "v34-ext-70b-fp8-after-warmup-no-kv", "json"))
    v = rep["engines"][0]["vllm"]
    assert v["sizing_mode"] == "extensible" and v["version"] == "0.34.0" and v["assumption"] is None
    assert v["kv_pool_bytes"] == 280 * 20 * 2**20 and v["kv_reservation_bytes"] > v["kv_pool_bytes"]
    text = _diagnose(B034 / "v34-ext-70b-fp8-after-warmup-no-kv", "text")
    assert "KV cache sized extensible (measured after warm-up)" in text
    unknown = _diagnose(DATA / "bundles" / "k5-generating-kv-saturated-near-miss", "text")
    assert "version unknown; assumed 0.33's defaults" in " ".join(unknown.split())
    old = _diagnose(DATA / "bundles" / "healthy-idle-gmu092", "text")
    assert "vLLM of" not in old  # a known 0.33 engine: nothing assumed, nothing to say


def test_sidecar_exports_the_034_parts_and_the_torch_cap() -> None:
    from kvdoctor.sidecar.exposition import SidecarCollector, View

    bundle = B034 / "v34-ext-gmu09-explicit-cap-warning"
    timeline = load_bundle(bundle).timeline
    report = Pipeline.load().evaluate(timeline)
    col = SidecarCollector("test")
    col.publish(View(breakdown=gpu_breakdown(timeline.latest, report)))
    text = col.text()
    v = _vars(bundle)
    pool_line = next(ln for ln in text.splitlines() if 'part="kv_cache"' in ln)
    assert float(pool_line.rsplit(" ", 1)[1]) == v["kv_pool_bytes"]
    assert 'part="cuda_graphs"' in text and 'part="transient_headroom"' in text
    cap_line = next(ln for ln in text.splitlines() if ln.startswith("kvdoctor_gpu_torch_cap_bytes{"))
    assert float(cap_line.rsplit(" ", 1)[1]) == v["torch_cap_bytes"]


def test_block_size_from_the_034_log() -> None:
    from kvdoctor.derive.engines import block_size_from_log

    head = "(APIServer pid=1) INFO 12-07 10:00:00 [x.py:1] vLLM API server version %s\n"
    pref = "(EngineCore pid=2) INFO 12-07 10:00:01 [x.py:1] Setting kv cache block size to 128 for CUTLASS_MLA backend(s).\n"
    assert block_size_from_log(parse_log(head % "0.34.0" + pref), 8192, "0.34.0") == 128
    assert block_size_from_log(parse_log(head % "0.33.0" + pref), 8192, "0.33.0") is None  # 0.33 unchanged
    # the committed blocks against the capacity line: 7576 blocks, 484,864 tokens at 131,072 → 64
    kv = (
        "(EngineCore pid=2) INFO 12-07 10:00:02 [x.py:1] GPU KV cache size: 484,864 tokens, Maximum concurrency "
        "for 131,072 tokens per request: 3.70x\n"
        "(EngineCore pid=2) INFO 12-07 10:00:03 [x.py:1] " + EXTENDED % (7576, 59.19) + "\n"
    )
    assert block_size_from_log(parse_log(head % "0.34.0" + kv), 131072, "0.34.0") == 64


def test_in_process_plugin_on_034_leaves_an_unset_gmu_to_the_mode() -> None:
    from types import SimpleNamespace

    from kvdoctor.integrations import vllm as integ

    cache = SimpleNamespace(
        block_size=64,
        gpu_memory_utilization=None,  # 0.34: unset stays None in the field
        cache_dtype="auto",
        enable_prefix_caching=True,
        num_gpu_blocks_override=None,
        kv_cache_memory_bytes=None,
        enable_extensible_kv_cache=None,
    )
    vc = SimpleNamespace(model_config=SimpleNamespace(model="m"), cache_config=cache)
    cfg = integ.engine_config_from_vllm(vc, "0.34.0")
    assert "gpu_memory_utilization" not in cfg.explicit and cfg.block_size == 64
    assert apply_defaults(cfg, "0.34.0", "extensible").gpu_memory_utilization == 1.0
    assert integ.cache_config_labels(vc)["enable_extensible_kv_cache"] == "None"
    cache.enable_extensible_kv_cache = False
    off = integ.engine_config_from_vllm(vc, "0.34.0")
    assert off.args["enable_extensible_kv_cache"] is False
    got = vd.decide_sizing_mode("0.34.0", args=off.args)
    assert got is not None and got.mode == "estimate"


def test_token_occupancy_behind_block_usage() -> None:
    # vllm-facts §9.9: usage counts blocks; at B = 64 a typical request pads (B − 1)/2 tokens
    v = _vars(B034 / "v34-label-only-metrics")
    n, usage = v["typical_request_tokens"], v["kv_usage"]
    assert usage == 0.9 and n
    assert v["kv_token_occupancy"] == pytest.approx(usage * n / (n + 31.5))
    assert v["kv_token_occupancy"] < usage
    assert v["typical_request_blocks"] == -(-n // 64)
    assert v["kv_pool_requests_typical"] == (7576 - 1) // v["typical_request_blocks"]
