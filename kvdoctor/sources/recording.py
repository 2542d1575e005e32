"""Recordings: JSON lines of Snapshots, written by ``kvdoctor record``, replayed by every face.

Format ``kvdoctor.recording/2`` (written now):

- line 1, the header: ``{"schema": "kvdoctor.recording/2", "created": <unix s>, "kvdoctor":
  "<version>", "interval_s": <s>|null, "label": "<input>"}``;
- then one line per Snapshot: a JSON object of its dataclass fields by name, a field left out
  when it holds its default (None, [], {}, False, …); ``+Inf``/``-Inf`` as strings, sets and
  tuples as lists;
- the parts that rarely change (:data:`STICKY`: ``log``, ``model``, ``configs``, ``env``,
  ``engines``, ``gpu_series``, ``xid_events``) are not on Snapshot lines: a *state line*
  ``{"$": {"model": {...}, "configs": [...]}}`` before a Snapshot gives the ones that changed,
  and holds for the Snapshots after it; a log that grew by appended lines is written as
  ``{"$": {"log+": {"events": [the new events], …the log's other fields}}}``;
- GPUs and scrapes are written against templates: a state line's ``"~gpus"`` / ``"~metrics"``
  holds one JSON object per list position, and a Snapshot line's item holds only the fields
  that differ from its position's template (a template field the item lacks is written as the
  field's default), so a GPU's name, bus id, total memory and processes or an engine's
  ``cache_config`` are not repeated on every line.

``kvdoctor.recording/1`` (every Snapshot complete on its line) is still read. Fields a reader
does not know (written by a newer kvdoctor, or removed since) are ignored and named in the
replay's "recording" source status. A ``.gz`` suffix is gzip, ``.zst`` zstandard (the optional
``zstandard`` module; a clear error without it). Append-only, flushed line by line: a crash
loses at most the last, partial line, which replay skips and reports.

Replay streams: :class:`RecordingFeed` holds one Snapshot ahead and a checkpoint every
:data:`CHECKPOINT_EVERY` Snapshots (file offset and the state), never the whole recording, so a
day at 1 Hz replays in bounded memory. :meth:`RecordingFeed.keep_last` passes over the Snapshot
lines it will not return without decoding them (only the small state lines are read), which
lets ``diagnose --recording`` read a day in seconds: its Timeline keeps the last ``max_len``
Snapshots anyway.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import io
import json
import math
import time
import types
import typing
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from kvdoctor import facts
from kvdoctor.facts import LogEvent, Snapshot, SourceError, SourceStatus, VllmLog
from kvdoctor.lazyre import lazy_re
from kvdoctor.units import MAX_INT64, MAX_QUANTITY, in_range

SCHEMA = "kvdoctor.recording/2"
#: schemas this reader understands
SCHEMAS = ("kvdoctor.recording/1", "kvdoctor.recording/2")
#: Snapshot fields written only when they change, on state lines ({"$": {...}}).
STICKY = ("log", "model", "configs", "env", "engines", "gpu_series", "xid_events")
#: a seek checkpoint every this many Snapshots
CHECKPOINT_EVERY = 1024
#: a line longer than this (bytes) is skipped as unreadable
MAX_LINE_BYTES = 64 * 1024 * 1024

_MISSING = object()


# --------------------------------------------------------------------------- encoding


def _enc_float(v: float) -> Any:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return None
    return v


def _encode(value: Any) -> Any:
    """Any fact → JSON-able value; dataclass fields holding their default are left out."""
    cls = type(value)
    enc = _ENCODERS.get(cls)
    if enc is not None:
        return enc(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_encoder(cls)(value)
    if cls is float:
        return _enc_float(value)
    if cls in (str, int, bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_encode(v) for v in value)
    if isinstance(value, float):
        return _enc_float(value)
    return str(value)


_ENCODERS: dict[type, Callable[[Any], Any]] = {}


def _dataclass_encoder(cls: type) -> Callable[[Any], Any]:
    defaults: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            defaults.append((f.name, f.default_factory()))
        else:
            defaults.append((f.name, _MISSING))

    def encode(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, default in defaults:
            v = getattr(obj, name)
            if default is not _MISSING and type(v) is type(default) and v == default:
                continue
            out[name] = _encode(v)
        return out

    _ENCODERS[cls] = encode
    return encode


def snapshot_to_json(snap: Snapshot) -> str:
    """One complete Snapshot as one JSON line (no newline; every part on it, as schema /1)."""
    return json.dumps(_encode(snap), separators=(",", ":"), allow_nan=False)


# --------------------------------------------------------------------------- decoding

#: A number that may be out of range (units.MAX_INT64): an integer part of 17 or more digits,
#: or a positive exponent of three digits. Only a line that has one is parsed again, checking
#: each number (kvdoctor writes none: no quantity it records comes near).
_BIG_NUMBER = lazy_re(r"(?<![.\d])\d{17}|[eE]\+?\d{3}")


def _constant(name: str) -> Any:
    # NaN / Infinity are not JSON (the writer refuses them, allow_nan=False): a corrupt line
    raise ValueError("a number that is not finite in a recording line")


def _checked_float(text: str) -> float:
    f = float(text)
    if not in_range(f, MAX_INT64):
        raise ValueError("number out of range in a recording line")
    return f


def _checked_int(text: str) -> int:
    if len(text) > 21 or not in_range(i := int(text), MAX_INT64):
        raise ValueError("number out of range in a recording line")
    return i


def loads_line(line: str | bytes) -> Any:
    """``json.loads`` of one recording line, refusing NaN, ±Infinity and numbers past a 64-bit
    value (``kvdoctor.units.MAX_INT64``: a recorded ``--seed`` may be any) with a ValueError: a
    corrupt line is skipped, never decoded into facts that later overflow arithmetic. The
    facts' own number fields are held to ``MAX_QUANTITY`` by the decoder. A line nested past
    Python's recursion limit is a ValueError too: that line is skipped, never the replay."""
    try:
        obj = json.loads(line, parse_constant=_constant)
        text = line if isinstance(line, str) else line.decode("latin-1")  # 1:1, never fails
        if _BIG_NUMBER.search(text) is not None:
            obj = json.loads(
                line, parse_constant=_constant, parse_float=_checked_float, parse_int=_checked_int
            )
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return obj


