"""nvidia-smi output → :class:`~kvdoctor.facts.Gpu` facts (offline twin of ``sources.nvml``).

Reads the four shapes people paste into bug reports and support bundles (spec/bundle.md):

- the plain ``nvidia-smi`` table, drivers 450 … 580 (:func:`parse_nvidia_smi_table`), one or
  several tables pasted one after another;
- ``nvidia-smi --query-gpu=… --format=csv[,noheader][,nounits]`` (:func:`parse_query_gpu_csv`),
  a time series when it has a ``timestamp`` column (the ``-l N`` loop);
- ``nvidia-smi --query-compute-apps=… --format=csv`` (:func:`parse_compute_apps_csv`);
- ``nvidia-smi -q -x`` (:func:`parse_nvidia_smi_xml`).

Units follow kvdoctor.facts: nvidia-smi's MiB become bytes (``MiB`` = 2**20), percentages become
fractions, watts and °C stay as printed. A field nvidia-smi prints as ``N/A``, ``[N/A]``,
``[Not Supported]`` or ``ERR!`` becomes None. Bad input raises :class:`SourceError` with origin
and line. Timestamps nvidia-smi prints (local time, no zone) are read as UTC.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kvdoctor.devices import normalize_bus_id
from kvdoctor.facts import Gpu, GpuProcess, SourceError
from kvdoctor.lazyre import lazy_re
from kvdoctor.sources.limits import MAX_TEXT_BYTES, guarded, read_bytes
from kvdoctor.units import MiB, parse_size

if TYPE_CHECKING:
    import xml.etree.ElementTree as ET

__all__ = [
    "CLOCK_EVENT_REASON_BITS",
    "attach_processes",
    "decode_clock_event_reasons",
    "latest_gpus",
    "normalize_bus_id",
    "parse_compute_apps_csv",
    "parse_nvidia_smi_file",
    "parse_nvidia_smi_table",
    "parse_nvidia_smi_text",
    "parse_nvidia_smi_xml",
    "parse_query_gpu_csv",
]

#: NVML clocks event (throttle) reason bits → kvdoctor names, in bit order. Same values for
#: ``nvmlClocksEventReason*`` and the older ``nvmlClocksThrottleReason*`` constants; nvidia-smi's
#: ``clocks_event_reasons.active`` CSV field prints this mask as hex.
CLOCK_EVENT_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clocks_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Decode an NVML clocks event reasons bitmask (``nvmlDeviceGetCurrentClocksEventReasons``,
    CSV ``clocks_event_reasons.active`` "0x…0001") into names like ["gpu_idle"], in bit order.
    Unknown bits are ignored. Never raises."""
    return [name for bit, name in CLOCK_EVENT_REASON_BITS if mask & bit]


# --------------------------------------------------------------------------- small helpers


def _is_na(v: str) -> bool:
    """nvidia-smi's ways of saying "no value": N/A, [N/A], [Not Supported], ERR!, …"""
    v = v.strip()
    return (
        not v
        or v in ("N/A", "ERR!", "Not Supported", "Unknown Error", "Unknown")
        or (v.startswith("[") and v.endswith("]"))
    )


# "\s*(unit){0,8}\s*$" would split one run of spaces two ways (quadratic on a padded cell):
# the unit, when there is one, is a group of its own
_NUM_RE = lazy_re(r"^\s*(-?\d{1,20}(?:\.\d{1,20})?)(?:\s*([A-Za-z%°]{1,8}))?\s*$")


def _num(v: str) -> float | None:
    """ "187.32 W", "41 C", "21 %", "21" → float; N/A-ish → None. Raises ValueError otherwise."""
    if _is_na(v):
        return None
    m = _NUM_RE.match(v)
    if not m:
        raise ValueError("not a number")
    return float(m.group(1))


def _mib(v: str) -> int | None:
    """ "40960 MiB", "40960MiB", "40960" (nounits, MiB) → bytes; N/A-ish → None."""
    if _is_na(v):
        return None
    return parse_size(v, default_unit="mib")


def _frac(v: str) -> float | None:
    """ "21 %", "21%", "21" → 0.21; N/A-ish → None."""
    x = _num(v)
    return None if x is None else x / 100.0


_CTRL_RE = lazy_re("[\x00-\x08\x0b\x0e-\x1f\ufffd]")


