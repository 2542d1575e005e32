"""Module-level regexes compiled on first use, not at import (issue 8, class 10: cold start).

``re.compile`` runs the pure-Python ``re._parser``/``re._compiler``: ~0.1-1 ms a pattern, and
kvdoctor keeps a few hundred at module level. A run that reads a bundle without ``dmesg.txt``
or whose log has no sleep-mode line should not pay for those parsers' patterns. Parsers gate
each pattern behind a cheap literal test (``"KV cache usage" in line``) before using it, so with
:class:`LazyPattern` a run compiles only the patterns its input gets to.

After the first use the compiled pattern's bound methods sit in the instance's ``__dict__``
(they shadow the class's functions), so a hot loop calls ``re.Pattern.match`` directly: no
extra Python frame per line.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LazyPattern", "lazy_re"]

_BOUND = ("match", "search", "fullmatch", "finditer", "findall", "sub", "subn", "split")


class LazyPattern:
    """A ``re.Pattern[str]`` stand-in that compiles ``pattern`` with ``flags`` on first use.

    ``pattern`` and ``flags`` read as given (``flags`` without the implicit ``re.UNICODE`` a
    compiled str pattern adds); :attr:`compiled` is the compiled pattern. A bad pattern raises
    ``re.error`` at first use (the regex-hygiene test compiles every one, so a typo fails CI)."""

    def __init__(self, pattern: str, flags: int | re.RegexFlag = 0) -> None:
        self.pattern = pattern
        self.flags = int(flags)

    def __repr__(self) -> str:
        return f"lazy_re({self.pattern!r}, {self.flags})"

    @property
    def compiled(self) -> re.Pattern[str]:
        """The compiled pattern (compiled now if it was not yet)."""
        got: re.Pattern[str] | None = self.__dict__.get("_compiled")
        return got if got is not None else self._compile()

    @property
    def groups(self) -> int:
        """Number of capturing groups (``re.Pattern.groups``)."""
        return self.compiled.groups

    @property
    def groupindex(self) -> Any:
        """Named groups → group numbers (``re.Pattern.groupindex``)."""
        return self.compiled.groupindex

    def _compile(self) -> re.Pattern[str]:
        compiled = re.compile(self.pattern, self.flags)
        d = self.__dict__
        d["_compiled"] = compiled
        for name in _BOUND:
            d[name] = getattr(compiled, name)
        return compiled

    # The methods below run once per instance: the first call compiles and rebinds them.

    def match(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        """``re.Pattern.match``."""
        return self.compiled.match(string, pos, endpos)

    def search(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        """``re.Pattern.search``."""
        return self.compiled.search(string, pos, endpos)

    def fullmatch(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        """``re.Pattern.fullmatch``."""
        return self.compiled.fullmatch(string, pos, endpos)

    def finditer(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> Iterator[re.Match[str]]:
        """``re.Pattern.finditer``."""
        return self.compiled.finditer(string, pos, endpos)

    def findall(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> list[Any]:
        """``re.Pattern.findall``."""
        return self.compiled.findall(string, pos, endpos)

    def sub(self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0) -> str:
        """``re.Pattern.sub``."""
        return self.compiled.sub(repl, string, count)

    def subn(
        self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0
    ) -> tuple[str, int]:
        """``re.Pattern.subn``."""
        return self.compiled.subn(repl, string, count)

    def split(self, string: str, maxsplit: int = 0) -> list[str | Any]:
        """``re.Pattern.split``."""
        return self.compiled.split(string, maxsplit)


def lazy_re(pattern: str, flags: int | re.RegexFlag = 0) -> LazyPattern:
    """``re.compile(pattern, flags)``, deferred to the pattern's first use (:class:`LazyPattern`)."""
    return LazyPattern(pattern, flags)
