"""Renderers of the watch screen's panels: View → rich Text of a given width.

Pure functions of a :class:`~kvdoctor.watch.controller.View` (no Textual), so they are cheap
to test and each panel can collapse to fewer lines (``lines``) rather than overflow.
"""

from __future__ import annotations

from kvdoctor.units import GiB

SPARK = " ▁▂▃▄▅▆▇█"
SEVERITY_STYLE = {
    "critical": "bold white on red",
    "warning": "bold black on yellow",
    "info": "bold black on cyan",
}
SEVERITY_FG = {"critical": "red", "warning": "yellow", "info": "cyan"}
SEVERITY_SHORT = {"critical": "CRIT", "warning": "WARN", "info": "INFO"}


def gib(nbytes: float | None, digits: int = 1) -> str:
    """Bytes as "23.7G" (GiB, the unit nvidia-smi users read), "–" when unknown."""
    if nbytes is None:
        return "–"
    return f"{nbytes / GiB:.{digits}f}G"


def pct(frac: float | None) -> str:
    """A fraction 0..1 as "97%", "–" when unknown."""
    return "–" if frac is None else f"{frac * 100:.0f}%"


def sparkline(values: list[float], width: int) -> str:
    """Values 0..1 (oldest first) as ``width`` block characters; older samples are binned
    (max per bin) so the line spans the whole history; padded on the left when short."""
    if width <= 0:
        return ""
    if not values:
        return " " * width
    if len(values) > width:
        n = len(values)
        bins = [
            max(values[i * n // width : max(i * n // width + 1, (i + 1) * n // width)]) for i in range(width)
        ]
    else:
        bins = list(values)
    chars = "".join(SPARK[min(len(SPARK) - 1, max(0, round(v * (len(SPARK) - 1))))] for v in bins)
    return chars.rjust(width)
