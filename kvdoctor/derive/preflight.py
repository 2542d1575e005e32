"""Family preflight: what in the launch command vLLM would reject before it loads anything
(issue 24 kind 10): a --max-model-len above the model's maximum, a tensor-parallel size that does
not divide the attention (or KV) heads, a flag the version
does not have. Read from the launch command alone, so that ``diagnose --cmdline '…'`` answers
before the engine is started."""

from __future__ import annotations

import re

from kvdoctor import kvmath
from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.vllm_defaults import is_known_version
from kvdoctor.vllm_flags import unavailable_flags

WRITES: dict[str, str] = {
    "launch_max_model_len": "tokens; --max-model-len as given on the launch command (None when not given, or auto/-1)",
    "model_max_model_len": "tokens; the longest --max-model-len vLLM accepts for the model without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (config.json / the catalogue, rope scaling included; kvmath.derived_max_model_len)",
    "long_max_model_len_allowed": "bool; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the engine's environment (vLLM then accepts a longer --max-model-len with a warning)",
    "launch_tp_invalid": "bool; the launch's tensor_parallel_size does not divide the model's attention heads (nor its KV heads, or is no multiple of fewer KV heads): vLLM's ValueError 'Total number of attention heads … must be divisible by tensor parallel size' (kvmath.valid_tensor_parallel_size)",
    "launch_tp_valid_sizes": "list[int]; the tensor-parallel sizes vLLM accepts for the model, up to 16",
    "launch_flags_unavailable": "list[str]; the launch's flags that its vLLM version does not have ('--swap-space' on 0.18+), from the version read (log, metrics) or the image tag vllm/vllm-openai:vX.Y.Z; empty when the version is unknown",
    "launch_version": "str; the vLLM version the flag check used ('0.34.0'), or None",
    "launch_version_source": "str; where it came from: 'engine' (log / metrics) or 'image tag'",
}
READS: frozenset[str] = frozenset({"vllm_version", "vllm_version_known", "engine_env", "tp"})

_IMAGE_TAG = re.compile(r"vllm[\w./-]*:v?(\d+\.\d+(?:\.\d+)?)\b")


def derive(s: Scope, v: Vars) -> None:
    """The launch checks of :data:`WRITES`."""
    cfg, arch = s.cfg, s.arch
    mml = cfg.max_model_len if "max_model_len" in cfg.explicit else None
    v["launch_max_model_len"] = mml if isinstance(mml, int) and mml > 0 else None
    env = v["engine_env"] or {}
    v["long_max_model_len_allowed"] = str(env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "")).strip().lower() in (
        "1",
        "true",
    )
    tp = v["tp"] or 1
    if arch is not None:
        v["model_max_model_len"] = kvmath.derived_max_model_len(arch)
        v["launch_tp_valid_sizes"] = kvmath.valid_tensor_parallel_sizes(arch)
        v["launch_tp_invalid"] = (
            "tensor_parallel_size" in cfg.explicit and not kvmath.valid_tensor_parallel_size(arch, int(tp))
        )
    version, source = None, None
    if v["vllm_version_known"]:
        version, source = v["vllm_version"], "engine"
    else:
        m = _IMAGE_TAG.search(cfg.command or "")
        if m and is_known_version(m.group(1)):
            version, source = m.group(1), "image tag"
    v["launch_version"], v["launch_version_source"] = version, source
    v["launch_flags_unavailable"] = unavailable_flags(cfg, version) if version else []


FAMILY = Family("preflight", WRITES, READS, derive)
