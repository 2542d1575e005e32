"""The one pipeline every face calls: Timeline (+ rules, user config) → Report.

``diagnose``, ``watch``, ``sidecar``, ``record``'s replay, the tests and ``bench/`` all evaluate
through :class:`Pipeline`. No click, no printing, no exit: a bad rule file or user config raises
:class:`PipelineError` (``str(err)`` is ``FILE:LINE: reason``), which each face maps (diagnose →
exit 3; a sidecar keeps serving and reports it). Evaluation never mutates the Timeline's facts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import Snapshot, SourceStatus, Timeline

if TYPE_CHECKING:
    from kvdoctor.report import Report
    from kvdoctor.rulekit import Rule

#: spec/rules.md "Windows": length of the "recent" window rules read, seconds.
DEFAULT_WINDOW_S = 60.0


class PipelineError(Exception):
    """The rules or the user config cannot be loaded; ``kind`` is "rules" or "config" and
    ``str(err)`` one line, ``FILE:LINE: reason``."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


def load_rules(
    rules_dirs: Iterable[str | Path] | None = None, config_path: str | Path | None = None
) -> list[Rule[Any]]:
    """:func:`load_configured` without the applied configuration."""
    return load_configured(rules_dirs, config_path)[0]


def load_configured(
    rules_dirs: Iterable[str | Path] | None = None, config_path: str | Path | None = None
) -> tuple[list[Rule[Any]], dict[str, Any]]:
    """The rule catalogue (the built-in ``kvdoctor.rules`` modules, or the Python rule modules
    of ``rules_dirs``, then the ``kvdoctor.rules`` entry-point group's) with the user config
    applied (``config_path``, else ``$KVDOCTOR_CONFIG`` / ``~/.config/kvdoctor/config.yaml``).

    Returns the rules and what the config changed, as reports show it: ``{"file": path or
    None, "thresholds": {rule id: {name: value}}, "disabled": [rule ids]}``. Raises
    :class:`PipelineError` for an invalid rule (kind "rules") or config ("config")."""
    from kvdoctor.rulekit import RuleFileError
    from kvdoctor.rulekit import load_rules as _load
    from kvdoctor.userconfig import UserConfigError, apply_user_config, load_user_config

    dirs = list(rules_dirs) if rules_dirs else None
    try:
        rules = _load(dirs)
    except RuleFileError as e:
        raise PipelineError("rules", f"invalid rule file: {e}") from None
    try:
        user = load_user_config(config_path, rules)
    except UserConfigError as e:
        raise PipelineError("config", f"invalid config: {e}") from None
    applied = {
        "file": user.origin,
        "thresholds": {rid: dict(values) for rid, values in sorted(user.thresholds.items()) if values},
        "disabled": sorted(user.disabled),
    }
    return apply_user_config(rules, user), applied


@shared_methods
@dataclass(repr=False, eq=False)
class Pipeline:
    """Rules loaded once, evaluated over any number of Timelines.

    ``window_s``: seconds of the "recent" window (rates, quantiles, gauge maxima) ending at the
    newest snapshot. :meth:`evaluate` is pure with respect to its input: the same Timeline gives
    the same Report (bar ``generated_at``) and its facts are left unchanged.
    """

    rules: list[Rule[Any]] = field(default_factory=list)
    window_s: float = DEFAULT_WINDOW_S
    #: what the user config changed (:func:`load_configured`), shown in every report
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        rules_dirs: Iterable[str | Path] | None = None,
        config_path: str | Path | None = None,
        *,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> Pipeline:
        """A pipeline over the shipped (or given) rules and the user config; raises
        :class:`PipelineError`."""
        rules, config = load_configured(rules_dirs, config_path)
        return cls(rules=rules, window_s=window_s, config=config)

    def evaluate(self, timeline: Timeline, *, now: float | None = None) -> Report:
        """Facts → engines → rule contexts → findings → :class:`~kvdoctor.report.Report`.

        ``now``: unix seconds stamped as ``generated_at`` (default: the clock). Never raises for
        missing or partial facts; a rule that fails is listed in the report's ``errors``."""
        return evaluate(timeline, rules=self.rules, window_s=self.window_s, now=now, config=self.config)


#: the modules of the stages, imported on the first evaluation (not to import this module)
_STAGES: list[Any] = []


def _stages() -> list[Any]:
    """kvdoctor.derive, kvdoctor.report and kvdoctor.rulekit, imported once (an import
    statement per evaluation costs a lookup each; their functions are looked up per call)."""
    if not _STAGES:
        import kvdoctor.derive
        import kvdoctor.report
        import kvdoctor.rulekit

        _STAGES[:] = [kvdoctor.derive, kvdoctor.report, kvdoctor.rulekit]
    return _STAGES


def evaluate(
    timeline: Timeline,
    *,
    rules: list[Rule[Any]],
    window_s: float = DEFAULT_WINDOW_S,
    now: float | None = None,
    config: dict[str, Any] | None = None,
) -> Report:
    """Functional form of :meth:`Pipeline.evaluate`.

    derive (``kvdoctor.derive.build_contexts``: new engine objects, one variables dict per
    engine, reading only the window and a bounded history) → the rules
    (``kvdoctor.rulekit.evaluate``: findings, ``caused_by`` linked from ``explains``, rules
    that failed as errors) → ``kvdoctor.report.build_report`` (root causes first, redacted)."""
    derive, report_mod, rulekit = _stages()
    latest = timeline.latest
    configs: list[Any] = list(latest.configs) if latest is not None else []
    engines, contexts, kv = derive.build_contexts(timeline, configs, window_s=window_s)
    failed_key = derive.FAILED_KEY
    failed = sorted({f for _eid, v, _inputs in contexts for f in v.pop(failed_key, ())})
    context = rulekit.RuleContext
    ctxs = [context(engine=eid, variables=v, inputs=inputs) for eid, v, inputs in contexts]
    result = rulekit.evaluate(rules, ctxs)
    # A GPU-level fact (two engines stacked on GPU 0) reads the same from every engine's
    # context: report it once.
    seen: set[tuple[str, str, tuple[tuple[str, str], ...]]] = set()
    findings = []
    for f in result.findings:
        key = (f.rule, f.summary, tuple(sorted(f.suggested_flags.items())))
        if key not in seen:
            seen.add(key)
            findings.append(f)
    # the findings are this call's own (the rule engine makes them afresh): redacted in place
    report = report_mod.build_report(
        latest or Snapshot(),
        findings,
        result.skipped,
        engine_kv=kv,
        now=now,
        engines=engines,
        owned=True,
        errors=[vars(e) for e in result.errors],
        config=config,
    )
    for f in failed:
        family, _, why = f.partition(": ")
        detail = f"a value out of range in the input ({why}); the variables it derives are unknown"
        report.sources.append(SourceStatus("derive", family, "error", detail))
    return report
