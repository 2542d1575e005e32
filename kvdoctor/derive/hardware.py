"""Family hardware: uncorrectable ECC (nvidia-smi / NVML) and NVIDIA XIDs from the kernel log
(``kvdoctor.sources.dmesg``), by GPU."""

from __future__ import annotations

from typing import Any

from kvdoctor.derive.base import Family, Scope, Vars
from kvdoctor.devices import normalize_bus_id

WRITES: dict[str, str] = {
    "xid_hw_count": "count; hardware XID errors (48, 63, 64, 74, 79, 92, 94, 95, 119, …) in dmesg.txt / --dmesg",
    "xid_app_count": "count; XIDs usually caused by the application (13, 31, 43, 45, …)",
    "xid_desc": "str; 'Xid 79 on GPU 1 (00000000:07:00.0, dmesg line 3): GPU has fallen off the bus, …'",
    "ecc_gpus": "list[int]; GPUs with uncorrectable ECC errors (nvidia-smi 'Volatile Uncorr. ECC' / NVML)",
    "ecc_desc": "str; 'GPU 0: 2 uncorrectable ECC errors, …'",
    "hw_error_gpus": "list[int]; GPUs with hardware XIDs or uncorrectable ECC errors",
    "hw_error_bus_ids": "list[str]; their PCI bus ids (XIDs whose bus id matches no listed GPU included)",
}
READS: frozenset[str] = frozenset()


def derive(s: Scope, v: Vars) -> None:
    """Hardware XIDs and uncorrectable ECC errors, with the GPUs and bus ids they name."""
    snapshot = s.snapshot
    # Keyed by (node, bus id): identical machines have the same bus ids (nodes/<host>/ dmesg.txt
    # tags its XIDs with the node; a top-level one matches a bus id only one node has).
    by_bus = {(g.node, normalize_bus_id(g.bus_id)): g for g in snapshot.gpus if g.bus_id}
    hw = [x for x in snapshot.xid_events if x.get("hardware")]
    v["xid_hw_count"] = len(hw)
    v["xid_app_count"] = len(snapshot.xid_events) - len(hw)
    gpus: set[int] = set()
    buses: list[str] = []
    parts: list[str] = []
    seen: set[tuple[Any, Any, Any]] = set()
    for x in hw:
        g = by_bus.get((x.get("node"), x.get("bus_id")))
        if g is None and x.get("node") is None:
            same = [gg for (_n, b), gg in by_bus.items() if b == x.get("bus_id")]
            g = same[0] if len(same) == 1 else None
        if g is not None:
            gpus.add(g.index)
        if x.get("bus_id") and x["bus_id"] not in buses:
            buses.append(x["bus_id"])
        key = (x.get("xid"), x.get("bus_id"), x.get("node"))
        if key in seen:
            continue
        seen.add(key)
        node = f" of node {g.node}" if g is not None and g.node else ""
        where = (
            f"GPU {g.index}{node} ({x.get('bus_id')})" if g is not None else f"PCI {x.get('bus_id') or '?'}"
        )
        parts.append(
            f"Xid {x.get('xid')} on {where}, dmesg line {x.get('line')}: {str(x.get('message') or '').rstrip('.')}"
        )
    v["xid_desc"] = "; ".join(parts) if parts else None
    ecc = [g for g in snapshot.gpus if (g.ecc_uncorrectable or 0) > 0]
    v["ecc_gpus"] = [g.index for g in ecc]
    v["ecc_desc"] = (
        ", ".join(f"GPU {g.index}: {g.ecc_uncorrectable} uncorrectable ECC error(s)" for g in ecc)
        if ecc
        else None
    )
    for g in ecc:
        gpus.add(g.index)
        bid = normalize_bus_id(g.bus_id)
        if bid and bid not in buses:
            buses.append(bid)
    v["hw_error_gpus"] = sorted(gpus)
    v["hw_error_bus_ids"] = buses


FAMILY = Family("hardware", WRITES, READS, derive)
