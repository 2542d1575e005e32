"""User overrides of the rule catalogue: per-rule thresholds and disabled rules.

Read from ``--config FILE``, else ``$KVDOCTOR_CONFIG``, else ``~/.config/kvdoctor/config.yaml``
when that file exists. The format (YAML, safe loading)::

    disabled: [idle-preallocation]        # rule ids that never run
    thresholds:                           # rule id -> threshold name -> value
      preemption-storm:
        per_min: 20

Unknown rule ids, unknown threshold names and values of the wrong kind are errors
(:class:`UserConfigError`, one line with file:line).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdoctor.dcmethods import shared_methods
from kvdoctor.rulekit import Rule
from kvdoctor.yamlfile import YamlFileError, key_line, load_yaml_with_lines, value_line

ENV_VAR = "KVDOCTOR_CONFIG"


class UserConfigError(Exception):
    """The user config is invalid; ``str(err)`` is ``"FILE:LINE: reason"``."""

    def __init__(self, path: str | None, line: int | None, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        where = path or "config"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {reason}")


@shared_methods
@dataclass(repr=False, eq=False)
class UserConfig:
    """Per-rule overrides. ``thresholds``: rule id → {threshold name → value};
    ``disabled``: rule ids to drop. ``origin`` is the file read (None: defaults only);
    ``lines`` maps (rule id, threshold name or None) → 1-based line, for error messages."""

    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)
    disabled: set[str] = field(default_factory=set)
    origin: str | None = None
    lines: dict[tuple[str, str | None], int] = field(default_factory=dict)


def default_config_path() -> Path | None:
    """``$KVDOCTOR_CONFIG`` when set, else ``~/.config/kvdoctor/config.yaml`` when it exists."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    home = Path.home() / ".config" / "kvdoctor" / "config.yaml"
    return home if home.is_file() else None


def load_user_config(path: str | Path | None = None, rules: Iterable[Rule[Any]] | None = None) -> UserConfig:
    """Read the user config from ``path`` (or :func:`default_config_path`); an empty
    :class:`UserConfig` when there is none. When ``rules`` is given the overrides are checked
    against them (see :func:`validate_user_config`).

    Raises :class:`UserConfigError` for an unreadable file, YAML errors, unknown keys and
    values of the wrong shape.
    """
    p = Path(path) if path is not None else default_config_path()
    if p is None:
        return UserConfig()
    shown = str(p)
    if not p.is_file():
        raise UserConfigError(shown, None, "config file does not exist")
    try:
        data = load_yaml_with_lines(p, shown)
    except YamlFileError as err:
        raise UserConfigError(shown, err.line, err.reason) from None
    cfg = UserConfig(origin=shown)
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise UserConfigError(
            shown, getattr(data, "line", 1) or 1, "expected a mapping with 'thresholds'/'disabled'"
        )
    for key in data:
        if key not in ("thresholds", "disabled"):
            raise UserConfigError(
                shown, key_line(data, key), f"unknown key {key!r} (expected thresholds, disabled)"
            )
    disabled = data.get("disabled", [])
    if not isinstance(disabled, list) or not all(isinstance(x, str) for x in disabled):
        raise UserConfigError(shown, value_line(data, "disabled"), "disabled must be a list of rule ids")
    for idx, rid in enumerate(disabled):
        cfg.disabled.add(rid)
        cfg.lines[(rid, None)] = disabled.lines[idx]  # type: ignore[attr-defined]
    thresholds = data.get("thresholds", {})
    if not isinstance(thresholds, dict):
        raise UserConfigError(
            shown, value_line(data, "thresholds"), "thresholds must map rule id → {name: value}"
        )
    for rid, values in thresholds.items():
        rline = key_line(thresholds, rid)
        if not isinstance(values, dict):
            raise UserConfigError(shown, rline, f"thresholds of {rid!r} must be a mapping name: value")
        cfg.thresholds[str(rid)] = dict(values)
        cfg.lines[(str(rid), None)] = rline or 0
        for name in values:
            cfg.lines[(str(rid), str(name))] = key_line(values, name) or 0
    if rules is not None:
        validate_user_config(cfg, rules)
    return cfg


def _line(cfg: UserConfig, rid: str, name: str | None) -> int | None:
    return cfg.lines.get((rid, name)) or None


def validate_user_config(cfg: UserConfig, rules: Iterable[Rule[Any]]) -> None:
    """Check every rule id and threshold name in ``cfg`` exists in ``rules`` and each value has
    the default's kind (number/text/bool). Raises :class:`UserConfigError` naming the line."""
    by_id = {r.id: r for r in rules}

    def unknown(rid: str, name: str | None) -> None:
        import difflib  # an unknown rule id only

        hint = difflib.get_close_matches(rid, list(by_id), n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise UserConfigError(cfg.origin, _line(cfg, rid, name), f"unknown rule id '{rid}'{extra}")

    for rid in sorted(cfg.disabled):
        if rid not in by_id:
            unknown(rid, None)
    for rid, values in cfg.thresholds.items():
        rule = by_id.get(rid)
        if rule is None:
            unknown(rid, None)
            continue
        for name, value in values.items():
            current = rule.threshold_values()
            if name not in current:
                known = ", ".join(sorted(current)) or "none"
                raise UserConfigError(
                    cfg.origin,
                    _line(cfg, rid, name),
                    f"rule '{rid}' has no threshold {name!r} (its thresholds: {known})",
                )
            try:
                rule.with_thresholds({name: value})
            except TypeError as err:
                raise UserConfigError(cfg.origin, _line(cfg, rid, name), str(err)) from None


def apply_user_config(rules: Iterable[Rule[Any]], cfg: UserConfig) -> list[Rule[Any]]:
    """The rules with ``cfg`` applied: disabled ones removed, thresholds overridden.
    Raises :class:`UserConfigError` like :func:`validate_user_config`."""
    rules = list(rules)
    validate_user_config(cfg, rules)
    out: list[Rule[Any]] = []
    for rule in rules:
        if rule.id in cfg.disabled:
            continue
        overrides = cfg.thresholds.get(rule.id)
        out.append(rule.with_thresholds(overrides) if overrides else rule)
    return out
