"""Recordings: JSON lines of Snapshots, written by ``kvdoctor record``, replayed by every face.

Format (``kvdoctor.recording/1``): the first line is a header ``{"schema": "kvdoctor.recording/1",
"created": <unix s>, "kvdoctor": "<version>"}``; every further line is one Snapshot as a JSON
object (dataclass fields by name; ``+Inf`` histogram bounds as the string "+Inf"; sets as lists).
A ``.gz`` suffix is gzip, ``.zst`` zstandard (when the ``zstandard`` module is installed).
Append-only: a crash loses at most the last, partial line, which replay skips and reports.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import time
import typing
from pathlib import Path
from typing import IO, Any

from kvdoctor import facts
from kvdoctor.facts import Snapshot, SourceError, SourceStatus

SCHEMA = "kvdoctor.recording/1"


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_encode(v) for v in value)
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def snapshot_to_json(snap: Snapshot) -> str:
    """One Snapshot as one JSON line (no newline)."""
    return json.dumps(_encode(snap), separators=(",", ":"), allow_nan=False)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    got = _HINTS.get(cls)
    if got is None:
        got = typing.get_type_hints(cls, vars(facts))
        _HINTS[cls] = got
    return got


def _decode(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ValueError(f"expected an object for {tp.__name__}")
        hints = _hints(tp)
        kwargs = {
            f.name: _decode(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value
        }
        return tp(**kwargs)
    if origin is list:
        return [_decode(args[0] if args else Any, v) for v in value]
    if origin is tuple:
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=False)) if args else tuple(value)
    if origin is set:
        return set(value)
    if origin is dict:
        vt = args[1] if len(args) == 2 else Any
        return {k: _decode(vt, v) for k, v in value.items()}
    if tp is float:
        if value == "+Inf":
            return math.inf
        if value == "-Inf":
            return -math.inf
        return float(value)
    return value


def snapshot_from_json(line: str) -> Snapshot:
    """Parse one recording line into a Snapshot; raises ValueError for anything malformed."""
    obj = json.loads(line)
    snap = _decode(Snapshot, obj)
    if not isinstance(snap, Snapshot):
        raise ValueError("not a snapshot")
    return snap


def _open(path: Path, mode: str) -> IO[str]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(path, mode + "b"), encoding="utf-8")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise SourceError("reading .zst needs the zstandard module", origin=str(path)) from None
        raw = open(path, mode + "b")
        stream = (
            zstandard.ZstdCompressor().stream_writer(raw)
            if mode in ("w", "a")
            else zstandard.ZstdDecompressor().stream_reader(raw)
        )
        return io.TextIOWrapper(stream, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


class RecordingWriter:
    """Appends Snapshots to a recording; use as a context manager. Each line is flushed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = _open(path, "w")
        from kvdoctor import __version__

        self._fh.write(json.dumps({"schema": SCHEMA, "created": time.time(), "kvdoctor": __version__}) + "\n")
        self.count = 0

    def write(self, snap: Snapshot) -> None:
        """Append one Snapshot as one line."""
        self._fh.write(snapshot_to_json(snap) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        """Close the file."""
        self._fh.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordingFeed:
    """A finite, seekable feed over a recording's Snapshots (``kvdoctor.sampler.SnapshotFeed``).

    ``skipped`` counts lines that could not be read (a cut last line, a newer field); the first
    Snapshot returned carries a "recording" SourceStatus saying so."""

    live = False

    def __init__(self, path: Path, snapshots: list[Snapshot], skipped: int) -> None:
        self.path = path
        self.label = f"recording {path}"
        self._snapshots = snapshots
        self.skipped = skipped
        self._pos = 0

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def position(self) -> int:
        """Index of the Snapshot :meth:`next` returns next (0-based)."""
        return self._pos

    def seek(self, index: int) -> None:
        """Move to Snapshot ``index`` (clamped to 0..len)."""
        self._pos = max(0, min(index, len(self._snapshots)))

    @property
    def interval_s(self) -> float | None:
        """Median seconds between recorded Snapshots, None with fewer than two timed ones."""
        ts = [s.timestamp for s in self._snapshots if s.timestamp is not None]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False) if b > a)
        return gaps[len(gaps) // 2] if gaps else None

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None at the end."""
        if self._pos >= len(self._snapshots):
            return None
        snap = self._snapshots[self._pos]
        self._pos += 1
        return snap

    def close(self) -> None:
        """Nothing to release."""


def open_recording(path: Path) -> RecordingFeed:
    """Read a recording made by :class:`RecordingWriter`. Raises SourceError when the file
    cannot be opened or has no recording header; bad lines are skipped and counted."""
    if not path.is_file():
        raise SourceError("no such recording", origin=str(path))
    snapshots: list[Snapshot] = []
    skipped = 0
    try:
        with _open(path, "r") as fh:
            header_line = fh.readline()
            try:
                header = json.loads(header_line)
            except ValueError:
                raise SourceError("not a kvdoctor recording (no header line)", origin=str(path)) from None
            if not isinstance(header, dict) or not str(header.get("schema", "")).startswith(
                "kvdoctor.recording/"
            ):
                raise SourceError("not a kvdoctor recording (no header line)", origin=str(path))
            for line in fh:
                try:
                    snapshots.append(snapshot_from_json(line))
                except (ValueError, TypeError, KeyError):
                    skipped += 1
    except (OSError, EOFError) as e:
        if not snapshots:
            raise SourceError(f"cannot read recording: {type(e).__name__}", origin=str(path)) from None
        skipped += 1  # a cut compressed stream: keep what was read
    if snapshots:
        detail = f"{len(snapshots)} snapshot(s)" + (
            f", {skipped} unreadable line(s) skipped" if skipped else ""
        )
        snapshots[-1].sources.append(SourceStatus("recording", str(path), "ok", detail))
    return RecordingFeed(path, snapshots, skipped)