Conv = Callable[[Any], Any] | None


def _dec_float(v: Any) -> Any:
    if type(v) is float:
        return v
    if v == "+Inf":
        return math.inf
    if v == "-Inf":
        return -math.inf
    return float(v)


_DECODERS: dict[type, Callable[[Any], Any]] = {}
_HINTS: dict[type, dict[str, Any]] = {}
#: field names met in a recording that no fact has (an older or newer kvdoctor wrote them)
_unknown_seen: set[str] = set()


def _converter(tp: Any) -> Conv:
    """A function turning the JSON form of type ``tp`` back into it (None: as is)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            return None
        return _converter(inner[0])  # decoders never call a converter with None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_decoder(tp)
    if origin is list:
        item = _converter(args[0]) if args else None
        if item is None:
            return list
        if item is _dec_pair:  # histogram buckets: the hot loop of a replay
            return _dec_buckets
        it = item
        return lambda v: [it(x) for x in v]
    if origin is tuple:
        convs = [_converter(a) for a in args]
        if all(c is _dec_float for c in convs) and len(convs) == 2:
            return _dec_pair
        return lambda v: tuple(c(x) if c else x for c, x in zip(convs, v, strict=False))
    if origin is set:
        return set
    if origin is dict:
        vc = _converter(args[1]) if len(args) == 2 else None
        if vc is None:
            return dict
        c2 = vc
        return lambda v: {k: c2(x) for k, x in v.items()}
    if tp is float:
        return _dec_float
    return None


def _dec_pair(v: Any) -> tuple[float, float]:
    return (_dec_float(v[0]), _dec_float(v[1]))


def _dec_buckets(v: Any) -> list[tuple[float, float]]:
    """Histogram buckets ``[[le, cumulative count], …]``: ``le`` may be "+Inf", a count is a
    number in range (else ValueError: a corrupt line)."""
    out = [
        (a if a.__class__ is float else _dec_float(a), b if b.__class__ is float else _dec_float(b))
        for a, b in v
    ]
    if not all(-MAX_QUANTITY <= b <= MAX_QUANTITY for _a, b in out):
        raise ValueError("histogram bucket count out of range")
    return out


def _dataclass_decoder(cls: type) -> Callable[[Any], Any]:
    """A decoder for dataclass ``cls``: JSON object → instance. Fields needing no conversion
    go straight to the constructor; floats are converted only when written as strings
    ("+Inf"); unknown fields are dropped and named in ``_unknown_seen``."""
    got = _DECODERS.get(cls)
    if got is not None:
        return got
    known: set[str] = set()
    floats: list[str] = []
    #: fields typed int / str / bool (or Optional of one): (name, the classes a value may have)
    typed: list[tuple[str, tuple[type, ...]]] = []
    convs: dict[str, Callable[[Any], Any]] = {}

    def decode(obj: Any) -> Any:
        if obj.__class__ is not dict:
            raise ValueError(f"expected an object for {cls.__name__}")
        keys = obj.keys()
        extra = keys - known
        if extra:
            _unknown_seen.update(f"{cls.__name__}.{k}" for k in extra)
            obj = {k: v for k, v in obj.items() if k in known}
            keys = obj.keys()
        kw = obj
        for k in floats:
            v = obj.get(k)
            if v.__class__ is str:
                if kw is obj:
                    kw = dict(obj)  # never change the input: templates are shared
                v = kw[k] = _dec_float(v)
            if v is not None and not (v.__class__ in _NUMBER and -MAX_QUANTITY <= v <= MAX_QUANTITY):
                raise ValueError(f"{cls.__name__}.{k}: not a number in range")
        for k, allowed in typed:
            v = obj.get(k)
            if v is not None and v.__class__ not in allowed:
                raise ValueError(f"{cls.__name__}.{k}: wrong type")
            if v.__class__ is int and not -MAX_QUANTITY <= v <= MAX_QUANTITY:
                raise ValueError(f"{cls.__name__}.{k}: number out of range")
        todo = convs.keys() & keys
        if todo:
            if kw is obj:
                kw = dict(obj)
            for k in todo:
                v = obj[k]
                if v is not None:
                    kw[k] = convs[k](v)
        return cls(**kw)

    _DECODERS[cls] = decode  # before the fields: a type may refer to itself
    hints = typing.get_type_hints(cls, vars(facts))
    for f in dataclasses.fields(cls):
        known.add(f.name)
        conv = _converter(hints[f.name])
        if conv is _dec_float:
            floats.append(f.name)
        elif conv is not None:
            convs[f.name] = conv
        else:
            prim = _primitive(hints[f.name])
            if prim is not None:
                typed.append((f.name, prim))
    return decode


#: a float field's JSON value: a number (JSON has no int/float split for whole numbers)
_NUMBER = (float, int)


def _primitive(tp: Any) -> tuple[type, ...] | None:
    """The classes a JSON value of type ``tp`` (int, str, bool, or Optional of one) may have;
    None for any other type (checked by its own converter, or not at all)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) != 1:
            return None
        tp = inner[0]
    return {int: (int,), str: (str,), bool: (bool,)}.get(tp)


