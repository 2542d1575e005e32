"""The launch command: ``cmdline.txt``, ``/proc/PID/cmdline``, psutil argv → :class:`EngineConfig`.

Parsed here, not by importing vLLM (that takes ~11 s and wants a device). Flag names, aliases,
abbreviations and value types come from :mod:`kvdoctor.vllm_flags` (vllm-facts §4.2).

Accepted command shapes (spec/bundle.md ``cmdline.txt``):

- ``vllm serve MODEL [flags]`` (also ``/usr/local/bin/vllm``, ``python … /bin/vllm serve``);
- ``python -m vllm.entrypoints.openai.api_server --model M …`` and ``python3 -m
  vllm.entrypoints.api_server …``;
- ``docker run [docker options] IMAGE [args]`` (podman, nerdctl too): the args after the image
  are vLLM's, since ``vllm/vllm-openai`` images have ``vllm serve`` as entrypoint; ``-e K=V``
  options are recorded like env prefixes;
- ``sh -c '…'`` / ``bash -c '…'`` wrapping any of the above;
- a bare argument list starting with ``--`` (``--model M --max-model-len 8192``);
- ``VAR=value …`` / ``env VAR=value …`` prefixes: recorded (redacted) under
  ``EngineConfig.args["_env"]``, otherwise ignored.

``cmdline.txt`` holds one command per line, shell-quoted, ``#`` comments, backslash
continuations; a NUL-separated ``/proc/PID/cmdline`` dump is one command. ``--config FILE.yaml``
(vLLM's YAML config: flag names without dashes, ``-`` or ``_``) is read relative to ``base_dir``;
command-line flags win over the file. A config file that cannot be read does not fail the
command: the reason is kept in ``EngineConfig.args["_config_error"]``.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvdoctor.facts import EngineConfig, SourceError
from kvdoctor.lazyre import lazy_re
from kvdoctor.redact import redact_argv, redact_env
from kvdoctor.sources.limits import (
    MAX_CMDLINE_CHARS,
    MAX_COMMANDS,
    MAX_TEXT_BYTES,
    guarded,
    load_yaml_bounded,
    read_bytes,
)
from kvdoctor.vllm_flags import (
    FlagError,
    canonical_dest,
    convert_value,
    flag_for_dest,
    lookup_option,
    out_of_range,
    update_config_from_args,
)

_ENV_ASSIGN = lazy_re(r"^[A-Za-z_][A-Za-z0-9_]*=")
_CONTAINER_TOOLS = {"docker", "podman", "nerdctl"}
_SHELLS = {"sh", "bash", "zsh", "dash"}
# docker run options that take no value; every other option takes one unless written --opt=value.
_DOCKER_BOOL_LONG = {
    "--rm",
    "--detach",
    "--interactive",
    "--tty",
    "--privileged",
    "--init",
    "--read-only",
    "--publish-all",
    "--no-healthcheck",
    "--oom-kill-disable",
    "--sig-proxy",
    "--quiet",
}
_DOCKER_BOOL_SHORT = set("ditPq")
_MAX_CONFIG_BYTES = 1 << 20
_SHELL_OPS = {"|", "||", "&&", ";", "&", "|&"}
_REDIRECT = lazy_re(r"^(\d*>>?|<|&>)")


def _check_text(text: str, origin: str, allow_nul: bool) -> None:
    """Reject binary input with one line instead of parsing noise."""
    for lineno, line in enumerate(text.splitlines() or [text], 1):
        for ch in line:
            if (ord(ch) < 32 and ch not in "\t\r\f\v" and not (allow_nul and ch == "\x00")) or ch == "\ufffd":
                raise SourceError(
                    f"binary or corrupt data (character {ord(ch):#x}), not a launch command",
                    origin=origin,
                    line=lineno,
                )


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; returns (first line number, joined text)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not buf:
            start = lineno
        stripped = line.rstrip()
        if stripped.endswith("\\") and not stripped.endswith("\\\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(buf)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def _basename(token: str) -> str:
    return token.rsplit("/", 1)[-1]


def _docker_image_index(argv: list[str], start: int) -> int | None:
    """Index of the IMAGE in ``docker run [opts] IMAGE …`` (``start`` is the token after ``run``)."""
    i = start
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return i + 1 if i + 1 < len(argv) else None
        if tok.startswith("--"):
            if "=" in tok or tok in _DOCKER_BOOL_LONG:
                i += 1
            else:
                i += 2
            continue
        if tok.startswith("-") and len(tok) > 1:
            letters = tok[1:]
            if all(c in _DOCKER_BOOL_SHORT for c in letters):
                i += 1
            elif len(letters) > 1 and letters[0] not in _DOCKER_BOOL_SHORT:
                i += 1  # value attached: -eFOO=1, -p8000:8000
            else:
                i += 2
            continue
        return i
    return None


def _docker_env(argv: list[str], start: int, end: int) -> dict[str, str]:
    env: dict[str, str] = {}
    i = start
    while i < end:
        tok = argv[i]
        val: str | None = None
        if tok in ("-e", "--env") and i + 1 < end:
            val = argv[i + 1]
            i += 1
        elif tok.startswith("--env="):
            val = tok[len("--env=") :]
        elif tok.startswith("-e") and len(tok) > 2 and not tok.startswith("--"):
            val = tok[2:]
        if val is not None and "=" in val:
            k, _, v = val.partition("=")
            env[k] = v
        i += 1
    return env


def locate_vllm_args(argv: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """Find vLLM's own arguments inside a full command line.

    Returns ``(vllm_args, env)`` where ``vllm_args`` are the arguments after ``vllm serve`` /
    ``-m vllm.entrypoints…`` / the docker image (a ``serve`` positional model stays first), and
    ``env`` the ``VAR=value`` prefixes and docker ``-e`` values (not redacted). None when the
    command is not a vLLM launch. Never raises.
    """
    env: dict[str, str] = {}
    i = 0
    n = len(argv)
    # Leading env assignments and wrappers (env, exec, nohup, sudo, time).
    while i < n:
        tok = argv[i]
        if _ENV_ASSIGN.match(tok):
            k, _, v = tok.partition("=")
            env[k] = v
            i += 1
        elif tok in ("env", "exec", "nohup", "sudo", "time", "command", "$"):
            i += 1
        else:
            break
    if i >= n:
        return None
    if argv[i].startswith("--"):
        return argv[i:], env
    for j in range(i, n):
        tok = argv[j]
        base = _basename(tok)
        if base == "vllm" and j + 1 < n and argv[j + 1] == "serve":
            return argv[j + 2 :], env
        if tok == "-m" and j + 1 < n and argv[j + 1].startswith("vllm.entrypoints"):
            if argv[j + 1] == "vllm.entrypoints.cli.main":
                # `vllm serve` through the module; another subcommand (`vllm preload`, `vllm
                # bench`) is no server
                return (argv[j + 3 :], env) if argv[j + 2 : j + 3] == ["serve"] else None
            return argv[j + 2 :], env
        if tok.endswith(("vllm/entrypoints/openai/api_server.py", "vllm/entrypoints/api_server.py")):
            return argv[j + 1 :], env
        if base in _SHELLS and j + 2 < n and argv[j + 1] == "-c":
            try:
                inner = shlex.split(argv[j + 2], comments=True)
            except ValueError:
                return None
            found = locate_vllm_args(inner)
            if found is not None:
                return found[0], {**env, **found[1]}
            return None
        if base in _CONTAINER_TOOLS and j + 1 < n and argv[j + 1] == "run":
            img = _docker_image_index(argv, j + 2)
            if img is None:
                return None
            env.update(_docker_env(argv, j + 2, img))
            rest = argv[img + 1 :]
            inner_found = locate_vllm_args(rest) if rest and not rest[0].startswith("-") else None
            if inner_found is not None:
                return inner_found[0], {**env, **inner_found[1]}
            if "vllm" in argv[img].lower() or (rest and rest[0].startswith("--")):
                return rest, env  # image entrypoint is `vllm serve`
            return None
    return None


def _parse_vllm_args(args: list[str], origin: str, line: int | None) -> tuple[dict[str, Any], list[str]]:
    """vLLM arguments → ({canonical dest: converted value}, positionals). Raises SourceError."""
    out: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    n = len(args)
    while i < n:
        tok = args[i]
        if tok == "--":
            positional.extend(args[i + 1 :])
            break
        if not tok.startswith("-") or tok == "-" or re.fullmatch(r"-\d+(\.\d*)?", tok):
            positional.append(tok)
            i += 1
            continue
        name, eq, inline = tok.partition("=")
        # -O3 / -O.mode=3: compilation config with the value attached.
        if name.startswith("-O") and not name.startswith("--") and len(name) > 2:
            name, eq, inline = "-O", "=", tok[2:]
        try:
            hit = lookup_option(name)
        except FlagError as e:
            raise SourceError(str(e), origin=origin, line=line) from None
        if hit is None:
            dest = canonical_dest(name)
            if eq:
                out[dest] = inline
            elif i + 1 < n and (
                not args[i + 1].startswith("-") or re.fullmatch(r"-\d+(\.\d*)?", args[i + 1])
            ):
                out[dest] = args[i + 1]
                i += 1
            else:
                out[dest] = True
            i += 1
            continue
        flag, switch = hit
        if flag.kind == "bool":
            if eq:
                try:
                    value = convert_value(flag, inline)
                except FlagError as e:
                    raise SourceError(_without_value(e, inline), origin=origin, line=line) from None
                out[flag.dest] = value if switch else not value
            else:
                out[flag.dest] = switch
            i += 1
            continue
        if flag.kind == "list" and not eq:
            vals = []
            j = i + 1
            while j < n and not args[j].startswith("-"):
                vals.append(args[j])
                j += 1
            if not vals:
                raise SourceError(f"{flag.cli} needs a value", origin=origin, line=line)
            out[flag.dest] = vals
            i = j
            continue
        if eq:
            raw = inline
            i += 1
        elif i + 1 < n:
            raw = args[i + 1]
            i += 2
        else:
            # hf_token is nargs='?': a bare switch means "use the cached token".
            if flag.dest == "hf_token":
                out[flag.dest] = True
                i += 1
                continue
            raise SourceError(f"{flag.cli} needs a value", origin=origin, line=line)
        try:
            out[flag.dest] = convert_value(flag, raw)
        except FlagError as e:
            raise SourceError(_without_value(e, raw), origin=origin, line=line) from None
    return out, positional


def _without_value(err: Exception, value: Any) -> str:
    """A FlagError's message with the offending value taken out (it may be a secret pasted in
    the wrong place): "--max-model-len: the value: decimals are not allowed …"."""
    msg = str(err)
    for shown in {repr(value), repr(str(value))}:
        msg = msg.replace(shown, "the value")
    return msg if len(msg) <= 200 else msg[:200] + "…"


def _load_config_file(
    path_text: str, base_dir: Path | None, confine_to: Path | None = None
) -> tuple[dict[str, Any], str | None]:
    """Read a ``--config`` YAML file; returns (mapping, error reason or None).

    With ``confine_to`` (a bundle directory) the file must resolve inside it: an absolute path
    from the host the bundle came from is looked up by its name in the bundle, and a path
    (or symlink) that leads out of the bundle is refused — a bundle never reads this host's files.
    """
    path = Path(path_text)
    if confine_to is not None:
        root = confine_to.resolve()
        candidate = (root / path.name) if path.is_absolute() else (base_dir or root) / path
        try:
            resolved = candidate.resolve()
        except (OSError, RuntimeError):
            return {}, "--config: cannot resolve the path inside the bundle"
        if resolved != root and root not in resolved.parents:
            return {}, "--config: the path leads outside the bundle; not read"
        if not resolved.is_file():
            return {}, f"--config: {path.name[:80]} is not in the bundle"
        path = resolved
    elif not path.is_absolute():
        if base_dir is None:
            return {}, f"{path_text}: relative path and no base directory to resolve it"
        path = base_dir / path
    try:
        raw = read_bytes(path, _MAX_CONFIG_BYTES)
        data = load_yaml_bounded(raw.decode("utf-8"), str(path))
    except SourceError as e:
        return {}, str(e)
    except (UnicodeDecodeError, RecursionError, ValueError):
        return {}, f"{path}: not YAML"
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        return {}, f"{path}: expected a mapping of flag names to values"
    return data, None


def _config_values(data: Mapping[str, Any], origin: str, line: int | None) -> dict[str, Any]:
    """A YAML/JSON mapping of flag names (either spelling) → {canonical dest: converted value}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        flag = flag_for_dest(str(key))
        if flag is None:
            out[canonical_dest(str(key))] = value
            continue
        try:
            out[flag.dest] = convert_value(flag, value)
        except FlagError as e:
            raise SourceError(f"config file: {_without_value(e, value)}", origin=origin, line=line) from None
    return out


