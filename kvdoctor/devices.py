"""Device knowledge shared by sources and derive (no I/O): which GPU indices
``CUDA_VISIBLE_DEVICES`` makes visible, the canonical spelling of a PCI bus id, and which NVIDIA
XIDs mean a failing device and which the application (spec/rules.md ``gpu-hardware-errors``).

``kvdoctor.sources.env`` and ``kvdoctor.sources.nvidia_smi`` re-export these, so existing
imports keep working; derive imports them from here (derive calls no source module).
"""

from __future__ import annotations

import re

from kvdoctor.lazyre import lazy_re

#: XIDs that point at the GPU, its memory or its links rather than at the program: the node
#: should be drained and the GPU reset or replaced. rules.md's list (48, 63, 64, 74, 79, 92, 94,
#: 95, 119, 120, 123, 154) plus the other device faults of NVIDIA's XID catalogue (61, 62, 121,
#: 140). Source: docs.nvidia.com/deploy/xid-errors.
HARDWARE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping recorded (a reset is pending)",
    64: "ECC page retirement / row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    123: "SPI PMU RPC failure (GPU firmware)",
    140: "unrecovered ECC error",
    # Blackwell drivers log the recovery action alone ("GPU recovery action changed from 0x0
    # (None) to 0x1 (GPU Reset Required)"), also after a GSP firmware heartbeat loss.
    154: "GPU recovery action changed (GPU Reset Required)",
}

#: XIDs the application causes (rules.md): 13 graphics engine exception, 31 MMU fault (an
#: illegal address: a kernel or CUDA-graph bug), 43 GPU stopped processing (a killed or faulting
#: process), 45 preemptive cleanup (a process ended while it ran). Info, with the process named.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception (a kernel bug)",
    31: "GPU memory page fault (illegal address in a kernel or CUDA graph)",
    43: "GPU stopped processing (the process faulted or was killed)",
    45: "preemptive cleanup (a process ended while it ran)",
}

_BUS_RE = lazy_re(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-9A-Fa-f])")


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


#: the fp8 KV-cache dtypes whose e4m3 form needs native fp8 (compute capability ≥ 8.9)
FP8_KV_E4M3 = frozenset({"fp8", "fp8_e4m3"})
#: the plain fp8 KV-cache spellings a GPU's capability decides (fp8_e4m3 / fp8 = e4m3, fp8_e5m2)
FP8_KV_PLAIN = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})


def fp8_kv_cache_dtypes(capability: tuple[int, int]) -> tuple[str, ...]:
    """The plain fp8 ``--kv-cache-dtype`` values vLLM's CUDA attention backends take on a GPU of
    this compute capability, preferred first: Ada / Hopper / Blackwell (≥ 8.9) all three
    (``fp8`` = e4m3); Ampere (8.0–8.7) only ``fp8_e5m2`` (its backends convert e5m2 in software,
    e4m3 needs native fp8, as Triton's ``fp8e4nv``); Volta / Turing (< 8.0) none. Issue 24 kind 6."""
    if capability >= (8, 9):
        return ("fp8", "fp8_e4m3", "fp8_e5m2")
    if capability >= (8, 0):
        return ("fp8_e5m2",)
    return ()


def architecture_name(capability: tuple[int, int]) -> str:
    """NVIDIA's architecture name for a compute capability ('Ampere' for 8.0 and 8.6)."""
    major, minor = capability
    names = {7: "Volta" if minor < 5 else "Turing", 8: "Ada" if minor >= 9 else "Ampere", 9: "Hopper"}
    return names.get(major, "Blackwell" if major >= 10 else f"sm_{major}{minor}")
