"""One YAML file read safely, with the line of every key and value (for ``FILE:LINE`` errors).

Used for the user config (``--config``, ``~/.config/kvdoctor/config.yaml``). Bounded: at most
:data:`MAX_BYTES` of text, and no aliases (``*name``): an alias bomb of a few hundred bytes
expands to gigabytes, and a config has no use for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MAX_BYTES", "YamlFileError", "key_line", "load_yaml_with_lines", "value_line"]

#: the largest YAML file read (a config is a few hundred bytes)
MAX_BYTES = 1 << 20


class YamlFileError(Exception):
    """The file cannot be read as YAML. ``str(err)`` is one line, ``path:line: reason``
    (``path: reason`` when no line is known); ``line`` is 1-based."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


class _LineDict(dict):  # type: ignore[type-arg]
    """A YAML mapping that remembers the 1-based line of each key and value."""

    line: int = 0
    key_lines: dict[Any, int]
    value_lines: dict[Any, int]


class _LineList(list):  # type: ignore[type-arg]
    """A YAML sequence that remembers the 1-based line of each item."""

    line: int = 0
    lines: list[int]


class _Refused(Exception):
    def __init__(self, line: int, reason: str) -> None:
        self.line, self.reason = line, reason


def _value_line(node: Any) -> int:
    import yaml

    line: int = node.start_mark.line + 1
    # A block scalar ("|", ">") starts at its indicator; its text begins on the next line.
    if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
        line += 1
    return line


def _loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise _Refused(self.peek_event().start_mark.line + 1, "YAML aliases (*name) are not accepted")
            return super().compose_node(parent, index)

        def construct_line_map(self, node: Any) -> _LineDict:
            self.flatten_mapping(node)
            out = _LineDict()
            out.line, out.key_lines, out.value_lines = node.start_mark.line + 1, {}, {}
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise _Refused(
                        key_node.start_mark.line + 1, "a key that is not text or a number"
                    ) from None
                if key in out:
                    raise _Refused(key_node.start_mark.line + 1, f"duplicate key {key!r}")
                out[key] = self.construct_object(value_node, deep=True)
                out.key_lines[key] = key_node.start_mark.line + 1
                out.value_lines[key] = _value_line(value_node)
            return out

        def construct_line_seq(self, node: Any) -> _LineList:
            out = _LineList(self.construct_object(n, deep=True) for n in node.value)
            out.line, out.lines = node.start_mark.line + 1, [_value_line(n) for n in node.value]
            return out

    Loader.add_constructor("tag:yaml.org,2002:map", Loader.construct_line_map)
    Loader.add_constructor("tag:yaml.org,2002:seq", Loader.construct_line_seq)
    return Loader


def load_yaml_with_lines(path: str | Path, display: str | None = None) -> Any:
    """One YAML document read safely; mappings are dicts with ``key_lines``/``value_lines``,
    sequences lists with ``lines``. Raises :class:`YamlFileError` (``display`` or ``path`` as
    the file name) for an unreadable or oversized file, non-UTF-8 bytes, a NUL byte, YAML
    syntax errors (with the line), duplicate keys and aliases."""
    shown = display or str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as err:
        raise YamlFileError(shown, None, f"cannot read: {err.strerror or err}") from None
    if len(raw) > MAX_BYTES:
        raise YamlFileError(shown, None, f"larger than {MAX_BYTES >> 20} MiB: not a config file")
    if b"\x00" in raw:
        raise YamlFileError(
            shown, raw[: raw.index(b"\x00")].count(b"\n") + 1, "binary data (NUL byte), not YAML text"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlFileError(shown, raw[: err.start].count(b"\n") + 1, "not UTF-8 text") from None
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except _Refused as err:
        raise YamlFileError(shown, err.line, err.reason) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        reason = err.problem or err.context or "invalid YAML"
        raise YamlFileError(shown, mark.line + 1 if mark else None, f"YAML syntax error: {reason}") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise YamlFileError(shown, None, f"YAML error: {type(err).__name__}") from None


def key_line(d: Any, key: Any) -> int | None:
    """1-based line of ``key`` in a mapping read by :func:`load_yaml_with_lines` (None if unknown)."""
    lines = getattr(d, "key_lines", None)
    return lines.get(key) if lines else getattr(d, "line", None) or None


def value_line(d: Any, key: Any) -> int | None:
    """1-based line where the value of ``key`` starts (None if unknown)."""
    lines = getattr(d, "value_lines", None)
    return lines.get(key) if lines else getattr(d, "line", None) or None
