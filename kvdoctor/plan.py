"""``kvdoctor plan``: KV-cache capacity planning that agrees with vLLM to the block.

A face of :mod:`kvdoctor.kvmath` (no arithmetic of its own): resolve the model (config.json,
local directory, Hugging Face cache, or the built-in catalogue) and the GPU, estimate the memory
vLLM would leave for the KV cache (or take ``--kv-cache-memory-bytes``), then report pages,
blocks, capacity, concurrency, whether one ``--max-model-len`` request fits, the flags that fit,
and a grid over TP × KV dtype. Exit 0 when it fits, 2 when not even one request of
max_model_len fits, 3 for bad input (spec/report.md exit codes).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvdoctor import catalog, kvmath, vllm_defaults
from kvdoctor.facts import ModelArch, SourceError
from kvdoctor.sources.model_config import parse_model_config, parse_model_config_file
from kvdoctor.sources.model_dir import hf_cache_dir, weights_bytes_from_dir
from kvdoctor.units import GiB, fmt_bytes
from kvdoctor.vllm_defaults import SizingMode

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 2, 3


class PlanError(Exception):
    """Bad plan input (unknown model or GPU, unreadable config, invalid flag): one line, exit 3."""


@dataclass
class ResolvedModel:
    """The model's architecture, where it came from, and its checkpoint size when local."""

    arch: ModelArch
    name: str
    source: str
    weights_bytes: int | None = None


def resolve_model(model: str | None, model_config: str | None = None) -> ResolvedModel:
    """Find the model's config: ``--model-config FILE``; a path to a config.json or a model
    directory (weights from its safetensors metadata); a Hugging Face cache entry; the built-in
    catalogue. Raises :class:`PlanError` when none has it, :class:`SourceError` for a bad config."""
    if model_config:
        arch = parse_model_config_file(model_config)
        return ResolvedModel(arch, model or Path(model_config).parent.name or model_config, model_config)
    if not model:
        raise PlanError("give a model (name, config.json or directory) or --model-config FILE")
    p = Path(model)
    if p.is_file():
        return ResolvedModel(parse_model_config_file(p), p.parent.name or p.name, str(p))
    if p.is_dir():
        arch = parse_model_config_file(p)
        return ResolvedModel(arch, p.name, str(p / "config.json"), weights_bytes_from_dir(p))
    cached = hf_cache_dir(model) if "/" in model else None
    if cached is not None:
        arch = parse_model_config_file(cached)
        return ResolvedModel(arch, model, str(cached / "config.json"), weights_bytes_from_dir(cached))
    cfg = catalog.model_config(model)
    if cfg is not None:
        return ResolvedModel(
            parse_model_config(cfg, origin=f"catalogue:{model}"), model, "built-in catalogue"
        )
    raise PlanError(
        f"unknown model {model!r}: not a file, directory, Hugging Face cache entry or catalogue model "
        f"(give its config.json with --model-config)"
    )


def _human_int(text: str) -> int:
    """vLLM's human-readable ints: 8192, 8k (10^3), 8K (2^10), 8G (2^30), 1.5g (10^9)."""
    try:
        from kvdoctor.vllm_flags import parse_human_int

        return parse_human_int(text)
    except ImportError:  # pragma: no cover - vllm_flags ships with the package
        return int(text)


def _parse_max_model_len(text: str | None) -> int | None:
    if text is None:
        return None
    if text.strip().lower() in ("auto", "-1"):
        return -1
    n = _human_int(text)
    if n < 1:
        raise PlanError(f"--max-model-len must be positive, -1 or auto, got {text!r}")
    return n


