"""Redaction: the one place that decides what is a secret (spec/bundle.md "Secrets never reach a
report or a bundle").

Every source that keeps user text (command lines, env, log lines, Namespace reprs) passes it
through here before it lands in a fact, a report or a bundle. Secrets are replaced by
:data:`MARK` ("***"); the name they belonged to is kept, so a finding can still say "--api-key
was set". Non-secrets (``--kv-cache-dtype fp8``, ``--max-num-batched-tokens 8192``,
``TOKENIZERS_PARALLELISM=false``) pass unchanged.

What counts as a secret:

- the value of a flag whose last name part is a secret word (``--api-key X``, ``--api-key=X``,
  ``--hf-token X``, ``--auth-token``) or whose name contains ``secret``/``password``;
- variables whose name is secret by :func:`is_secret_env_name` (``HF_TOKEN``, ``*_TOKEN``,
  ``*_KEY``, ``*_SECRET``, ``*PASSWORD*``), as ``NAME=value``, ``name='value'`` (Namespace
  repr), ``'name': 'value'`` (dict repr) or ``name: value`` at the start of a line (YAML, headers);
- ``Authorization: Bearer …`` / ``Basic …`` headers, and anywhere in a line the value of an
  ``Authorization`` (no scheme), ``X-Api-Key``, ``X-Auth-Token``, ``Cookie`` or ``Set-Cookie``
  header;
- token shapes anywhere: Hugging Face ``hf_…``, OpenAI-style ``sk-…``, GitHub ``ghp_…``/
  ``github_pat_…``, Slack ``xox?-…``, AWS access key ids ``AKIA…``;
- the password in URLs ``scheme://user:password@host`` (and ``user:password@host:port/…``
  without a scheme).

Nothing here raises: any string goes in, a string of the same shape comes out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

from kvdoctor.lazyre import lazy_re

MARK = "***"

# Last name part that makes a flag or variable secret ("--api-key", "HF_TOKEN", "db_pass").
_SECRET_LAST_PARTS = frozenset(
    {
        "token",
        "key",
        "apikey",
        "secret",
        "password",
        "passwd",
        "pass",
        "pwd",
        "credential",
        "credentials",
        "cookie",
        "cookies",
    }
)
# Words that make a name secret wherever they stand ("AWS_SECRET_ACCESS_KEY_ID", "PGPASSWORD").
_SECRET_ANY_PARTS = frozenset({"secret", "password", "passwd"})
# Values that are clearly not secrets even under a secret name ("api_key=None" in a Namespace).
_NOT_SECRET_VALUES = frozenset({"", "none", "null", "false", "true", "''", '""', MARK})

# A text without any of these (lower-cased) cannot hold a secret this module recognises.
_TRIGGER = lazy_re(
    r"token|key|secret|pass|pwd|credential|auth|cookie|:/|@|hf_|sk-|gh[pousr]_|github_pat|xox|akia"
)
_TOKEN_SHAPES = lazy_re(
    r"\bhf_[A-Za-z0-9]{20,}\b"
    r"|\bsk-[A-Za-z0-9_-]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}\b"
    r"|\bgithub_pat_[A-Za-z0-9_]{20,}\b"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
)
_AUTH_HEADER = lazy_re(
    r"(?i)(\bauthorization['\"]?\s*[:=]\s*['\"]?\s*(?:bearer|basic|token)\s+)([^\s'\",}]+)"
)
# An HTTP header anywhere in a line ("… X-Api-Key: abc path=/v1", "headers Cookie: a=1; b=2",
# "authorization: tok" without a scheme): its value up to a space (a cookie: up to the line's
# end or a quote), a scheme word (Bearer/Basic, handled above) excepted.
_HEADER_IN_TEXT = lazy_re(
    r"(?i)(?<![\w-])((?:x-)?api[-_]key|x-auth-token|(?:proxy-)?authorization|(?:set-)?cookie)"
    r"(['\"]?[ \t]{0,8}[:=][ \t]{0,8}['\"]?)(?!(?:bearer|basic|token)\s)(?!\*\*\*)"
    r"((?<=[cC][oO][oO][kK][iI][eE]: )[^'\"\r\n]+|[^\s'\",;}]+)"
)
# The start of a URL, any scheme, any case ("HTTP://", "redis://", "git+ssh://"); its token runs
# to the next space or quote and its userinfo to the token's LAST "@" (a password may hold "/",
# "@" or ":"). A "host:8000/path@x" (a port, then a path) is not a password.
# "scheme:/" too: a URL that went through pathlib (Path("ftp://u:p@h") is "ftp:/u:p@h").
_URL_START = lazy_re(r"(?<![a-zA-Z0-9+.-])[a-zA-Z][a-zA-Z0-9+.-]{0,31}:/{1,3}(?!/)")
_URL_TOKEN_END = lazy_re(r"[\s'\"<>]")
_PORT_PATH = lazy_re(r"\d{1,5}(?:[/?#]|$)")
_MAX_URL_CHARS = 4096


# "user:password@host:port/…" or "//user:password@host" without a scheme (what people type for
# --metrics; an error message quotes it back): the password up to the "@" before a host name.
_BARE_USERINFO = lazy_re(
    r"(?<![\w.+:@-])(?!(?i:mailto|tel|sip):)((?://)?[A-Za-z0-9._~%+-]{1,64}:)([^\s/@'\"<>]{1,256})(@[A-Za-z0-9.-]{1,253}(?::\d{1,5})?(?:[/?#\s'\"]|$))"
)


def redact_url_credentials(text: str) -> str:
    """Replace the password of every ``scheme://user:password@host`` in ``text`` by "***"
    (any scheme, any case; a password with "/", "@" or ":" in it too), and of a scheme-less
    ``user:password@host[:port]/…`` or ``//user:password@host``. Never raises."""
    if "@" not in text:
        return text
    if ":" in text:
        text = _BARE_USERINFO.sub(
            lambda m: m.group(1) + (m.group(2) if m.group(2) == MARK else MARK) + m.group(3), text
        )
    if ":/" not in text:
        return text
    out: list[str] = []
    pos = 0
    for m in _URL_START.finditer(text):
        start = m.end()
        if start < pos:
            continue
        end_m = _URL_TOKEN_END.search(text, start, start + _MAX_URL_CHARS)
        end = end_m.start() if end_m else min(len(text), start + _MAX_URL_CHARS)
        at = text.rfind("@", start, end)
        if at < 0:
            continue
        colon = text.find(":", start, at)
        if colon < 0 or _PORT_PATH.match(text, colon + 1, at + 1) and "/" in text[colon:at]:
            continue
        if colon + 1 == at:
            continue  # "user:@host": nothing to hide
        out.append(text[pos : colon + 1])
        out.append(MARK)
        pos = at
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


