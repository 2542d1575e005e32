"""Multiplexing prefixes a log collector puts before vLLM's own line: strip them before parsing.

vLLM's line is ``(NAME pid=N) LEVEL MM-DD HH:MM:SS [file.py:NNN] message`` (vllm-facts §3.1).
What people paste adds, in front of it (spec/bundle.md ``vllm.log``):

- ``docker compose logs``: the service column ``vllm-1  | `` (``svc_1 | `` in compose v1), often
  coloured, sometimes followed by a ``--timestamps`` RFC 3339 stamp;
- ``kubectl logs --prefix``: ``[pod/vllm-7d9c/vllm] `` (``--all-containers`` / ``-l``);
- journald's ``short`` / ``short-iso`` output: ``Jul 01 09:12:43 gpu-node-2 vllm[1234]: `` or
  ``2025-07-01T09:12:43+0000 gpu-node-2 vllm[1234]: ``;
- CRI / docker ``--timestamps``: ``2025-07-01T09:12:43.123456789Z [stdout F ]`` (the caller's
  own timestamp stripping handles these once the outer prefixes are gone);
- Ray's process prefix with the worker's node: ``(RayWorkerWrapper pid=380, ip=10.0.0.2) `` →
  ``(RayWorkerWrapper pid=380) `` and the host "10.0.0.2".

:func:`strip_prefixes` removes them (in any order, each at most once) and returns the node a
prefix named. It never raises and never removes text a vLLM line itself starts with.
"""

from __future__ import annotations

from kvdoctor.lazyre import lazy_re

__all__ = ["strip_prefixes"]

# "vllm-1  | ", "vllm_server_1 | ", "svc | " — a compose service name, spaces, a bar.
_COMPOSE_RE = lazy_re(r"^[A-Za-z0-9][\w.\-]{0,62}\s+\| ?")
# "[pod/vllm-7d9c/vllm] " — kubectl logs --prefix.
_KUBECTL_RE = lazy_re(r"^\[pod/[\w.\-]+/[\w.\-]+\] ")
# journald short ("Jul 01 09:12:43 host unit[pid]: ") and short-iso / short-precise.
_JOURNALD_RE = lazy_re(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?)"
    r" ([\w.\-]+) [\w.@\-/]+(?:\[\d+\])?: "
)
# Ray: "(RayWorkerWrapper pid=380, ip=10.0.0.2) " / "(pid=380, ip=10.0.0.2) ".
_RAY_RE = lazy_re(r"^\((?:([A-Za-z][\w.\-\[\]]*) )?pid=(\d{1,10}), ip=([\w.\-:]+)\) ?")
# A timestamp after a compose column (docker compose logs --timestamps).
_ISO_RE = lazy_re(r"^\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? ")


def strip_prefixes(line: str) -> tuple[str, str | None]:
    """``line`` (ANSI codes already removed) without the collectors' prefixes, and the host a
    prefix named (journald's hostname, Ray's ``ip=``), else None.

    A compose column is one word, padding and a bar at the very start of the line (compose
    always pads the name), so a message or progress bar containing "|" is left alone.
    """
    host: str | None = None
    for _ in range(3):
        c = line[:1]
        if c == "[" and line.startswith("[pod/"):
            m = _KUBECTL_RE.match(line)
            if m:
                line = line[m.end() :]
                continue
        if c.isalnum() and "|" in line[:66]:
            m = _COMPOSE_RE.match(line)
            if m:
                line = line[m.end() :]
                mt = _ISO_RE.match(line)
                if mt:
                    line = line[mt.end() :]
                continue
        if c.isalnum() and ": " in line[:160]:
            m = _JOURNALD_RE.match(line)
            if m:
                host = m.group(1)
                line = line[m.end() :]
                continue
        break
    if line.startswith("(") and ", ip=" in line[:120]:
        m = _RAY_RE.match(line)
        if m:
            host = m.group(3)
            name = m.group(1) or "RayWorker"
            line = f"({name} pid={m.group(2)}) " + line[m.end() :]
    return line, host
