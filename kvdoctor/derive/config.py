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
    "is_pooling": "bool; a pooling (embedding / classify / score / reward) engine: --task / --runner pooling / --convert, else the config.json architecture (vLLM's suffix defaults), else the traffic (prompt tokens and finished requests without a generated token); its KV usage gauge is a placeholder (100 % on V0 pooling runners)",
    "pooling_from": "str; what said the engine pools ('--task embed', \"config.json architectures ['BertModel']\", 'traffic: …'), None for a generating engine",
    "max_num_seqs_explicit": "bool; --max-num-seqs was given",
    "max_num_batched_tokens_explicit": "bool; --max-num-batched-tokens was given",
    "expandable_segments_on": "bool; PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True (env.txt / live env)",
    "dp_engine": "str; the data-parallel engine label this context is about (None without DP)",
}
READS: frozenset[str] = frozenset()

_POOLING_TASKS = ("embed", "embedding", "pooling", "score", "classify", "reward")
_GENERATE_TASKS = ("generate", "auto", "draft", "transcription")
#: vLLM's default runner by architecture name suffix (``config/model.py`` ``_SUFFIX_TO_DEFAULTS``,
#: tried in this order): these make a model a pooling one when no ``--runner`` is given. A
#: generating architecture (``…ForCausalLM``, ``…ForConditionalGeneration``, ``…LMHeadModel``)
#: never ends in one of them, except the bare ``Model`` suffix, which is checked last.
_POOLING_SUFFIXES = (
    "ForTextEncoding",
    "EmbeddingModel",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForAudioClassification",
    "ForImageClassification",
    "ForVideoClassification",
    "ClassificationModel",
    "ForRewardModeling",
    "RewardModel",
)
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "ForMaskedLM", "MTPModel")
#: generating architectures vLLM registers under a bare ``…Model`` name (its registry is read
#: before the suffix defaults): InternVL / H2OVL / Skywork chat models, ChatGLM, NVLM-D, Qwen-Omni.
_GENERATE_MODEL_NAMES = ("ChatModel", "ChatGLMModel", "GLMModel", "NVLM_D_Model", "OmniModel")


def _pooling_architecture(archs: list[str]) -> bool:
    """True when vLLM would run ``architectures`` (config.json) with the pooling runner: a
    suffix of :data:`_POOLING_SUFFIXES`, or a bare ``…Model`` (``BertModel``, ``MistralModel``,
    ``XLMRobertaModel``: the base model without an LM head). Any generating architecture wins."""
    if not archs or any(a.endswith(_GENERATE_SUFFIXES + _GENERATE_MODEL_NAMES) for a in archs):
        return False
    return all(a.endswith(_POOLING_SUFFIXES) or a.endswith("Model") for a in archs)


def _pooling_traffic(s: Scope) -> str | None:
    """'…' when the window's scrapes show pooling traffic: prompt tokens flowing
    (``vllm:prompt_tokens_total``) and requests finishing (``vllm:request_success_total``) while
    ``vllm:generation_tokens_total`` is still 0 over the engine's lifetime — an embedding or
    score request generates nothing, a generate request at least one token (a stalled generating
    engine has generated before, and swaps or preempts). None otherwise (or with fewer than two
    scrapes)."""
    series = s.series
    for m in reversed(series):
        if m.prompt_tokens_total is not None and m.generation_tokens_total is not None:
            if m.generation_tokens_total != 0:
                return None  # the last of the samples below has generated: no pooling traffic
            break
    pts = [m for m in series if m.prompt_tokens_total is not None and m.generation_tokens_total is not None]
    if len(pts) < 2:
        return None
    first, last = pts[0], pts[-1]
    if last.prompt_tokens_total is None or first.prompt_tokens_total is None:
        return None
    prompt = last.prompt_tokens_total - first.prompt_tokens_total
    gen = (last.generation_tokens_total or 0) - (first.generation_tokens_total or 0)
    done = (last.request_success_total or 0) - (first.request_success_total or 0)
    never_generated = last.generation_tokens_total == 0
    swapped_or_preempted = any(
        (m.num_requests_swapped or 0) > 0 or (m.num_preemptions_total or 0) > 0 for m in pts
    )
    if prompt > 0 and done > 0 and gen == 0 and never_generated and not swapped_or_preempted:
        return (
            f"traffic: {prompt:,.0f} prompt tokens and {done:,.0f} finished requests in the window, "
            "no generated token (vllm:prompt_tokens_total, vllm:request_success_total, vllm:generation_tokens_total)"
        )
    return None


def _pooling(s: Scope) -> str | None:
    """What says this engine is a pooling one (see ``is_pooling``), or None."""
    cfg = s.cfg
    task = (cfg.task or "").lower()
    convert = str(cfg.args.get("convert") or "").lower()
    if task in _POOLING_TASKS:
        return f"--task/--runner {task}"
    if convert in _POOLING_TASKS:
        return f"--convert {convert}"
    if task in _GENERATE_TASKS and "task" in cfg.explicit:
        return None  # the user asked for generation: no architecture or traffic overrides it
    if s.arch is not None and _pooling_architecture(list(s.arch.architectures)):
        return f"config.json architectures {list(s.arch.architectures)}"
    return _pooling_traffic(s)


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
    v["pooling_from"] = _pooling(s)
    v["is_pooling"] = v["pooling_from"] is not None
    v["max_num_seqs_explicit"] = "max_num_seqs" in cfg.explicit
    v["max_num_batched_tokens_explicit"] = "max_num_batched_tokens" in cfg.explicit
    conf = (s.snapshot.env.get("PYTORCH_CUDA_ALLOC_CONF") or "").replace(" ", "").lower()
    v["expandable_segments_on"] = "expandable_segments:true" in conf
    v["dp_engine"] = s.dp_label


FAMILY = Family("config", WRITES, READS, derive)
