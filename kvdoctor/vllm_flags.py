"""vLLM's engine flags: the one place that knows their names, aliases, types and per-version
defaults (reference/vllm-facts.md §4.2, §4.1, §3.2).

Everything that reads a launch command (``sources/cmdline.py``), a ``non-default args`` dict or a
``Namespace(...)`` repr (``sources/vllm_log.py``), or an ``engine-args.json`` goes through
:data:`FLAGS` and :func:`convert_value`, so a flag's spelling and units are decided once.

Value kinds (``Flag.kind``):

- ``int`` / ``float`` / ``str`` — plain argparse types.
- ``tokens`` — vLLM's ``human_readable_int`` (``--max-model-len 1k`` = 1000, ``1K`` = 1024,
  ``25.6k`` = 25600; decimals are refused with binary suffixes). ``--max-model-len`` also takes
  ``auto``/``-1`` = auto-fit (≥0.14, ``config/model.py:249-262``), kept as -1.
- ``size`` — bytes, the same parser: ``--kv-cache-memory-bytes 8G`` = 8·2^30, ``8g`` = 8·10^9,
  ``1.5g`` = 1.5·10^9; ``8GiB`` is rejected as vLLM does (``engine/arg_utils.py:396-409``).
- ``bool`` — a switch; ``--no-X`` negates it (argparse ``BooleanOptionalAction``), and
  ``--disable-prefix-caching``/``--disable-chunked-prefill`` are spelled as negations of
  ``enable_prefix_caching``/``enable_chunked_prefill``.
- ``list`` — ``nargs='+'`` (``--served-model-name a b``), kept as a list of strings.
- ``json`` — a JSON/dict argument (``--limit-mm-per-prompt '{"image": 2}'``), parsed when it is
  JSON, else kept as the string.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdoctor import vllm_defaults
from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import EngineConfig
from kvdoctor.lazyre import lazy_re
from kvdoctor.redact import MARK, is_secret_name, redact_text
from kvdoctor.units import MAX_INT64, in_range
from kvdoctor.vllm_defaults import SizingMode, Version
from kvdoctor.vllm_defaults import parse_version as parse_version  # the one parser, re-exported
from kvdoctor.vllm_defaults import version_tuple as version_tuple


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class Flag:
    """One vLLM engine/server flag.

    ``dest`` is vLLM's argparse dest (the key in ``non-default args``); ``names`` its option
    strings, the canonical ``--long-name`` first, then aliases (``-tp``); ``field`` the
    :class:`~kvdoctor.facts.EngineConfig` field it fills (None: kept only in ``EngineConfig.args``);
    ``added_in``/``removed_in`` the first vLLM version with / without it (vllm-facts §4.2).
    """

    dest: str
    names: tuple[str, ...]
    kind: str = "str"
    field: str | None = None
    added_in: str | None = None
    removed_in: str | None = None
    #: extra option strings that set a bool flag to False (``--disable-prefix-caching``).
    negative_names: tuple[str, ...] = ()
    doc: str = ""

    @property
    def cli(self) -> str:
        """The canonical spelling, e.g. ``--max-model-len``."""
        return self.names[0]


def _f(dest: str, *aliases: str, **kw: Any) -> Flag:
    return Flag(dest=dest, names=("--" + dest.replace("_", "-"), *aliases), **kw)


#: Every flag kvdoctor knows, memory/scheduling/metrics ones with their EngineConfig field
#: (vllm-facts §4.2). Others are listed so that argparse-style prefix abbreviation is ambiguous
#: where vLLM's would be (``--kv-cache`` could be several flags).
FLAGS: tuple[Flag, ...] = (
    # model and serving identity
    _f("model", kind="str", field="model"),
    _f("served_model_name", kind="list", field="served_model_name"),
    _f("tokenizer"),
    _f("tokenizer_mode"),
    _f("revision"),
    _f("trust_remote_code", kind="bool"),
    _f("download_dir"),
    _f("load_format"),
    _f("config_format"),
    _f("hf_overrides", kind="json"),
    _f("hf_token", doc="secret; nargs='?' (bare switch means use the cached token)"),
    _f("seed", kind="int"),
    _f("task", kind="str", field="task", doc="generate/embed/…; superseded by --runner/--convert"),
    _f("runner", kind="str", field="task"),
    _f("convert"),
    _f("model_impl"),
    _f("generation_config"),
    # parallelism
    _f("tensor_parallel_size", "-tp", kind="int", field="tensor_parallel_size"),
    _f("pipeline_parallel_size", "-pp", kind="int", field="pipeline_parallel_size"),
    _f("data_parallel_size", "-dp", kind="int", field="data_parallel_size"),
    _f("data_parallel_size_local", "-dpl", kind="int"),
    _f("data_parallel_rank", "-dpn", kind="int"),
    _f("data_parallel_address", "-dpa"),
    _f("data_parallel_rpc_port", "-dpp", kind="int"),
    _f("decode_context_parallel_size", "-dcp", kind="int"),
    _f("enable_expert_parallel", "-ep", kind="bool"),
    _f("distributed_executor_backend"),
    _f("headless", kind="bool"),
    _f("api_server_count", "-asc", kind="int", doc=">1 switches on Prometheus multiprocess mode"),
    _f("worker_use_ray", kind="bool", removed_in="0.7"),
    _f("engine_use_ray", kind="bool", removed_in="0.6"),
    # memory and KV cache
    _f("gpu_memory_utilization", "--device-memory-utilization", kind="float", field="gpu_memory_utilization"),
    _f("max_model_len", kind="tokens", field="max_model_len"),
    _f("kv_cache_dtype", kind="str", field="kv_cache_dtype"),
    _f("block_size", kind="int", field="block_size"),
    _f("dtype", kind="str", field="dtype"),
    _f("quantization", "-q", kind="str", field="quantization"),
    _f("enforce_eager", kind="bool", field="enforce_eager"),
    _f("kv_cache_memory_bytes", kind="size", field="kv_cache_memory_bytes", added_in="0.10.2"),
    _f("num_gpu_blocks_override", kind="int", field="num_gpu_blocks_override"),
    _f("cpu_offload_gb", kind="float", field="cpu_offload_gb"),
    _f("swap_space", kind="float", field="swap_space_gib", removed_in="0.18"),
    _f("kv_offloading_size", kind="float", added_in="0.13"),
    _f("kv_offloading_backend", added_in="0.13"),
    _f("calculate_kv_scales", kind="bool", removed_in="0.28"),
    _f("disable_hybrid_kv_cache_manager", kind="bool"),
    _f("disable_sliding_window", kind="bool"),
    _f("max_seq_len_to_capture", kind="int"),
    _f("max_context_len_to_capture", kind="int", removed_in="0.6"),
    _f("max_cudagraph_capture_size", kind="int"),
    _f("cuda_graph_sizes", kind="list"),
    _f("compilation_config", "-O", "-cc", kind="json"),
    _f("mm_processor_cache_gb", kind="float"),
    _f("limit_mm_per_prompt", kind="json"),
    _f("mm_processor_kwargs", kind="json"),
    _f("kv_transfer_config", kind="json"),
    _f("speculative_config", "-sc", kind="json"),
    _f("enable_sleep_mode", kind="bool"),
    # catalogue 2 (spec/rules-catalogue2.md §4.4)
    _f("sleep_mode_offload_cudagraph", kind="bool", added_in="0.32"),
    _f("enable_nccl_comm_suspend", kind="bool", added_in="0.30"),
    _f("attention_backend", kind="str", added_in="0.13"),
    # vLLM 0.34 (reference/vllm-facts.md §9.1, §9.7): kept in args, read by the sizing-mode decision
    _f("enable_extensible_kv_cache", kind="bool", added_in="0.34"),
    _f("enable_elastic_ep", kind="bool"),
    _f("checkpoint_prepare_on_startup", kind="bool", added_in="0.34"),
    _f("data_parallel_external_lb", kind="bool"),
    _f("data_parallel_hybrid_lb", kind="bool"),
    _f("aggregate_engine_logging", kind="bool"),
    _f("max_parallel_loading_workers", kind="int"),
    # scheduling
    _f("max_num_seqs", kind="int", field="max_num_seqs"),
    _f("max_num_batched_tokens", kind="tokens", field="max_num_batched_tokens"),
    _f(
        "enable_prefix_caching",
        kind="bool",
        field="enable_prefix_caching",
        negative_names=("--disable-prefix-caching",),
    ),
    _f(
        "enable_chunked_prefill",
        kind="bool",
        field="enable_chunked_prefill",
        negative_names=("--disable-chunked-prefill",),
    ),
    _f("max_num_partial_prefills", kind="int", removed_in="0.27"),
    _f("max_long_partial_prefills", kind="int"),
    _f("long_prefill_token_threshold", kind="int"),
    _f("scheduling_policy"),
    _f("preemption_mode", removed_in="0.11"),
    _f("num_scheduler_steps", kind="int", removed_in="0.11"),
    _f("use_v2_block_manager", kind="bool", removed_in="0.11"),
    _f("num_lookahead_slots", kind="int"),
    _f("async_scheduling", kind="bool"),
    _f("performance_mode", doc="'throughput' doubles unset max_num_seqs defaults"),
    # LoRA
    _f("enable_lora", kind="bool"),
    _f("max_loras", kind="int"),
    _f("max_lora_rank", kind="int"),
    _f("max_cpu_loras", kind="int"),
    _f("lora_modules", kind="list"),
    # server
    _f("host", kind="str", field="host"),
    _f("port", kind="int", field="port"),
    _f("api_key", kind="list", doc="secret, always redacted; a list of keys in recent vLLM"),
    _f("ssl_keyfile"),
    _f("ssl_certfile"),
    _f("root_path"),
    _f("allowed_origins", kind="json"),
    _f("middleware", kind="list"),
    _f("uvicorn_log_level"),
    _f("disable_uvicorn_access_log", kind="bool"),
    _f("disable_frontend_multiprocessing", kind="bool"),
    _f("chat_template"),
    _f("response_role"),
    _f("enable_auto_tool_choice", kind="bool"),
    _f("tool_call_parser"),
    _f("reasoning_parser"),
    _f("enable_server_load_tracking", kind="bool"),
    _f("enable_prompt_tokens_details", kind="bool"),
    _f("enable_request_id_headers", kind="bool"),
    _f("config", doc="a YAML file of flags; see sources/cmdline.py"),
    # logging and metrics
    _f("disable_log_stats", kind="bool", doc="no vllm: metrics and no periodic stats line"),
    _f("disable_log_requests", kind="bool"),
    _f("enable_log_requests", kind="bool"),
    _f("max_log_len", kind="int"),
    _f("show_hidden_metrics_for_version"),
    _f("kv_cache_metrics", kind="bool"),
    _f("kv_cache_metrics_sample", kind="float"),
    _f("enable_mfu_metrics", kind="bool"),
    _f("custom_histogram_buckets", kind="json"),
    _f("otlp_traces_endpoint"),
    _f("collect_detailed_traces"),
)

_BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
# Option string → (flag, value a bare switch sets); bool flags get their --no-X too.
_OPTIONS: dict[str, tuple[Flag, bool]] = {}
for _flag in FLAGS:
    for _name in _flag.names:
        _OPTIONS[_name] = (_flag, True)
    if _flag.kind == "bool":
        _OPTIONS["--no-" + _flag.names[0][2:]] = (_flag, False)
        for _name in _flag.negative_names:
            _OPTIONS[_name] = (_flag, False)
_LONG_OPTIONS = sorted(o for o in _OPTIONS if o.startswith("--"))

# Dest names other readers use for the same thing ("model_tag" is vllm serve's positional).
_DEST_ALIASES = {
    "model_tag": "model",
    "device_memory_utilization": "gpu_memory_utilization",
    "swap_space_gib": "swap_space",
    "cache_dtype": "kv_cache_dtype",
    "max_seq_len": "max_model_len",
}


class FlagError(ValueError):
    """A flag name or value vLLM would reject (ambiguous abbreviation, bad number)."""


def flag_for_dest(dest: str) -> Flag | None:
    """The :class:`Flag` for a vLLM dest name (``max_model_len``; also ``max-model-len``,
    ``model_tag`` → model), or None when kvdoctor does not know it."""
    key = dest.strip().lstrip("-").replace("-", "_").lower()
    key = _DEST_ALIASES.get(key, key)
    return _BY_DEST.get(key)


def canonical_dest(dest: str) -> str:
    """vLLM's dest spelling for a name: ``--max-model-len``/``max-model-len`` → ``max_model_len``;
    known aliases resolved (``model_tag`` → ``model``)."""
    flag = flag_for_dest(dest)
    if flag is not None:
        return flag.dest
    return dest.strip().lstrip("-").replace("-", "_")


def lookup_option(option: str) -> tuple[Flag, bool] | None:
    """Resolve an option string from a command line to ``(flag, switch_value)``.

    Like vLLM's ``FlexibleArgumentParser``: underscores in a long name become dashes
    (``--max_model_len``), an exact name or alias wins (``-tp``, ``--device-memory-utilization``,
    ``--no-enforce-eager``, ``--disable-prefix-caching``), else a unique prefix of a long option
    (argparse ``allow_abbrev``: ``--kv-cache-memory`` → ``--kv-cache-memory-bytes``).
    ``switch_value`` is what a bare bool switch sets (False for ``--no-X``/``--disable-X``).
    Returns None for an unknown option. Raises :class:`FlagError` for an ambiguous prefix.
    """
    name = option
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    hit = _OPTIONS.get(name)
    if hit is not None:
        return hit
    if not name.startswith("--") or len(name) < 3:
        return None
    matches = [o for o in _LONG_OPTIONS if o.startswith(name)]
    distinct = {(_OPTIONS[o][0].dest, _OPTIONS[o][1]) for o in matches}
    if len(distinct) == 1:
        return _OPTIONS[matches[0]]
    if len(distinct) > 1:
        raise FlagError(f"ambiguous option: {option} could match {', '.join(matches)}")
    return None


_HUMAN_INT = lazy_re(r"(\d{1,20}(?:\.\d{1,20})?)([kKmMgGtT])")
_DECIMAL_MULT = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_MULT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str) -> int:
    """vLLM's ``human_readable_int``: ``"1k"`` → 1000, ``"1K"`` → 1024, ``"25.6k"`` → 25600,
    ``"8G"`` → 8·2^30, ``"1.5g"`` → 1500000000, ``"4096"`` → 4096.

    Raises :class:`FlagError` for anything else (``"8GiB"``, ``"1.5K"``, ``"abc"``).
    """
    value = text.strip()
    m = _HUMAN_INT.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL_MULT:
            return int(float(number) * _DECIMAL_MULT[suffix])
        if "." in number:
            raise FlagError(
                f"{text!r}: decimals are not allowed with binary suffixes like {suffix}; "
                f"did you mean {number}{suffix.lower()}?"
            )
        return int(number) * _BINARY_MULT[suffix]
    try:
        return int(value)
    except ValueError:
        raise FlagError(f"{text!r} is not an integer (vLLM accepts e.g. 8192, 8k, 8K, 1.5g)") from None


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", "none"}


def convert_value(flag: Flag, value: Any) -> Any:
    """Convert a raw value (a command-line string, or an already-typed value from a log's
    ``non-default args`` dict / YAML config) to the flag's Python type.

    ``tokens``/``size`` → int (see module docstring; ``max_model_len`` ``auto`` → -1); ``int`` →
    int; ``float`` → float; ``bool`` → bool (``"true"``/``"false"``…); ``list`` → list[str];
    ``json`` → parsed JSON when it is JSON, else the string; ``str`` → str. ``None`` stays None.
    Raises :class:`FlagError` naming the flag when the value cannot be converted.
    """
    if value is None:
        return None
    out = _convert(flag, value)
    if isinstance(out, (int, float)) and not isinstance(out, bool) and not in_range(out, MAX_INT64):
        # "inf", "nan", "1e400", a 400-digit int: no flag of vLLM's takes such a value (a
        # --seed may be any 64-bit one); reading it as a number would overflow later arithmetic
        raise FlagError(f"{flag.cli}: out of range")
    return out


def _convert(flag: Flag, value: Any) -> Any:
    try:
        if flag.kind in ("tokens", "size"):
            if isinstance(value, bool):
                raise FlagError(f"{value!r} is not an integer")
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            text = str(value).strip()
            if flag.dest == "max_model_len" and text.lower() == "auto":
                return -1
            return parse_human_int(text)
        if flag.kind == "int":
            if isinstance(value, bool):
                raise FlagError(f"{value!r} is not an integer")
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            return int(str(value).strip())
        if flag.kind == "float":
            if isinstance(value, bool):
                raise FlagError(f"{value!r} is not a number")
            return float(value)
        if flag.kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise FlagError(f"{value!r} is not true/false")
        if flag.kind == "list":
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            return [str(value)]
        if flag.kind == "json":
            if isinstance(value, str):
                try:
                    return json.loads(value)
                except ValueError:
                    return value
            return value
        return value if isinstance(value, str) else str(value)
    except FlagError as e:
        raise FlagError(f"{flag.cli}: {e}") from None
    except (TypeError, ValueError):
        raise FlagError(f"{flag.cli}: {value!r} is not a valid {flag.kind}") from None


# --------------------------------------------------------------------------- args → EngineConfig


def _redact_value(dest: str, value: Any) -> Any:
    if is_secret_name(dest) and value not in (None, True, False, ""):
        return MARK
    if isinstance(value, str):
        return redact_text(value)
    return value


#: physical ranges of vLLM flag values (dest → (low, high, low exclusive)); outside them a value
#: is an input error, never a fact (gmu 1.5, 10**9 GPUs).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "gpu_memory_utilization": (0.0, 1.0, True),
    "tensor_parallel_size": (1, 4096, False),
    "pipeline_parallel_size": (1, 4096, False),
    "data_parallel_size": (1, 4096, False),
    "max_model_len": (-1, 10**9, False),  # -1: auto-fit
    "max_num_seqs": (1, 10**7, False),
    "max_num_batched_tokens": (1, 10**10, False),
    "block_size": (1, 65_536, False),
    "swap_space": (0, 10**6, False),
    "kv_cache_memory_bytes": (1, 2**50, False),
    "num_gpu_blocks_override": (0, 10**9, False),
}


def out_of_range(dest: str, value: Any) -> str | None:
    """A reason when a flag's converted value is outside its physical range, else None."""
    r = _RANGES.get(dest)
    if r is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    low, high, exclusive = r
    if value != value or (value <= low if exclusive else value < low) or value > high:
        lo = f"({low:g}" if exclusive else f"[{low:g}"
        return f"--{dest.replace('_', '-')} out of range {lo}, {high:g}]"
    return None