# --flag value / --flag=value in free text (a log line quoting a command).
_FLAG_IN_TEXT = lazy_re(r"(?<![\w-])(--?[A-Za-z][\w-]*)(=|\s+)(?!-)('[^']*'|\"[^\"]*\"|\S+)")
# --api-key K1 K2 (a list of keys in recent vLLM): every key up to the next flag.
_API_KEYS_IN_TEXT = lazy_re(r"(?<![\w-])(--api[-_]key[ \t]+)((?:(?!-)\S+)(?:[ \t]+(?!-)\S+)*)", re.IGNORECASE)
# ['--api-key', 'X'] in a Python list repr of argv.
_FLAG_IN_LIST = lazy_re(r"(['\"])(--?[A-Za-z][\w-]*)\1(\s*,\s*)(['\"])([^'\"]*)\4")
# NAME=value, name='value' (Namespace repr), export NAME="value".
_ASSIGN = lazy_re(r"(?<![\w.-])([A-Za-z_][A-Za-z0-9_]*)(=)('[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s,)]+)")
# 'name': 'value' in a dict repr or JSON.
_DICT_ITEM = lazy_re(r"(['\"])([A-Za-z_][\w-]*)\1(\s*:\s*)('[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s,}]+)")
# name: value at the start of a line (YAML config files, HTTP headers).
_LINE_KEY = lazy_re(r"(?m)^([ \t]*(?:-[ \t]*)?)([A-Za-z_][\w-]{0,200})([ \t]*:[ \t]+)(\S(?:.*\S)?)[ \t]*$")