def _check_text(text: object, origin: str, what: str) -> str:
    """Reject non-str, empty and binary input with one clear line."""
    if not isinstance(text, str):
        raise SourceError(f"{what}: expected text, got {type(text).__name__}", origin=origin or None)
    if not text.strip():
        raise SourceError(f"{what}: empty input", origin=origin or None)
    sample = text[:4096]
    bad = len(_CTRL_RE.findall(sample))
    if "\x00" in sample or bad > max(8, len(sample) // 20):
        raise SourceError(f"{what}: binary data, not text", origin=origin or None)
    return text.lstrip("\ufeff")


_FAIL_MESSAGES = (
    "No devices were found",
    "NVIDIA-SMI has failed",
    "Failed to initialize NVML",
    "couldn't communicate with the NVIDIA driver",
)


def _check_failure(text: str, origin: str) -> None:
    """nvidia-smi's own failure messages become a SourceError quoting them."""
    head = text.strip()[:400]
    for msg in _FAIL_MESSAGES:
        if msg in head:
            # nvidia-smi's own words, matched against the known list (not the file's text)
            raise SourceError(f"nvidia-smi reported an error: {msg}", origin=origin or None, line=1)


# --------------------------------------------------------------------------- the table

_TABLE_HEADER_RE = lazy_re(r"NVIDIA-SMI\s+\S+")
# A shell prompt running nvidia-smi ("root@gpu-node-2:~# nvidia-smi", "user@host:~$ nvidia-smi",
# "[user@host ~]$ nvidia-smi") or a header naming a host ("==> gpu-node-2 <==" as `tail`/`head`
# print between files, "### gpu-node-2"): the table after it is that host's (bundle.md).
_PROMPT_HOST_RE = lazy_re(
    r"^\s*\[?[\w.\-]{1,64}@([A-Za-z0-9][\w.\-]{0,253})[: ][^\n]{0,200}?[#$%>] *nvidia-smi\b"
)
_HEADER_HOST_RE = lazy_re(
    r"^\s*(?:==> *([A-Za-z0-9][\w.\-/]{0,253}?) *<==|#{2,4} +([A-Za-z0-9][\w.\-]{0,253}))\s*$"
)
_DATE_RE = lazy_re(r"^\s*[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\s*$")
#: the last word of row 1's first cell (Persistence-M; WDDM/TCC/MCDM: the Windows driver model).
_PM_WORDS = frozenset({"On", "Off", "N/A", "WDDM", "TCC", "MCDM"})
#: a table line longer than this is no nvidia-smi line (theirs are ~90-120 characters; names
#: are cut to fit): it is skipped before any pattern sees it.
MAX_TABLE_LINE_CHARS = 4096
_TEMP_RE = lazy_re(r"(?<![\w.])(\d+)C\b")
_POWER_RE = lazy_re(r"(?<!\S)(\S{1,32})[ \t]{0,32}/[ \t]{0,32}(\S{1,32})[ \t]*$")
_WATTS_RE = lazy_re(r"^(\d+(?:\.\d+)?)W$")
_MEM_RE = lazy_re(r"(?<!\d)(\d{1,15})MiB\s{0,32}/\s{0,32}(\d{1,15})MiB")
_UTIL_RE = lazy_re(r"^\s*(\d+)%")
_PROC_GICI = lazy_re(
    r"^\|\s*(\d+|N/A)\s+(\S+)\s+(\S+)\s+(\d+|N/A)\s+([CGM+]{1,3})\s+(.*\S)?\s+(\d+MiB|N/A)\s*\|\s*$"
)
_PROC_PLAIN = lazy_re(r"^\|\s*(\d+|N/A)\s+(\d+|N/A)\s+([CGM+]{1,3})\s+(.*\S)?\s+(\d+MiB|N/A)\s*\|\s*$")


def _watts(v: str) -> float | None:
    m = _WATTS_RE.match(v.strip())
    return float(m.group(1)) if m else None


def _cells(line: str) -> list[str]:
    """Split "| a | b | c |" into ["a", "b", "c"] (unstripped)."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return s.split("|")


class _Table:
    """One pasted ``nvidia-smi`` table while it is being read."""

    __slots__ = ("gpus", "by_index", "timestamp", "in_procs", "proc_gici", "line", "host")

    def __init__(self, line: int, timestamp: float | None = None, host: str | None = None) -> None:
        self.gpus: list[Gpu] = []
        #: the host a shell prompt or a header line before the table named (bundle.md), else None.
        self.host = host
        self.by_index: dict[int, Gpu] = {}
        self.timestamp = timestamp
        self.in_procs = False
        self.proc_gici = True
        self.line = line


_WEEKDAYS = frozenset(("mon", "tue", "wed", "thu", "fri", "sat", "sun"))
_MONTHS = {
    m: i
    for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1
    )
}


def _parse_date(line: str) -> float | None:
    """nvidia-smi's first line "Sat Aug 26 09:14:38 2023" → unix seconds (read as UTC).

    What ``datetime.strptime(line, "%a %b %d %H:%M:%S %Y")`` reads in the C locale, by hand:
    ``_strptime`` builds a dozen regexes on its first call, a cold start's cost for one line."""
    parts = line.split()
    if len(parts) != 5:
        return None
    wday, mon, day, hms, year = parts
    clock = hms.split(":")
    nums = [day, *clock, year]
    if (
        wday.lower() not in _WEEKDAYS
        or mon.lower() not in _MONTHS
        or len(clock) != 3
        or not all(n.isascii() and n.isdigit() and len(n) <= 2 for n in nums[:4])
        or not (year.isascii() and year.isdigit() and len(year) == 4)
    ):
        return None
    try:
        d, h, mi, sec = (int(n) for n in nums[:4])
        dt = datetime(int(year), _MONTHS[mon.lower()], d, h, mi, sec, tzinfo=timezone.utc)
    except ValueError:  # Feb 30, 25:00:00
        return None
    return dt.timestamp()


def _gpu_rows(lines: list[str], i: int, cells: list[str], origin: str) -> tuple[Gpu, int] | None:
    """Read the 2-3 row block of one GPU starting at ``lines[i]``; return it and the next index.

    Row 1: ``| idx Name Persistence-M | Bus-Id Disp.A | Volatile Uncorr. ECC |``;
    row 2: ``| Fan Temp Perf Pwr:Usage/Cap | Memory-Usage | GPU-Util Compute M. |``;
    row 3 (drivers ≥ 450): ``| | | MIG M. |``.
    """
    bus = normalize_bus_id(cells[1])
    if bus is None:
        return None
    # "idx Name [Persistence-M]" by words, not "(\d+)\s+(.*?)\s+(On|Off)": a pattern over a
    # name padded with 64,000 spaces was quadratic (30 s)
    words = cells[0].split()
    if not words or not (words[0].isascii() and words[0].isdigit()) or len(words[0]) > 6:
        return None
    name_words = words[1:-1] if len(words) > 1 and words[-1] in _PM_WORDS else words[1:]
    gpu = Gpu(index=int(words[0]), name=" ".join(name_words) or None, bus_id=bus)
    ecc = cells[2].strip()
    if ecc.isdigit():
        gpu.ecc_uncorrectable = int(ecc)
    i += 1
    if i < len(lines) and lines[i].lstrip().startswith("|"):
        c2 = _cells(lines[i])
        if len(c2) >= 3 and normalize_bus_id(c2[1]) is None:
            i += 1
            tm = _TEMP_RE.search(c2[0])
            if tm:
                gpu.temperature_c = float(tm.group(1))
            pm = _POWER_RE.search(c2[0])
            if pm:
                gpu.power_w, gpu.power_limit_w = _watts(pm.group(1)), _watts(pm.group(2))
            if "Insufficient Permissions" in c2[1]:
                gpu.no_permission = True  # NoPermission, not N/A
            mm = _MEM_RE.search(c2[1])
            if mm:
                gpu.memory_used_bytes = int(mm.group(1)) * MiB
                gpu.memory_total_bytes = int(mm.group(2)) * MiB
            um = _UTIL_RE.match(c2[2])
            if um:
                gpu.utilization_gpu = int(um.group(1)) / 100.0
            # Row 3: "MIG M." (Enabled / Disabled / N/A) under blank cells.
            if i < len(lines) and lines[i].lstrip().startswith("|"):
                c3 = _cells(lines[i])
                if len(c3) >= 3 and not c3[0].strip() and not c3[1].strip():
                    mig = c3[2].strip()
                    if mig in ("Enabled", "Disabled", "N/A"):
                        gpu.mig_enabled = {"Enabled": True, "Disabled": False}.get(mig)
                        i += 1
    return gpu, i


def _split_tables(text: str, origin: str) -> list[_Table]:
    lines = [ln if len(ln) <= MAX_TABLE_LINE_CHARS else "" for ln in text.splitlines()]
    tables: list[_Table] = []
    cur: _Table | None = None
    pending_ts: float | None = None
    pending_host: str | None = None
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i]
        s = line.lstrip()
        if not s.startswith("|"):
            if s and s[0].isalpha() and _DATE_RE.match(line):
                pending_ts = _parse_date(line)
            elif s and ("@" in s or s[0] in "=#"):
                host = _line_host(s)
                if host is not None:
                    pending_host = host
            i += 1
            continue
        if "NVIDIA-SMI" in s and _TABLE_HEADER_RE.search(s):
            cur = _Table(i + 1, pending_ts, pending_host)
            tables.append(cur)
            pending_ts = None
            i += 1
            continue
        if "Processes:" in s:
            if cur is not None:
                cur.in_procs = True
            i += 1
            continue
        # Process rows are one cell wide; a wider row after them is the next table's GPU row.
        if cur is not None and cur.in_procs and s.count("|") <= 2:
            if "PID" in s:
                cur.proc_gici = " GI " in s
            elif "No running processes found" not in s:
                _proc_row(cur, line, i + 1, origin)
            i += 1
            continue
        cells = _cells(line)
        if len(cells) >= 3 and cells[0].strip()[:1].isdigit():
            got = _gpu_rows(lines, i, cells, origin)
            if got is not None:
                gpu, nxt = got
                # A GPU row after a Processes table, or an index seen again, starts a new table
                # (tables pasted without their "NVIDIA-SMI" header line).
                if cur is None or cur.in_procs or gpu.index in cur.by_index:
                    cur = _Table(i + 1, pending_ts, pending_host)
                    tables.append(cur)
                    pending_ts = None
                gpu.timestamp = cur.timestamp
                cur.gpus.append(gpu)
                cur.by_index[gpu.index] = gpu
                i = nxt
                continue
        i += 1
    return tables