def update_config_from_args(cfg: EngineConfig, args: Mapping[str, Any], *, explicit: bool) -> EngineConfig:
    """Merge vLLM args (dest name → value) into ``cfg`` in place and return it (``cfg`` must be
    the caller's own object: derive passes a fresh one, never a fact).

    Re-exported by ``kvdoctor.sources.cmdline``, which parses command lines with it.

    ``args`` is a ``non-default args`` dict, a parsed ``Namespace(...)``, an
    ``engine-args.json``/``.yaml`` mapping or a parsed command line: keys are vLLM dest names
    (``max_model_len``; ``max-model-len`` and ``model_tag`` are understood), values either
    strings (converted as the command line would) or typed values. Known flags fill their
    :class:`EngineConfig` field (``swap_space`` → ``swap_space_gib``; ``runner``/``task`` →
    ``task``; ``served_model_name`` list → its first name; ``model_tag`` only when no ``model``);
    every key also lands in ``cfg.args`` under its canonical dest, secrets redacted. A ``None``
    value never clears a field. With ``explicit=True`` (command line, config file, non-default
    args) the names are added to ``cfg.explicit`` (the field name for known flags, else the dest).
    A value that cannot be converted is kept in ``cfg.args`` only. Never raises.
    """
    has_model = any(canonical_dest(str(k)) == "model" and str(k) != "model_tag" for k in args)
    for key, value in args.items():
        key = str(key)
        if key.startswith("_"):
            cfg.args[key] = value
            continue
        dest = canonical_dest(key)
        flag = flag_for_dest(key)
        if key == "model_tag" and has_model:
            continue
        cfg.args[dest] = _redact_value(dest, value)
        if flag is None or flag.field is None or value is None:
            if explicit and value is not None:
                cfg.explicit.add(dest)
            continue
        try:
            conv = convert_value(flag, value)
        except FlagError:
            continue
        if out_of_range(flag.dest, conv) is not None:
            continue  # kept in cfg.args only: never a field a rule reads
        if flag.dest == "served_model_name":
            conv = conv[0] if conv else None
        if conv is None:
            continue
        setattr(cfg, flag.field, conv)
        if explicit:
            cfg.explicit.add(flag.field)
    return cfg


