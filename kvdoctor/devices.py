"""Device knowledge shared by sources and derive (no I/O): which GPU indices
``CUDA_VISIBLE_DEVICES`` makes visible, and the canonical spelling of a PCI bus id.

``kvdoctor.sources.env`` and ``kvdoctor.sources.nvidia_smi`` re-export these, so existing
imports keep working; derive imports them from here (derive calls no source module).
"""

from __future__ import annotations

import re

_BUS_RE = re.compile(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-9A-Fa-f])")


def visible_devices_detail(env: dict[str, str]) -> tuple[list[int] | None, str]:
    """``CUDA_VISIBLE_DEVICES`` → (GPU indices, note).

    Unset → (None, ""): all GPUs visible. ``""`` → ([], "…no GPU visible"). ``"0,1"`` → [0, 1].
    CUDA stops at the first invalid entry, so ``"0,-1,2"`` → [0]. UUIDs (``GPU-…``) and MIG
    instances (``MIG-…``) → (None, note): they name devices by id, which only NVML can map to an
    index. Never raises.
    """
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None, ""
    value = raw.strip()
    if value == "":
        return [], "CUDA_VISIBLE_DEVICES is empty: no GPU visible"
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if part.upper().startswith(("GPU-", "MIG-")):
            return None, f"CUDA_VISIBLE_DEVICES={value} names devices by UUID; indices need NVML to resolve"
        if not re.fullmatch(r"\d+", part):
            # CUDA ignores this entry and everything after it.
            note = f"CUDA_VISIBLE_DEVICES entry {part!r} is not a device index; CUDA ignores it and the rest"
            return out, note
        out.append(int(part))
    return out, ""


def visible_devices(env: dict[str, str]) -> list[int] | None:
    """GPU indices from ``CUDA_VISIBLE_DEVICES`` (see :func:`visible_devices_detail`); None when
    unset or given as UUIDs."""
    return visible_devices_detail(env)[0]


def normalize_bus_id(text: str | None) -> str | None:
    """Canonical PCI bus id "00000000:07:00.0" (8-digit domain, upper case) from any of
    nvidia-smi's spellings ("0000:07:00.0" on old drivers, "00000000:07:00.0"), NVML
    ``nvmlPciInfo_t.busId`` or XML ``<pci_bus_id>``. None when ``text`` holds no bus id."""
    if not text:
        return None
    m = _BUS_RE.search(text)
    if not m:
        return None
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):08X}:{bus.upper()}:{dev.upper()}.{fn.upper()}"