def _line_host(s: str) -> str | None:
    """The host a shell-prompt or header line names (see ``_PROMPT_HOST_RE``), else None."""
    m = _PROMPT_HOST_RE.match(s)
    if m:
        return m.group(1)
    m = _HEADER_HOST_RE.match(s)
    if m:
        name = m.group(1) or m.group(2)
        # "==> nodes/gpu-node-2/nvidia-smi.txt <==": the file's directory names the host.
        parts = [p for p in name.split("/") if p and "smi" not in p.lower()]
        host = parts[-1] if parts else None
        # A heading of a pasted report ("### Before", "### nvidia-smi") names no host: a host
        # name has a digit, a dot or a hyphen ("gpu-node-2", "node1", "10.0.0.3").
        if host is None or "nvidia" in host.lower() or not any(c.isdigit() or c in ".-" for c in host):
            return None
        return host
    return None


def _proc_row(table: _Table, line: str, lineno: int, origin: str) -> None:
    """One row of the ``Processes:`` table: GPU [GI CI] PID Type Process-name GPU-Memory.
    ``N/A`` memory (MIG, Windows WDDM) → used_bytes None; an ``N/A`` PID (another PID namespace)
    cannot name a process, so that row is skipped."""
    m = _PROC_GICI.match(line) if table.proc_gici else _PROC_PLAIN.match(line)
    if m is None:
        m = _PROC_PLAIN.match(line) if table.proc_gici else _PROC_GICI.match(line)
        if m is None:
            return
    g = m.groups()
    if len(g) == 7:
        gpu_s, pid_s, typ, name, mem = g[0], g[3], g[4], g[5], g[6]
    else:
        gpu_s, pid_s, typ, name, mem = g
    if not gpu_s.isdigit() or not pid_s.isdigit():
        return
    gpu = table.by_index.get(int(gpu_s))
    if gpu is None:
        return
    used = int(mem[:-3]) * MiB if mem.endswith("MiB") else None
    gpu.processes.append(
        GpuProcess(pid=int(pid_s), name=(name or "").strip(), used_bytes=used, type=typ, gpu_uuid=gpu.uuid)
    )