# --------------------------------------------------------------------------- versions


def _at_least(version: Version | None, ref: str) -> bool:
    """True when ``version`` ≥ ``ref``; unknown versions count as current (True)."""
    if version is None:
        return True
    ref_v = parse_version(ref) or (0,)
    return version >= ref_v


def default_gpu_memory_utilization(version: str | None, mode: SizingMode | None = None) -> float:
    """vLLM's default ``--gpu-memory-utilization``: 0.92 from 0.20, 0.9 up to 0.19; on 0.34 1.0
    with the extensible KV cache (``mode`` None on 0.34 = extensible, its default) and 0.92
    without (vllm-facts §4.2, §9.3). Unknown version → 0.92 (0.33 assumed): the table is
    :data:`kvdoctor.vllm_defaults.DEFAULTS`."""
    return vllm_defaults.default_gpu_memory_utilization(version, mode)


def default_max_num_seqs(
    version: str | None, gpu_total_bytes: int | None, gpu_name: str | None = None
) -> int:
    """vLLM's device default for ``--max-num-seqs`` (vllm-facts §4.2, ``arg_utils.py``):
    1024 on a ≥160 GiB device or an H100/H200-class one (≥70 GiB, not A100/GB10), else 256;
    256 before 0.10 (and on an unknown device). ``version`` None means 0.33 (assumed).
    The one copy of this default (:func:`kvdoctor.vllm_defaults.default_max_num_seqs`):
    ``plan`` and ``diagnose`` (derive) both call it."""
    return vllm_defaults.default_max_num_seqs(version, gpu_total_bytes, gpu_name)


