"""Functions rule expressions may call beyond the basics (rules/*.yaml ``let``/``fix``).

The KV arithmetic is kvmath's: rules call it, they never copy it. Each wrapper returns None
instead of raising when an input is missing, so a rule with a gap renders "N/A" or drops a flag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvdoctor import kvmath


def _none_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if any(a is None for a in args):
            return None
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, ZeroDivisionError, KeyError):
            return None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def join(items: Iterable[Any] | None, sep: str = " ") -> str:
    """``join([48211, 48212])`` → "48211 48212" (str.join without attribute access)."""
    return sep.join(str(i) for i in (items or []))


def fmt(value: Any, spec: str = "") -> str:
    """``format(value, spec)``; "N/A" for None."""
    return "N/A" if value is None else format(value, spec)


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
    return ", ".join(f"{n} {fmt(x, spec)}" for n, x in zip(ns, vs, strict=True))


def count_at_least(values: Iterable[float | None] | None, threshold: float | None) -> int:
    """How many of ``values`` are ≥ ``threshold`` (None values never count); 0 for None."""
    if values is None or threshold is None:
        return 0
    return sum(1 for x in values if x is not None and x >= threshold)


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


RULE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "pp_layer_partition": _none_safe(pp_layer_partition),
    "smallest_tensor_parallel_size": _none_safe(kvmath.smallest_tensor_parallel_size),
    "max_model_len_for_tokens": _none_safe(kvmath.max_model_len_for_tokens),
    "max_num_seqs_for": _none_safe(kvmath.max_num_seqs_for),
    "gmu_for_bytes": _none_safe(kvmath.gmu_for_bytes),
    "gmu_fitting": _none_safe(kvmath.gmu_fitting),
    "join": join,
    "gpus_under": gpus_under,
    "gpus_full": gpus_full,
    "gmu_split": gmu_split,
    "pair_desc": pair_desc,
    "count_at_least": count_at_least,
    "format": fmt,
}