@guarded("origin", 1)
def parse_nvidia_smi_table(text: str, origin: str = "") -> list[list[Gpu]]:
    """Parse the plain ``nvidia-smi`` table (drivers 450 … 580 layouts; older ones without the
    ``MIG M.`` row or the ``GI CI`` process columns too) into moments of GPUs.

    Returns one list of :class:`Gpu` per moment, oldest first. Several tables pasted one after
    another: a table whose bus ids were seen before is a later moment of the same node; a table
    with new bus ids is another node, read as part of the same moment; ``Gpu.node`` is set to
    "node1", "node2", … only when there is more than one node. A shell prompt before a table
    (``root@gpu-node-2:~# nvidia-smi``, ``user@host:~$ nvidia-smi``) or a ``==> host <==`` /
    ``### host`` header names its host: tables of differently named hosts are different nodes
    even with identical bus ids (``Gpu.node`` = the host), the same name is a later moment.

    Per GPU, from the table's columns: ``index``, ``name`` (as printed, possibly truncated
    "NVIDIA A100-SXM..."), ``bus_id`` ("Bus-Id"), ``memory_used_bytes``/``memory_total_bytes``
    ("Memory-Usage" MiB → bytes), ``utilization_gpu`` ("GPU-Util" % → fraction),
    ``temperature_c`` ("Temp"), ``power_w``/``power_limit_w`` ("Pwr:Usage/Cap"), ``mig_enabled``
    ("MIG M."), ``ecc_uncorrectable`` ("Volatile Uncorr. ECC" when a number), ``timestamp`` (the
    date line above the table, read as UTC) and ``processes`` from the ``Processes:`` table,
    attached by its "GPU" column.

    Raises SourceError (origin, line) on empty or binary text, nvidia-smi's own failure messages
    ("No devices were found", "NVIDIA-SMI has failed …") and text with no GPU rows.
    """
    text = _check_text(text, origin, "nvidia-smi table")
    # A table pasted with an indent (a chat, an issue's quote) is still a table.
    if text[:1] in (" ", "\t") or "\n " in text or "\n\t" in text:
        import textwrap  # dedent changes only text with an indented line: none, no import

        text = textwrap.dedent(text)
    _check_failure(text, origin)
    tables = [t for t in _split_tables(text, origin) if t.gpus]
    if not tables:
        raise SourceError("no GPU rows found: not an nvidia-smi table", origin=origin or None, line=1)
    return _group_moments(tables)


def _group_moments(tables: list[_Table]) -> list[list[Gpu]]:
    """Assign tables to nodes and to moments (see parse_nvidia_smi_table): a table whose host a
    prompt or header named is that host's, whatever its bus ids; an unnamed one by bus id."""
    node_buses: list[set[str]] = []
    node_names: list[str | None] = []
    moments: list[list[Gpu]] = []
    moment_nodes: set[int] = set()
    table_node: list[tuple[_Table, int]] = []
    for t in tables:
        buses = {g.bus_id or f"#{g.index}" for g in t.gpus}
        if t.host is not None:
            node = next((k for k, name in enumerate(node_names) if name == t.host), None)
        else:
            node = next(
                (k for k, known in enumerate(node_buses) if node_names[k] is None and known & buses), None
            )
        if node is None:
            node_buses.append(set(buses))
            node_names.append(t.host)
            node = len(node_buses) - 1
        else:
            node_buses[node] |= buses
        if not moments or node in moment_nodes:
            moments.append([])
            moment_nodes = set()
        moment_nodes.add(node)
        moments[-1].extend(t.gpus)
        table_node.append((t, node))
    if len(node_buses) > 1:
        for t, node in table_node:
            for g in t.gpus:
                g.node = node_names[node] or f"node{node + 1}"
    return moments


def latest_gpus(moments: Sequence[Sequence[Gpu]]) -> list[Gpu]:
    """The newest reading of every GPU: for each node (``Gpu.node``, None for a single node) the
    GPUs of the last moment that has that node, merged; ordered by node then index.
    ``[]`` for no moments. Never raises."""
    seen_nodes: set[str | None] = set()
    out: list[Gpu] = []
    for moment in reversed(moments):
        nodes_here = {g.node for g in moment} - seen_nodes
        out.extend(g for g in moment if g.node in nodes_here)
        seen_nodes |= nodes_here
    out.sort(key=lambda g: (g.node is not None, g.node or "", g.index))
    return out


# --------------------------------------------------------------------------- --query-gpu CSV