def default_max_num_batched_tokens(
    version: str | None, gpu_total_bytes: int | None, gpu_name: str | None = None, server: bool = True
) -> int:
    """vLLM's device default for ``--max-num-batched-tokens`` with chunked prefill on (vllm-facts
    §4.2): on a ≥160 GiB device (≥0.28) 16384; on an H100/H200-class one (≥70 GiB, not
    A100/GB10) 8192 for ``vllm serve`` (16384 for ``LLM``); otherwise 2048 (8192 for ``LLM``).
    2048 / 8192 before 0.10 and on an unknown device (memory read as 0: the small tier).
    :func:`kvdoctor.vllm_defaults.default_max_num_batched_tokens`."""
    return vllm_defaults.default_max_num_batched_tokens(version, gpu_total_bytes, gpu_name, server)


def flag_available(dest: str, version: str | None) -> bool:
    """Whether vLLM ``version`` has the flag (``swap_space`` is gone from 0.18,
    ``max_num_partial_prefills`` from 0.27, ``calculate_kv_scales`` from 0.28;
    ``kv_cache_memory_bytes`` arrived in 0.10.2). Unknown flags and versions → True."""
    flag = flag_for_dest(dest)
    v = parse_version(version)
    if flag is None or v is None:
        return True
    if flag.added_in and not _at_least(v, flag.added_in):
        return False
    return not (flag.removed_in and _at_least(v, flag.removed_in))


