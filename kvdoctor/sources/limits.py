"""Hard limits and the one guard every public parser goes through (hostile or broken input).

kvdoctor reads files people paste and endpoints that misbehave, on production GPU hosts. Every
read here is bounded while it happens (never by trusting ``st_size``), opens only regular files
(non-blocking, so a FIFO or a device cannot hang it), and every failure is a one-line
:class:`~kvdoctor.facts.SourceError` naming the file, the line when known and a reason — never
the bytes read.
"""

from __future__ import annotations

import functools
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

from kvdoctor.facts import SourceError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: a text artifact (nvidia-smi output, cmdline.txt, ps.txt, env.txt, config.json, one scrape).
MAX_TEXT_BYTES = 64 * MiB
#: a model config.json / engine-args / --config YAML.
MAX_CONFIG_BYTES = 4 * MiB
#: a log, after gzip decompression (the log itself is streamed, never held whole).
MAX_LOG_BYTES = 8 * GiB
#: one physical log line is cut here before any regex sees it (vLLM's longest real lines, the
#: engine config and non-default args, are a few KiB).
MAX_LINE_CHARS = 64 * KiB
#: one HTTP response body (a /metrics page is 50-500 KiB), after Content-Encoding.
MAX_HTTP_BYTES = 16 * MiB
#: one command line or environment value before shlex.
MAX_CMDLINE_CHARS = 256 * KiB
#: members of a bundle archive looked at (a bundle has a dozen files).
MAX_TAR_MEMBERS = 10_000
#: a bundle archive's kept files together, and each one.
MAX_TAR_BYTES = 2 * GiB
MAX_TAR_MEMBER_BYTES = 1 * GiB
#: engines (engine label values, command lines) and processes kept from one input.
MAX_ENGINES = 1024
#: vLLM launch commands read from one cmdline.txt (a node runs one per GPU or a few more; each
#: engine is compared with every other, so 1,000 commands took 7 s and 5,000 took 40 s).
MAX_COMMANDS = 64
MAX_PROCESSES = 100_000
#: digits of one number in any text input (int("1" * 5000) is slow and meaningless).
MAX_DIGITS = 30

F = TypeVar("F", bound=Callable[..., Any])


def reason_of(exc: BaseException) -> str:
    """A short reason for an unexpected exception that carries none of its message (which may
    quote the input): the exception type, in words where it is a familiar one."""
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    if isinstance(exc, MemoryError):
        return "input too large to hold in memory"
    if isinstance(exc, UnicodeError):
        return "not valid text"
    if isinstance(exc, OverflowError):
        return "a number out of range"
    if isinstance(exc, OSError):
        return f"cannot read ({exc.strerror or type(exc).__name__})"
    return f"unreadable input (parser error {type(exc).__name__})"