#: ``--query-gpu`` field (header without its "[unit]") → Gpu attribute and converter.
_GPU_FIELDS: dict[str, str] = {
    "index": "index",
    "name": "name",
    "gpu_name": "name",
    "uuid": "uuid",
    "gpu_uuid": "uuid",
    "pci.bus_id": "bus_id",
    "gpu_bus_id": "bus_id",
    "memory.total": "memory_total_bytes",
    "memory.used": "memory_used_bytes",
    "utilization.gpu": "utilization_gpu",
    "utilization.memory": "utilization_memory",
    "temperature.gpu": "temperature_c",
    "power.draw": "power_w",
    "power.draw.instant": "power_w",
    "power.draw.average": "power_w",
    "power.limit": "power_limit_w",
    "enforced.power.limit": "power_limit_w",
    "mig.mode.current": "mig_enabled",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrectable",
    "timestamp": "timestamp",
    "clocks_event_reasons.active": "clock_event_reasons",
    "clocks_throttle_reasons.active": "clock_event_reasons",
}
_REASON_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")
_HEADER_CELL = lazy_re(r"^[A-Za-z_][\w.]*(\s*\[[^\]]*\])?$")
_TS_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S")


def _parse_ts(v: str) -> float | None:
    """CSV ``timestamp`` "2024/07/24 10:15:20.123" → unix seconds, read as UTC."""
    if _is_na(v):
        return None
    for fmt in _TS_FORMATS:
        try:
            return datetime.strptime(v.strip(), fmt).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            continue
    raise ValueError("not a timestamp")


def _field_key(header: str) -> str:
    """ "memory.used [MiB]" → "memory.used"."""
    return header.split("[", 1)[0].strip().lower()


def _csv_rows(text: str, origin: str, what: str) -> list[tuple[int, list[str]]]:
    """Non-blank CSV rows with their 1-based line numbers, cells stripped."""
    import csv  # the CSV forms only: a table-only bundle does not import it

    rows: list[tuple[int, list[str]]] = []
    try:
        for lineno, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), 1):
            cells = [c.strip() for c in row]
            if any(cells):
                rows.append((lineno, cells))
    except csv.Error as e:
        raise SourceError(f"{what}: bad CSV: {e}", origin=origin or None) from None
    return rows


def _looks_like_header(cells: list[str]) -> bool:
    return all(_HEADER_CELL.match(c) for c in cells) and not all(c.isdigit() for c in cells)


def _set_gpu_field(gpu: Gpu, key: str, value: str) -> None:
    """Set one ``--query-gpu`` value on ``gpu``; raises ValueError on a malformed value."""
    if "Insufficient Permissions" in value:
        gpu.no_permission = True  # NoPermission, not N/A
        return
    attr = _GPU_FIELDS.get(key)
    if attr is None:
        if key.startswith(_REASON_PREFIXES) and not key.endswith(".supported"):
            # Per-reason columns: "Active" / "Not Active".
            if value.strip() == "Active":
                name = key.split(".", 1)[1]
                if name not in gpu.clock_event_reasons:
                    gpu.clock_event_reasons.append(name)
        return
    if attr == "index":
        if not value.strip().isdigit():
            raise ValueError("index is not a number")
        gpu.index = int(value)
    elif attr in ("name", "uuid"):
        setattr(gpu, attr, None if _is_na(value) else value.strip())
    elif attr == "bus_id":
        gpu.bus_id = normalize_bus_id(value) or (None if _is_na(value) else value.strip())
    elif attr in ("memory_total_bytes", "memory_used_bytes"):
        setattr(gpu, attr, _mib(value))
    elif attr in ("utilization_gpu", "utilization_memory"):
        setattr(gpu, attr, _frac(value))
    elif attr in ("temperature_c", "power_w", "power_limit_w"):
        x = _num(value)
        if x is not None or getattr(gpu, attr) is None:
            setattr(gpu, attr, x)
    elif attr == "mig_enabled":
        gpu.mig_enabled = {"enabled": True, "disabled": False}.get(value.strip().lower())
    elif attr == "ecc_uncorrectable":
        x = _num(value)
        gpu.ecc_uncorrectable = None if x is None else int(x)
    elif attr == "timestamp":
        gpu.timestamp = _parse_ts(value)
    elif attr == "clock_event_reasons":
        if not _is_na(value):
            for name in decode_clock_event_reasons(int(value.strip(), 16)):
                if name not in gpu.clock_event_reasons:
                    gpu.clock_event_reasons.append(name)


