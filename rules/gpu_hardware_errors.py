"""## What
NVIDIA XID errors that mean the device is failing (48 double-bit ECC, 63/64 page retirement
or row remapping, 74 NVLink, 79 "GPU has fallen off the bus", 92/94/95 ECC, 119/120 GSP, 123,
and 154 "GPU recovery action … GPU Reset Required", which Blackwell cards log alone, …) in
the kernel log (`dmesg.txt` in a bundle, or `--dmesg FILE`), or uncorrectable ECC errors on
a GPU (nvidia-smi "Volatile Uncorr. ECC" / NVML).

## Why
A GPU with uncorrectable memory errors or one that dropped off the PCIe bus corrupts or kills
whatever runs on it: vLLM engines on it crash with CUDA errors ("an illegal memory access",
"unspecified launch failure") or hang, whatever their memory settings. XIDs 13, 31, 43 and 45
are caused by the program (a kernel or CUDA-graph bug, a killed process), not the device: alone
they are an info finding that names the process the driver names.

## How to confirm
`dmesg -T | grep -i xid`, `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`, and the GPU's
PCI bus id (nvidia-smi's Bus-Id column) to tell which card it is.

## Fix
None as vLLM flags: drain the node (cordon it), reset or replace the GPU named by its index and
bus id, then return it to service. The fix is the exact command, `nvidia-smi -r -i N` for each
failing GPU: it needs root and every process on that GPU stopped (nvidia-smi refuses while one
runs, so it cannot kill a workload by accident). No command for Xid 79 (the GPU fell off the
bus: a reset fails; reboot or reseat it) or when the GPU's index is unknown.

## Sources
spec/rules.md family P; NVIDIA XID catalogue (kvdoctor/devices.py HARDWARE_XIDS, APPLICATION_XIDS);
nvidia-smi's ECC column as read by kvdoctor/sources/nvidia_smi.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, na

_DMESG = "dmesg.txt / --dmesg (NVRM: Xid lines)"


@dataclass(frozen=True)
class Thresholds:
    """None: any hardware XID or uncorrectable ECC error counts."""


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def reset_commands(f: Facts) -> list[str]:
    """``nvidia-smi -r -i N`` for each failing GPU index, or [] when a reset is no remedy to
    offer: the index is unknown, or the GPU fell off the bus (Xid 79: the driver cannot reach
    it, a reset fails; it needs a reboot or reseating)."""
    gpus, xid = f["hw_error_gpus"], f["xid_desc"] or ""
    if not gpus or "Xid 79 " in xid or "fallen off the bus" in xid:
        return []
    return [f"nvidia-smi -r -i {g}" for g in sorted(set(gpus))]


def _failing_words(f: Facts, commands: list[str]) -> str:
    """Drain the node, and which card to reset (by index and PCI bus id)."""
    gpus, bus_ids, xid = f["hw_error_gpus"], f["hw_error_bus_ids"], f["xid_desc"]
    which = "GPU " + ", GPU ".join(str(g) for g in gpus) if gpus else "the GPU"
    if bus_ids:
        which += " (PCI " + ", ".join(bus_ids) + ")"
    reset = "; ".join(commands) if commands else "nvidia-smi -r"
    if xid is not None and ("Xid 154 " in xid or "Reset Required" in xid):
        how = f" reset (the XID asks for a GPU reset: {reset}, or a reboot)"
    elif xid is not None and ("Xid 79 " in xid or "fallen off the bus" in xid):
        how = " reseated or replaced (it fell off the bus: a reset fails, reboot the node first)"
    else:
        how = f" reset ({reset}, or a reboot) or replaced"
    words = (
        f"The device itself is failing; no vLLM flag fixes that. Drain the node and have {which}{how}"
        " before scheduling work on it again."
    )
    if commands:
        words += (
            " A reset needs root and every process on that GPU stopped first (the vLLM engines and any"
            " other CUDA process; nvidia-smi refuses while one runs)."
        )
    return words


def check(f: Facts, t: Thresholds) -> Hit | None:
    hw_count, xid, ecc, app = f["xid_hw_count"], f["xid_desc"], f["ecc_desc"], f["xid_app_desc"]
    failing = (hw_count or 0) > 0 or len(f["ecc_gpus"] or []) > 0
    if not failing and not (f["xid_app_count"] or 0) > 0:
        return None
    parts = []
    if hw_count:
        # a count without its description cannot be told (the YAML form's "N/A")
        parts.append(
            "N/A" if xid is None else f"The kernel log shows {hw_count} NVIDIA hardware XID error(s): {xid}. "
        )
    if ecc:
        parts.append(f"{ecc} (nvidia-smi Volatile Uncorr. ECC). ")
    commands = reset_commands(f) if failing else []
    if failing:
        parts.append(_failing_words(f, commands))
    if app:
        parts.append(
            (" " if failing else "")
            + f"Application XIDs, caused by the program rather than the device (a kernel or CUDA-graph"
            f" bug, or a killed process): {app}."
            + ("" if failing else " The GPU is not failing; look at the process named.")
        )
    evidence = []
    if hw_count:
        evidence.append(Evidence("hardware XID errors", na(xid), _DMESG))
    if ecc:
        evidence.append(Evidence("uncorrectable ECC errors", ecc, "nvidia-smi 'Volatile Uncorr. ECC' / NVML"))
    if app:
        evidence.append(Evidence("application XIDs", app, _DMESG))
    fixes = [
        Fix(
            commands=tuple(commands),
            why="resets the failing GPU; run it only after draining the node and stopping every process"
            " on that GPU (it needs root, and nvidia-smi refuses while a process uses the GPU)",
        )
    ]
    return Hit(
        summary="".join(parts),
        evidence=evidence,
        fixes=fixes if commands else [],
        gpus=_gpus(f["hw_error_gpus"] if failing else f["xid_app_gpus"]),
        severity=None if failing else "info",
    )


RULE = Rule(
    id="gpu-hardware-errors",
    family="P",
    severity="critical",
    title="A GPU reports hardware errors (XID / uncorrectable ECC)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    explains=("engine-crashed",),
)
