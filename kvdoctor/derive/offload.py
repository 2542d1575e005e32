"""Family offload: was ``--cpu-offload-gb`` applied? (``cpu-offload-not-applied``,
spec/rules-catalogue2.md §3.1, vllm-facts §2.1 "CPU weight offload").

The V2 model runner of 0.12–0.27 installs no weight offloader, so the flag is accepted and does
nothing; the V1 runner (and V2 from 0.28) logs "Offloader set to …" and "Total CPU offloaded
parameters: N" (≥0.17). This family gathers the evidence; whether it is enough is the rule's."""

from __future__ import annotations

import math

from kvdoctor import kvmath
from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.units import GiB

WRITES: dict[str, str] = {
    "cpu_offload_bytes": "bytes; G: --cpu-offload-gb (launch flag or 'cpu_offload_gb' in non-default args) × 2**30",
    "v2_runner_line": "int; log line of 'Using V2 Model Runner' (≥0.17)",
    "v2_runner_env": "str; VLLM_USE_V2_MODEL_RUNNER as set (env.txt / launch prefix), None when unset",
    "v2_runner_refused": "bool; 'Model Runner V2 does not yet support …; using the V1 model runner instead' logged",
    "offloader_line": "int; log line of 'Offloader set to UVAOffloader|PrefetchOffloader' or 'Total CPU offloaded parameters'",
    "offloaded_bytes": "bytes; 'Total CPU offloaded parameters: N' (GiB, no unit in the line)",
    "model_loading_line": "int; log line of the last 'Model loading took'",
    "checkpoint_bytes_per_rank": "bytes; S: checkpoint weights ÷ (tp × pp) (config.json estimate, kvmath.weights_bytes; an fp32 checkpoint served in 16 bit counts 2 bytes per parameter)",
    "offload_evidence": "list[str]; which evidence shows the offload missing: 'v2_runner', 'no_offloader_lines', 'weights_not_reduced'",
    "offload_not_applied": "bool; G > 0, no offloader line, and some evidence above",
    "offload_kv_one_request_bytes": "bytes; KV₁: KV of one max_model_len request per rank (kv_bytes_per_token × max_model_len)",
    "offload_other_bytes": "bytes; O: peak activation + non-torch from the post-warm-up summary, else 1 GiB",
    "offload_other_assumed": "bool; O is the 1 GiB assumption (no summary logged)",
    "offload_needed_gib": "GiB; G_needed = ceil_GiB(S + KV₁ + O − B), at least 0",
    "dspark_speculative": "bool; speculative decoding with a DSpark drafter (forces the V2 runner on 0.25–0.27)",
}
READS: frozenset[str] = frozenset(
    {
        "tp_pp",
        "arch",
        "vllm_release",
        "engine_env",
        "weights_logged_bytes",
        "kv_bytes_per_token",
        "max_model_len",
        "engine_budget_bytes",
        "summary_activation_bytes",
        "summary_non_torch_bytes",
    }
)


def derive(s: Scope, v: Vars) -> None:
    """The offload flag, the runner and offloader lines, S against 'Model loading took'."""
    g = s.cfg.cpu_offload_gb or s.cfg.args.get("cpu_offload_gb")
    try:
        g_bytes = int(float(g) * GiB) if g else 0
    except (TypeError, ValueError):
        g_bytes = 0
    v["cpu_offload_bytes"] = g_bytes
    env = v["engine_env"] or {}
    v["v2_runner_env"] = env.get("VLLM_USE_V2_MODEL_RUNNER")
    spec = s.cfg.args.get("speculative_config")
    method = spec.get("method") if isinstance(spec, dict) else None
    log = s.log
    if log is not None:
        runner = log.last("v2_model_runner")
        v["v2_runner_line"] = runner.line if runner else None
        v["v2_runner_refused"] = log.last("v2_model_runner_refused") is not None
        off = log.of("offloader_set") + log.of("cpu_offloaded_params")
        v["offloader_line"] = min(e.line for e in off) if off else None
        params = log.last("cpu_offloaded_params")
        v["offloaded_bytes"] = params.values.get("bytes") if params else None
        loads = log.of("model_loading")
        v["model_loading_line"] = loads[-1].line if loads else None
        sc = log.last("speculative_config")
        method = method or (sc.values.get("method") if sc else None)
    v["dspark_speculative"] = bool(method and "dspark" in str(method).lower())
    arch = v["arch"]
    if arch is not None:
        try:
            dtype = s.cfg.dtype if s.cfg.dtype not in (None, "auto") else None
            total = kvmath.weights_bytes(arch, dtype=dtype, quantization=s.cfg.quantization)
            if dtype is None and (arch.dtype or "").lower() in ("float32", "fp32"):
                total //= 2  # an fp32 checkpoint is served in 16 bit by default
            v["checkpoint_bytes_per_rank"] = kvmath.weights_bytes_per_gpu(total, v["tp_pp"] or 1)
        except (ValueError, ZeroDivisionError, KeyError, TypeError):
            pass
    _evidence(s, v, g_bytes)
    _needed(v)


def _evidence(s: Scope, v: Vars, g: int) -> None:
    rel = v["vllm_release"]
    evidence: list[str] = []
    if (
        rel is not None
        and 12 <= rel <= 27
        and (v["v2_runner_line"] is not None or v["v2_runner_env"] in ("1", "true", "True"))
    ):
        evidence.append("v2_runner")
    if rel is not None and rel >= 17 and v["model_loading_line"] is not None and v["offloader_line"] is None:
        evidence.append("no_offloader_lines")
    w, sz = v["weights_logged_bytes"], v["checkpoint_bytes_per_rank"]
    if g and w is not None and sz:
        if w >= sz - 0.5 * min(g, sz):
            evidence.append("weights_not_reduced")
    v["offload_evidence"] = evidence
    v["offload_not_applied"] = bool(g > 0 and v["offloader_line"] is None and evidence)


def _needed(v: Vars) -> None:
    sz, b = v["checkpoint_bytes_per_rank"], v["engine_budget_bytes"]
    if v["kv_bytes_per_token"] and v["max_model_len"]:
        v["offload_kv_one_request_bytes"] = int(v["kv_bytes_per_token"] * v["max_model_len"])
    act, nt = v["summary_activation_bytes"], v["summary_non_torch_bytes"]
    if act is not None or nt is not None:
        v["offload_other_bytes"], v["offload_other_assumed"] = (act or 0) + (nt or 0), False
    else:
        v["offload_other_bytes"], v["offload_other_assumed"] = GiB, True
    kv1 = v["offload_kv_one_request_bytes"]
    if sz and b and kv1 is not None:
        v["offload_needed_gib"] = max(0, math.ceil((sz + kv1 + v["offload_other_bytes"] - b) / GiB))


FAMILY = Family("offload", WRITES, READS, derive)
