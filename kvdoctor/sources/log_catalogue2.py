"""Log lines of catalogue 2 (spec/rules-catalogue2.md §3, §4.3): sleep mode, weight offload,
the V2 model runner, speculative decoding and kernel workspaces.

``kvdoctor.sources.vllm_log`` hands every message to :func:`match` (after its own prefix
stripping and secret redaction of the event text) and tags every error block's event with
``frames`` (:func:`frame_hints`). Matching is on the message text only, never on ``file:line``.
Every pattern is anchored on a literal, uses bounded quantifiers only, and runs only after a
cheap substring gate: a hostile log line costs one ``in`` test per gate.

Event kinds (``LogEvent.kind`` → ``values``); "§" cites reference/vllm-facts.md:

- ``engine_init_done`` {seconds}: "init engine (profile, create kv cache, warmup model) took
  S seconds" (``v1/engine/core.py``): the start of the run-time phase.
- ``v2_model_runner`` {}: "Using V2 Model Runner" (INFO once, ≥0.17, §3.7).
- ``v2_model_runner_refused`` {}: "Model Runner V2 does not yet support …; using the V1 model
  runner instead." (≥0.22, either case).
- ``offloader_set`` {name}: "Offloader set to UVAOffloader|PrefetchOffloader" (≥0.17).
- ``cpu_offloaded_params`` {bytes}: "Total CPU offloaded parameters: 12.0" (GiB, no unit).
- ``flashinfer_overflow`` {buffer, size_bytes, alignment, available_bytes}: FlashInfer's
  "Buffer overflow when allocating memory for NAME with size S and alignment N, but only R bytes
  available in AlignedAllocator" (FlashInfer ``allocator.h``; not a CUDA OOM).
- ``flashinfer_sparse_mla_warning`` {configured_bytes, computed_bytes}: vLLM 0.33's
  "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=%d is below the %d bytes computed for the sparse MLA
  workspace" warning.
- ``attention_backend`` {backend}: "Using FLASHINFER attention backend out of potential
  backends: […]" and, for a user choice, "Using FLASH_ATTN backend.".
- ``triton_oom`` {phase, hints, frames}: "Triton Error [CUDA]: out of memory" (Triton's driver,
  outside PyTorch's allocator: no sizes). ``phase``/``hints`` as for ``cuda_oom``; ``frames``
  (every error block, ``cuda_oom`` too): :func:`frame_hints` of its traceback.
- ``gdn_warmup_failed`` {tokens, layer}: "GDN prefill kernel warmup (T=N) failed for layer L.
  First inference may OOM due to autotuner." (WARNING, ≥0.18).
- ``gdn_flashinfer_prefill`` {compute_capability}: "Using FlashInfer GDN prefill kernel on CUDA
  compute capability 90" (0.17 on Hopper: the Triton autotune path is not used).
- ``compute_capability`` {major, minor, gpu_name}: the GPU's compute capability as the log states
  it — vLLM's dtype check "Your Tesla V100-SXM2-32GB GPU has compute capability 7.0" (ValueError
  of ``check_if_supports_dtype``), PyTorch's "NVIDIA GeForce RTX 5090 with CUDA capability sm_120
  is not compatible with the current PyTorch installation" and "Found GPU0 … which is of cuda
  capability 3.7"; ``gpu_name`` None when the line names no GPU.
- ``fp8_not_native`` {}: "Your GPU does not have native support for FP8 computation" (vLLM's fp8
  quantization warning: compute capability below 8.9).
- ``speculative_config`` {method, num_spec_tokens}: the engine-config line's
  ``speculative_config=SpeculativeConfig(method='eagle', model=…, num_spec_tokens=4)``.
- ``spec_decode_metrics`` {mean_acceptance_length}: "SpecDecoding metrics: Mean acceptance
  length: 2.31, …".
- ``loading_drafter`` {}: "Loading drafter model...".
- ``sleep_freed`` {freed_bytes, in_use_bytes}: "Sleep mode freed F GiB memory, U GiB memory is
  still in use." (one per worker; U is the whole device's used memory).
- ``cumem_sleep`` {freed_bytes, backed_up_bytes, discarded_bytes}: "CuMemAllocator: sleep freed
  X GiB memory in total, of which Y GiB is backed up in CPU and the rest Z GiB is discarded
  directly."
- ``fell_asleep`` {seconds}: "It took S seconds to fall asleep."
- ``woke_up`` {seconds, tags}: "It took S seconds to wake up tags ['weights']." (tags a list,
  empty when the line names none).
- ``wake_up_request`` {tags}: the API server's "wake up the engine with tags: …".
- ``cumem_oom`` {phase, hints}: "CUDA Error: out of memory at …/csrc/cumem_allocator.cpp:N"
  (vLLM's cuMem allocator, raised when a wake-up cannot map its memory back).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.lazyre import lazy_re
from kvdoctor.units import GiB

__all__ = ["BLOCK_KINDS", "ERROR_KINDS", "FRAME_HINTS", "SERVING_NEEDLES", "frame_hints", "match"]

#: Kinds raised inside a traceback block: they get ``phase`` and ``hints`` like ``cuda_oom``.
BLOCK_KINDS = frozenset({"triton_oom", "cumem_oom", "flashinfer_overflow"})
#: Kinds kept once per failure (the same error re-raised by EngineCore / the API server).
ERROR_KINDS = BLOCK_KINDS
#: Messages that mean the engine is serving (the run-time phase, spec §2).
SERVING_NEEDLES = ("init engine (profile, create kv cache, warmup model) took",)

#: traceback text → the ``frames`` tags of an error block (lower-cased needles).
FRAME_HINTS: dict[str, tuple[str, ...]] = {
    "rejection_sampler": ("rejection_sampler.py", "rejection_sample("),
    "triton_autotune": ("triton/runtime/autotuner.py", "autotuner.py", "_bench(", "do_bench"),
    "fla_ops": ("layers/fla/ops/", "solve_tril", "chunk_gated_delta_rule", "gdn_linear_attn"),
    "attention": ("attention/backends/", "/mla/", "indexer", "flash_attn", "attention.py"),
    "wake_up": ("wake_up", "create_and_map"),
    # the model's MLP in the forward pass (prefill-burst-oom's inference, spec/rules.md)
    "mlp": (
        "self.mlp(",
        "mlp.py",
        "act_fn(",
        "silu_and_mul",
        "gate_up_proj",
        "down_proj",
        "layers/activation.py",
    ),
}


def frame_hints(lines: list[str]) -> list[str]:
    """The :data:`FRAME_HINTS` tags whose needles occur in a traceback block's lines, sorted
    (the block is bounded by the log parser: at most a few hundred lines)."""
    low = "\n".join(lines).lower()
    return sorted(tag for tag, needles in FRAME_HINTS.items() if any(n in low for n in needles))


_NUM = r"(\d{1,12}(?:\.\d{1,9})?)"
_RE = {
    "init_done": lazy_re(r"init engine \(profile, create kv cache, warmup model\) took " + _NUM),
    "offloader": lazy_re(r"Offloader set to (UVAOffloader|PrefetchOffloader)\b"),
    "offloaded": lazy_re(r"Total CPU offloaded parameters: " + _NUM),
    "fi_overflow": lazy_re(
        r"Buffer overflow when allocating memory for (\S{1,200}) with size (\d{1,20}) and alignment "
        r"(\d{1,20}), but only (\d{1,20}) bytes available in AlignedAllocator"
    ),
    "fi_sparse": lazy_re(
        r"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=(\d{1,20}) is below the (\d{1,20}) bytes computed"
    ),
    "backend_auto": lazy_re(r"Using ([A-Z][A-Z0-9_]{1,40}) attention backend out of potential backends"),
    "backend_user": lazy_re(r"^Using ([A-Z][A-Z0-9_]{1,40}) backend\.?$"),
    "gdn_failed": lazy_re(r"GDN prefill kernel warmup \(T=(\d{1,12})\) failed for layer (\S{1,200})"),
    "gdn_fi": lazy_re(r"Using FlashInfer GDN prefill kernel on CUDA compute capability (\d{2,3})"),
    "cc_dtype": lazy_re(r"Your (.{1,80}?) GPU has compute capability (\d{1,2})\.(\d)"),
    # anchored on the literal; the GPU name is the text before it (no leading wildcard to backtrack)
    "cc_torch_sm": lazy_re(r" with CUDA capability sm_(\d{1,2})(\d)\b"),
    "cc_torch_found": lazy_re(r"Found GPU\d{1,3} (.{1,80}?) which is of cuda capability (\d{1,2})\.(\d)"),
    "spec_cfg": lazy_re(
        r"SpeculativeConfig\(method='?([\w-]{1,40})'?, model=[^,)]{0,300}, num_spec_tokens=(\d{1,3})\)"
    ),
    "spec_metrics": lazy_re(r"SpecDecoding metrics: Mean acceptance length: " + _NUM),
    "sleep_freed": lazy_re(
        r"Sleep mode freed " + _NUM + r" GiB memory, " + _NUM + r" GiB memory is still in use"
    ),
    "cumem_sleep": lazy_re(
        r"CuMemAllocator: sleep freed "
        + _NUM
        + r" GiB memory in total, of which "
        + _NUM
        + r" GiB is backed up in CPU and the rest "
        + _NUM
        + r" GiB is discarded directly"
    ),  # fmt: skip
    "asleep": lazy_re(r"It took " + _NUM + r" seconds to fall asleep"),
    "woke": lazy_re(r"It took " + _NUM + r" seconds to wake up(?: tags ([^\n]{0,300}?))?\.?$"),
    "wake_req": lazy_re(r"wake up the engine with tags: ([^\n]{0,300})$"),
    "cumem_oom": lazy_re(r"CUDA Error: out of memory at \S{0,400}cumem_allocator\.cpp:\d{1,6}"),
    "tags": lazy_re(r"[A-Za-z_]{1,40}"),
}


def _gib_bytes(text: str) -> int:
    return int(round(float(text) * GiB))


def _tags(text: str | None) -> list[str]:
    """``['weights', 'kv_cache']`` / ``None`` / ``weights`` → the tag names (None → [])."""
    if not text:
        return []
    return [t for t in _RE["tags"].findall(text[:300]) if t != "None"]


def match(msg: str) -> list[tuple[str, dict[str, Any]]]:  # noqa: C901
    """The catalogue-2 events of one log message: a list of (kind, values), usually empty.

    ``msg`` is the message with prefix and level stripped (``vllm_log.parse_line``). Values are
    in base units (bytes, seconds, tokens). Never raises on odd text: a line that passes a gate
    but not its pattern gives no event."""
    out: list[tuple[str, dict[str, Any]]] = []
    R = _RE
    if len(msg) > 8192:
        msg = msg[:8192]
    if "init engine (" in msg:
        m = R["init_done"].search(msg)
        if m:
            out.append(("engine_init_done", {"seconds": float(m.group(1))}))
        return out
    if "Model Runner" in msg or "Model runner" in msg:
        if "Using V2 Model Runner" in msg:
            out.append(("v2_model_runner", {}))
        elif "does not yet support" in msg and "v1 model runner" in msg.lower():
            out.append(("v2_model_runner_refused", {}))
        return out
    if "Offloader set to" in msg:
        m = R["offloader"].search(msg)
        if m:
            out.append(("offloader_set", {"name": m.group(1)}))
        return out
    if "Total CPU offloaded parameters" in msg:
        m = R["offloaded"].search(msg)
        if m:
            out.append(("cpu_offloaded_params", {"bytes": _gib_bytes(m.group(1))}))
        return out
    if "AlignedAllocator" in msg and "Buffer overflow" in msg:
        m = R["fi_overflow"].search(msg)
        if m:
            out.append(
                (
                    "flashinfer_overflow",
                    {
                        "buffer": m.group(1),
                        "size_bytes": int(m.group(2)),
                        "alignment": int(m.group(3)),
                        "available_bytes": int(m.group(4)),
                    },
                )
            )
        return out
    if "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=" in msg and "sparse MLA" in msg:
        m = R["fi_sparse"].search(msg)
        if m:
            out.append(
                (
                    "flashinfer_sparse_mla_warning",
                    {"configured_bytes": int(m.group(1)), "computed_bytes": int(m.group(2))},
                )
            )
        return out
    if msg.startswith("Using ") and "backend" in msg:
        m = R["backend_auto"].search(msg) or R["backend_user"].search(msg.strip())
        if m:
            out.append(("attention_backend", {"backend": m.group(1)}))
        return out
    if "Triton Error [CUDA]: out of memory" in msg:
        out.append(("triton_oom", {}))
        return out
    if "apability" in msg and (
        "compute capability" in msg or "CUDA capability" in msg or "cuda capability" in msg
    ):
        for key in ("cc_dtype", "cc_torch_found"):
            m = R[key].search(msg)
            if m:
                name = m.group(1).strip().strip("'\"")
                out.append(
                    (
                        "compute_capability",
                        {"major": int(m.group(2)), "minor": int(m.group(3)), "gpu_name": name or None},
                    )
                )
                return out
        m = R["cc_torch_sm"].search(msg)
        if m:
            name = msg[: m.start()].rsplit("Warning: ", 1)[-1].strip().strip("'\"")[-80:]
            out.append(
                (
                    "compute_capability",
                    {"major": int(m.group(1)), "minor": int(m.group(2)), "gpu_name": name or None},
                )
            )
            return out
    if "does not have native support for FP8 computation" in msg:
        out.append(("fp8_not_native", {}))
        return out
    if "GDN prefill kernel" in msg:
        m = R["gdn_fi"].search(msg)
        if m:
            out.append(("gdn_flashinfer_prefill", {"compute_capability": int(m.group(1))}))
            return out
        m = R["gdn_failed"].search(msg)
        if m:
            out.append(("gdn_warmup_failed", {"tokens": int(m.group(1)), "layer": m.group(2).rstrip(".")}))
        return out
    if "SpeculativeConfig(" in msg:
        m = R["spec_cfg"].search(msg)
        if m:
            out.append(("speculative_config", {"method": m.group(1), "num_spec_tokens": int(m.group(2))}))
        # no return: the engine-config line is the existing parser's too
    if "SpecDecoding metrics" in msg:
        m = R["spec_metrics"].search(msg)
        if m:
            out.append(("spec_decode_metrics", {"mean_acceptance_length": float(m.group(1))}))
        return out
    if "Loading drafter model" in msg:
        out.append(("loading_drafter", {}))
        return out
    if "Sleep mode freed" in msg:
        m = R["sleep_freed"].search(msg)
        if m:
            out.append(
                (
                    "sleep_freed",
                    {"freed_bytes": _gib_bytes(m.group(1)), "in_use_bytes": _gib_bytes(m.group(2))},
                )
            )
        return out
    if "CuMemAllocator: sleep freed" in msg:
        m = R["cumem_sleep"].search(msg)
        if m:
            out.append(
                (
                    "cumem_sleep",
                    {
                        "freed_bytes": _gib_bytes(m.group(1)),
                        "backed_up_bytes": _gib_bytes(m.group(2)),
                        "discarded_bytes": _gib_bytes(m.group(3)),
                    },
                )
            )
        return out
    if msg.startswith("It took ") or " It took " in msg:
        m = R["asleep"].search(msg)
        if m:
            out.append(("fell_asleep", {"seconds": float(m.group(1))}))
            return out
        m = R["woke"].search(msg.rstrip())
        if m:
            out.append(("woke_up", {"seconds": float(m.group(1)), "tags": _tags(m.group(2))}))
        return out
    if "wake up the engine with tags" in msg:
        m = R["wake_req"].search(msg.rstrip())
        if m:
            out.append(("wake_up_request", {"tags": _tags(m.group(1))}))
        return out
    if "cumem_allocator" in msg and "CUDA Error: out of memory" in msg:
        if R["cumem_oom"].search(msg):
            out.append(("cumem_oom", {}))
        return out
    return out
