"""vLLM knowledge per version and sizing mode: the one version parser and the one table of
defaults (no I/O).

vLLM sizes its KV cache in one of two ways (reference/vllm-facts.md §9.1–9.3):

- ``"estimate"``: the profile-run estimate every version before 0.34 uses, and 0.34 with the
  extensible KV cache off. The budget is ``gmu × total``, an unset ``--gpu-memory-utilization``
  means 0.92 (0.9 before 0.20), the startup check "free ≥ gmu × total" applies, torch is not
  capped, and ``Available KV cache memory`` is the pool.
- ``"extensible"``: vLLM 0.34's default on CUDA and ROCm. It reserves address space, captures
  CUDA graphs and warms up, measures what is free and then commits the pool
  (``Extended KV cache to N blocks (X GiB)``). An unset gmu means 1.0, the startup free-memory
  check is skipped, torch's allocator is capped, and ``Available KV cache memory`` is only a
  reservation.

:data:`DEFAULTS` holds one row per (first version, mode): gmu, block size, and the
``--max-num-seqs`` / ``--max-num-batched-tokens`` device tiers. :func:`defaults_for` picks the
row for a version; an unknown version (None, unparseable, or newer than
:data:`NEWEST_KNOWN_VERSION`) is never read as the newest: callers get the row of
:data:`UNKNOWN_VERSION_ASSUMED` (0.33, the last release every kvdoctor rule was written for)
together with an ``assumption`` sentence that says so. :func:`decide_sizing_mode` decides the
mode as spec/vllm-0.34.md §1 says (log lines, launch flags, ``cache_config_info`` labels,
platform) and says which evidence it used or what it assumed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

Version = tuple[int, ...]
SizingMode = Literal["extensible", "estimate"]

#: The newest vLLM release whose behaviour kvdoctor models (``plan``'s default).
NEWEST_KNOWN_VERSION = "0.34"
#: Defaults applied when an engine's version is unknown: the last release before the
#: extensible KV cache. Every answer built on it carries :attr:`Resolved.assumption`.
UNKNOWN_VERSION_ASSUMED = "0.33"
#: First release with the extensible KV cache, block size 64 and no Model Runner V1.
V034 = (0, 34)
FIRST_EXTENSIBLE_VERSION = "0.34"

# parts of at most 9 digits (no real version has more; a longer run of digits is no version)
_VERSION_RE = re.compile(r"\A\s*v?(\d{1,9}(?:\.\d{1,9})*)(?![\d.]*\d)")


def parse_version(version: str | None) -> Version | None:
    """``"0.10.1.1"`` → (0, 10, 1, 1); ``"v0.9.1"``, ``"0.11.0rc1"``, ``"0.6.3.post1"``,
    ``"0.10.2+cu128"`` → their numeric release part. None or unparseable → None, and so is a
    part of more than 9 digits. The one version parser (``vllm_flags``, ``kvmath``, derive and
    the log source use it)."""
    if not version:
        return None
    return _parse_version_text(str(version)[:64])


@functools.lru_cache(maxsize=256)
def _parse_version_text(text: str) -> Version | None:
    # rules ask for the same few versions every evaluation (a tuple: the cached answer is immutable)
    m = _VERSION_RE.match(text)
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def version_tuple(version: str | None, width: int = 3) -> tuple[int, ...] | None:
    """:func:`parse_version` padded/cut to ``width`` parts (``"0.9"`` → (0, 9, 0)); None when
    unparseable."""
    v = parse_version(version)
    if v is None:
        return None
    return (tuple(v) + (0,) * width)[:width]


def is_known_version(version: str | None) -> bool:
    """True for a parseable version not newer than :data:`NEWEST_KNOWN_VERSION`'s minor release
    (0.34.2 is known, 0.35 and 1.0 are not; nor is None or ``"main"``)."""
    v = version_tuple(version, 2)
    return v is not None and v <= version_tuple(NEWEST_KNOWN_VERSION, 2)  # type: ignore[operator]


def is_v034(version: str | None) -> bool:
    """True only for a known version ≥ 0.34 (an unknown version is not assumed to be 0.34)."""
    v = version_tuple(version, 2)
    return v is not None and v >= V034 and is_known_version(version)


@dataclass(frozen=True)
class VersionDefaults:
    """vLLM's defaults from release ``since`` in sizing ``mode`` (vllm-facts §4.2, §9.3).

    ``gpu_memory_utilization``: what an unset ``--gpu-memory-utilization`` resolves to;
    ``block_size``: tokens per KV block with no ``--block-size`` (before a backend's own
    preference or hybrid alignment); ``startup_free_check``: vLLM refuses to start when free
    memory < gmu × total; ``torch_capped``: torch's allocator is capped after startup;
    ``graph_estimate``: the CUDA-graph estimate is subtracted from the KV budget;
    ``reservation_is_pool``: ``Available KV cache memory`` is the KV pool (False: a reservation);
    ``tier_70g`` / ``tier_160g``: the device tiers of ``--max-num-seqs`` and
    ``--max-num-batched-tokens`` exist (≥ 0.10; the ≥ 160 GiB tier ≥ 0.28).
    """

    since: str
    mode: SizingMode
    gpu_memory_utilization: float
    block_size: int
    startup_free_check: bool
    torch_capped: bool
    graph_estimate: bool
    reservation_is_pool: bool
    tier_70g: bool
    tier_160g: bool


def _est(since: str, gmu: float, block: int, graphs: bool, t70: bool, t160: bool) -> VersionDefaults:
    return VersionDefaults(since, "estimate", gmu, block, True, False, graphs, True, t70, t160)


#: One row per (first version, mode), oldest first. A version takes the last row of its mode
#: whose ``since`` it reaches. Sources: vllm-facts §4.2 (gmu 0.9 → 0.92 in 0.20; tiers from
#: 0.10, ≥ 160 GiB tier from 0.28; graph estimate subtracted from 0.20), §9.3 (0.34).
DEFAULTS: tuple[VersionDefaults, ...] = (
    _est("0.0", 0.9, 16, False, False, False),
    _est("0.10", 0.9, 16, False, True, False),
    _est("0.20", 0.92, 16, True, True, False),
    _est("0.28", 0.92, 16, True, True, True),
    _est("0.34", 0.92, 64, True, True, True),
    VersionDefaults("0.34", "extensible", 1.0, 64, False, True, False, False, True, True),
)


@dataclass(frozen=True)
class Resolved:
    """The defaults row an engine gets: ``defaults``; ``version`` the version used to pick it
    (the engine's, or :data:`UNKNOWN_VERSION_ASSUMED`); ``known`` False when the engine's version
    was unknown; ``assumption`` a sentence for reports when anything was assumed (else None)."""

    defaults: VersionDefaults
    version: str
    known: bool
    assumption: str | None


def defaults_for(version: str | None, mode: SizingMode | None = None) -> Resolved:
    """The :data:`DEFAULTS` row for ``version`` and ``mode``.

    ``mode`` None on 0.34+ means extensible (vLLM's default on CUDA/ROCm, stated in
    ``assumption``); before 0.34 only ``"estimate"`` exists. An unknown version gets the
    :data:`UNKNOWN_VERSION_ASSUMED` row in estimate mode, with the assumption stated."""
    known = is_known_version(version)
    used = str(version) if known and version else UNKNOWN_VERSION_ASSUMED
    notes: list[str] = []
    if not known:
        notes.append(
            f"vLLM version {'unknown' if not version else repr(str(version)[:40]) + ' not known to kvdoctor'}: "
            f"assumed {UNKNOWN_VERSION_ASSUMED}'s defaults (gmu 0.92, block 16)"
        )
    v = version_tuple(used, 2) or (0, 0)
    if v < V034:
        mode = "estimate"
    elif mode is None:
        mode = "extensible"
        notes.append("vLLM ≥ 0.34 on CUDA/ROCm: assumed the extensible KV cache (its default)")
    row = DEFAULTS[0]
    for r in DEFAULTS:
        if r.mode == mode and v >= (version_tuple(r.since, 2) or (0, 0)):
            row = r
    return Resolved(row, used, known, "; ".join(notes) or None)


def default_gpu_memory_utilization(version: str | None, mode: SizingMode | None = None) -> float:
    """What an unset ``--gpu-memory-utilization`` resolves to: 0.9 before 0.20, 0.92 after; on
    0.34 1.0 with the extensible KV cache (the default, also for ``mode`` None) and 0.92
    without (``config/cache.py:494-501``). Unknown version → 0.92 (0.33, assumed)."""
    return defaults_for(version, mode).defaults.gpu_memory_utilization


def default_block_size(version: str | None) -> int:
    """Tokens per KV block with no ``--block-size`` before the backend's preference: 16 up to
    0.33, 64 from 0.34 (both modes, ``config/cache.py:185``). Unknown version → 16 (assumed)."""
    return defaults_for(version, "estimate").defaults.block_size


_GIB = 2**30


def _big_class(total: int, name: str) -> bool:
    up = name.upper()
    return total >= 70 * _GIB and "A100" not in up and "GB10" not in up


def default_max_num_seqs(
    version: str | None, gpu_total_bytes: int | None, gpu_name: str | None = None
) -> int:
    """vLLM's device default for ``--max-num-seqs`` (vllm-facts §4.2, §9.3 unchanged in 0.34):
    1024 on a ≥ 160 GiB device (≥ 0.28) or an H100/H200-class one (≥ 70 GiB, not A100/GB10),
    else 256; 256 before 0.10 and on an unknown device. Unknown version → 0.33 (assumed)."""
    d = defaults_for(version).defaults
    if not d.tier_70g or not gpu_total_bytes:
        return 256
    huge = d.tier_160g and gpu_total_bytes >= 160 * _GIB
    return 1024 if (huge or _big_class(gpu_total_bytes, gpu_name or "")) else 256


def default_max_num_batched_tokens(
    version: str | None, gpu_total_bytes: int | None, gpu_name: str | None = None, server: bool = True
) -> int:
    """vLLM's device default for ``--max-num-batched-tokens`` with chunked prefill (vllm-facts
    §4.2, unchanged in 0.34): ≥ 160 GiB (≥ 0.28) 16384; H100/H200-class 8192 for ``vllm serve``
    (16384 for ``LLM``); otherwise 2048 (8192 for ``LLM``); the small tier before 0.10 and on an
    unknown device. Unknown version → 0.33 (assumed)."""
    small = 2048 if server else 8192
    d = defaults_for(version).defaults
    if not d.tier_70g or not gpu_total_bytes:
        return small
    if d.tier_160g and gpu_total_bytes >= 160 * _GIB:
        return 16384
    if _big_class(gpu_total_bytes, gpu_name or ""):
        return 8192 if server else 16384
    return small


# --------------------------------------------------------------------------- sizing mode

#: Launch settings that turn the extensible KV cache off on 0.34 (vllm-facts §9.1 table), as
#: EngineConfig / ``non-default args`` dest names.
EXTENSIBLE_OFF_FLAGS: dict[str, str] = {
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes overrides measured sizing",
    "num_gpu_blocks_override": "--num-gpu-blocks-override overrides measured sizing",
    "enable_elastic_ep": "--enable-elastic-ep skips warm-up",
}
#: KV connectors that share the cache through legacy CUDA IPC (vllm-facts §9.1).
EXTENSIBLE_OFF_CONNECTORS = ("LMCacheMPConnector",)


@dataclass(frozen=True)
class ModeDecision:
    """How an engine sized its KV cache: ``mode`` ("extensible" / "estimate"), ``source`` the
    evidence in words ("log: 'Memory after warmup'", "--no-enable-extensible-kv-cache", …),
    ``assumed`` True when no evidence decided it (the version's default was taken), and
    ``configured`` the ``cache_config_info{enable_extensible_kv_cache}`` label (True/False/None),
    which is the frontend's config-time value, not proof it ran."""

    mode: SizingMode
    source: str
    assumed: bool
    configured: bool | None = None


def _truthy(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    return None


def decide_sizing_mode(
    version: str | None,
    *,
    log_ran_extensible: bool | None = None,
    log_disabled_reason: str | None = None,
    args: dict[str, Any] | None = None,
    label: str | None = None,
    platform: str | None = None,
) -> ModeDecision | None:
    """The sizing mode as spec/vllm-0.34.md §1 decides it, or None for an engine that is not
    known to be 0.34+ (every earlier version has only the estimate mode; the caller keeps its
    0.33 reading).

    In order: the log (``log_ran_extensible`` True for ``Memory after warmup`` /
    ``Extended KV cache to``; ``log_disabled_reason`` for ``Disabling the extensible KV cache:
    …``); the launch flags in ``args`` (dest → value: ``enable_extensible_kv_cache`` False,
    ``kv_cache_memory_bytes``, ``num_gpu_blocks_override``, ``enable_elastic_ep``, a legacy-IPC
    connector in ``kv_transfer_config``); a ``platform`` other than CUDA/ROCm ("cpu", "xpu",
    "tpu"); the ``cache_config_info{enable_extensible_kv_cache}`` ``label``; else extensible,
    assumed. ``version`` None counts as 0.34 only when the label exists (it exists only from
    0.34, vllm-facts §9.8).
    """
    configured = _truthy(label)
    if not is_v034(version) and not (version is None and label is not None):
        return None
    if log_ran_extensible:
        return ModeDecision(
            "extensible", "log: 'Memory after warmup' / 'Extended KV cache to'", False, configured
        )
    if log_disabled_reason is not None:
        reason = log_disabled_reason.strip()[:200] or "no reason given"
        return ModeDecision(
            "estimate", f"log: 'Disabling the extensible KV cache: {reason}'", False, configured
        )
    args = args or {}
    if _truthy(args.get("enable_extensible_kv_cache")) is False:
        return ModeDecision("estimate", "--no-enable-extensible-kv-cache", False, configured)
    for dest, why in EXTENSIBLE_OFF_FLAGS.items():
        val = args.get(dest)
        if val is not None and val is not False and str(val).strip().lower() not in ("none", "false", ""):
            return ModeDecision("estimate", why, False, configured)
    kvt = str(args.get("kv_transfer_config") or "")
    for name in EXTENSIBLE_OFF_CONNECTORS:
        if name in kvt:
            return ModeDecision("estimate", f"{name} shares the KV cache through CUDA IPC", False, configured)
    if "custom_mem_pool" in kvt:
        return ModeDecision("estimate", "custom_mem_pool in kv_connector_extra_config", False, configured)
    if platform and platform.lower() not in ("cuda", "rocm", "gpu"):
        return ModeDecision(
            "estimate", f"platform {platform}: the extensible KV cache is CUDA/ROCm only", False, configured
        )
    if configured is not None:
        return ModeDecision(
            "extensible" if configured else "estimate",
            f'cache_config_info enable_extensible_kv_cache="{configured}" (configured; not proof it ran)',
            configured,  # "True" is the config-time value: the run-time fallback is not sent back
            configured,
        )
    return ModeDecision(
        "extensible", "assumed: vLLM ≥ 0.34 on CUDA/ROCm defaults to the extensible KV cache", True, None
    )


def resolved_gpu_memory_utilization(
    explicit: float | None, version: str | None, mode: SizingMode | None
) -> float:
    """u: the explicit ``--gpu-memory-utilization`` when given, else the default for the
    version and mode (1.0 extensible, 0.92 estimate on 0.34)."""
    if explicit is not None:
        return float(explicit)
    return default_gpu_memory_utilization(version, mode)


# --------------------------------------------------------------------------- 0.34 error texts

#: ``{U}`` of the 0.34 hints (``kv_cache_planning.py:64-96``): before / after warm-up.
HINT_SUBJECT_BEFORE = "the model and its activations"
HINT_SUBJECT_AFTER = "the model, its activations, CUDA graphs and warmup"
#: ``{G}`` after warm-up.
HINT_GRAPHS_AFTER = " CUDA graphs take less with fewer or smaller capture sizes in the compilation config."
#: H1, the non-extensible hint (identical to 0.33's wording).
HINT_H1 = (
    "Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls "
    "CPU memory reservation on the CPU backend, despite its name)."
)


def _py_float(x: float) -> str:
    return repr(float(x))


def kv_memory_hint(mode: SizingMode, gmu: float, *, after_warmup: bool = False) -> str:
    """vLLM 0.34's "more KV cache memory" hint (``_more_kv_cache_memory_hint``, vllm-facts §9.4):
    H1 in estimate mode; H2 extensible with gmu < 1.0; H3 extensible at 1.0. ``after_warmup``
    picks the ``{U}``/``{G}`` parts of the check after CUDA-graph capture."""
    if mode != "extensible":
        return HINT_H1
    subject = HINT_SUBJECT_AFTER if after_warmup else HINT_SUBJECT_BEFORE
    graphs = HINT_GRAPHS_AFTER if after_warmup else ""
    if gmu < 1.0:
        return (
            f"The KV cache gets what is left after {subject} within `gpu_memory_utilization`={_py_float(gmu)}; "
            "increase it (with the extensible KV cache it defaults to 1.0) or decrease `max_model_len` or "
            f"`max_num_seqs`.{graphs}"
        )
    return (
        f"The extensible KV cache already takes all device memory left after {subject}; decrease "
        f"`max_model_len` or `max_num_seqs`, or the model needs a device with more memory.{graphs}"
    )


def classify_kv_hint(text: str) -> tuple[str, bool | None, float | None] | None:
    """Which hint a vLLM error text carries: ("H1"|"H2"|"H3", after_warmup, gmu) — after_warmup
    None for H1 (it has no phase), gmu only for H2 — or None when it carries none. Bounded: reads
    the first 4096 characters with substring tests and one anchored, bounded pattern."""
    t = text[:4096]
    if "Try increasing `gpu_memory_utilization` when initializing the engine" in t:
        return ("H1", None, None)
    after = HINT_SUBJECT_AFTER in t
    if "The extensible KV cache already takes all device memory left after" in t:
        return ("H3", after, None)
    if "The KV cache gets what is left after" in t:
        m = _H2_GMU.search(t)
        return ("H2", after, float(m.group(1)) if m else None)
    return None


_H2_GMU = re.compile(r"within `gpu_memory_utilization`=(\d{1,3}(?:\.\d{1,12})?)")
