"""Log lines of vLLM 0.34 (reference/vllm-facts.md §9): the extensible KV cache, its
after-warm-up sizing and errors, the removed Model Runner V1.

``kvdoctor.sources.vllm_log`` hands every message to :func:`match` (after its own prefix
stripping), beside :mod:`kvdoctor.sources.log_catalogue2`; the events here are additional: a
0.34 error line also gives the event the 0.33 matchers give it (``no_available_kv_memory``,
``max_seq_len_exceeds_kv``, ``autofit_failed``), and this module adds what is new in it (the
hint form). Matching is on the message text only, never on ``file:line``. Every pattern is
anchored on a literal, uses bounded quantifiers only, and runs after a cheap substring gate; a
message is cut to 8 KiB first.

Event kinds (``LogEvent.kind`` → ``values``); "§" cites reference/vllm-facts.md:

- ``memory_after_warmup`` {free_bytes, committed_bytes, kept_bytes, transient_peak_bytes,
  torch_growth_bytes, blocks, blocks_bytes, requested_bytes, torch_cap_bytes}: "Memory after
  warmup: F1 GiB free, c GiB committed to the KV cache, max(Tr,Gr) GiB kept for transient
  activations (Tr GiB allocated at peak, Gr GiB of torch reservation growth); N KV cache blocks
  (X GiB) fit within the requested R GiB. Torch may reserve up to L GiB." (INFO per worker,
  §9.2 step 8; N is this rank's count before the minimum over ranks). Extensible mode only.
- ``kv_extended`` {blocks, bytes}: "Extended KV cache to N blocks (X GiB)." (per worker; X the
  physical, granule-rounded mapping: the real KV pool, §9.2 step 10). Extensible mode only.
- ``kv_remapped`` {from_blocks, to_blocks}: "Remapping the KV cache from A to B blocks to fit
  the measured budget." (§9.2 step 10).
- ``gmu_cap_warning`` {gmu, cap_bytes, withheld_bytes}: "gpu_memory_utilization=u caps this
  instance at R GiB, keeping W GiB of free device memory out of the KV cache. …" (WARNING once
  per process, explicit 0.7 < u < 1.0 with ≥ 1 GiB withheld, §9.2 step 8).
- ``autofit_034`` {phase, from, to, kv_bytes, short, extensible}: the 0.34 auto-fit lines (§9.2
  table): phase "tentative" (before warm-up, "…; the final length is set after CUDA graph
  capture and warmup"; the 0.33 matcher also gives ``autofit`` for it) or "final" ("Auto-fit
  max_model_len: using max_model_len=N, which fits in the KV cache memory left after …", "--max-
  model-len auto reduced max_model_len from A to B (X GiB GPU left for / available for the KV
  cache)"); ``from`` None when the line gives none; ``short`` the WARNING form below 8192 tokens
  ("Requests longer than N tokens will be rejected."); ``extensible`` True for the "left … after
  CUDA graph capture and warmup" forms, False for "available for the KV cache", None when the
  line does not say.
- ``extensible_disabled`` {reason, at}: "Disabling the extensible KV cache: REASON. The KV cache
  will be sized from profiling estimates instead of measured memory." (WARNING, at "runtime",
  §9.1) and "Extensible KV cache off: without an IMEX channel, …" (INFO, at "config").
- ``extensible_config_error`` {reason}: "enable_extensible_kv_cache: REASON." (ValueError: asked
  for explicitly but unsupported, §9.1); also "The KV connector allocates the KV cache from its
  own memory pool, which the extensible KV cache cannot use." (reason "connector memory pool").
- ``kv_hint`` {error, hint, after_warmup, gmu}: the hint a KV-fit error carries (§9.4): error
  "no_available_kv_memory" / "max_seq_len_exceeds_kv" / "autofit_failed"; hint "H1" (the 0.33
  wording, non-extensible), "H2" (extensible, gmu < 1.0; ``gmu`` the value it prints) or "H3"
  (extensible, gmu 1.0); ``after_warmup`` True when ``{U}`` names "CUDA graphs and warmup" (the
  check after graph capture), None for H1. Lines without a hint (0.33's own texts, except H1)
  give no ``kv_hint``.
- ``autofit_failed_after_warmup`` {}: "Cannot auto-fit max_model_len: … CUDA graph capture and
  warmup left no memory for the KV cache." (§9.4; the 0.33 matcher also gives ``autofit_failed``).
- ``v1_runner_removed`` {value}: "VLLM_USE_V2_MODEL_RUNNER=V is no longer supported: Model
  Runner V1 has been removed. Unset this variable." (startup ValueError, §9.4);
  ``v1_runner_redundant`` {}: "VLLM_USE_V2_MODEL_RUNNER=1 is redundant and can be unset" (WARNING).
- ``vmm_driver_error`` {code, message, oom}: "GPU driver error N: TEXT" (a KV commit, wake-up or
  restore that could not map memory, §9.4; not a torch OOM, no sizes); ``oom`` for code 2 /
  "out of memory". Raised in a traceback: gets ``phase``/``hints``/``frames`` like ``cuda_oom``.
- ``torch_cap_rejected`` {}: torch's "Allocation was preemptively rejected because it would
  exceed per_process_memory_fraction limit" (a run-time OOM at the torch cap, §9.4). In a block.
- ``kv_loan`` {free_bytes, needed_bytes}: "Releasing the emptied KV cache's memory for a weight
  update: F GiB free, about N GiB needed." (§9.7).
- ``weight_update_no_room`` {needed_bytes, layer_bytes, free_bytes}: "Updating weights layer by
  layer needs about N GiB of free device memory, at least L GiB for the largest layer alone, but
  only F GiB is free beside the extensible KV cache." (§9.4).
- ``startup_plan_applied`` {kv_cache_memory_bytes}: "Applying persisted startup plan
  (fingerprint …): kv_cache_memory_bytes=N" (``VLLM_ENABLE_STARTUP_PLAN=1``, §9.6).
- ``cudagraph_profiling_disabled`` {}: 0.34's "CUDA graph memory profiling is disabled
  (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). … Consider re-enabling it (the default as of
  v0.21.0)." without the 0.33 "increasing --gpu-memory-utilization from A to B" numbers.
- ``capture_sizes_deprecated`` {}: "cudagraph_capture_sizes and max_cudagraph_capture_size are
  deprecated. …" (§9.3).
- ``backend_block_size`` {block_size, backends}: "Setting kv cache block size to N for B
  backend(s)." (a backend's preference differs from the default: 64 on 0.34, 16 before).
- ``checkpoint_restore`` {}: "Restoring from a process checkpoint"; ``checkpoint_failed`` {}:
  "Process checkpoint lifecycle failed" (§9.7).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.lazyre import lazy_re
from kvdoctor.units import GiB
from kvdoctor.vllm_defaults import classify_kv_hint

__all__ = ["BLOCK_KINDS", "ERROR_KINDS", "match"]

#: Kinds raised inside a traceback block: they get ``phase``, ``hints`` and ``frames``.
BLOCK_KINDS = frozenset({"vmm_driver_error", "torch_cap_rejected"})
#: Kinds kept once per failure (the same error re-raised by EngineCore / the API server).
ERROR_KINDS = BLOCK_KINDS | frozenset(
    {
        "kv_hint",
        "autofit_failed_after_warmup",
        "v1_runner_removed",
        "extensible_config_error",
        "weight_update_no_room",
    }
)

_NUM = r"(-?\d{1,9}(?:\.\d{1,9})?)"
_INT = r"(\d{1,12})"
_RE = {
    "after_warmup": lazy_re(
        r"Memory after warmup: "
        + _NUM
        + r" GiB free, "
        + _NUM
        + r" GiB committed to the KV cache, "
        + _NUM
        + r" GiB kept for transient activations \("
        + _NUM
        + r" GiB allocated at peak, "
        + _NUM
        + r" GiB of torch reservation growth\); "
        + _INT
        + r" KV cache blocks \("
        + _NUM
        + r" GiB\) fit within the requested "
        + _NUM
        + r" GiB\. Torch may reserve up to "
        + _NUM
        + r" GiB"
    ),  # fmt: skip
    "extended": lazy_re(r"Extended KV cache to " + _INT + r" blocks \(" + _NUM + r" GiB\)"),
    "remapped": lazy_re(r"Remapping the KV cache from " + _INT + r" to " + _INT + r" blocks"),
    "gmu_cap": lazy_re(
        r"gpu_memory_utilization="
        + _NUM
        + r" caps this instance at "
        + _NUM
        + r" GiB, keeping "
        + _NUM
        + r" GiB of free device memory out of the KV cache"
    ),  # fmt: skip
    "fit_tentative_full": lazy_re(
        r"Auto-fit max_model_len: full model context length "
        + _INT
        + r" fits in available KV cache memory \("
        + _NUM
        + r" GiB GPU\); the final length is set after"
    ),  # fmt: skip
    "fit_tentative_reduced": lazy_re(
        r"Auto-fit max_model_len: reduced from "
        + _INT
        + r" to "
        + _INT
        + r" to fit in available KV cache memory \("
        + _NUM
        + r" GiB GPU\); the final length is set after"
    ),  # fmt: skip
    "fit_final_using": lazy_re(
        r"Auto-fit max_model_len: using max_model_len="
        + _INT
        + r", which fits in the KV cache memory left after CUDA graph capture and warmup \("
        + _NUM
        + r" GiB GPU\)"
    ),  # fmt: skip
    "fit_final_reduced": lazy_re(
        r"--max-model-len auto reduced max_model_len from "
        + _INT
        + r" to "
        + _INT
        + r" \("
        + _NUM
        + r" GiB GPU (left for the KV cache after CUDA graph capture and warmup|available for the KV cache)\)"
    ),  # fmt: skip
    "disabling": lazy_re(
        r"Disabling the extensible KV cache: (.{1,600}?)(?:\. The KV cache will be sized from profiling estimates|\.?$)"
    ),
    "config_error": lazy_re(r"enable_extensible_kv_cache: (.{1,400}?)\.?$"),
    "v1_removed": lazy_re(r"VLLM_USE_V2_MODEL_RUNNER=(\S{0,64}) is no longer supported"),
    "driver_error": lazy_re(r"GPU driver error (-?\d{1,6}): ?(.{0,200})$"),
    "kv_loan": lazy_re(
        r"Releasing the emptied KV cache's memory for a weight update: "
        + _NUM
        + r" GiB free, about "
        + _NUM
        + r" GiB needed"
    ),  # fmt: skip
    "no_room": lazy_re(
        r"Updating weights layer by layer needs about "
        + _NUM
        + r" GiB of free device memory, at least "
        + _NUM
        + r" GiB for the largest layer alone, but only "
        + _NUM
        + r" GiB is free"
    ),  # fmt: skip
    "startup_plan": lazy_re(
        r"Applying persisted startup plan \(fingerprint [^)]{0,200}\): kv_cache_memory_bytes=(\d{1,20})"
    ),
    "backend_block": lazy_re(r"Setting kv cache block size to (\d{1,6}) for (.{1,200}?) backend\(s\)"),
    "short": lazy_re(r"Requests longer than " + _INT + r" tokens will be rejected"),
}


def _gib(text: str) -> int:
    return int(round(float(text) * GiB))


def match(msg: str) -> list[tuple[str, dict[str, Any]]]:  # noqa: C901
    """The vLLM 0.34 events of one log message: a list of (kind, values), usually empty.

    ``msg`` is the message with prefix and level stripped (``vllm_log.parse_line``). Values are
    in base units (bytes, tokens). Never raises on odd text: a line that passes a gate but not
    its pattern gives no event."""
    out: list[tuple[str, dict[str, Any]]] = []
    if len(msg) > 8192:
        msg = msg[:8192]
    R = _RE
    if "Memory after warmup:" in msg:
        m = R["after_warmup"].search(msg)
        if m:
            g = m.groups()
            out.append(
                (
                    "memory_after_warmup",
                    {
                        "free_bytes": _gib(g[0]),
                        "committed_bytes": _gib(g[1]),
                        "kept_bytes": _gib(g[2]),
                        "transient_peak_bytes": _gib(g[3]),
                        "torch_growth_bytes": _gib(g[4]),
                        "blocks": int(g[5]),
                        "blocks_bytes": _gib(g[6]),
                        "requested_bytes": _gib(g[7]),
                        "torch_cap_bytes": _gib(g[8]),
                    },
                )
            )
        return out
    if "Extended KV cache to" in msg:
        m = R["extended"].search(msg)
        if m:
            out.append(("kv_extended", {"blocks": int(m.group(1)), "bytes": _gib(m.group(2))}))
        return out
    if "Remapping the KV cache from" in msg:
        m = R["remapped"].search(msg)
        if m:
            out.append(("kv_remapped", {"from_blocks": int(m.group(1)), "to_blocks": int(m.group(2))}))
        return out
    if "caps this instance at" in msg:
        m = R["gmu_cap"].search(msg)
        if m:
            out.append(
                (
                    "gmu_cap_warning",
                    {
                        "gmu": float(m.group(1)),
                        "cap_bytes": _gib(m.group(2)),
                        "withheld_bytes": _gib(m.group(3)),
                    },
                )
            )
        return out
    if "max_model_len" in msg and ("Auto-fit" in msg or "auto reduced" in msg):
        ev = _autofit(msg)
        if ev is not None:
            out.append(("autofit_034", ev))
            return out
    if "extensible KV cache" in msg or "Extensible KV cache" in msg or "enable_extensible_kv_cache" in msg:
        _extensible(msg, out)
        if out:
            return out
    # The KV-fit errors: the 0.33 matchers give their own event; the hint form is added here.
    err = None
    if "No available memory for the cache blocks" in msg:
        err = "no_available_kv_memory"
    elif "To serve at least one request with the model" in msg:
        err = "max_seq_len_exceeds_kv"
    elif "Cannot auto-fit max_model_len" in msg:
        err = "autofit_failed"
        if "CUDA graph capture and warmup left no memory for the KV cache" in msg:
            out.append(("autofit_failed_after_warmup", {}))
    if err is not None:
        hint = classify_kv_hint(msg)
        if hint is not None:
            out.append(("kv_hint", {"error": err, "hint": hint[0], "after_warmup": hint[1], "gmu": hint[2]}))
        return out
    if "VLLM_USE_V2_MODEL_RUNNER=" in msg:
        if "Model Runner V1 has been removed" in msg and "no longer supported" in msg:
            m = R["v1_removed"].search(msg)
            if m:
                out.append(("v1_runner_removed", {"value": m.group(1)[:64]}))
        elif "is redundant and can be unset" in msg:
            out.append(("v1_runner_redundant", {}))
        return out
    if "GPU driver error" in msg:
        m = R["driver_error"].search(msg.rstrip())
        if m:
            text = m.group(2).strip()
            code = int(m.group(1))
            out.append(
                (
                    "vmm_driver_error",
                    {"code": code, "message": text, "oom": code == 2 or "out of memory" in text},
                )
            )
        return out
    if "preemptively rejected" in msg and "per_process_memory_fraction" in msg:
        out.append(("torch_cap_rejected", {}))
        return out
    if "for a weight update" in msg and "Releasing the emptied KV cache" in msg:
        m = R["kv_loan"].search(msg)
        if m:
            out.append(("kv_loan", {"free_bytes": _gib(m.group(1)), "needed_bytes": _gib(m.group(2))}))
        return out
    if "Updating weights layer by layer needs about" in msg:
        m = R["no_room"].search(msg)
        if m:
            out.append(
                (
                    "weight_update_no_room",
                    {
                        "needed_bytes": _gib(m.group(1)),
                        "layer_bytes": _gib(m.group(2)),
                        "free_bytes": _gib(m.group(3)),
                    },
                )
            )
        return out
    if "Applying persisted startup plan" in msg:
        m = R["startup_plan"].search(msg)
        if m:
            out.append(("startup_plan_applied", {"kv_cache_memory_bytes": int(m.group(1))}))
        return out
    if "CUDA graph memory profiling is disabled" in msg:
        if "increasing --gpu-memory-utilization from" not in msg:
            out.append(("cudagraph_profiling_disabled", {}))
        return out
    if "cudagraph_capture_sizes and max_cudagraph_capture_size are deprecated" in msg:
        out.append(("capture_sizes_deprecated", {}))
        return out
    if "Setting kv cache block size to" in msg:
        m = R["backend_block"].search(msg)
        if m:
            out.append(
                ("backend_block_size", {"block_size": int(m.group(1)), "backends": m.group(2).strip()})
            )
        return out
    if "Restoring from a process checkpoint" in msg:
        out.append(("checkpoint_restore", {}))
        return out
    if "Process checkpoint lifecycle failed" in msg:
        out.append(("checkpoint_failed", {}))
        return out
    return out


def _autofit(msg: str) -> dict[str, Any] | None:
    """The ``autofit_034`` values of one auto-fit line, None for a 0.33-only form."""
    R = _RE
    if "the final length is set after" in msg:
        m = R["fit_tentative_full"].search(msg)
        if m:
            n = int(m.group(1))
            return {
                "phase": "tentative",
                "from": n,
                "to": n,
                "kv_bytes": _gib(m.group(2)),
                "short": False,
                "extensible": True,
            }
        m = R["fit_tentative_reduced"].search(msg)
        if m:
            return {
                "phase": "tentative",
                "from": int(m.group(1)),
                "to": int(m.group(2)),
                "kv_bytes": _gib(m.group(3)),
                "short": False,
                "extensible": True,
            }
        return None
    if "using max_model_len=" in msg:
        m = R["fit_final_using"].search(msg)
        if m:
            n = int(m.group(1))
            return {
                "phase": "final",
                "from": None,
                "to": n,
                "kv_bytes": _gib(m.group(2)),
                "short": False,
                "extensible": True,
            }
        return None
    if "--max-model-len auto reduced" in msg:
        m = R["fit_final_reduced"].search(msg)
        if m:
            return {
                "phase": "final",
                "from": int(m.group(1)),
                "to": int(m.group(2)),
                "kv_bytes": _gib(m.group(3)),
                "short": R["short"].search(msg) is not None,
                "extensible": m.group(4).startswith("left"),
            }
    return None


def _extensible(msg: str, out: list[tuple[str, dict[str, Any]]]) -> None:
    """``extensible_disabled`` / ``extensible_config_error`` of one message, appended to ``out``."""
    R = _RE
    if "Disabling the extensible KV cache:" in msg:
        m = R["disabling"].search(msg.rstrip())
        if m:
            out.append(("extensible_disabled", {"reason": m.group(1).strip(), "at": "runtime"}))
        return
    if "Extensible KV cache off:" in msg and "IMEX channel" in msg:
        out.append(("extensible_disabled", {"reason": "no IMEX channel", "at": "config"}))
        return
    if "enable_extensible_kv_cache: " in msg and "non-default args" not in msg and "cache_config" not in msg:
        m = R["config_error"].search(msg.rstrip())
        if m:
            out.append(("extensible_config_error", {"reason": m.group(1).strip()}))
        return
    if "which the extensible KV cache cannot use" in msg and "own memory pool" in msg:
        out.append(("extensible_config_error", {"reason": "connector memory pool"}))