def _sizing_mode(
    vllm_version: str, enable_extensible: bool | None, kv_cache_memory_bytes: int | None
) -> tuple[SizingMode, str]:
    """The KV sizing mode ``plan`` models, and why (vllm-facts §9.1)."""
    if not vllm_defaults.is_v034(vllm_version):
        return "estimate", f"vLLM {vllm_version} sizes the KV cache from profiling estimates"
    if kv_cache_memory_bytes is not None:
        if enable_extensible:
            raise PlanError(
                "vLLM rejects --enable-extensible-kv-cache with --kv-cache-memory-bytes: "
                "enable_extensible_kv_cache: it sizes the KV cache from measured memory, which "
                "kv_cache_memory_bytes overrides."
            )
        return "estimate", "--kv-cache-memory-bytes turns the extensible KV cache off"
    if enable_extensible is False:
        return "estimate", "--no-enable-extensible-kv-cache"
    return "extensible", "vLLM 0.34's default on CUDA and ROCm"


def _capacity_row(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    kv_cache_dtype: str,
    block_size: int | None,
    gpu: catalog.GpuSpec | None,
    total_bytes: int | None,
    gmu: float,
    weights_total: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    kv_cache_memory_bytes: int | None,
    max_model_len: int,
    enforce_eager: bool,
    vllm_version: str | None,
    dtype: str | None = None,
    mode: SizingMode = "estimate",
) -> dict[str, Any]:
    layout = kvmath.kv_layout(
        arch,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu=gpu,
        max_num_batched_tokens=max_num_batched_tokens,
        vllm_version=vllm_version,
        dtype=dtype,
    )
    w_gpu = kvmath.weights_bytes_per_gpu(weights_total, tp, pp)
    overheads = kvmath.estimate_overheads(
        arch,
        tensor_parallel_size=tp,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        vllm_version=vllm_version,
    )
    if kv_cache_memory_bytes is not None:
        available = kv_cache_memory_bytes
        available_source = "--kv-cache-memory-bytes"
    elif mode == "extensible":
        assert total_bytes is not None
        available = kvmath.estimate_extensible_kv_bytes(total_bytes, gmu, w_gpu, overheads)
        available_source = "estimate (extensible KV cache, after warm-up)"
    else:
        assert total_bytes is not None
        available = kvmath.estimate_available_kv_bytes(total_bytes, gmu, w_gpu, overheads)
        available_source = "estimate"
    model_max = kvmath.derived_max_model_len(arch) or max(max_model_len, 1)
    mml = max_model_len
    if mml == -1:  # auto-fit (vLLM ≥ 0.14)
        mml = kvmath.estimated_max_model_len(available, layout, model_max)
    ok = mml > 0 and kvmath.fits(available, layout, mml)
    row: dict[str, Any] = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "kv_cache_dtype": kv_cache_dtype,
        "max_model_len": mml,
        "weights_bytes_per_gpu": w_gpu,
        "kv_bytes_per_token_per_gpu": layout.kv_bytes_per_token,
        "available_kv_bytes_per_gpu": available,
        "available_kv_source": available_source,
        "overheads_bytes": {
            "non_torch": overheads.non_torch,
            "activation_peak": overheads.activation_peak,
            "cudagraph": overheads.cudagraph,
        },
        "block_size": layout.block_size,
        "page_size_bytes_per_layer": layout.page_size_bytes_per_layer,
        "bytes_per_block": layout.bytes_per_block,
        "bytes_per_block_per_pp_stage": layout.bytes_per_block_per_stage,
        "max_in_flight_tokens": layout.max_in_flight_tokens,
        "kv_cache_groups": [{"kind": g.kind, "num_layers": len(g.layers)} for g in layout.groups],
        "fits": ok,
        "num_gpu_blocks": None,
        "kv_cache_tokens": None,
        "max_concurrency": None,
        "blocks_per_request": layout.blocks_per_request(mml) if mml > 0 else None,
        "estimated_max_model_len": kvmath.estimated_max_model_len(available, layout, max(mml, 1)),
        "largest_max_model_len": kvmath.estimated_max_model_len(available, layout, max(model_max, mml, 1)),
        "notes": list(layout.notes),
    }
    if ok:
        cap = kvmath.kv_capacity(
            kvmath.num_gpu_blocks(available, layout), layout, mml, vllm_version=vllm_version
        )
        row.update(
            num_gpu_blocks=cap.num_gpu_blocks,
            kv_cache_tokens=cap.kv_cache_tokens,
            max_concurrency=round(cap.max_concurrency, 2),
            log_line=cap.log_line(),
        )
    else:
        row["error"] = kvmath.vllm_fit_error(
            available, layout, max(mml, 1), vllm_version=vllm_version, mode=mode, gpu_memory_utilization=gmu
        )
    row["_layout"] = layout
    return row