def _build_config(
    full_argv: list[str], origin: str, line: int | None, base_dir: Path | None, confine_to: Path | None = None
) -> EngineConfig | None:
    found = locate_vllm_args(full_argv)
    if found is None:
        return None
    vllm_args, env = found
    # `vllm serve m > log 2>&1 &`: shell operators end vLLM's arguments.
    for k, tok in enumerate(vllm_args):
        if tok in _SHELL_OPS or _REDIRECT.match(tok):
            vllm_args = vllm_args[:k]
            break
    values, positional = _parse_vllm_args(vllm_args, origin, line)
    for dest, value in values.items():
        why = out_of_range(dest, value)
        if why is not None:
            raise SourceError(why, origin=origin or None, line=line)
    cfg = EngineConfig()
    cfg.command = shlex.join(redact_argv(full_argv))
    if "config" in values and isinstance(values["config"], str) and values["config"]:
        data, err = _load_config_file(values["config"], base_dir, confine_to)
        if err:
            cfg.args["_config_error"] = err
        update_config_from_args(cfg, _config_values(data, origin, line), explicit=True)
    if positional:
        # `vllm serve MODEL`: the positional model_tag wins over --model and the config file.
        values = {"model": positional[0], **{k: v for k, v in values.items() if k != "model"}}
        if len(positional) > 1:
            cfg.args["_positional"] = positional[1:]
    update_config_from_args(cfg, values, explicit=True)
    if env:
        cfg.args["_env"] = redact_env(env)
    return cfg