@guarded("origin", 1)
def parse_query_gpu_csv(text: str, origin: str = "", fields: Sequence[str] | None = None) -> list[list[Gpu]]:
    """Parse ``nvidia-smi --query-gpu=… --format=csv[,noheader][,nounits]`` into moments.

    The header row names the fields (``index, name, uuid, pci.bus_id, memory.total [MiB],
    memory.used [MiB], utilization.gpu [%], timestamp, temperature.gpu, power.draw [W],
    power.limit [W], clocks_event_reasons.active, mig.mode.current,
    ecc.errors.uncorrected.volatile.total``, …); for ``noheader`` output pass ``fields`` (the
    ``--query-gpu`` list). Values with or without units ("40960 MiB" / "40960"); "[N/A]",
    "[Not Supported]" → None. Columns kvdoctor does not use are ignored.

    A ``timestamp`` column ("2024/07/24 10:15:20.123", read as UTC → ``Gpu.timestamp``) with many
    rows (the ``-l N`` loop) gives a time series: a new moment starts when the timestamp changes
    or a GPU repeats. Without an ``index`` column a GPU's index is its row position in its moment.

    Raises SourceError (origin, line) on empty/binary text, a header with no known field, a row
    with the wrong cell count, or a value
    that is not what its column says.
    """
    what = "nvidia-smi --query-gpu CSV"
    text = _check_text(text, origin, what)
    _check_failure(text, origin)
    rows = _csv_rows(text, origin, what)
    if not rows:
        raise SourceError(f"{what}: no rows", origin=origin or None)
    if fields is not None:
        keys = [_field_key(f) for f in fields]
        header_line = 0
    else:
        header_line, header = rows[0]
        if not _looks_like_header(header):
            raise SourceError(
                f"{what}: no header row (noheader output needs the field list)",
                origin=origin or None,
                line=header_line,
            )
        keys = [_field_key(h) for h in header]
        rows = rows[1:]
    known = [k for k in keys if k in _GPU_FIELDS or k.startswith(_REASON_PREFIXES)]
    # Without an identity column (index, uuid, pci.bus_id) the row order is the index.
    if not known:
        raise SourceError(
            f"{what}: unknown header (no known --query-gpu field)",
            origin=origin or None,
            line=header_line or None,
        )
    moments: list[list[Gpu]] = []
    ids: set[tuple[str, str]] = set()
    last_ts: float | None = None
    has_index = "index" in keys
    first_bad: SourceError | None = None  # a bad row costs that row; raised only if none is good
    for n, (lineno, cells) in enumerate(rows):
        if len(cells) != len(keys):
            if n == len(rows) - 1 and len(cells) < len(keys) and moments:
                break  # a truncated last row (file cut while the loop was writing)
            first_bad = first_bad or SourceError(
                f"{what}: {len(cells)} values for {len(keys)} columns", origin=origin or None, line=lineno
            )
            continue
        gpu = Gpu(index=-1)
        try:
            for key, value in zip(keys, cells, strict=True):
                try:
                    _set_gpu_field(gpu, key, value)
                except (ValueError, OverflowError) as e:
                    raise SourceError(
                        f"{what}: column {key[:40]!r}: {e}", origin=origin or None, line=lineno
                    ) from None
        except SourceError as e:
            first_bad = first_bad or e
            continue
        ident = (
            ("uuid", gpu.uuid)
            if gpu.uuid
            else ("bus", gpu.bus_id)
            if gpu.bus_id
            else ("idx", str(gpu.index))
            if has_index
            else ("row", str(n))  # no identity column: only the timestamp starts a moment
        )
        new_ts = gpu.timestamp is not None and last_ts is not None and abs(gpu.timestamp - last_ts) >= 0.5
        if not moments or ident in ids or new_ts:
            moments.append([])
            ids = set()
        ids.add(ident)
        if not has_index:
            gpu.index = len(moments[-1])
        moments[-1].append(gpu)
        last_ts = gpu.timestamp
    if not moments:
        if first_bad is not None:
            raise first_bad
        raise SourceError(f"{what}: header but no GPU rows", origin=origin or None, line=header_line or None)
    return moments


# --------------------------------------------------------------------------- compute apps