def build_plan(
    resolved: ResolvedModel,
    *,
    gpu: catalog.GpuSpec | None = None,
    gpu_memory_bytes: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    enforce_eager: bool = False,
    vllm_version: str | None = None,
    grid: bool = True,
    enable_extensible_kv_cache: bool | None = None,
) -> dict[str, Any]:
    """Compute the whole plan as a JSON-ready dict (bytes, tokens, fractions).

    ``vllm_version`` None = the newest version kvdoctor knows
    (:data:`kvdoctor.vllm_defaults.NEWEST_KNOWN_VERSION`, 0.34); a version kvdoctor does not know
    (newer, or unparseable) is a :class:`PlanError`, never read as the newest. On 0.34 the plan
    models the extensible KV cache (gmu unset = 1.0, block 64, the pool measured after warm-up)
    unless ``enable_extensible_kv_cache`` is False or ``kv_cache_memory_bytes`` is given (which
    turns it off in vLLM too); ``sizing_mode`` and ``sizing_mode_reason`` say which it modelled.

    Top-level keys include the golden names ``page_size_bytes_per_layer``, ``bytes_per_block``,
    ``num_gpu_blocks``, ``kv_cache_tokens``, ``max_concurrency`` (2 decimals), ``fits`` and
    ``estimated_max_model_len``, plus weights/KV per GPU, the typical-request concurrency,
    ``suggested_flags`` and ``grid``. Raises :class:`PlanError` for inconsistent inputs and
    ValueError (from kvmath) for invalid values such as a rejected kv_cache_dtype.
    """
    arch = resolved.arch
    if gpu is not None and gpu_memory_bytes is not None:
        gpu = catalog.GpuSpec(gpu.name, gpu_memory_bytes, gpu.fp8, gpu.sm)
    elif gpu is None and gpu_memory_bytes is not None:
        gpu = catalog.GpuSpec(f"{fmt_bytes(gpu_memory_bytes)} GPU", gpu_memory_bytes, False, "")
    if gpu is None and kv_cache_memory_bytes is None:
        raise PlanError("give --gpu NAME, --gpu-memory SIZE or --kv-cache-memory-bytes N")
    total = gpu.memory_bytes if gpu is not None else None
    if vllm_version is None:
        vllm_version = vllm_defaults.NEWEST_KNOWN_VERSION
    if not vllm_defaults.is_known_version(vllm_version):
        raise PlanError(
            f"unknown --vllm-version {str(vllm_version)[:40]!r}: kvdoctor models vLLM up to "
            f"{vllm_defaults.NEWEST_KNOWN_VERSION} (give one of those; a newer release is not assumed to behave like it)"
        )
    mode, mode_reason = _sizing_mode(vllm_version, enable_extensible_kv_cache, kv_cache_memory_bytes)
    gmu = gpu_memory_utilization or vllm_defaults.default_gpu_memory_utilization(vllm_version, mode)
    if not 0 < gmu <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {gmu}")
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise PlanError("--tensor-parallel-size and --pipeline-parallel-size must be ≥ 1")
    mnbt = max_num_batched_tokens or vllm_defaults.default_max_num_batched_tokens(
        vllm_version,
        gpu.memory_bytes if gpu is not None else 80 * GiB,
        gpu.name if gpu is not None else "H100",
    )
    mns = max_num_seqs or kvmath.default_max_num_seqs(gpu, vllm_version)
    if not kvmath.valid_tensor_parallel_size(arch, tensor_parallel_size):
        valid = ", ".join(str(n) for n in kvmath.valid_tensor_parallel_sizes(arch))
        raise PlanError(
            f"vLLM rejects --tensor-parallel-size {tensor_parallel_size} for this model: "
            f"{arch.num_attention_heads} attention heads / {arch.num_key_value_heads} KV heads do not "
            f"divide evenly (valid: {valid})"
        )
    model_max = kvmath.derived_max_model_len(arch)
    mml = max_model_len if max_model_len is not None else (model_max or 0)
    if mml == 0:
        raise PlanError("the config has no max_position_embeddings: give --max-model-len")
    if model_max and mml > model_max and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise PlanError(
            f"vLLM rejects --max-model-len {mml}: the model's maximum is {model_max} "
            f"(set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to override, at the risk of wrong outputs)"
        )
    # --dtype auto serves a float32 checkpoint in 16-bit (vllm-facts §2.2): weights and an
    # "auto" KV cache are sized in the served dtype, never the checkpoint's.
    try:
        served = kvmath.served_dtype(arch.dtype, dtype, gpu)
    except ValueError as e:
        raise PlanError(str(e)) from None
    checkpoint_bytes = kvmath.model_dtype_bytes(arch.dtype) if arch.dtype else 2
    served_bytes = kvmath.model_dtype_bytes(served)
    if resolved.weights_bytes and not quantization and (not dtype or served_bytes == checkpoint_bytes):
        weights_total = resolved.weights_bytes * served_bytes // checkpoint_bytes
        weights_source = "safetensors metadata"
        if served_bytes != checkpoint_bytes:
            weights_source += f" ({arch.dtype} checkpoint served in {served})"
    else:
        weights_total = kvmath.weights_bytes(arch, dtype=served, quantization=quantization)
        weights_source = "config estimate"

    common: dict[str, Any] = dict(
        block_size=block_size,
        gpu=gpu,
        total_bytes=total,
        gmu=gmu,
        weights_total=weights_total,
        max_num_batched_tokens=mnbt,
        max_num_seqs=mns,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=mml,
        enforce_eager=enforce_eager,
        vllm_version=vllm_version,
        dtype=dtype,
        mode=mode,
    )
    main = _capacity_row(
        arch, tp=tensor_parallel_size, pp=pipeline_parallel_size, kv_cache_dtype=kv_cache_dtype, **common
    )
    layout: kvmath.KvLayout = main.pop("_layout")
    mml = main["max_model_len"]
    plan: dict[str, Any] = {
        "schema": "kvdoctor.plan/1",
        "model": resolved.name,
        "model_source": resolved.source,
        "gpu": None
        if gpu is None
        else {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "fp8": gpu.fp8, "sm": gpu.sm},
        "vllm_version": vllm_version,
        "sizing_mode": mode,
        "sizing_mode_reason": mode_reason,
        "gpu_memory_utilization": gmu,
        "gpu_memory_utilization_explicit": gpu_memory_utilization is not None,
        "max_num_batched_tokens": mnbt,
        "max_num_seqs": mns,
        "block_size_flag": block_size,
        "weights_bytes_total": weights_total,
        "weights_source": weights_source,
        "dtype": served,
        "model_max_len": model_max,
        **main,
    }
    notes: list[str] = plan["notes"]
    if gpu is not None and kv_cache_dtype.startswith("fp8") and not gpu.fp8 and gpu.sm:
        notes.append(
            f"{gpu.name} (SM {gpu.sm}) has no native fp8: vLLM's fp8 KV support there depends on the backend"
        )
    if served != resolved.arch.dtype and resolved.arch.dtype:
        notes.append(
            f"the checkpoint is {resolved.arch.dtype}; vLLM serves it in {served} "
            f"({'--dtype ' + dtype if dtype else '--dtype auto'}), so weights and an auto KV cache use "
            f"{kvmath.model_dtype_bytes(served)} bytes per element"
        )
    if main["available_kv_source"] == "estimate":
        notes.append(
            "available KV memory is an estimate (gmu × total − weights − activation/non-torch/CUDA-graph "
            "allowances); a real log's 'Available KV cache memory' or --kv-cache-memory-bytes is exact"
        )
    elif main["available_kv_source"].startswith("estimate"):
        notes.append(
            f"modelled vLLM {vllm_version} with the extensible KV cache ({mode_reason}): the pool is what is "
            f"free after weights, CUDA graphs and warm-up, less the kept transient peak and the margin "
            f"max(1 GiB, 0.75 × peak), capped at gmu {gmu:g} × total (an estimate; a real log's 'Extended KV "
            "cache to N blocks (X GiB)' is exact, and 'Available KV cache memory' there is only a reservation)"
        )
    if mode == "estimate" and vllm_defaults.is_v034(vllm_version) and kv_cache_memory_bytes is not None:
        notes.append(
            "--kv-cache-memory-bytes turns vLLM 0.34's extensible KV cache off: with gpu-memory-utilization "
            "unset the budget is 0.92, the startup free-memory check applies and torch is not capped"
        )

    # Typical request (workload): concurrency the KV cache holds without preemption.
    typical = (prompt_tokens or 0) + (output_tokens or 0)
    if typical > 0 and main["fits"]:
        n = main["num_gpu_blocks"]
        bpr_t = layout.blocks_per_request(min(typical, mml))
        plan["typical_request_tokens"] = typical
        plan["max_concurrency_typical"] = round(n / bpr_t, 2)

    flags: dict[str, str] = {}
    if main["fits"]:
        flags["--max-model-len"] = str(mml)
        # Only with a workload: capping at the concurrency of full-length requests would cut
        # throughput for the short requests most traffic is made of.
        if typical > 0:
            cap_seqs = kvmath.max_num_seqs_for(main["kv_cache_tokens"], min(typical, mml))
            chosen = max(1, min(mns, cap_seqs))
            flags["--max-num-seqs"] = str(chosen)
            if chosen < mns:
                given = "--max-num-seqs" if max_num_seqs else "vLLM's default --max-num-seqs"
                notes.append(
                    f"--max-num-seqs {chosen} replaces {given} {mns}: the KV cache holds {chosen} "
                    f"requests of {typical:,} tokens at once; more would be preempted"
                )
        if not (mode == "extensible" and gpu_memory_utilization is None):
            # on 0.34 extensible an unset gmu (1.0) is the advice: no explicit value to add
            flags["--gpu-memory-utilization"] = f"{gmu:.2f}"
    else:
        largest = main["largest_max_model_len"]
        if largest > 0:
            flags["--max-model-len"] = str(min(largest, mml))
        if total is not None and kv_cache_memory_bytes is None:
            o = main["overheads_bytes"]
            need = (
                main["weights_bytes_per_gpu"]
                + o["non_torch"]
                + o["activation_peak"]
                + o["cudagraph"]
                + kvmath.required_kv_bytes(layout, mml)
            )
            g = kvmath.gmu_for_bytes(need, total)
            if mode == "extensible":
                # nothing is above 1.0; an explicit gmu below 1.0 only costs KV (spec/vllm-0.34.md §1)
                if gpu_memory_utilization is not None and gmu < 1.0:
                    flags["--gpu-memory-utilization"] = "1.0"
            elif g <= 0.95 and g > gmu:
                flags["--gpu-memory-utilization"] = f"{g:.2f}"
    plan["suggested_flags"] = flags
    # issue 24 kind 10: the launch flags the plan assumed, then its advice, so that pasting the
    # Flags line after `vllm serve MODEL` reproduces the plan ("" = a flag without a value).
    assumed: dict[str, str] = {
        "--tensor-parallel-size": str(tensor_parallel_size),
        "--kv-cache-dtype": kv_cache_dtype,
    }
    if pipeline_parallel_size != 1:
        assumed["--pipeline-parallel-size"] = str(pipeline_parallel_size)
    for flag, value in (
        ("--block-size", block_size),
        ("--dtype", dtype),
        ("--quantization", quantization),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--max-num-seqs", max_num_seqs),
        ("--kv-cache-memory-bytes", kv_cache_memory_bytes),
    ):
        if value is not None:
            assumed[flag] = str(value)
    if gpu_memory_utilization is not None:
        assumed["--gpu-memory-utilization"] = f"{gpu_memory_utilization:g}"
    if max_model_len is not None:
        assumed["--max-model-len"] = str(max_model_len)
    if enforce_eager:
        assumed["--enforce-eager"] = ""
    if (
        enable_extensible_kv_cache is False
        and vllm_defaults.is_v034(vllm_version)
        and kv_cache_memory_bytes is None
    ):
        assumed["--no-enable-extensible-kv-cache"] = ""
    plan["launch_flags"] = {**assumed, **flags}

    if grid:
        rows = []
        dtypes = ["auto"]
        if gpu is None or gpu.fp8 or kv_cache_dtype.startswith("fp8"):
            dtypes.append("fp8")
        for tp in (1, 2, 4, 8):
            if not kvmath.valid_tensor_parallel_size(arch, tp):
                continue
            for dt in dtypes:
                r = _capacity_row(arch, tp=tp, pp=pipeline_parallel_size, kv_cache_dtype=dt, **common)
                r.pop("_layout")
                rows.append(
                    {
                        k: r[k]
                        for k in (
                            "tensor_parallel_size",
                            "kv_cache_dtype",
                            "weights_bytes_per_gpu",
                            "kv_bytes_per_token_per_gpu",
                            "available_kv_bytes_per_gpu",
                            "num_gpu_blocks",
                            "kv_cache_tokens",
                            "max_concurrency",
                            "fits",
                            "largest_max_model_len",
                        )
                    }
                )
        plan["grid"] = rows
        if not main["fits"] and gpu is not None and gpu.fp8 and kv_cache_dtype == "auto":
            fp8_row = next(
                (
                    r
                    for r in rows
                    if r["tensor_parallel_size"] == tensor_parallel_size and r["kv_cache_dtype"] == "fp8"
                ),
                None,
            )
            if fp8_row and fp8_row["fits"]:
                flags["--kv-cache-dtype"] = "fp8"
    return plan