@guarded("origin", 1)
def parse_argv(
    argv: list[str], origin: str = "", base_dir: Path | None = None, *, confine_to: Path | None = None
) -> EngineConfig:
    """Parse one command line given as argv (psutil ``Process.cmdline()``, a NUL-split
    ``/proc/PID/cmdline``). ``base_dir`` resolves a relative ``--config`` (the process's cwd).

    Returns the :class:`EngineConfig` with fields the command sets, ``explicit`` naming them,
    ``args`` every flag (canonical dest → value, secrets redacted) and ``command`` the redacted
    shell string. vLLM's defaults are NOT applied (see :func:`kvdoctor.vllm_flags.apply_defaults`).
    Raises :class:`SourceError` when it is not a vLLM launch, or a flag is ambiguous or has a bad
    value.
    """
    argv = [str(a) for a in argv]
    if sum(len(a) + 1 for a in argv) > MAX_CMDLINE_CHARS:
        raise SourceError("command longer than 256 KiB: not a launch command", origin=origin or None)
    cfg = _build_config(argv, origin, None, base_dir, confine_to)
    if cfg is None:
        # named by its program only: the rest may hold anything (and did, in pasted commands)
        prog = os.path.basename(argv[0])[:40] if argv else ""
        shown = (
            f" (runs {prog!r})" if prog.replace("-", "").replace("_", "").replace(".", "").isalnum() else ""
        )
        raise SourceError(f"not a vLLM launch command{shown}", origin=origin or None)
    return cfg


