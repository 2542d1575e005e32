"""Unit helpers shared by the parsers: sizes as printed by nvidia-smi, PyTorch and vLLM.

All sizes become integer bytes. Binary units (KiB, MiB, GiB, TiB) are powers of 1024; vLLM's
"GB" in V0 "Loading model weights took 7.5123 GB" is really GiB (it divides by 2**30), so "GB"
here means 2**30 unless ``decimal=True``.
"""

from __future__ import annotations

import math

from kvdoctor.lazyre import lazy_re

#: The largest magnitude a number read from an input may have: 2**53, the largest integer a
#: float holds exactly. No byte, token, block or request count, rate or ratio that vLLM,
#: NVML or a model's config.json reports comes near it; a number beyond it (or NaN, ±Inf)
#: is a corrupt input, read as unknown, so that no later arithmetic overflows.
MAX_QUANTITY = float(2**53)


#: The bound for a number that may be any 64-bit value: a launch flag's (``--seed`` takes any),
#: and so any number in a recording line (it holds the flags).
MAX_INT64 = float(2**64)


def in_range(x: float, limit: float = MAX_QUANTITY) -> bool:
    """True when ``x`` (int or float) is finite and ``|x| <= limit``; False for NaN."""
    return -limit <= x <= limit


def number_in_range(value: object, factor: float = 1.0) -> float | None:
    """``float(value) * factor`` when ``value`` reads as a number ("12.5", 7, "1e3") and the
    product is :func:`in_range`; None for text, None, NaN, ±Inf or a magnitude past
    :data:`MAX_QUANTITY`. For a number written as text by a source (a label value, a sample
    of Prometheus' HTTP API)."""
    try:
        f = float(value) * factor  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if in_range(f) else None


KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "kb": KiB,
    "mb": MiB,
    "gb": GiB,
    "tb": TiB,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": TiB,
}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# the unit a group of its own: "\s*(unit){0,8}\s*$" splits one run of spaces two ways (quadratic)
_SIZE_RE = lazy_re(r"^\s*(-?(?:\d{1,20}(?:\.\d{0,20})?|\.\d{1,20}))(?:\s*([A-Za-z]{1,8}))?\s*$")


def parse_size(text: str, *, default_unit: str = "b", decimal: bool = False) -> int:
    """Parse "20.00 MiB", "15.78 GiB", "0 bytes", "40960MiB", "8 GB" into bytes (int, rounded).

    ``default_unit`` applies when the text has no unit ("40960" with default_unit="mib").
    Raises ValueError on text that is not a number with a known unit.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError("not a size (expected a number and a unit, e.g. 20.00 MiB)")
    num = float(m.group(1))  # at most 20 digits: always finite
    unit = (m.group(2) or default_unit).lower()
    if decimal and unit in _DECIMAL:
        mult = _DECIMAL[unit]
    elif unit in _UNITS:
        mult = _UNITS[unit]
    else:
        raise ValueError(f"unknown size unit {m.group(2)[:8]!r}")
    return int(round(num * mult))


def gib(nbytes: float | None) -> float | None:
    """Bytes → GiB (float), None stays None."""
    return None if nbytes is None else nbytes / GiB


def fmt_bytes(nbytes: float | None) -> str:
    """Human display: "73.39 GiB", "512.00 MiB", "N/A" for None."""
    if nbytes is None:
        return "N/A"
    n = float(nbytes)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def floor_to(value: float, step: float) -> float:
    """Round ``value`` down to a multiple of ``step`` (0.01 for gmu), robust to float noise."""
    q = math.floor(value / step + 1e-9)
    return round(q * step, 10)


def ceil_to(value: float, step: float) -> float:
    """Round ``value`` up to a multiple of ``step``."""
    q = math.ceil(value / step - 1e-9)
    return round(q * step, 10)


def na(value: object, spec: str = "") -> str:
    """``format(value, spec)`` for a finding's words, "N/A" for None (a value not read)."""
    return "N/A" if value is None else format(value, spec)