def unavailable_flags(cfg: EngineConfig, version: str | None) -> list[str]:
    """CLI spellings of the flags ``cfg`` sets that vLLM ``version`` does not have
    (``--swap-space`` on 0.18+), in ``cfg.args`` order."""
    out = []
    for dest in cfg.args:
        flag = flag_for_dest(dest)
        if flag is not None and not flag_available(flag.dest, version):
            out.append(flag.cli)
    return out


_NON_GENERATE_TASKS = {"embed", "embedding", "pooling", "classify", "score", "reward"}


def apply_defaults(cfg: EngineConfig, version: str | None, mode: SizingMode | None = None) -> EngineConfig:
    """Return a copy of ``cfg`` with vLLM's defaults for ``version`` filled into every field the
    user did not set (``cfg.explicit``). ``version`` None (or unknown) means 0.33, assumed.
    ``mode`` is the KV sizing mode of a 0.34 engine (:func:`kvdoctor.vllm_defaults.decide_sizing_mode`;
    None = extensible, 0.34's default); earlier versions have only the estimate mode.

    Defaults (vllm-facts §4.2, §9.3; the table is :data:`kvdoctor.vllm_defaults.DEFAULTS`):
    gpu_memory_utilization 0.92 (0.9 before 0.20; on 0.34 1.0 extensible, 0.92 estimate);
    block_size 16 (64 from 0.34);
    swap_space_gib 4 up to 0.17, None after (removed in 0.18); cpu_offload_gb 0; dtype "auto";
    kv_cache_dtype "auto"; port 8000; from 0.8 (V1) prefix caching and chunked prefill on for
    generate models; before 0.8 (V0) prefix caching off and max_num_seqs 256. max_num_seqs and
    max_num_batched_tokens from 0.8 depend on the device and stay None. ``vllm_version`` is set
    when it was None.
    """
    v = parse_version(version)
    new = dataclasses.replace(cfg, explicit=set(cfg.explicit), args=dict(cfg.args))
    ex = new.explicit
    if "gpu_memory_utilization" not in ex:
        new.gpu_memory_utilization = default_gpu_memory_utilization(version, mode)
    if "block_size" not in ex and new.block_size is None:
        new.block_size = vllm_defaults.default_block_size(version)
    if "swap_space_gib" not in ex:
        new.swap_space_gib = None if _at_least(v, "0.18") else 4.0
    if "cpu_offload_gb" not in ex and new.cpu_offload_gb is None:
        new.cpu_offload_gb = 0.0
    if "dtype" not in ex and new.dtype is None:
        new.dtype = "auto"
    if "kv_cache_dtype" not in ex and not new.kv_cache_dtype:
        new.kv_cache_dtype = "auto"
    if "port" not in ex and new.port is None:
        new.port = 8000
    generate = (new.task or "generate").lower() not in _NON_GENERATE_TASKS
    if _at_least(v, "0.8"):
        if "enable_prefix_caching" not in ex and new.enable_prefix_caching is None:
            new.enable_prefix_caching = generate
        if "enable_chunked_prefill" not in ex and new.enable_chunked_prefill is None:
            new.enable_chunked_prefill = generate
    else:
        if "enable_prefix_caching" not in ex and new.enable_prefix_caching is None:
            new.enable_prefix_caching = False
        if "max_num_seqs" not in ex and new.max_num_seqs is None:
            new.max_num_seqs = 256
    if new.vllm_version is None and version:
        new.vllm_version = version
    return new