@guarded("origin", 1)
def parse_cmdline_text(
    text: str, origin: str = "", base_dir: Path | None = None, *, confine_to: Path | None = None
) -> list[EngineConfig]:
    """Parse a bundle's ``cmdline.txt`` (or a ``/proc/PID/cmdline`` dump) into one
    :class:`EngineConfig` per vLLM command, in file order.

    Lines that are not vLLM commands (``cd /srv``, ``export X=1``) are skipped. ``base_dir`` (the
    bundle directory) resolves ``--config FILE.yaml``; None resolves only absolute paths;
    ``confine_to`` (a bundle directory) keeps ``--config`` inside it (else refused, with the reason
    in ``cfg.args["_config_error"]``). At most :data:`MAX_COMMANDS` commands are read; when more
    follow, the last config's ``args["_cut"]`` says so. Raises
    :class:`SourceError` (origin, line, reason) for binary data, unbalanced quotes, an ambiguous
    or badly valued flag, or when no line holds a vLLM command.
    """
    if not text.strip("\x00 \t\r\n"):
        raise SourceError("empty launch command file", origin=origin or None)
    if "\x00" in text:
        if len(text) > MAX_CMDLINE_CHARS:
            raise SourceError("command longer than 256 KiB: not a launch command", origin=origin or None)
        _check_text(text, origin, allow_nul=True)
        argv = [a for a in text.split("\x00") if a != ""]
        cfg = _build_config(argv, origin, 1, base_dir, confine_to)
        if cfg is None:
            raise SourceError(
                "NUL-separated command line is not a vLLM launch", origin=origin or None, line=1
            )
        return [cfg]
    _check_text(text, origin, allow_nul=False)
    configs: list[EngineConfig] = []
    for lineno, line in _logical_lines(text):
        if len(line) > MAX_CMDLINE_CHARS:
            # shlex is pure Python: a megabyte "command" is not one, and would take seconds
            raise SourceError(
                "command longer than 256 KiB: not a launch command", origin=origin or None, line=lineno
            )
        if len(configs) >= MAX_COMMANDS:
            configs[-1].args["_cut"] = (
                f"more than {MAX_COMMANDS} vLLM commands: the first {MAX_COMMANDS} read"
            )
            break
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as e:
            raise SourceError(f"cannot split the command ({e})", origin=origin or None, line=lineno) from None
        if not argv:
            continue
        cfg = _build_config(argv, origin, lineno, base_dir, confine_to)
        if cfg is not None:
            configs.append(cfg)
    if not configs:
        raise SourceError(
            "no vLLM command found (expected `vllm serve …`, `python -m vllm.entrypoints…` or `docker run … IMAGE …`)",
            origin=origin or None,
        )
    return configs


@guarded("path", 0)
def parse_cmdline_file(path: str | os.PathLike[str]) -> list[EngineConfig]:
    """Read and parse a ``cmdline.txt`` file; ``--config`` resolves relative to its directory.
    Raises :class:`SourceError` when the file cannot be read or parsed."""
    p = Path(path)
    raw = read_bytes(p, MAX_TEXT_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"not UTF-8 text (byte {e.start})", origin=str(p)) from None
    return parse_cmdline_text(text, origin=str(p), base_dir=p.parent)
