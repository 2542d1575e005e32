"""The engine's environment: a bundle's ``env.txt`` (spec/bundle.md) → ``dict[str, str]``.

Variables that matter (vllm-facts §4.2): ``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF``,
``VLLM_USE_V1``, ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, ``VLLM_LOG_STATS_INTERVAL``,
``VLLM_ALLOW_LONG_MAX_MODEL_LEN``, ``VLLM_CPU_KVCACHE_SPACE``. Secret values (``HF_TOKEN``,
``*_TOKEN``, ``*_KEY``, …; :func:`kvdoctor.redact.is_secret_env_name`) never leave this module:
they become ``"***"``.
"""

from __future__ import annotations

import shlex

from kvdoctor.devices import visible_devices, visible_devices_detail
from kvdoctor.facts import SourceError
from kvdoctor.lazyre import lazy_re
from kvdoctor.redact import redact_env
from kvdoctor.sources.limits import MAX_CMDLINE_CHARS, guarded

__all__ = ["parse_env_text", "visible_devices", "visible_devices_detail"]

_LINE = lazy_re(r"^(?:export\s+|declare\s+-x\s+|set\s+)?([A-Za-z_][A-Za-z0-9_.]*)\s*=(.*)$")


def _unquote(raw: str) -> str:
    """Shell-style value: quotes removed, a trailing `` # comment`` dropped for bare values."""
    value = raw.strip()
    if not value:
        return ""
    if value[0] in "'\"":
        try:
            parts = shlex.split(value, comments=True)
        except ValueError:
            return value.strip("'\"")
        return " ".join(parts)
    # a comment starts at " #": found by str.find, not re.split(r"\s+#") (quadratic on a value
    # of 64,000 spaces)
    hash_at = value.find("#", 1)
    while hash_at > 0 and not value[hash_at - 1].isspace():
        hash_at = value.find("#", hash_at + 1)
    return (value[:hash_at] if hash_at > 0 else value).strip()


@guarded("origin", 1)
def parse_env_text(text: str, origin: str = "") -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (``export KEY=VALUE``, ``declare -x``, quoted values, ``#``
    comments, blank lines; ``env``/``printenv`` output) into a dict, later lines winning.

    Secret values are redacted to ``"***"``. Lines that are not assignments (the continuation of
    a multi-line value in ``env`` output) are skipped. Raises :class:`SourceError` (origin, line)
    on binary data, or when the text has content but not one assignment.
    """
    env: dict[str, str] = {}
    first_bad: int | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        if "\x00" in raw or "\ufffd" in raw or any(ord(c) < 32 and c not in "\t\r\f\v" for c in raw):
            raise SourceError(
                "binary or corrupt data, not KEY=VALUE lines", origin=origin or None, line=lineno
            )
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_CMDLINE_CHARS:
            first_bad = first_bad or lineno  # no variable is 256 KiB long: skipped before shlex
            continue
        m = _LINE.match(line)
        if not m:
            first_bad = first_bad or lineno
            continue
        env[m.group(1)] = _unquote(m.group(2))
    if not env and first_bad is not None:
        raise SourceError("expected KEY=VALUE lines", origin=origin or None, line=first_bad)
    return redact_env(env)