# --------------------------------------------------------------------------- --kv-cache-dtype

# (first version, values added) — vllm-facts §4.1. Versions before 0.8 were not checked; they are
# given the 0.8 set. The octave_* values are in 0.33's KV_CACHE_DTYPES but in no row of the
# history table, so they are placed at 0.33.
_KV_DTYPE_HISTORY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.0", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    ("0.10", ("fp8_inc",)),
    ("0.11", ("bfloat16",)),
    ("0.12", ("fp8_ds_mla",)),
    ("0.18", ("float16",)),
    (
        "0.20",
        (
            "turboquant_k8v4",
            "turboquant_4bit_nc",
            "turboquant_k3v4_nc",
            "turboquant_3bit_nc",
            "int8_per_token_head",
            "fp8_per_token_head",
            "nvfp4",
        ),
    ),
    ("0.28", ("int4_per_token_head", "nvfp4_4over6")),
    ("0.30", ("nvfp4_ds_mla",)),
    ("0.32", ("ultraquant_4bit",)),
    ("0.33", ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")),
)


def valid_kv_cache_dtypes(version: str | None) -> list[str]:
    """The ``--kv-cache-dtype`` values vLLM ``version`` accepts (vllm-facts §4.1 table), in the
    order they were added. Unknown version → the 0.33 list. Plain ``int8`` is never valid."""
    v = parse_version(version)
    out: list[str] = []
    for since, values in _KV_DTYPE_HISTORY:
        if _at_least(v, since):
            out.extend(values)
    return out