def render_text(plan: dict[str, Any]) -> None:
    """Print the plan as rich tables on stdout."""
    from rich.table import Table

    from kvdoctor.report import make_console

    con = make_console()
    gpu = plan["gpu"]
    title = f"{plan['model']} on {gpu['name'] if gpu else 'GPU'}" + (
        f" × {plan['tensor_parallel_size'] * plan['pipeline_parallel_size']}"
        if plan["tensor_parallel_size"] * plan["pipeline_parallel_size"] > 1
        else ""
    )
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")

    def add(k: str, v: Any) -> None:
        t.add_row(k, "—" if v is None else str(v))

    add("vLLM / KV sizing", f"{plan['vllm_version']} / {plan['sizing_mode']} ({plan['sizing_mode_reason']})")
    add("TP × PP", f"{plan['tensor_parallel_size']} × {plan['pipeline_parallel_size']}")
    add(
        "dtype / kv_cache_dtype / block_size",
        f"{plan['dtype']} / {plan['kv_cache_dtype']} / {plan['block_size']}",
    )
    add("max_model_len", f"{plan['max_model_len']:,}")
    add("weights per GPU", f"{fmt_bytes(plan['weights_bytes_per_gpu'])} ({plan['weights_source']})")
    add("KV per token per GPU", fmt_bytes(plan["kv_bytes_per_token_per_gpu"]))
    add(
        "page size per layer / bytes per block",
        f"{plan['page_size_bytes_per_layer']:,} / {plan['bytes_per_block']:,} B",
    )
    add(
        "available KV memory per GPU",
        f"{fmt_bytes(plan['available_kv_bytes_per_gpu'])} ({plan['available_kv_source']}, gmu {plan['gpu_memory_utilization']:.2f})",
    )
    add("num_gpu_blocks", plan["num_gpu_blocks"])
    add("KV capacity (tokens)", None if plan["kv_cache_tokens"] is None else f"{plan['kv_cache_tokens']:,}")
    add(
        "max concurrency at max_model_len",
        None if plan["max_concurrency"] is None else f"{plan['max_concurrency']:.2f}x",
    )
    if "max_concurrency_typical" in plan:
        add(
            f"max concurrency at {plan['typical_request_tokens']:,} tokens",
            f"{plan['max_concurrency_typical']:.2f}x",
        )
    add("fits one max_model_len request", "yes" if plan["fits"] else "NO")
    if not plan["fits"]:
        add("largest max_model_len that fits", plan["largest_max_model_len"])
    con.print(t)
    if plan.get("log_line"):
        con.print(f"vLLM would log: [bold]{plan['log_line']}[/bold]")
    launch = plan.get("launch_flags") or plan["suggested_flags"]
    if launch:
        con.print(
            "Flags: " + " ".join(f"{k} {v}" if v != "" else k for k, v in launch.items()),
            markup=False,
            soft_wrap=True,
        )
    if plan.get("grid"):
        g = Table(title="TP × KV dtype", title_justify="left")
        for col in (
            "TP",
            "kv dtype",
            "weights/GPU",
            "KV/token/GPU",
            "KV memory/GPU",
            "KV tokens",
            "conc",
            "fits",
        ):
            g.add_column(col, justify="right")
        for r in plan["grid"]:
            g.add_row(
                str(r["tensor_parallel_size"]),
                r["kv_cache_dtype"],
                fmt_bytes(r["weights_bytes_per_gpu"]),
                fmt_bytes(r["kv_bytes_per_token_per_gpu"]),
                fmt_bytes(r["available_kv_bytes_per_gpu"]),
                "—" if r["kv_cache_tokens"] is None else f"{r['kv_cache_tokens']:,}",
                "—" if r["max_concurrency"] is None else f"{r['max_concurrency']:.2f}x",
                "yes" if r["fits"] else f"no (≤{r['largest_max_model_len']:,})",
            )
        con.print(g)
    for n in plan["notes"]:
        con.print(f"[dim]note: {n}[/dim]")


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False)
@click.option(
    "--model-config", "model_config", type=click.Path(dir_okay=False), help="The model's config.json."
)
@click.option(
    "--gpu", "gpu_name", help="GPU model (A100-80GB, H100, H200, L40S, 'NVIDIA A100-SXM4-80GB', …)."
)
@click.option("--gpu-memory", "gpu_memory", help="GPU memory per card, e.g. 80GiB or 81920MiB.")
@click.option("-tp", "--tensor-parallel-size", "tp", type=int, default=1, show_default=True)
@click.option("-pp", "--pipeline-parallel-size", "pp", type=int, default=1, show_default=True)
@click.option("--max-model-len", "max_model_len", help="Tokens per request (8192, 32k, -1/auto = auto-fit).")
@click.option(
    "--gpu-memory-utilization",
    "gmu",
    type=float,
    help="Default: 1.0 on vLLM 0.34 with the extensible KV cache, 0.92 without it and on 0.20-0.33, 0.9 before.",
)
@click.option("--kv-cache-dtype", "kv_cache_dtype", default="auto", show_default=True)
@click.option("--block-size", "block_size", type=int, help="Default: what vLLM picks for the model and GPU.")
@click.option("--max-num-seqs", "max_num_seqs", type=int)
@click.option("--max-num-batched-tokens", "max_num_batched_tokens")
@click.option(
    "--kv-cache-memory-bytes",
    "--kv-cache-memory",
    "kv_cache_memory_bytes",
    help="KV bytes per GPU (8G = 8·2^30).",
)
@click.option("--prompt-tokens", type=int, help="Typical prompt length of the workload.")
@click.option("--output-tokens", type=int, help="Typical output length of the workload.")
@click.option("--dtype", "dtype", help="Model dtype override (--dtype).")
@click.option("--quantization", "quantization", help="Quantization override (awq, gptq, fp8, …).")
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (no graph memory estimate).")
@click.option(
    "--vllm-version",
    "vllm_version",
    default=vllm_defaults.NEWEST_KNOWN_VERSION,
    show_default=True,
    help="vLLM version to model; a version kvdoctor does not know is an error.",
)
@click.option(
    "--enable-extensible-kv-cache/--no-enable-extensible-kv-cache",
    "extensible",
    default=None,
    help="vLLM 0.34: model the extensible KV cache (the default on CUDA/ROCm) or the estimate-based sizing.",
)
@click.option("--no-grid", is_flag=True, help="Skip the TP × KV dtype grid.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def plan_command(
    model: str | None,
    model_config: str | None,
    gpu_name: str | None,
    gpu_memory: str | None,
    tp: int,
    pp: int,
    max_model_len: str | None,
    gmu: float | None,
    kv_cache_dtype: str,
    block_size: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: str | None,
    kv_cache_memory_bytes: str | None,
    prompt_tokens: int | None,
    output_tokens: int | None,
    dtype: str | None,
    quantization: str | None,
    enforce_eager: bool,
    vllm_version: str | None,
    extensible: bool | None,
    no_grid: bool,
    fmt: str,
) -> None:
    """Plan KV-cache capacity for MODEL (a Hugging Face id, config.json or directory) on a GPU.

    Exit 0 when one request of --max-model-len fits, 2 when it does not (the largest length
    that fits is printed), 3 for bad input.
    """
    try:
        resolved = resolve_model(model, model_config)
        gpu = catalog.gpu(gpu_name) if gpu_name else None
        mem = catalog.parse_gpu_memory(gpu_memory) if gpu_memory else None
        plan = build_plan(
            resolved,
            gpu=gpu,
            gpu_memory_bytes=mem,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            max_model_len=_parse_max_model_len(max_model_len),
            gpu_memory_utilization=gmu,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=_human_int(max_num_batched_tokens) if max_num_batched_tokens else None,
            kv_cache_memory_bytes=_human_int(kv_cache_memory_bytes) if kv_cache_memory_bytes else None,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            dtype=dtype,
            quantization=quantization,
            enforce_eager=enforce_eager,
            vllm_version=vllm_version,
            grid=not no_grid,
            enable_extensible_kv_cache=extensible,
        )
    except (PlanError, SourceError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        click.echo(f"kvdoctor plan: {msg}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if fmt == "json":
        click.echo(json.dumps(plan, separators=(",", ":")))
    else:
        render_text(plan)
        if not plan["fits"]:
            click.echo(_does_not_fit(plan), err=True)
    sys.exit(EXIT_OK if plan["fits"] else EXIT_DOES_NOT_FIT)


def _does_not_fit(plan: dict[str, Any]) -> str:
    """The stderr line for a plan that cannot serve one request, with what would fit."""
    avail = plan["available_kv_bytes_per_gpu"]
    tp = plan.get("tensor_parallel_size")
    better = [
        r
        for r in plan.get("grid") or []
        if r["fits"]
        and r["kv_cache_dtype"] == plan.get("kv_cache_dtype")
        and (tp is None or r["tensor_parallel_size"] > tp)
    ]
    hint = ""
    if better:
        hint = f"; --tensor-parallel-size {better[0]['tensor_parallel_size']} fits"
    if avail is not None and avail <= 0:
        # Not a context-length problem: the weights (and overheads) already exceed the budget.
        return (
            f"Does not fit: weights ({fmt_bytes(plan['weights_bytes_per_gpu'])} per GPU) and overheads leave "
            f"{fmt_bytes(avail)} for the KV cache{hint}, or use a quantized model or larger GPUs"
        )
    return (
        f"Does not fit: one request of {plan['max_model_len']:,} tokens needs more KV memory than "
        f"{fmt_bytes(avail)}; largest max_model_len that fits: {plan['largest_max_model_len']:,}{hint}"
    )


__all__ = ["plan_command", "build_plan", "resolve_model", "ResolvedModel", "PlanError", "GiB"]