def snapshot_from_json(line: str | bytes) -> Snapshot:
    """Parse one complete Snapshot line (``kvdoctor.recording/1``, or :func:`snapshot_to_json`)
    into a Snapshot; raises ValueError for anything malformed."""
    obj = loads_line(line)
    snap = _dataclass_decoder(Snapshot)(obj)
    if not isinstance(snap, Snapshot):
        raise ValueError("not a snapshot")
    return snap


# --------------------------------------------------------------------------- files


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise SourceError(
            ".zst recordings need the zstandard module (pip install zstandard), or use .gz"
        ) from None
    return zstandard


def _open_binary(path: Path, mode: str) -> IO[bytes]:
    """The file as bytes, decompressed by suffix; ``mode`` "r" or "w"."""
    name = path.name.lower()
    if name.endswith(".gz"):
        if mode == "w":
            return typing.cast(IO[bytes], gzip.GzipFile(path, "wb"))
        return typing.cast(IO[bytes], io.BufferedReader(_GzipReader(path), buffer_size=1 << 20))
    if name.endswith(".zst"):
        zstandard = _zstd()
        raw = open(path, mode + "b")
        if mode == "w":
            return typing.cast(IO[bytes], zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=True))
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return typing.cast(IO[bytes], io.BufferedReader(reader))  # readline() for the reader
    return open(path, mode + "b")


class _LazyLog:
    """A log grown by a state line's appended events, built when a Snapshot needs it: passing
    over a day of appends (``keep_last``) then costs nothing, and building one is a single
    pass over the appends since the nearest log already built."""

    __slots__ = ("parent", "raw", "value")

    def __init__(self, parent: Any, raw: dict[str, Any]) -> None:
        self.parent = parent
        self.raw = raw
        self.value: VllmLog | None = None

    def resolve(self) -> VllmLog:
        """The VllmLog (built once)."""
        if self.value is not None:
            return self.value
        chain: list[_LazyLog] = []
        node: Any = self
        while isinstance(node, _LazyLog) and node.value is None:
            chain.append(node)
            node = node.parent
        base = node.value if isinstance(node, _LazyLog) else node
        events = list(base.events) if isinstance(base, VllmLog) else []
        decode_event = _dataclass_decoder(LogEvent)
        for link in reversed(chain):
            events.extend(decode_event(e) for e in link.raw.get("events", ()))
        fields = {k: v for k, v in self.raw.items() if k != "events"}
        log = _dataclass_decoder(VllmLog)(fields)
        log.events = events
        if not log.origin and isinstance(base, VllmLog):
            log.origin = base.origin
        self.value, self.parent = log, None  # what it grew from may go now
        return typing.cast(VllmLog, log)


