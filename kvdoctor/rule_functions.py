"""Helpers several rules share beyond kvmath (rules import them directly): GPU lists by
memory, gmu splits, speculative-decoding sampler sizing, data-parallel skew, pipeline layer
partitions. The KV arithmetic is kvmath's: rules call it, they never copy it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvdoctor import kvmath
from kvdoctor.units import na


def gpus_under(
    used: dict[int, int] | None, max_bytes: float | None, among: Iterable[int] | None = None
) -> list[int]:
    """GPU indices whose used memory (``gpu_used_map``: index → bytes) is under ``max_bytes``,
    sorted; with ``among`` only those indices are considered, and one whose memory was not read
    counts as holding nothing. ``gpus_under(gpu_used_map, 1 * GiB, gpus_without_processes)``:
    the empty GPUs. [] when ``used`` or ``max_bytes`` is None."""
    if used is None or max_bytes is None:
        return []
    keys = list(among) if among is not None else list(used)
    return sorted(i for i in keys if (used.get(i) or 0) < max_bytes)


def gpus_full(used: dict[int, int] | None, total: dict[int, int] | None, fraction: float | None) -> list[int]:
    """GPU indices whose used memory is at least ``fraction`` of their total (``gpu_used_map``,
    ``gpu_total_map``), sorted; [] when an argument is None."""
    if used is None or total is None or fraction is None:
        return []
    return sorted(i for i, u in used.items() if total.get(i) and u >= fraction * total[i])


def gmu_split(gmus: Iterable[float | None] | None, target: float | None) -> list[float] | None:
    """A ``--gpu-memory-utilization`` per engine sharing a card, proportional to what each asked
    for and summing to at most ``target`` (each rounded down to 0.01; unchanged when they fit).
    None when a gmu is unknown or the sum is not positive."""
    from kvdoctor.units import floor_to

    if gmus is None or target is None:
        return None
    vals = list(gmus)
    if not vals or any(x is None for x in vals):
        return None
    total = sum(float(x) for x in vals if x is not None)
    if total <= 0:
        return None
    scale = min(1.0, target / total)
    return [floor_to(float(x) * scale, 0.01) for x in vals if x is not None]


def pair_desc(names: Iterable[Any] | None, values: Iterable[Any] | None, spec: str = ".2f") -> str | None:
    """``pair_desc(['a', 'b'], [0.51, 0.43])`` → "a 0.51, b 0.43"; None when either is None or
    their lengths differ."""
    if names is None or values is None:
        return None
    ns, vs = list(names), list(values)
    if len(ns) != len(vs):
        return None
    return ", ".join(f"{n} {na(x, spec)}" for n, x in zip(ns, vs, strict=True))


def count_at_least(values: Iterable[float | None] | None, threshold: float | None) -> int:
    """How many of ``values`` are ≥ ``threshold`` (None values never count); 0 for None."""
    if values is None or threshold is None:
        return 0
    return sum(1 for x in values if x is not None and x >= threshold)


# --------------------------------------------------------------------------- catalogue 2


def spec_sampler_bytes(
    vocab: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    k: int | None,
    logit_bytes: int = 2,
    probabilistic: bool = False,
    v2_runner: bool = False,
) -> int | None:
    """U, the rejection-sampler memory a step with k drafts per request needs beyond vLLM's
    warm-up (spec/rules-catalogue2.md §3.3 ``spec-decode-sampler-oom``; an estimate read off
    the code, not measured): V × (N_run·k − N_prof) × (b + 12) (+ V × (N_run·k − N_prof) × 8
    with ``probabilistic`` draft sampling), N_run = min(max_num_seqs, ⌊mnbt/(k+1)⌋), N_prof =
    min(max_num_seqs, mnbt). For the V2 runner the lower bound V × N_run × k × b. Bytes, at least
    0; None when an input is missing."""
    if not vocab or not max_num_seqs or not max_num_batched_tokens or not k or k < 1:
        return None
    n_run = min(max_num_seqs, max_num_batched_tokens // (k + 1))
    if v2_runner:
        return int(vocab * n_run * k * logit_bytes)
    n_prof = min(max_num_seqs, max_num_batched_tokens)
    extra = max(0, n_run * k - n_prof)
    per = logit_bytes + 12 + (8 if probabilistic else 0)
    return int(vocab * extra * per)


def spec_max_num_seqs_fit(
    limit_bytes: float | None,
    vocab: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    k: int | None,
    logit_bytes: int = 2,
    probabilistic: bool = False,
    v2_runner: bool = False,
) -> int | None:
    """The largest multiple of 8 below ``max_num_seqs`` whose :func:`spec_sampler_bytes` is
    ≤ ``limit_bytes``; None when none (or an input is missing)."""
    if limit_bytes is None or not max_num_seqs:
        return None
    n = (max_num_seqs - 1) // 8 * 8
    while n >= 8:
        u = spec_sampler_bytes(vocab, n, max_num_batched_tokens, k, logit_bytes, probabilistic, v2_runner)
        if u is None:
            return None
        if u <= limit_bytes:
            return n
        n -= 8
    return None


def spec_k_fit(
    limit_bytes: float | None,
    vocab: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    k: int | None,
    logit_bytes: int = 2,
    probabilistic: bool = False,
    v2_runner: bool = False,
) -> int | None:
    """The largest k' in [1, k) whose :func:`spec_sampler_bytes` is ≤ ``limit_bytes``; None when
    none fits or an input is missing."""
    if limit_bytes is None or not k:
        return None
    for kk in range(k - 1, 0, -1):
        u = spec_sampler_bytes(
            vocab, max_num_seqs, max_num_batched_tokens, kk, logit_bytes, probabilistic, v2_runner
        )
        if u is not None and u <= limit_bytes:
            return kk
    return None


def spec_config_with_k(config_json: str | None, k: int | None) -> str | None:
    """``--speculative-config`` JSON with ``num_speculative_tokens`` set to ``k``; None without
    either."""
    import json

    if not config_json or not k:
        return None
    try:
        cfg = json.loads(config_json)
    except ValueError:
        return None
    if not isinstance(cfg, dict):
        return None
    cfg["num_speculative_tokens"] = int(k)
    return json.dumps(cfg, separators=(",", ":"), sort_keys=True)


def dp_skew(
    samples: list[dict[str, Any]] | None,
    hot_waiting: float,
    hot_kv: float,
    cold_kv: float,
    hot_share: float,
    max_num_seqs: int | None = None,
) -> dict[str, Any] | None:
    """Data-parallel load skew over ``samples`` (derive ``dp_samples``): in every sample some
    engines are hot (waiting ≥ ``hot_waiting`` and KV usage ≥ ``hot_kv``) and some cold (waiting
    0, KV ≤ ``cold_kv``, running < ``max_num_seqs`` when known), and the hot ones hold ≥
    ``hot_share`` of all waiting requests. Returns {'hot': [labels], 'cold': [labels],
    'last': the last sample's engines, 'moves': Σ_hot (waiting − mean waiting)} or None."""
    if not samples:
        return None
    hot_all: set[str] | None = None
    cold_all: set[str] | None = None
    for smp in samples:
        eng = smp.get("engines") or {}
        hot = {
            lab for lab, e in eng.items()
            if (e.get("waiting") or 0) >= hot_waiting and (e.get("kv") or 0) >= hot_kv
        }  # fmt: skip
        cold = {
            lab for lab, e in eng.items()
            if (e.get("waiting") or 0) == 0 and e.get("kv") is not None and e["kv"] <= cold_kv
            and (max_num_seqs is None or (e.get("running") or 0) < max_num_seqs)
        }  # fmt: skip
        total_wait = sum((e.get("waiting") or 0) for e in eng.values())
        hot_wait = sum((eng[lab].get("waiting") or 0) for lab in hot)
        if not hot or not cold or total_wait <= 0 or hot_wait < hot_share * total_wait:
            return None
        hot_all = hot if hot_all is None else hot_all & hot
        cold_all = cold if cold_all is None else cold_all & cold
    last = samples[-1].get("engines") or {}
    hot_l = sorted(hot_all or [], key=_label_key)
    cold_l = sorted(cold_all or [], key=_label_key)
    if not hot_l or not cold_l:
        return None
    mean = sum((e.get("waiting") or 0) for e in last.values()) / max(1, len(last))
    moves = sum(max(0.0, (last[h].get("waiting") or 0) - mean) for h in hot_l)
    return {"hot": hot_l, "cold": cold_l, "last": last, "moves": int(round(moves)), "mean_waiting": mean}


def _label_key(x: str) -> tuple[int, str]:
    return (int(x), x) if str(x).isdigit() else (1 << 30, str(x))


def dp_absorb(
    skew: dict[str, Any] | None,
    capacity: dict[str, int] | None,
    max_num_seqs: int | None,
    typical_tokens: int | None,
) -> int | None:
    """Requests the cold engines could take now: Σ_cold min(max_num_seqs − running,
    ⌊(1 − kv) × capacity tokens / typical tokens⌋); the slot term alone when the KV room is
    unknown; None without max_num_seqs."""
    if skew is None or not max_num_seqs:
        return None
    total = 0
    for lab in skew["cold"]:
        e = skew["last"].get(lab) or {}
        slots = max(0, int(max_num_seqs - (e.get("running") or 0)))
        cap = (capacity or {}).get(lab)
        if cap and typical_tokens and e.get("kv") is not None:
            slots = min(slots, int((1 - e["kv"]) * cap // typical_tokens))
        total += slots
    return total


def dp_desc(skew: dict[str, Any] | None, which: str) -> str:
    """'engine 0 (waiting 117, running 51, KV 1.00), …' for skew['hot'] / skew['cold']."""
    if skew is None:
        return ""
    parts = []
    for lab in skew[which]:
        e = skew["last"].get(lab) or {}
        parts.append(
            f"engine {lab} (waiting {int(e.get('waiting') or 0)}, running {int(e.get('running') or 0)}, "
            f"KV {na(e.get('kv'), '.2f')})"
        )
    return ", ".join(parts)


def pp_layer_partition(
    arch: Any, pp: int, heavy_stage: int, excess_bytes: float, weights_bytes: float
) -> str | None:
    """``VLLM_PP_LAYER_PARTITION`` that moves layers off the heavy pipeline stage: the even split
    of ``arch.num_hidden_layers`` over ``pp`` stages (remainder to the first stages), minus the
    layers that balance ``excess_bytes`` (bytes per layer = ``weights_bytes`` / layers) on
    ``heavy_stage`` (0-based), handed to the other stages in turn: "15,17" for 32 layers, pp 2,
    two layers' worth of excess on stage 0. None when an input is missing or no layer would move
    (the partition would change nothing)."""
    layers = int(getattr(arch, "num_hidden_layers", 0) or 0)
    pp, heavy_stage = int(pp), int(heavy_stage)
    if layers <= 0 or pp < 2 or not 0 <= heavy_stage < pp or not weights_bytes or excess_bytes <= 0:
        return None
    split = [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]
    per_layer = float(weights_bytes) / layers
    # k layers off the heavy stage, spread over the pp-1 others, balance it when
    # heavy - k·L = light + k·L/(pp-1), i.e. k = excess·(pp-1) / (pp·L).
    move = min(split[heavy_stage] - 1, max(1, round(float(excess_bytes) * (pp - 1) / (pp * per_layer))))
    if move <= 0:
        return None
    split[heavy_stage] -= move
    others = [i for i in range(pp) if i != heavy_stage]
    for k in range(move):
        split[others[k % len(others)]] += 1
    return ",".join(str(x) for x in split)


def proportional_layer_partition(arch: Any, gpus: list[int], totals: dict[int, int]) -> str | None:
    """``VLLM_PP_LAYER_PARTITION`` with one pipeline stage per GPU of ``gpus`` (in that order: the
    order of the engine's visible devices, which is how vLLM places PP ranks on one node) and
    layers proportional to each card's total memory (``totals``: index → bytes, nvidia-smi
    memory.total), largest remainders first, at least one layer per stage: "20,12" for 32 layers
    on an 80 GB and a 48 GB card. None when an input is missing, fewer layers than stages, or
    all cards are the same size (the even split vLLM makes by itself)."""
    layers = int(getattr(arch, "num_hidden_layers", 0) or 0)
    sizes = [int(totals.get(i) or 0) for i in gpus or []]
    if layers <= 0 or len(sizes) < 2 or min(sizes) <= 0 or layers < len(sizes) or len(set(sizes)) == 1:
        return None
    whole = sum(sizes)
    exact = [layers * x / whole for x in sizes]
    split = [max(1, int(e)) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    k = 0
    while sum(split) < layers:
        split[order[k % len(order)]] += 1
        k += 1
    while sum(split) > layers:
        i = max(range(len(split)), key=lambda j: split[j] - exact[j])
        split[i] -= 1
    return ",".join(str(x) for x in split)


def seqs_step(n: int) -> int:
    """``n`` rounded down to a step of about 1/8 of itself (a power of two: exact below 16,
    multiples of 2 up to 31, of 4 up to 63, of 8 up to 127, …; at least 1): a computed
    ``--max-num-seqs`` moves only when its evidence moves by more than a step, so a live view and
    the sidecar do not flap (issue 24), and it stays within about 12 % of what fits."""
    if n < 1:
        return 1
    q = 1
    while q * 2 <= n // 8:
        q *= 2
    return n // q * q


def concurrency_fix(
    kv_tokens: int | None,
    typical_tokens: int | None,
    needed: float | None,
    prompt_p50: float | None,
    prompt_tail: float | None,
    tail_ratio: float = 4,
    fits: int | None = None,
) -> tuple[int | None, str]:
    """The ``--max-num-seqs`` that admits only what the KV cache holds at once, and why not when
    None (issue 24 kind 1: a fix that helps, never one that serialises the engine).

    ``kv_tokens``: KV capacity in tokens; ``typical_tokens``: a typical request (p50 prompt + p50
    generation); ``needed``: the requests running before the trouble (derive
    ``running_before_trouble``); ``prompt_p50`` / ``prompt_tail``: the prompt median and the
    larger of p99 and the highest bucket; ``fits``: the requests the pool holds counted in
    blocks where known (vLLM 0.34: (N − 1) // req_blocks(typical), derive
    ``kv_pool_requests_typical``), else kv // typical. The value is that count rounded down to
    :func:`seqs_step`. None when the traffic is mixed (the tail ≥ ``tail_ratio`` × the median:
    a few huge requests are the problem, a limit from the median would only serialise the
    rest), or when the value is below ``needed`` (the cache cannot hold the concurrency the
    traffic needs at this request size: cap or chunk the tail, or more KV, instead)."""
    if not kv_tokens or not typical_tokens or typical_tokens < 1:
        return None, "the KV capacity or the request size is unknown"
    if prompt_p50 and prompt_tail and prompt_tail >= tail_ratio * prompt_p50:
        return None, (
            f"the prompts are mixed (p99 {prompt_tail:,.0f} vs median {prompt_p50:,.0f} tokens): a few huge"
            " requests fill the cache, and a limit from the median would only serialise the rest"
        )
    held = fits if fits is not None and fits >= 0 else kv_tokens // typical_tokens
    seqs = seqs_step(held)
    if needed and seqs < needed:
        return None, (
            f"the cache holds only about {held:,} such requests, below the"
            f" {needed:,.0f} running before the trouble: fewer sequences would serialise the traffic"
        )
    return seqs, ""


def tp_that_fits(
    variables: Mapping[str, Any], total: int | None, gmu: float | None, gpus: int | None
) -> int | None:
    """The smallest ``--tensor-parallel-size`` whose weight shards and one ``max_model_len``
    request's KV cache fit each GPU's budget ``gmu × total`` bytes
    (:func:`kvdoctor.kvmath.smallest_tensor_parallel_size` over a rule context's ``arch``,
    ``weights_bytes``, ``max_model_len``, ``kv_cache_dtype`` and, on vLLM 0.34, ``block_size``);
    None when none fits within ``gpus`` or an input is unknown."""
    arch, weights, mml = variables.get("arch"), variables.get("weights_bytes"), variables.get("max_model_len")
    if arch is None or not weights or not total or not gpus or gmu is None or not mml:
        return None
    try:
        return kvmath.smallest_tensor_parallel_size(
            arch,
            weights_bytes=weights,
            gpu_total_bytes=total,
            gpu_memory_utilization=gmu,
            visible_gpus=gpus,
            max_model_len=mml,
            kv_cache_dtype=variables.get("kv_cache_dtype") or "auto",
            block_size=variables.get("block_size") if variables.get("vllm_v34") else None,
        )
    except (ValueError, TypeError, ZeroDivisionError, KeyError):
        return None