# Common wrong spellings → preferred answers, best first; the first valid for the version wins.
_KV_DTYPE_NEAREST: dict[str, tuple[str, ...]] = {
    "int8": ("int8_per_token_head", "fp8"),
    "i8": ("int8_per_token_head", "fp8"),
    "int8_kv": ("int8_per_token_head", "fp8"),
    "int4": ("int4_per_token_head", "int8_per_token_head", "fp8"),
    "fp16": ("float16", "auto"),
    "half": ("float16", "auto"),
    "float16": ("float16", "auto"),
    "bf16": ("bfloat16", "auto"),
    "bfloat16": ("bfloat16", "auto"),
    "fp32": ("auto",),
    "float32": ("auto",),
    "float": ("auto",),
    "fp8e4m3": ("fp8_e4m3", "fp8"),
    "e4m3": ("fp8_e4m3", "fp8"),
    "fp8_e4m3fn": ("fp8_e4m3", "fp8"),
    "float8_e4m3fn": ("fp8_e4m3", "fp8"),
    "fp8e5m2": ("fp8_e5m2", "fp8"),
    "e5m2": ("fp8_e5m2", "fp8"),
    "float8_e5m2": ("fp8_e5m2", "fp8"),
    "float8": ("fp8",),
    "fp4": ("nvfp4", "fp8"),
    "nvfp4": ("nvfp4", "fp8"),
    "fp8_per_token_head": ("fp8_per_token_head", "fp8"),
    "int8_per_token_head": ("int8_per_token_head", "fp8"),
    "int4_per_token_head": ("int4_per_token_head", "int8_per_token_head", "fp8"),
}


def nearest_valid_kv_cache_dtype(value: str, version: str | None) -> str:
    """The valid ``--kv-cache-dtype`` for ``version`` closest to what the user wrote.

    A valid value is returned as is. ``"int8"`` → ``"int8_per_token_head"`` from 0.20, ``"fp8"``
    before; ``"fp16"`` → ``"float16"`` from 0.18, ``"auto"`` before; ``"fp8e4m3"`` →
    ``"fp8_e4m3"``; otherwise the closest spelling (difflib) or ``"auto"``. An unknown
    ``version`` (None) gets a value every version accepts (``"int8"`` → ``"fp8"``): a suggestion
    must not be one an older vLLM rejects.
    """
    valid = valid_kv_cache_dtypes(version if version else "0.0")
    norm = str(value).strip().lower().replace("-", "_")
    if norm in valid:
        return norm
    for cand in _KV_DTYPE_NEAREST.get(norm, ()):
        if cand in valid:
            return cand
    import difflib  # a rejected value only

    close = difflib.get_close_matches(norm, valid, n=1, cutoff=0.75)
    return close[0] if close else "auto"