@guarded("origin", 1)
def parse_compute_apps_csv(text: str, origin: str = "") -> list[GpuProcess]:
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv[,nounits]`` (``gpu_bus_id`` instead of / besides ``gpu_uuid`` too) into processes.

    Header fields used: ``pid``, ``process_name`` (or ``name``), ``used_memory`` /
    ``used_gpu_memory`` ("12830 MiB" → bytes; "[N/A]" → None), ``gpu_uuid``, ``gpu_bus_id``.
    Every row is a compute process (``type`` "C"). A header with no rows means no processes: [].

    Raises SourceError (origin, line) on empty/binary text, a header without ``pid`` or without
    any GPU key, a row with the wrong cell count, or a non-numeric pid or memory value.
    """
    what = "nvidia-smi --query-compute-apps CSV"
    text = _check_text(text, origin, what)
    _check_failure(text, origin)
    rows = _csv_rows(text, origin, what)
    header_line, header = rows[0]
    keys = [_field_key(h) for h in header]
    if "pid" not in keys or not {"gpu_uuid", "gpu_bus_id"} & set(keys):
        raise SourceError(
            f"{what}: unknown header (needs pid and gpu_uuid or gpu_bus_id)",
            origin=origin or None,
            line=header_line,
        )
    procs: list[GpuProcess] = []
    first_bad: SourceError | None = None  # a bad row costs that row; raised only if none is good
    for lineno, cells in rows[1:]:
        if len(cells) == 1 and "No running" in cells[0]:
            continue
        if len(cells) != len(keys):
            first_bad = first_bad or SourceError(
                f"{what}: {len(cells)} values for {len(keys)} columns", origin=origin or None, line=lineno
            )
            continue
        row = dict(zip(keys, cells, strict=True))
        pid_s = row["pid"]
        if not pid_s.isdigit() or len(pid_s) > 10:
            if _is_na(pid_s):
                continue  # a process in another PID namespace: nothing to name it by
            first_bad = first_bad or SourceError(
                f"{what}: pid is not a number", origin=origin or None, line=lineno
            )
            continue
        try:
            used = _mib(row.get("used_memory", row.get("used_gpu_memory", "")))
        except (ValueError, OverflowError) as e:
            first_bad = first_bad or SourceError(
                f"{what}: used memory: {e}", origin=origin or None, line=lineno
            )
            continue
        uuid = row.get("gpu_uuid")
        procs.append(
            GpuProcess(
                pid=int(pid_s),
                name=row.get("process_name", row.get("name", "")),
                used_bytes=used,
                type="C",
                gpu_uuid=None if uuid is None or _is_na(uuid) else uuid,
                gpu_bus_id=normalize_bus_id(row.get("gpu_bus_id")),
            )
        )
    if not procs and first_bad is not None:
        raise first_bad
    return procs


def attach_processes(gpus: Sequence[Gpu], procs: Iterable[GpuProcess]) -> None:
    """Attach ``procs`` (from :func:`parse_compute_apps_csv`) to their GPUs, in place.

    A process goes to the GPU with the same ``uuid``, else the same bus id; failing both (a
    table, which has no uuids) to the one GPU already listing that pid, whose ``uuid`` is then
    learnt from the process. A pid already listed on its GPU is merged (missing name, memory and
    uuid filled in) rather than duplicated. Processes matching no GPU are dropped. Never raises.
    """
    by_uuid = {g.uuid: g for g in gpus if g.uuid}
    by_bus = {g.bus_id: g for g in gpus if g.bus_id}
    for p in procs:
        gpu = by_uuid.get(p.gpu_uuid or "") or by_bus.get(normalize_bus_id(p.gpu_bus_id) or "")
        if gpu is None:
            holders = [g for g in gpus if any(q.pid == p.pid for q in g.processes)]
            if len(holders) != 1:
                continue
            gpu = holders[0]
            if gpu.uuid is None and p.gpu_uuid:
                gpu.uuid = p.gpu_uuid
                by_uuid[p.gpu_uuid] = gpu
        if p.gpu_uuid is None and gpu.uuid:
            p.gpu_uuid = gpu.uuid
        same = next((q for q in gpu.processes if q.pid == p.pid), None)
        if same is None:
            gpu.processes.append(p)
            continue
        same.name = same.name or p.name
        # nvidia-smi's table truncates long names ("...ython3"); the CSV has them whole.
        if p.name and (same.name.startswith("...") or len(p.name) > len(same.name)):
            same.name = p.name
        if same.used_bytes is None:
            same.used_bytes = p.used_bytes
        same.gpu_uuid = same.gpu_uuid or p.gpu_uuid
        same.gpu_bus_id = same.gpu_bus_id or p.gpu_bus_id or gpu.bus_id


# --------------------------------------------------------------------------- -q -x XML


def _xt(el: ET.Element | None, path: str) -> str | None:
    """Text at ``path`` under ``el``, None when absent or N/A-ish."""
    if el is None:
        return None
    t = el.findtext(path)
    return None if t is None or _is_na(t) else t.strip()


def _xnum(el: ET.Element | None, path: str) -> float | None:
    t = _xt(el, path)
    try:
        return None if t is None else _num(t)
    except ValueError:
        return None


def _xml_ecc(gpu_el: ET.Element) -> int | None:
    """Volatile uncorrectable ECC errors: ``ecc_errors/volatile`` ``dram_uncorrectable`` +
    ``sram_uncorrectable`` (or its ``_parity``/``_secded`` split, drivers ≥ 535), or the older
    ``double_bit/total``. None when every counter is N/A."""
    vol = gpu_el.find("ecc_errors/volatile")
    if vol is None:
        return None
    old = _xnum(vol, "double_bit/total")
    if vol.find("double_bit") is not None:
        return None if old is None else int(old)
    vals: list[float] = []
    names = {c.tag for c in vol}
    for c in vol:
        tag = c.tag
        if "uncorrectable" not in tag:
            continue
        if tag.startswith("sram_uncorrectable_") and "sram_uncorrectable" in names:
            continue  # split counters of a total that is also given
        x = _xnum(c, ".")
        if x is not None:
            vals.append(x)
    return int(sum(vals)) if vals else None


@guarded("origin", 1)
def parse_nvidia_smi_xml(text: str, origin: str = "") -> list[Gpu]:
    """Parse ``nvidia-smi -q -x`` (``<nvidia_smi_log>``, one ``<gpu>`` per device in index order).

    Per ``<gpu>``: ``product_name``, ``uuid``, ``pci/pci_bus_id``, ``fb_memory_usage/total`` and
    ``used`` ("81920 MiB" → bytes), ``utilization/gpu_util`` and ``memory_util`` ("21 %" →
    fraction), ``temperature/gpu_temp`` ("41 C"), ``gpu_power_readings`` (or the older
    ``power_readings``) ``power_draw``/``instant_power_draw`` and
    ``current_power_limit``/``power_limit`` (W), ``mig_mode/current_mig``,
    ``clocks_event_reasons`` (older ``clocks_throttle_reasons``) children that are "Active",
    ``ecc_errors/volatile`` uncorrectable counts, and ``processes/process_info`` (pid, type,
    process_name, used_memory). The index is the ``<gpu>``'s position.

    Raises SourceError (origin, line) on empty/binary text, malformed or truncated XML (with
    the parser's line) and a document that is not ``<nvidia_smi_log>``.
    """
    what = "nvidia-smi -q -x XML"
    text = _check_text(text, origin, what)
    import xml.etree.ElementTree as ET  # only for -q -x XML: not imported to start

    try:
        # ET (expat) ignores the DOCTYPE and never fetches external entities.
        root = ET.fromstring(text)
    except ET.ParseError as e:
        line = e.position[0] if getattr(e, "position", None) else None
        raise SourceError(
            f"{what}: malformed XML ({e.msg if hasattr(e, 'msg') else e})", origin=origin or None, line=line
        ) from None
    if root.tag != "nvidia_smi_log":
        raise SourceError(
            f"{what}: root element is <{root.tag}>, not <nvidia_smi_log>", origin=origin or None, line=1
        )
    gpus: list[Gpu] = []
    for idx, g in enumerate(root.findall("gpu")):
        gpu = Gpu(index=idx)
        gpu.name = _xt(g, "product_name")
        gpu.uuid = _xt(g, "uuid")
        gpu.bus_id = normalize_bus_id(_xt(g, "pci/pci_bus_id") or g.get("id"))
        for attr, path in (
            ("memory_total_bytes", "fb_memory_usage/total"),
            ("memory_used_bytes", "fb_memory_usage/used"),
        ):
            t = _xt(g, path)
            try:
                setattr(gpu, attr, None if t is None else parse_size(t, default_unit="mib"))
            except ValueError:
                setattr(gpu, attr, None)
        u = _xnum(g, "utilization/gpu_util")
        gpu.utilization_gpu = None if u is None else u / 100.0
        u = _xnum(g, "utilization/memory_util")
        gpu.utilization_memory = None if u is None else u / 100.0
        gpu.temperature_c = _xnum(g, "temperature/gpu_temp")
        pr = g.find("gpu_power_readings")
        if pr is None:
            pr = g.find("power_readings")
        if pr is not None:
            gpu.power_w = next(
                (
                    x
                    for x in (
                        _xnum(pr, p) for p in ("power_draw", "instant_power_draw", "average_power_draw")
                    )
                    if x is not None
                ),
                None,
            )
            gpu.power_limit_w = next(
                (
                    x
                    for x in (
                        _xnum(pr, p) for p in ("current_power_limit", "power_limit", "enforced_power_limit")
                    )
                    if x is not None
                ),
                None,
            )
        mig = _xt(g, "mig_mode/current_mig")
        gpu.mig_enabled = {"Enabled": True, "Disabled": False}.get(mig or "")
        reasons = g.find("clocks_event_reasons")
        if reasons is None:
            reasons = g.find("clocks_throttle_reasons")
        if reasons is not None:
            for c in reasons:
                if (c.text or "").strip() == "Active":
                    name = re.sub(r"^clocks?_(event|throttle)_reasons?_", "", c.tag)
                    gpu.clock_event_reasons.append(name)
        gpu.ecc_uncorrectable = _xml_ecc(g)
        for p in g.findall("processes/process_info"):
            pid = _xt(p, "pid")
            if pid is None or not pid.isdigit():
                continue
            used_t = _xt(p, "used_memory")
            try:
                used = None if used_t is None else parse_size(used_t, default_unit="mib")
            except ValueError:
                used = None
            gpu.processes.append(
                GpuProcess(
                    pid=int(pid),
                    name=_xt(p, "process_name") or "",
                    used_bytes=used,
                    type=_xt(p, "type"),
                    gpu_uuid=gpu.uuid,
                    gpu_bus_id=gpu.bus_id,
                )
            )
        gpus.append(gpu)
    if not gpus:
        raise SourceError(f"{what}: no <gpu> elements", origin=origin or None, line=1)
    return gpus


# --------------------------------------------------------------------------- sniffing


@guarded("origin", 1)
def parse_nvidia_smi_text(text: str, origin: str = "") -> list[list[Gpu]]:
    """Parse any nvidia-smi GPU output, telling the shape from the text: ``-q -x`` XML (one
    moment), the plain table, or ``--query-gpu`` CSV. Returns moments as
    :func:`parse_nvidia_smi_table`. A ``--query-compute-apps`` CSV holds no GPUs and is refused
    (read it with :func:`parse_compute_apps_csv` and :func:`attach_processes`).

    Raises SourceError (origin, line) on empty/binary/unrecognised text and whatever the chosen
    parser raises.
    """
    text = _check_text(text, origin, "nvidia-smi output")
    head = text.lstrip()[:2000]
    if head.startswith("<"):
        return [parse_nvidia_smi_xml(text, origin)]
    if "NVIDIA-SMI" in head or head.startswith(("+--", "|")) or re.search(r"^\s*\|", head, re.M):
        return parse_nvidia_smi_table(text, origin)
    _check_failure(text, origin)
    first = head.splitlines()[0] if head else ""
    if "," in first:
        keys = {_field_key(c) for c in first.split(",")}
        if "pid" in keys and ({"process_name", "used_memory", "used_gpu_memory"} & keys):
            raise SourceError(
                "this is a --query-compute-apps CSV (processes, not GPUs); read it as compute-apps.csv",
                origin=origin or None,
                line=1,
            )
        return parse_query_gpu_csv(text, origin)
    raise SourceError(
        "not nvidia-smi output (expected the table, --query-gpu CSV or -q -x XML)",
        origin=origin or None,
        line=1,
    )


@guarded("path", 0)
def parse_nvidia_smi_file(path: str | Path) -> list[list[Gpu]]:
    """Read ``nvidia-smi.txt`` / ``nvidia-smi.csv`` / ``nvidia-smi.xml`` (any name: the shape is
    sniffed from the content, see :func:`parse_nvidia_smi_text`) into moments of GPUs.

    Raises SourceError (origin = the path) when the file cannot be read, is binary, or cannot be
    parsed.
    """
    origin = str(path)
    data = read_bytes(origin, MAX_TEXT_BYTES)
    if b"\x00" in data[:4096]:
        raise SourceError("nvidia-smi output: binary data, not text", origin=origin)
    return parse_nvidia_smi_text(data.decode("utf-8", errors="replace"), origin)