class _GzipReader(io.RawIOBase):
    """gzip decompression in large steps (``GzipFile.readline`` works in 8 KiB ones) that
    keeps every byte before a cut: a stream without its end (a crash while recording) or with
    corrupt data ends there, ``truncated`` set, rather than raising and losing the buffer."""

    def __init__(self, path: Path) -> None:
        self._fh = open(path, "rb")
        self._d = zlib.decompressobj(wbits=31)
        self._pending: bytes | memoryview = b""
        self._at = 0  # read position in _pending (slicing a bytes copies it)
        self.truncated = False
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._pending and not self._done:
            chunk = self._fh.read(256 * 1024)
            try:
                if not chunk:
                    self._done = True
                    self.truncated = not self._d.eof
                    self._pending = memoryview(self._d.flush())
                    break
                out = self._d.decompress(chunk)
                while self._d.eof and self._d.unused_data:  # a multi-member gzip file
                    rest = self._d.unused_data
                    self._d = zlib.decompressobj(wbits=31)
                    out += self._d.decompress(rest)
                self._pending = memoryview(out)
            except zlib.error:
                self._done = self.truncated = True
        n = min(len(b), len(self._pending) - self._at)
        b[:n] = self._pending[self._at : self._at + n]
        self._at += n
        if self._at >= len(self._pending):
            self._pending, self._at = b"", 0
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


class RecordingWriter:
    """Appends Snapshots to a recording (``kvdoctor.recording/2``); use as a context manager.

    Each line is flushed when written (``flush_each``; a gzip/zstd block flush too), so a crash
    loses at most the last line. ``interval_s`` and ``label`` go into the header. Raises
    SourceError when the file cannot be created (or .zst without the zstandard module)."""

    def __init__(
        self, path: Path, *, interval_s: float | None = None, label: str = "", flush_each: bool = True
    ) -> None:
        from kvdoctor import __version__

        self.path = path
        try:
            self._fh = _open_binary(path, "w")
        except OSError as e:
            raise SourceError(f"cannot write recording: {e.strerror or e}", origin=str(path)) from None
        self._zstd_flush: int | None = None
        if path.name.lower().endswith(".zst"):
            self._zstd_flush = _zstd().FLUSH_BLOCK
        self._flush_each = flush_each
        header = {
            "schema": SCHEMA,
            "created": time.time(),
            "kvdoctor": __version__,
            "interval_s": interval_s,
            "label": label,
        }
        self._write_line(json.dumps(header))
        self.count = 0
        self._prev: dict[str, Any] = {}
        self._prev_json: dict[str, str] = {}
        self._tmpl: dict[str, list[dict[str, Any]]] = {}

    def _write_line(self, text: str, *, flush: bool = True) -> None:
        self._fh.write(text.encode("utf-8") + b"\n")
        if flush and self._flush_each:
            if self._zstd_flush is not None:
                self._fh.flush(self._zstd_flush)  # type: ignore[call-arg]
            else:
                self._fh.flush()

    def _same(self, name: str, value: Any) -> bool:
        prev = self._prev.get(name, _MISSING)
        if prev is value:
            return True
        if isinstance(value, list) and isinstance(prev, list) and len(value) == len(prev):
            if all(a is b for a, b in zip(value, prev, strict=True)):
                return True
        return False

    def write(self, snap: Snapshot) -> None:
        """Append one Snapshot: a state line first when an unchanging part changed, then the
        Snapshot's line (flushed)."""
        changes: dict[str, Any] = {}
        for name in STICKY:
            value = getattr(snap, name)
            if self._same(name, value):
                continue
            if name == "log" and isinstance(value, VllmLog):
                appended = self._log_append(value)
                if appended is not None:
                    changes["log+"] = appended
                    self._prev["log"] = value
                    continue
            encoded = _encode(value)
            text = json.dumps(encoded, separators=(",", ":"), allow_nan=False)
            if self._prev_json.get(name, _EMPTY_JSON.get(name)) != text:
                changes[name] = encoded
            self._prev[name] = value
            self._prev_json[name] = text
        obj: dict[str, Any] = {}
        for name in _PLAIN:
            value = getattr(snap, name)
            default = _SNAPSHOT_DEFAULTS[name]
            if type(value) is type(default) and value == default:
                continue
            if name in _TEMPLATED:
                obj[name] = self._against_templates(name, [_encode(x) for x in value], changes)
            else:
                obj[name] = _encode(value)
        if changes:
            self._write_line(json.dumps({"$": changes}, separators=(",", ":"), allow_nan=False), flush=False)
        self._write_line(json.dumps(obj, separators=(",", ":"), allow_nan=False))
        self.count += 1

    def _against_templates(
        self, name: str, encoded: list[dict[str, Any]], changes: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """GPUs and scrapes as their fields that differ from a template (the first reading of
        each position; a new one on a state line when most of its fields changed): a GPU's name,
        bus id, total memory and processes, an engine's cache_config are not repeated."""
        tmpls = self._tmpl.setdefault(name, [])
        defaults = _TEMPLATE_DEFAULTS[name]
        out: list[dict[str, Any]] = []
        renewed = False
        for i, enc in enumerate(encoded):
            tmpl = tmpls[i] if i < len(tmpls) else None
            diff = _diff_against(enc, tmpl, defaults) if tmpl is not None else None
            if diff is None or len(diff) * 2 > len(enc) + 2:  # mostly different: a new template
                if i < len(tmpls):
                    tmpls[i] = enc
                else:
                    tmpls.append(enc)
                renewed = True
                diff = {}
            out.append(diff)
        if renewed:
            changes["~" + name] = list(tmpls)
        return out

    def _log_append(self, log: VllmLog) -> dict[str, Any] | None:
        """The events appended to the previous line's log, or None when it is not a growth."""
        prev = self._prev.get("log")
        if not isinstance(prev, VllmLog) or prev.origin != log.origin:
            return None
        old, new = prev.events, log.events
        if len(new) < len(old) or (old and (new[0] is not old[0] or new[len(old) - 1] is not old[-1])):
            return None
        body = _encode(dataclasses.replace(log, events=[]))
        body.pop("events", None)
        body["events"] = [_encode(e) for e in new[len(old) :]]
        self._prev_json.pop("log", None)
        return typing.cast(dict[str, Any], body)

    def close(self) -> None:
        """Finish the stream and close the file; never raises."""
        try:
            self._fh.close()
        except Exception:
            pass

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- replay


def _describe_error(e: BaseException) -> str:
    if isinstance(e, json.JSONDecodeError):
        return "cut short or not JSON"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}".rstrip(": ")