def guarded(origin_arg: str = "origin", position: int = 1) -> Callable[[F], F]:
    """Decorate a public parser: any exception but SourceError becomes ``SourceError(reason,
    origin=…)``, the origin taken from the ``origin_arg`` keyword or the positional argument at
    ``position`` (for ``*_file(path)`` parsers, ``position=0``). KeyboardInterrupt and SystemExit
    pass through."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except SourceError:
                raise
            except Exception as exc:
                origin = kwargs.get(origin_arg)
                if origin is None and len(args) > position:
                    origin = args[position]
                raise SourceError(reason_of(exc), origin=str(origin) if origin else None) from None

        return cast(F, wrapper)

    return deco


def open_regular(path: str | os.PathLike[str], *, nofollow: bool = False, what: str = "") -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file.

    Opened non-blocking (a FIFO would otherwise block the open itself) and checked with fstat on
    the open descriptor (no race between check and use). ``nofollow`` refuses a symlink as the
    last path component. ``what`` names the input in the message ("cannot read log (…)").
    Raises SourceError("not a regular file" / "cannot read (…)").
    """
    origin = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    if nofollow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(origin, flags)
    except OSError as exc:
        if nofollow and os.path.islink(origin):
            raise SourceError("a symlink: not followed", origin=origin) from None
        noun = f"cannot read {what}" if what else "cannot read"
        raise SourceError(f"{noun} ({exc.strerror or exc.__class__.__name__})", origin=origin) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceError("not a regular file", origin=origin)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES, *, nofollow: bool = False) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (read ``limit + 1`` bytes:
    a file that grows, or lies in ``st_size``, cannot get past it). Raises SourceError."""
    origin = os.fspath(path)
    with open_regular(origin, nofollow=nofollow) as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise SourceError(f"cannot read ({exc.strerror or type(exc).__name__})", origin=origin) from None
    if len(data) > limit:
        raise SourceError(f"larger than {_size(limit)}: not read", origin=origin)
    return data


def read_text(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES, *, nofollow: bool = False) -> str:
    """:func:`read_bytes` decoded as UTF-8, bad bytes replaced."""
    return read_bytes(path, limit, nofollow=nofollow).decode("utf-8", errors="replace")


def gunzip_bounded(data: bytes, limit: int, origin: str) -> bytes:
    """Decompress gzip ``data`` (all members) to at most ``limit`` bytes; SourceError beyond it
    (a gzip bomb) or on corrupt data."""
    out = bytearray()
    for chunk in iter_gunzip([data], limit, origin):
        out += chunk
    return bytes(out)


#: a gzip log may expand this many times its compressed size (real vLLM logs: 10-30×) once past
#: :data:`GZIP_RATIO_FLOOR` bytes; beyond, it is a decompression bomb (4 MB → 1 GiB: 256×).
MAX_GZIP_RATIO = 100
GZIP_RATIO_FLOOR = 8 * MiB


def _slices(chunks: Any, size: int) -> Iterator[bytes]:
    for chunk in chunks:
        chunk = bytes(chunk)
        for i in range(0, len(chunk), size):
            yield chunk[i : i + size]


def iter_gunzip(
    chunks: Any, limit: int, origin: str, *, truncated_ok: bool = False, max_ratio: int | None = None
) -> Iterator[bytes]:
    """Decompress a stream of gzip chunks (several members allowed), yielding pieces; raises
    SourceError once more than ``limit`` bytes came out, or (with ``max_ratio``) more than
    :data:`GZIP_RATIO_FLOOR` bytes at more than ``max_ratio`` times the compressed bytes read,
    or on corrupt or truncated data."""
    total = 0
    consumed = 0
    step = 1 * MiB
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    started = False  # the current member has input
    try:
        for piece_in in _slices(chunks, 64 * KiB):  # small steps: the ratio is checked early
            buf = piece_in
            consumed += len(buf)
            while buf:
                if not started and not buf.strip(b"\x00"):
                    break  # NUL padding after the last member
                started = True
                piece = d.decompress(buf, step)
                total += len(piece)
                if total > limit:
                    raise SourceError(f"decompresses to more than {_size(limit)}: not read", origin=origin)
                if max_ratio is not None and total > GZIP_RATIO_FLOOR and total > max_ratio * consumed:
                    raise SourceError(
                        f"decompresses to more than {max_ratio}× its size (a gzip bomb?): not read",
                        origin=origin,
                    )
                if piece:
                    yield piece
                if d.eof:
                    buf = d.unused_data
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    started = False
                else:
                    buf = d.unconsumed_tail
        if started and not truncated_ok:
            raise SourceError("truncated gzip data", origin=origin)
    except zlib.error:
        raise SourceError("corrupt gzip data", origin=origin) from None


def check_number_text(text: str) -> None:
    """ValueError when a number's text has more than :data:`MAX_DIGITS` digits (``int()`` of
    thousands of digits is slow, and no quantity kvdoctor reads has them)."""
    if len(text) > MAX_DIGITS + 8 and sum(c.isdigit() for c in text) > MAX_DIGITS:
        raise ValueError("number with too many digits")


def _size(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n} bytes"


#: YAML nodes composed from one config file (a vLLM --config holds tens of keys).
MAX_YAML_NODES = 100_000


def load_yaml_bounded(text: str, origin: str) -> Any:
    """``yaml.safe_load`` of an untrusted config (``--config``, ``engine-args.yaml``), bounded:
    an alias (``*a``, the "billion laughs" bomb: 287 bytes that expand to GiBs) or more than
    :data:`MAX_YAML_NODES` nodes is refused, as is nesting past the recursion limit. Raises
    SourceError with a one-line reason that never quotes the file (PyYAML's messages do)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        nodes = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise SourceError("uses YAML aliases (*name): not read", origin=origin)
            _Loader.nodes += 1
            if _Loader.nodes > MAX_YAML_NODES:
                raise SourceError(f"more than {MAX_YAML_NODES} YAML nodes: not read", origin=origin)
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except SourceError:
        raise
    except (yaml.YAMLError, RecursionError, ValueError):
        raise SourceError("not valid YAML", origin=origin) from None
