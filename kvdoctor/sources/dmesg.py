"""The kernel log (``dmesg``, ``dmesg -T``, ``journalctl -k``) → NVIDIA XID events.

The NVIDIA driver reports GPU faults as ``NVRM: Xid (PCI:0000:07:00): 79, pid=1234, name=python3,
GPU has fallen off the bus.`` (older drivers omit ``pid=``/``name=``, some print the bus id without
``PCI:``). Each becomes a dict (the shape of :attr:`kvdoctor.facts.Snapshot.xid_events`):

- ``xid``: the XID number;
- ``bus_id``: the GPU's PCI bus id in nvidia-smi's canonical form ("00000000:07:00.0"), so it
  matches :attr:`kvdoctor.facts.Gpu.bus_id`; None when the line has none;
- ``pid``/``name``: the process the driver names (None for ``'<unknown>'``);
- ``message``: the driver's text after the numbers;
- ``line``: 1-based line in the file;
- ``hardware``: True for the XIDs that mean the device itself is failing (:data:`HARDWARE_XIDS`,
  kept in ``kvdoctor.devices``), False otherwise;
- ``application``: True for the XIDs the application causes (13, 31, 43, 45: :data:`APPLICATION_XIDS`).
"""

from __future__ import annotations

import os
from typing import Any

from kvdoctor.devices import APPLICATION_XIDS, HARDWARE_XIDS
from kvdoctor.facts import SourceError
from kvdoctor.lazyre import lazy_re
from kvdoctor.sources.limits import guarded, read_bytes
from kvdoctor.sources.nvidia_smi import normalize_bus_id

__all__ = ["APPLICATION_XIDS", "HARDWARE_XIDS", "parse_dmesg", "parse_dmesg_file"]

_XID_RE = lazy_re(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.(?P<fn>[0-7]))?\):"
    r"\s*(?P<xid>\d+)\s*,?\s*(?P<rest>.*)$"
)
_PID_RE = lazy_re(r"^pid=(?P<pid>[^,]*),\s*")
_NAME_RE = lazy_re(r"^name=(?P<name>[^,]*),\s*")
_MAX_BYTES = 64 * 1024 * 1024


def _pid(text: str) -> int | None:
    text = text.strip().strip("'\"")
    return int(text) if text.isdigit() else None


@guarded("origin", 1)
def parse_dmesg(text: str, origin: str = "") -> list[dict[str, Any]]:
    """Every NVIDIA XID line of a kernel log, in file order (other lines are ignored).

    Raises :class:`SourceError` (origin, line) when ``text`` is binary (NUL bytes or mostly
    undecodable characters), never for a log without XIDs (that is ``[]``).
    """
    events: list[dict[str, Any]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if "\x00" in raw or raw.count("\ufffd") > max(4, len(raw) // 10):
            raise SourceError("binary data, not a kernel log", origin=origin or None, line=lineno)
        if "Xid" not in raw:
            continue
        m = _XID_RE.search(raw)
        if m is None:
            continue
        rest = m.group("rest").strip()
        pid: int | None = None
        name: str | None = None
        mp = _PID_RE.match(rest)
        if mp:
            pid = _pid(mp.group("pid"))
            rest = rest[mp.end() :]
        mn = _NAME_RE.match(rest)
        if mn:
            got = mn.group("name").strip()
            name = None if got in ("", "<unknown>") else got
            rest = rest[mn.end() :]
        xid = int(m.group("xid"))
        events.append(
            {
                "xid": xid,
                "bus_id": normalize_bus_id(f"{m.group('bus')}.{m.group('fn') or '0'}"),
                "pid": pid,
                "name": name,
                "message": rest.strip() or HARDWARE_XIDS.get(xid) or APPLICATION_XIDS.get(xid, ""),
                "line": lineno,
                "hardware": xid in HARDWARE_XIDS,
                "application": xid in APPLICATION_XIDS,
            }
        )
    return events


@guarded("path", 0)
def parse_dmesg_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read and parse a kernel log file (``dmesg.txt``). Raises :class:`SourceError` for an
    unreadable, oversized or binary file."""
    origin = str(path)
    data = read_bytes(origin, _MAX_BYTES)
    if b"\x00" in data:
        line = data[: data.index(b"\x00")].count(b"\n") + 1
        raise SourceError("binary data, not a kernel log", origin=origin, line=line)
    return parse_dmesg(data.decode("utf-8", errors="replace"), origin=origin)
