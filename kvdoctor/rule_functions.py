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


RULE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "smallest_tensor_parallel_size": _none_safe(kvmath.smallest_tensor_parallel_size),
    "max_model_len_for_tokens": _none_safe(kvmath.max_model_len_for_tokens),
    "max_num_seqs_for": _none_safe(kvmath.max_num_seqs_for),
    "gmu_for_bytes": _none_safe(kvmath.gmu_for_bytes),
    "gmu_fitting": _none_safe(kvmath.gmu_fitting),
    "join": join,
    "format": fmt,
}