def _name_parts(name: str) -> list[str]:
    return [p for p in re.split(r"[-_\s]+", name.strip("-").lower()) if p]


def is_secret_name(name: str) -> bool:
    """True when a flag, variable or key name holds a secret.

    ``name`` may be a flag (``--api-key``), a dest (``api_key``) or a variable (``HF_TOKEN``);
    case and ``-``/``_`` do not matter. Secret when its last part is token/key/secret/password/
    pass/credential(s) or any part contains secret/password/passwd. ``--max-num-batched-tokens``,
    ``--ssl-keyfile``, ``TOKENIZERS_PARALLELISM`` and ``--kv-cache-dtype`` are not secrets.
    """
    parts = _name_parts(name)
    if not parts:
        return False
    if parts[-1] in _SECRET_LAST_PARTS:
        return True
    return any(word in p for p in parts for word in _SECRET_ANY_PARTS)


@functools.lru_cache(maxsize=4096)
def is_secret_flag(option: str) -> bool:
    """True when a command-line option holds a secret, after resolving it as vLLM would: an
    abbreviation (``--api-ke X``, argparse ``allow_abbrev``) or an ``_`` spelling names the
    flag it resolves to (:func:`kvdoctor.vllm_flags.lookup_option`)."""
    if is_secret_name(option):
        return True
    if not option.startswith("--") or len(option) < 4 or len(option) > 80:
        return False
    from kvdoctor.vllm_flags import FlagError, lookup_option

    try:
        hit = lookup_option(option)
    except FlagError:  # ambiguous: secret when any candidate is
        low = "--" + option[2:].replace("_", "-")
        return any(is_secret_name(o) for o in _long_options() if o.startswith(low))
    return hit is not None and is_secret_name(hit[0].dest)


def _long_options() -> list[str]:
    from kvdoctor import vllm_flags

    return list(getattr(vllm_flags, "_LONG_OPTIONS", ()))


def is_secret_env_name(name: str) -> bool:
    """True when an environment variable's value must be redacted (``HF_TOKEN``,
    ``HUGGING_FACE_HUB_TOKEN``, ``OPENAI_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASSWORD``,
    ``VLLM_API_KEY``). Same test as :func:`is_secret_name`."""
    return is_secret_name(name)


def _is_plain_value(value: str) -> bool:
    return value.strip().lower() in _NOT_SECRET_VALUES


