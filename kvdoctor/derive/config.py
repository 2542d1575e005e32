"""Family config: the engine's launch configuration as rules read it (EngineConfig from the
launch command, the log's args, cache_config_info, vLLM's defaults by version)."""

from __future__ import annotations

from kvdoctor.derive.base import Family, Scope, Vars

WRITES: dict[str, str] = {
    "engine_id": "str; served model name or engine index",
    "model_name": "str; --model / served model name",
    "vllm_version": "str; 'vLLM API server version' / 'Initializing … engine (vX)' log line",
    "engine_generation": "'v0'|'v1'; from the log or /metrics names",
    "tp": "int; --tensor-parallel-size",
    "pp": "int; --pipeline-parallel-size",
    "tp_pp": "int; tp × pp (GPUs per engine replica)",
    "gmu": "fraction; --gpu-memory-utilization (vLLM default by version when not given)",
    "gmu_explicit": "bool; --gpu-memory-utilization was given",
    "max_model_len": "tokens; --max-model-len, 'Using max model len', or the model's max_position_embeddings",
    "max_num_seqs": "int; --max-num-seqs (None = vLLM's device default)",
    "max_num_batched_tokens": "tokens; --max-num-batched-tokens or 'Chunked prefill is enabled with max_num_batched_tokens=N'",
    "kv_cache_dtype": "str; --kv-cache-dtype",
    "block_size": "tokens per KV block; cache_config_info block_size, --block-size, else 16",
    "enforce_eager": "bool; --enforce-eager",
    "num_gpu_blocks_override": "int; --num-gpu-blocks-override",
    "is_pooling": "bool; --task embed / --runner pooling (KV usage reads 100 % on V0 pooling models)",
    "max_num_seqs_explicit": "bool; --max-num-seqs was given",
    "max_num_batched_tokens_explicit": "bool; --max-num-batched-tokens was given",
    "expandable_segments_on": "bool; PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True (env.txt / live env)",
    "dp_engine": "str; the data-parallel engine label this context is about (None without DP)",
}
READS: frozenset[str] = frozenset()

_POOLING_TASKS = ("embed", "embedding", "pooling", "score", "classify", "reward")


def derive(s: Scope, v: Vars) -> None:
    """Launch configuration of the engine (``s.cfg``, already merged and defaulted)."""
    cfg, log = s.cfg, s.log
    v["engine_id"] = s.engine.id if s.engine else None
    v["model_name"] = cfg.served_model_name or cfg.model
    v["vllm_version"] = cfg.vllm_version or (log.vllm_version if log else None)
    v["engine_generation"] = log.engine_generation if log else None
    v["tp"] = cfg.tensor_parallel_size or 1
    v["pp"] = cfg.pipeline_parallel_size or 1
    v["tp_pp"] = v["tp"] * v["pp"]
    v["gmu"] = cfg.gpu_memory_utilization
    v["gmu_explicit"] = "gpu_memory_utilization" in cfg.explicit
    mml = cfg.max_model_len
    if mml is None and log is not None:
        ev = log.last("max_model_len_used")
        if ev is not None:
            mml = ev.values.get("max_model_len")
    if (mml is None or mml <= 0) and s.arch is not None:
        mml = s.arch.max_position_embeddings
    v["max_model_len"] = mml
    v["max_num_seqs"] = cfg.max_num_seqs
    mnbt = cfg.max_num_batched_tokens
    if mnbt is None and log is not None:
        ev = log.last("chunked_prefill")
        if ev is not None:
            mnbt = ev.values.get("max_num_batched_tokens")
    v["max_num_batched_tokens"] = mnbt
    v["kv_cache_dtype"] = cfg.kv_cache_dtype or "auto"
    v["block_size"] = cfg.block_size or 16
    v["enforce_eager"] = bool(cfg.enforce_eager)
    v["num_gpu_blocks_override"] = cfg.num_gpu_blocks_override
    v["is_pooling"] = (cfg.task or "").lower() in _POOLING_TASKS
    v["max_num_seqs_explicit"] = "max_num_seqs" in cfg.explicit
    v["max_num_batched_tokens_explicit"] = "max_num_batched_tokens" in cfg.explicit
    conf = (s.snapshot.env.get("PYTORCH_CUDA_ALLOC_CONF") or "").replace(" ", "").lower()
    v["expandable_segments_on"] = "expandable_segments:true" in conf
    v["dp_engine"] = s.dp_label


FAMILY = Family("config", WRITES, READS, derive)