class RecordingFeed:
    """A finite, seekable feed over a recording's Snapshots (``kvdoctor.sampler.SnapshotFeed``).

    Streams the file: one Snapshot decoded ahead (so the last one is known), a checkpoint every
    :data:`CHECKPOINT_EVERY` lines for :meth:`seek`; ``len()`` counts the lines once, on first
    use. ``skipped`` counts lines that could not be read (a cut last line, a broken line);
    the last Snapshot returned carries a "recording" SourceStatus saying how many Snapshots
    were read, the schema, and what was skipped and why."""

    live = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = f"recording {path}"
        self.skipped = 0
        self.skipped_reasons: list[str] = []
        self._fh: IO[bytes] | None = None
        self._open_and_read_header()
        self._len: int | None = None
        self._interval: float | None | object = _MISSING
        self._unknown: set[str] = set()
        self._skip_keys: set[int] = set()
        #: Snapshot index → (decompressed byte offset, data line number, unchanged parts)
        self._checkpoints: dict[int, tuple[int, int, dict[str, Any]]] = {}
        self._rewind(0, self._data_offset, 0, {})

    # -- file handling

    def _open_and_read_header(self) -> None:
        if not self.path.is_file():
            raise SourceError("no such recording", origin=str(self.path))
        try:
            fh = _open_binary(self.path, "r")
            line = fh.readline(MAX_LINE_BYTES)
        except (OSError, EOFError) as e:
            raise SourceError(
                f"cannot read recording: {type(e).__name__}: {e}".splitlines()[0], origin=str(self.path)
            ) from None
        except Exception as e:  # zstandard's ZstdError and friends
            raise SourceError(f"cannot read recording: {type(e).__name__}", origin=str(self.path)) from None
        try:
            header = json.loads(line)
        except (ValueError, RecursionError):
            fh.close()
            raise SourceError("not a kvdoctor recording (no header line)", origin=str(self.path)) from None
        schema = str(header.get("schema", "")) if isinstance(header, dict) else ""
        if not schema.startswith("kvdoctor.recording/"):
            fh.close()
            raise SourceError("not a kvdoctor recording (no header line)", origin=str(self.path))
        self.header: dict[str, Any] = header
        self.schema = schema
        self._data_offset = len(line)
        self._fh = fh
        self._offset = len(line)

    def _seek_bytes(self, offset: int) -> None:
        """Position the decompressed stream at ``offset`` (forward reads; backward reopens)."""
        assert self._fh is not None
        if offset == self._offset:
            return
        try:
            if not self.path.name.lower().endswith((".gz", ".zst")):
                self._fh.seek(offset)
            else:
                if offset < self._offset:
                    self._fh.close()
                    self._fh = _open_binary(self.path, "r")
                    self._offset = 0
                left = offset - self._offset
                while left > 0:
                    chunk = self._fh.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    left -= len(chunk)
        except Exception:
            pass  # a broken stream: reading will say so
        self._offset = offset

    def _rewind(self, index: int, offset: int, line_no: int, state: dict[str, Any]) -> None:
        self._seek_bytes(offset)
        self._line_no = line_no  # data lines consumed (good, bad or blank)
        self._pos = index  # Snapshots returned by next()
        self._decoded = index  # Snapshots decoded (one ahead of _pos)
        self._state = dict(state)
        self._ahead: Snapshot | None = None
        self._ahead_ready = False
        self._eof = False
        self._tail: Any = None  # keep_last's raw lines
        self._decoded_tail: Any = None  # keep_last's decoded Snapshots

    # -- decoding

    def _read_raw(self) -> bytes | None:
        """The next line's bytes, None at the end (a cut compressed stream ends it)."""
        if self._eof or self._fh is None:
            return None
        try:
            line = self._fh.readline(MAX_LINE_BYTES)
        except (OSError, EOFError, ValueError) as e:
            self._note_skip(f"stream cut short ({type(e).__name__})")
            self._eof = True
            return None
        except Exception as e:  # zstandard.ZstdError
            self._note_skip(f"stream cut short ({type(e).__name__})")
            self._eof = True
            return None
        if not line:
            self._eof = True
            raw = getattr(self._fh, "raw", None)
            if getattr(raw, "truncated", False):
                self._note_skip("stream cut short (no gzip end)")
            return None
        self._offset += len(line)
        return line

    def _note_skip(self, reason: str) -> None:
        key = self._line_no if "cut short (" not in reason else -1
        if key in self._skip_keys:
            return  # read again after a backward seek: counted already
        self._skip_keys.add(key)
        self.skipped += 1
        if len(self.skipped_reasons) < 5:
            self.skipped_reasons.append(reason)

    def _apply_state(self, changes: Any) -> None:
        """A state line: the unchanging parts that changed, for the Snapshots that follow."""
        if not isinstance(changes, dict):
            raise ValueError("state line without an object")
        state = dict(self._state)
        for name, raw in changes.items():
            if name == "log+":
                state["log"] = _LazyLog(state.get("log"), raw)  # built only if a Snapshot needs it
            elif name in STICKY:
                value = _SNAPSHOT_CONVS[name](raw) if raw is not None else None
                state[name] = _default(name) if value is None else value
            elif name[:1] == "~" and name[1:] in _TEMPLATED and isinstance(raw, list):
                state[name] = raw  # templates stay JSON: a Snapshot line's fields go over them
            else:
                self._unknown.add(f"state.{name}")
        self._state = state

    def _decode_line(self, line: bytes) -> Snapshot | None:
        """A Snapshot line → Snapshot (the unchanging parts from the state); a state line →
        None after applying it."""
        obj = loads_line(line)
        if not isinstance(obj, dict):
            raise ValueError("not an object")
        if "$" in obj and len(obj) == 1:
            self._apply_state(obj["$"])
            return None
        given = {n: obj.pop(n) for n in STICKY if n in obj}  # schema /1: every line complete
        if given:
            self._apply_state(given)
        for name in _TEMPLATED:
            tmpls = self._state.get("~" + name)
            items = obj.get(name)
            if tmpls and items:
                obj[name] = [{**tmpls[i], **d} if i < len(tmpls) else d for i, d in enumerate(items)]
        snap = _dataclass_decoder(Snapshot)(obj)
        assert isinstance(snap, Snapshot)
        state = self._state
        log = state.get("log")
        if isinstance(log, _LazyLog):
            state["log"] = log.resolve()
        for name in STICKY:
            value = state.get(name, _MISSING)
            setattr(snap, name, _default(name) if value is _MISSING else value)
        return snap

    def _read_snapshot(self) -> Snapshot | None:
        """Decode the next good line into a Snapshot (skipping and counting bad ones)."""
        if self._decoded_tail is not None:
            return self._decoded_tail.popleft() if self._decoded_tail else None
        if (
            self._tail is None
            and self._decoded % CHECKPOINT_EVERY == 0
            and self._decoded not in self._checkpoints
        ):
            self._checkpoints[self._decoded] = (self._offset, self._line_no, dict(self._state))
        while True:
            if self._tail is not None:
                if not self._tail:
                    return None
                line, self._state, self._line_no = self._tail.popleft()
            else:
                line = self._read_raw()
                if line is None:
                    return None
                self._line_no += 1
            if not line.strip():
                continue
            if not line.endswith(b"\n") and len(line) >= MAX_LINE_BYTES:
                self._note_skip(f"line {self._line_no + 1}: longer than {MAX_LINE_BYTES} bytes")
                self._drain_long_line()
                continue
            global _unknown_seen
            _unknown_seen = self._unknown
            try:
                got = self._decode_line(line)
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
                self._note_skip(f"line {self._line_no + 1}: {_describe_error(e)}")
                continue
            if got is None:
                continue  # a state line
            self._decoded += 1
            return got

    def keep_last(self, n: int) -> int:
        """Read on to the end now, keeping only the last ``n`` Snapshot lines (raw, with the
        state before each) for :meth:`next` to decode; the earlier ones are passed over without
        decoding (state lines still apply), so they are not checked either. Returns how many
        Snapshots were passed over. Memory: ``n`` raw lines."""
        from collections import deque

        tail: deque[tuple[bytes, dict[str, Any], int]] = deque(maxlen=max(1, n))
        passed = 0
        paused = gc.isenabled()
        if paused:
            gc.disable()  # this loop makes no cycles; collections here only cost time
        try:
            passed = self._scan_into(tail)
            self._tail = tail
            # decode the kept ones now, while collections are paused (the Timeline keeps them
            # anyway; a collection per few thousand new objects over a growing heap is slow)
            decoded: deque[Snapshot] = deque()
            while (snap := self._read_snapshot()) is not None:
                decoded.append(snap)
        finally:
            if paused:
                gc.enable()
        if self._ahead_ready and self._ahead is not None and len(decoded) >= n:
            # the Snapshot decoded ahead is older than the kept ones: pass it over too
            passed += 1
            self._ahead, self._ahead_ready = None, False
        self._decoded_tail = decoded
        self._pos += passed
        self._decoded += passed
        return passed

    def _scan_into(self, tail: Any) -> int:
        """keep_last's pass: raw Snapshot lines into ``tail``, state lines applied."""
        passed = 0
        while True:
            line = self._read_raw()
            if line is None:
                break
            self._line_no += 1
            if not line.strip():
                continue
            if line.startswith(b'{"$"'):
                try:
                    obj = loads_line(line)
                    self._apply_state(obj["$"])
                except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
                    self._note_skip(f"line {self._line_no + 1}: {_describe_error(e)}")
                continue
            if len(tail) == tail.maxlen:
                passed += 1
            tail.append((line, self._state, self._line_no))
        return passed

    def _drain_long_line(self) -> None:
        while True:
            rest = self._read_raw()
            if rest is None or rest.endswith(b"\n"):
                return

    # -- the feed

    def next(self) -> Snapshot | None:
        """The next Snapshot, or None at the end."""
        if not self._ahead_ready:
            self._ahead = self._read_snapshot()
            self._ahead_ready = True
        snap = self._ahead
        if snap is None:
            return None
        self._ahead = self._read_snapshot()
        self._pos += 1
        if self._ahead is None:
            if self._len is None:
                self._len = self._pos
            snap = dataclasses.replace(snap, sources=[*snap.sources, self._status()])
        return snap

    def _status(self) -> SourceStatus:
        detail = f"{self._pos} snapshot(s)"
        if self.schema != SCHEMA:
            detail += f", older schema {self.schema}"
        if self.skipped:
            detail += f", {self.skipped} unreadable line(s) skipped ({'; '.join(self.skipped_reasons)})"
        unknown = sorted(self._unknown)
        if unknown:
            detail += f", unknown fields ignored: {', '.join(unknown[:8])}"
        return SourceStatus("recording", str(self.path), "ok", detail)

    def __len__(self) -> int:
        if self._len is None:
            self._len = self._count()
        return self._len

    def _count(self) -> int:
        """Snapshots in the file (a second pass over it, lines counted, none decoded)."""
        n = 0
        try:
            with _open_binary(self.path, "r") as fh:
                fh.readline(MAX_LINE_BYTES)
                tail, last = b"\n", b"\n"  # state lines start after a newline: not counted
                while True:
                    chunk = fh.read(1 << 20)
                    if not chunk:
                        break
                    data = tail + chunk  # a 5-byte marker cannot hide in the 4-byte tail
                    n += chunk.count(b"\n") - data.count(b'\n{"$"')
                    tail, last = data[-4:], chunk[-1:]
                if last != b"\n":
                    n += 1  # a last line without its newline (usually cut: may be skipped)
        except Exception:
            pass
        return max(n - self.skipped, self._pos)

    @property
    def position(self) -> int:
        """Index of the Snapshot :meth:`next` returns next (0-based)."""
        return self._pos

    def seek(self, index: int) -> None:
        """Move to Snapshot ``index`` (clamped at 0; past the end → exhausted). Backward in a
        compressed file reopens it and reads forward from the nearest checkpoint."""
        index = max(0, index)
        if index == self._pos:
            return
        if index < self._pos or not self._ahead_ready:
            usable = [k for k in self._checkpoints if k <= index]
            start = max(usable) if usable else 0
            offset, line_no, state = self._checkpoints.get(start, (self._data_offset, 0, {}))
            self._rewind(start, offset, line_no, state)
        while self._pos < index:
            if self.next() is None:
                break

    @property
    def interval_s(self) -> float | None:
        """Seconds between recorded Snapshots: the header's, else the median gap of the first
        64 timed ones; None when unknown."""
        if self._interval is _MISSING:
            value = self.header.get("interval_s")
            if isinstance(value, (int, float)) and value > 0:
                self._interval = float(value)
            else:
                self._interval = self._sample_interval()
        return typing.cast("float | None", self._interval)

    def _sample_interval(self) -> float | None:
        try:
            probe = RecordingFeed(self.path)
        except SourceError:
            return None
        try:
            ts: list[float] = []
            while len(ts) < 64:
                s = probe.next()
                if s is None:
                    break
                if s.timestamp is not None:
                    ts.append(s.timestamp)
        finally:
            probe.close()
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False) if b > a)
        return gaps[len(gaps) // 2] if gaps else None

    def close(self) -> None:
        """Close the file; never raises."""
        if self._fh is not None:
            try:
                self._fh.close()
            except Exception:
                pass
            self._fh = None


def _default(name: str) -> Any:
    f = _SNAPSHOT_FIELDS[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


_SNAPSHOT_FIELDS = {f.name: f for f in dataclasses.fields(Snapshot)}
#: Snapshot lists whose items are written against templates held by the state
_TEMPLATED = ("gpus", "metrics")
#: Snapshot fields written on every line
_PLAIN = tuple(n for n in _SNAPSHOT_FIELDS if n not in STICKY)
_SNAPSHOT_DEFAULTS = {n: _default(n) for n in _SNAPSHOT_FIELDS}
#: the JSON of each unchanging part at its default: a recording starts from there
_EMPTY_JSON = {n: json.dumps(_encode(_default(n)), separators=(",", ":")) for n in STICKY}


def _field_defaults_json(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = _encode(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _encode(f.default_factory())
    return out


#: each templated list's item fields at their defaults, JSON form (a field the template has and
#: an item lacks is written as its default)
_TEMPLATE_DEFAULTS = {
    "gpus": _field_defaults_json(facts.Gpu),
    "metrics": _field_defaults_json(facts.EngineMetrics),
}


def _diff_against(enc: dict[str, Any], tmpl: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``enc`` that differ from ``tmpl`` (JSON forms)."""
    diff = {k: v for k, v in enc.items() if tmpl.get(k, _MISSING) != v}
    for k in tmpl.keys() - enc.keys():
        diff[k] = defaults.get(k)
    return diff


_SNAPSHOT_HINTS = typing.get_type_hints(Snapshot, vars(facts))
_SNAPSHOT_CONVS: dict[str, Callable[[Any], Any]] = {
    n: (_converter(_SNAPSHOT_HINTS[n]) or (lambda v: v)) for n in STICKY
}


def open_recording(path: Path) -> RecordingFeed:
    """Open a recording made by :class:`RecordingWriter` (schema /1 or /2) for streaming replay.

    Raises SourceError when the file cannot be opened or has no recording header; bad lines are
    skipped and counted as the replay reaches them."""
    return RecordingFeed(path)