def _mask_quoted(value: str) -> str:
    """Replace a value by MARK, keeping its quotes or brackets."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[0] + MARK + value[0]
    if value.startswith("[") and value.endswith("]"):
        return "[" + MARK + "]"
    return MARK


def redact_text(text: str) -> str:
    """Redact secrets inside free text (a log line, a shell command, a repr, a YAML file).

    Handles every shape listed in the module docstring. Returns the text with each secret value
    replaced by ``"***"``; everything else, whitespace included, is unchanged.
    """
    if not text:
        return text

    def flag_sub(m: re.Match[str]) -> str:
        if is_secret_flag(m.group(1)) and not _is_plain_value(m.group(3)):
            return m.group(1) + m.group(2) + _mask_quoted(m.group(3))
        return m.group(0)

    def list_sub(m: re.Match[str]) -> str:
        if is_secret_flag(m.group(2)) and not _is_plain_value(m.group(5)):
            return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{MARK}{m.group(4)}"
        return m.group(0)

    def assign_sub(m: re.Match[str]) -> str:
        if is_secret_name(m.group(1)) and not _is_plain_value(m.group(3).strip("'\"")):
            return m.group(1) + m.group(2) + _mask_quoted(m.group(3))
        return m.group(0)

    def dict_sub(m: re.Match[str]) -> str:
        if is_secret_name(m.group(2)) and not _is_plain_value(m.group(4).strip("'\"")):
            return m.group(1) + m.group(2) + m.group(1) + m.group(3) + _mask_quoted(m.group(4))
        return m.group(0)

    def line_key_sub(m: re.Match[str]) -> str:
        if is_secret_name(m.group(2)) and not _is_plain_value(m.group(4).strip("'\"")):
            return m.group(1) + m.group(2) + m.group(3) + _mask_quoted(m.group(4))
        return m.group(0)

    # Cheap gates first: the log parser redacts every line, and most hold nothing secret-like.
    low = text.lower()
    if not _TRIGGER.search(low):
        return text
    out = text
    if "auth" in low:
        out = _AUTH_HEADER.sub(lambda m: m.group(1) + MARK, out)
    if ":" in out or "=" in out:
        out = _HEADER_IN_TEXT.sub(
            lambda m: m.group(0) if _is_plain_value(m.group(3)) else m.group(1) + m.group(2) + MARK, out
        )
    if ":" in out and "@" in out:
        out = redact_url_credentials(out)
    if "-" in out:
        if "'" in out or '"' in out:
            out = _FLAG_IN_LIST.sub(list_sub, out)
        if "api" in low:
            out = _API_KEYS_IN_TEXT.sub(lambda m: m.group(1) + re.sub(r"\S+", MARK, m.group(2)), out)
        out = _FLAG_IN_TEXT.sub(flag_sub, out)
    if "'" in out or '"' in out:
        out = _DICT_ITEM.sub(dict_sub, out)
    if "=" in out:
        out = _ASSIGN.sub(assign_sub, out)
    if ":" in out:
        out = _LINE_KEY.sub(line_key_sub, out)
    out = _TOKEN_SHAPES.sub(MARK, out)
    return out


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Redact a command line given as a list of arguments (``/proc/PID/cmdline``, psutil).

    ``--api-key X`` → ``--api-key ***``; ``--api-key=X`` → ``--api-key=***``; the same for every
    secret flag name (:func:`is_secret_name`); after ``--api-key`` every value up to the next flag
    (recent vLLM takes a list of keys). A secret flag followed by another flag (``--hf-token``
    used as a switch) redacts nothing. Every other argument goes through :func:`redact_text`
    (``-e HF_TOKEN=…``, ``Authorization: Bearer …``, token shapes, URL passwords). Returns a new
    list of the same length.
    """
    out: list[str] = []
    redact_next = False
    redact_more = False  # --api-key takes a list of keys in recent vLLM
    for arg in argv:
        arg = str(arg)
        if redact_next or redact_more:
            redact_next = False
            if not arg.startswith("-"):
                out.append(MARK)
                continue
            redact_more = False
        if arg.startswith("-") and len(arg) > 1 and not arg[1:2].isdigit():
            name, eq, value = arg.partition("=")
            if is_secret_flag(name):
                if eq:
                    out.append(f"{name}={MARK}" if value else arg)
                else:
                    out.append(arg)
                    redact_next = True
                    redact_more = _is_api_key(name)
                continue
        out.append(redact_text(arg))
    return out


def _is_api_key(option: str) -> bool:
    if _name_parts(option) == ["api", "key"]:
        return True
    from kvdoctor.vllm_flags import FlagError, lookup_option

    try:
        hit = lookup_option(option) if option.startswith("--") else None
    except FlagError:
        return False
    return hit is not None and hit[0].dest == "api_key"


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Redact an environment mapping: a secret name's non-empty value becomes ``"***"``; every
    other value goes through :func:`redact_text` (``HTTP_PROXY=http://user:pw@proxy`` loses its
    password). Returns a new dict in the same order."""
    out: dict[str, str] = {}
    for key, value in env.items():
        value = "" if value is None else str(value)
        if is_secret_env_name(key) and value:
            out[key] = MARK
        else:
            out[key] = redact_text(value)
    return out


# C0 controls but TAB and LF, DEL and C1 controls: what a terminal acts on (ESC starts a
# sequence that can recolour, retitle or clear it; BEL rings; NUL truncates in some viewers).
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0)]}


def escape_controls(text: str) -> str:
    """``text`` with every control character a terminal would act on (ESC, BEL, NUL, CR, …; TAB
    and LF kept) written as ``\\xNN``, so a metrics label or a directory name shows as text,
    never as a terminal sequence. Never raises."""
    if text.isprintable():
        return text
    return text.translate(_CONTROLS)
