"""The diagnosis report: one :class:`Report` (schema ``kvdoctor.report/2``), three renderings
(rich text, JSON, markdown) and the exit code (spec/report.md).

The report only lays out what the sources read and the rules found; it computes no diagnosis.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import Engine, Snapshot, SourceStatus
from kvdoctor.findings import (
    FAMILIES,
    Evidence,
    Finding,
    Fix,
    Health,
    Skipped,
    causal_order,
    depth_of,
    worst_health,
)
from kvdoctor.redact import redact_text
from kvdoctor.timeline import MIN_RATE_SPAN_S

if TYPE_CHECKING:  # rich is imported by the text renderer only: JSON/markdown start without it
    from rich.console import Console
    from rich.panel import Panel

#: report/2 (kvdoctor 0.2): ``findings[].fixes`` (alternatives) and ``errors`` (rules that failed);
#: ``findings[].suggested_flags`` is the first alternative's flags and environment, kept for one
#: release.
SCHEMA = "kvdoctor.report/2"

#: EngineConfig fields copied into ``engines[].config`` (spec/report.md, plus a few more).
ENGINE_CONFIG_FIELDS: tuple[str, ...] = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "block_size",
    "enforce_eager",
    "vllm_version",
)
#: keys of ``engines[].kv`` (values from ``engine_kv[engine.id]``; None when unknown).
ENGINE_KV_FIELDS: tuple[str, ...] = ("num_gpu_blocks", "block_size", "capacity_tokens", "usage")

EXIT_OK, EXIT_WARNING, EXIT_CRITICAL, EXIT_UNKNOWN = 0, 1, 2, 3

_SEVERITY_STYLE = {"critical": "bold red", "warning": "bold yellow", "info": "bold cyan", "ok": "bold green"}
_STATUS_MARK = {"ok": ("✓", "green"), "missing": ("–", "dim"), "error": ("✗", "red")}
#: the mark of a source read in part ("ok" with a ``cut``: the time budget ran out in it)
_PART_MARK = ("◐", "yellow")


@shared_methods
@dataclass(repr=False, eq=False)
class Report:
    """Everything ``kvdoctor diagnose`` outputs (spec/report.md JSON schema).

    ``gpus``/``engines`` are plain JSON-ready dicts; ``findings`` lead with root causes (worst
    first), each followed by its consequences (``caused_by`` = the root's rule id).
    ``generated_at`` is ISO-8601 UTC with a "Z" suffix.
    """

    generated_at: str
    health: Health
    sources: list[SourceStatus] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    #: rules that failed on this input (raised, or computed an invalid fix): {rule, engine,
    #: where, message}. A failed rule is never a silent absence: see :func:`exit_code`.
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: what the user config changed: {"file", "thresholds": {rule: {name: value}}, "disabled"}
    #: (empty when no config was read)
    config: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (key order as in spec/report.md)."""
        return {
            "schema": self.schema,
            "generated_at": self.generated_at,
            "health": self.health,
            "sources": [
                {"kind": s.kind, "origin": s.origin, "status": s.status, "detail": s.detail, "cut": s.cut}
                for s in self.sources
            ],
            "gpus": self.gpus,
            "engines": self.engines,
            "findings": [f.to_dict() for f in self.findings],
            "skipped": [s.to_dict() for s in self.skipped],
            "errors": [dict(e) for e in self.errors],
            "config": {
                "file": self.config.get("file"),
                "thresholds": self.config.get("thresholds") or {},
                "disabled": list(self.config.get("disabled") or ()),
            },
            # Added in report/1 (fields may be added): the process exit code, 3 = nothing readable,
            # so a consumer of the JSON need not re-derive "unknown" from the sources.
            "exit_code": exit_code(self),
        }


def _iso_utc(now: datetime | float | None) -> str:
    if now is None:
        dt = datetime.now(timezone.utc)
    elif isinstance(now, (int, float)):
        dt = datetime.fromtimestamp(now, timezone.utc)
    else:
        dt = now if now.tzinfo is not None else now.replace(tzinfo=timezone.utc)
    # the text is a function of the UTC second alone: a live face stamps the same second's
    # text again (strftime was a quarter of a report's cost)
    second = math.floor(dt.timestamp())
    last = _ISO_LAST[0]
    if last[0] == second:
        return last[1]
    text = dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    _ISO_LAST[0] = (second, text)  # one tuple: a concurrent reader sees either pair whole
    return text


#: the last (unix second, its ISO-8601 text) :func:`_iso_utc` made
_ISO_LAST: list[tuple[int | None, str]] = [(None, "")]


def build_report(
    snapshot: Snapshot,
    findings: list[Finding],
    skipped: list[Skipped],
    engine_kv: dict[str, dict[str, Any]] | None = None,
    now: datetime | float | None = None,
    *,
    engines: list[Engine] | None = None,
    owned: bool = False,
    errors: list[dict[str, Any]] | None = None,
    config: dict[str, Any] | None = None,
) -> Report:
    """Assemble a :class:`Report` from a snapshot and the rule engine's output.

    ``gpus`` from ``snapshot.gpus`` (NVML / nvidia-smi facts: bytes, utilisation 0..1),
    ``engines`` from ``engines`` (the pipeline passes derive's; default ``snapshot.engines``)
    with a subset of their EngineConfig and ``kv`` from ``engine_kv[engine.id]``
    ({num_gpu_blocks, block_size, capacity_tokens, usage}, built by ``kvdoctor.derive``).
    ``now``: datetime or unix seconds (default: the clock). Findings are redacted as copies:
    neither ``snapshot`` nor ``findings`` is modified; ``owned``: the findings are the caller's
    own, shared with nothing (the pipeline's, fresh from the rule engine): redacted in place
    and reported as they are (the same report). Never raises.
    """
    gpus = [
        {
            "index": g.index,
            "uuid": g.uuid,
            "name": g.name,
            "memory_total_bytes": g.memory_total_bytes,
            "memory_used_bytes": g.memory_used_bytes,
            "utilization_gpu": g.utilization_gpu,
            "processes": [{"pid": p.pid, "name": p.name, "used_bytes": p.used_bytes} for p in g.processes],
        }
        for g in snapshot.gpus
    ]
    engine_rows = []
    for e in snapshot.engines if engines is None else engines:
        kv_src = (engine_kv or {}).get(e.id) or {}
        engine_rows.append(
            {
                "id": e.id,
                "pid": e.pid,
                "model": e.config.served_model_name or e.config.model,
                "gpus": list(e.gpus),
                "config": {name: getattr(e.config, name, None) for name in ENGINE_CONFIG_FIELDS},
                "kv": {name: kv_src.get(name) for name in ENGINE_KV_FIELDS},
                # how GPU memory was matched to it: "pid" | "gpu_uuid" | None (derive/container.py)
                "attribution": kv_src.get("attribution"),
                # the vLLM version and KV sizing mode read or assumed (derive/extensible.py)
                "vllm": dict(kv_src.get("vllm") or {}),
            }
        )
    # The last line of defence for "secrets never leave": whatever a source echoed back
    # (an unparsable command line, a URL with credentials) is redacted here too.
    sources = [
        SourceStatus(s.kind, _redacted(s.origin), s.status, _redacted(s.detail), cut=s.cut)
        for s in snapshot.sources
    ]
    shown = [_redact_owned(f) for f in findings] if owned else [_shown(f) for f in findings]
    return Report(
        generated_at=_iso_utc(now),
        # Nothing read is not "OK": findings from no facts mean nothing (spec/report.md, exit 3).
        health="unknown" if not any(s.status == "ok" for s in sources) else worst_health(shown),
        sources=sources,
        gpus=gpus,
        engines=engine_rows,
        findings=_causal_order(shown),
        skipped=sorted(skipped, key=lambda s: (s.rule, s.engine or "")),
        errors=[
            {k: _redacted(str(v)) if isinstance(v, str) else v for k, v in e.items()} for e in errors or ()
        ],
        config=dict(config or {}),
    )


#: text → redact_text(text), for the texts a live face reports every cycle (the same source
#: origins, summaries and evidence, cycle after cycle); bounded, cleared when full
_REDACTED: dict[str, str] = {}
_REDACTED_MAX = 2048


def _redacted(text: str) -> str:
    """:func:`~kvdoctor.redact.redact_text` of ``text`` (a pure function of it), kept."""
    try:
        return _REDACTED[text]
    except KeyError:
        pass
    out = redact_text(text)
    if len(_REDACTED) >= _REDACTED_MAX:
        _REDACTED.clear()
    _REDACTED[text] = out
    return out


#: the (rule, severity, family, engine, caused_by) of each finding in the order given → the
#: positions :func:`~kvdoctor.findings.causal_order` puts them in (a function of those alone);
#: bounded, cleared when full
_ORDER: dict[tuple[tuple[Any, ...], ...], tuple[int, ...]] = {}
_ORDER_MAX = 256


def _causal_order(findings: list[Finding]) -> list[Finding]:
    """:func:`~kvdoctor.findings.causal_order` of ``findings``, its order kept per keys: a
    live face's findings keep their keys cycle after cycle while their texts change."""
    keys = tuple([(f.rule, f.severity, f.family, f.engine, f.caused_by) for f in findings])
    order = _ORDER.get(keys)
    if order is None:
        ordered = causal_order(findings)
        position = {id(f): i for i, f in enumerate(findings)}
        order = tuple([position[id(f)] for f in ordered])
        if len(_ORDER) >= _ORDER_MAX:
            _ORDER.clear()
        _ORDER[keys] = order
    return [findings[i] for i in order]


def _shown(f: Finding) -> Finding:
    """The report's copy of a finding: its own lists and dict (``dataclasses.replace`` with
    every field, without its cost), redacted as :func:`_redact_owned` redacts."""
    return _redact_owned(
        Finding(
            rule=f.rule,
            severity=f.severity,
            family=f.family,
            title=f.title,
            summary=f.summary,
            evidence=[Evidence(ev.fact, ev.value, ev.source) for ev in f.evidence],
            suggested_flags=dict(f.suggested_flags),
            fixes=list(f.fixes),
            gpus=list(f.gpus),
            engine=f.engine,
            docs=f.docs,
            caused_by=f.caused_by,
        )
    )


def _redact_owned(f: Finding) -> Finding:
    """A finding shared with nothing (its lists and dict its own), redacted in place: the
    summary and the evidence values and sources (``kvdoctor.redact``)."""
    f.summary = _redacted(f.summary)
    f.fixes = [
        Fix(dict(x.flags), dict(x.env), tuple(_redacted(c) for c in x.commands), _redacted(x.why))
        for x in f.fixes
    ]
    for ev in f.evidence:
        ev.value = _redacted(ev.value)
        ev.source = _redacted(ev.source)
    return f


def exit_code(report: Report) -> int:
    """0 ok/info, 1 warning, 2 critical, 3 when no source could be read (spec/report.md), and 3
    when a rule failed (``errors``) and nothing critical was found: the diagnosis is incomplete,
    so "OK" or "WARNING" would claim more than was checked."""
    if report.health == "unknown" or not any(s.status == "ok" for s in report.sources):
        return EXIT_UNKNOWN
    if report.health == "critical":
        return EXIT_CRITICAL
    if report.errors:
        return EXIT_UNKNOWN
    return EXIT_WARNING if report.health == "warning" else EXIT_OK


# --------------------------------------------------------------------------- JSON


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/Infinity; an unknown number is null, like a value never read.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    return value


def render_json(report: Report) -> str:
    """The report as one compact JSON document on one line (no trailing newline)."""
    return json.dumps(
        _json_safe(report.to_dict()), separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str
    )


# --------------------------------------------------------------------------- shared helpers


def fix_lines(finding: Finding) -> list[str]:
    """The fixes as copy-pasteable lines, one per alternative, the recommended first
    (:meth:`~kvdoctor.findings.Fix.line`: "--max-model-len 23648 --max-num-seqs 64",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "kill 48211 48212"). A finding made
    without ``fixes`` (report/1's) shows its ``suggested_flags`` as one line."""
    if finding.fixes:
        return [line for line in (x.line() for x in finding.fixes) if line]
    flags = {k: v for k, v in finding.suggested_flags.items() if k.startswith("-")}
    env = {k: v for k, v in finding.suggested_flags.items() if not k.startswith("-")}
    line = Fix(flags, env).line()
    return [line] if line else []


def _source_line(s: SourceStatus) -> str:
    detail = f" — {s.detail}" if s.detail else ""
    return f"{s.kind} {s.origin}: {status_word(s)}{detail}"


def status_word(s: SourceStatus) -> str:
    """A source's status as faces show it: "ok (in part)" when the time budget cut it."""
    return f"{s.status} (in part)" if s.cut and s.status == "ok" else s.status


def cut_text(sources: list[SourceStatus]) -> str | None:
    """The report's note when the time budget for reading offline inputs cut any source
    (``sources[].cut``): "Partial evidence: the time budget for reading the inputs ran out (log
    b/vllm.log read in part, 2 sources not read); the findings rest on what was read
    (--time-budget 0: no limit)". None when nothing was cut."""
    part = [s for s in sources if s.cut and s.status == "ok"]
    unread = [s for s in sources if s.cut and s.status != "ok"]
    if not part and not unread:
        return None
    said = [f"{s.kind} {s.origin} read in part" for s in part]
    if unread:
        said.append(f"{len(unread)} source{'s' if len(unread) != 1 else ''} not read")
    return (
        "Partial evidence: the time budget for reading the inputs ran out ("
        + ", ".join(said)
        + "); the findings rest on what was read (--time-budget 0: no limit)"
    )


#: rule input names (rules/*.yaml ``needs``) in the words of the artifacts that provide them.
INPUT_WORDS = {
    "gpus": "nvidia-smi/NVML",
    "metrics": "/metrics",
    "timeline": f"two /metrics scrapes {MIN_RATE_SPAN_S:g} s apart",
    "log": "vLLM log",
    "config": "launch command",
    "model": "config.json",
    "processes": "process table",
}


def config_text(config: dict[str, Any]) -> str | None:
    """The user config's changes in one line ("config c.yaml: preemption-storm min_per_min=20;
    disabled idle-preallocation"), None when it changed nothing."""
    parts = [
        f"{rid} " + ", ".join(f"{k}={v}" for k, v in values.items())
        for rid, values in (config.get("thresholds") or {}).items()
    ]
    if config.get("disabled"):
        parts.append("disabled " + ", ".join(config["disabled"]))
    if not parts:
        return None
    return f"config {config.get('file') or ''}: ".replace(" :", ":") + "; ".join(parts)


def _error_text(e: dict[str, Any]) -> str:
    """ "rule-id [engine] check: ValueError: …" """
    eng = f" [{e.get('engine')}]" if e.get("engine") else ""
    return f"{e.get('rule')}{eng} {e.get('where')}: {e.get('message')}"


def _input_words(missing: str) -> str:
    return " or ".join(INPUT_WORDS.get(part, part) for part in missing.split("|"))


def _skipped_text(skipped: list[Skipped]) -> str:
    """ "no nvidia-smi/NVML: rule-a, rule-b; no /metrics: rule-c"; with two or three engines each
    rule names its engine (rule-a[e1]), with more it says on how many (rule-a on 25 engines)."""
    engines = {s.engine for s in skipped}
    groups: dict[str, dict[str, list[str | None]]] = {}
    for s in skipped:
        missing = ", ".join(_input_words(m) for m in s.missing)
        groups.setdefault(missing, {}).setdefault(s.rule, []).append(s.engine)
    parts = []
    for missing, rules in groups.items():
        names = []
        for rule, where in rules.items():
            if len(engines) <= 1:
                names.append(rule)
            elif len(engines) <= 3:
                names += [f"{rule}[{e}]" if e else rule for e in where]
            else:
                names.append(f"{rule} on {len(where)} engine{'s' if len(where) != 1 else ''}")
        parts.append(f"no {missing}: {', '.join(names)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- markdown


def _md_cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def printable(obj: Any) -> Any:
    """A copy of a report (or any part of it) with every string's control characters escaped
    (:func:`kvdoctor.redact.escape_controls`): what text and markdown faces render, so ESC, BEL
    or NUL from a metrics label, a log line or a directory name never reach a terminal raw."""
    import copy
    import dataclasses

    from kvdoctor.redact import escape_controls

    if isinstance(obj, str):
        return escape_controls(obj)
    if isinstance(obj, list):
        return [printable(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(printable(v) for v in obj)
    if isinstance(obj, dict):
        return {printable(k): printable(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, printable(getattr(obj, f.name)))
        return new
    return obj


def render_markdown(report: Report) -> str:
    """Markdown for an issue tracker: each finding with its fix first, then its summary and a
    collapsed ``<details>`` evidence table; then the sources table and skipped rules. Control
    characters in any text are escaped (:func:`printable`)."""
    report = printable(report)
    n = len(report.findings)
    lines = [
        f"## kvdoctor: {'UNKNOWN (no source could be read)' if exit_code(report) == EXIT_UNKNOWN else report.health.upper()}",
        "",
        f"{n} finding{'s' if n != 1 else ''} · generated {report.generated_at} · `{report.schema}`",
        "",
    ]
    cut = cut_text(report.sources)
    if cut:
        lines += [f"> ⚠ **{_md_cell(cut)}**", ""]
    configured = config_text(report.config)
    if configured:
        lines += [f"Thresholds and rules changed by the user {_md_cell(configured)}", ""]
    for f in report.findings:
        scope = []
        if f.engine:
            scope.append(f"engine `{f.engine}`")
        if f.gpus:
            scope.append("GPU " + ", ".join(str(g) for g in f.gpus))
        depth = depth_of(f, report.findings)
        if depth:
            lines.append(f"{'#' * min(6, 3 + depth)} ↳ {f.severity.upper()}: {f.title}")
            lines.append("")
            lines.append(f"*A consequence of `{f.caused_by}` above: its fix should clear this too.*")
        else:
            lines.append(f"### {f.severity.upper()}: {f.title}")
        lines.append("")
        for i, line in enumerate(fix_lines(f)):
            why = f.fixes[i].why if i < len(f.fixes) and f.fixes[i].why else ""
            lines.append(("**Fix:**" if i == 0 else "**or:**") + (f" {_md_cell(why)}" if why else ""))
            lines += ["", "```", line, "```", ""]
        lines.append(f.summary)
        lines.append("")
        if f.evidence:
            lines += [
                "<details><summary>Evidence</summary>",
                "",
                "| fact | value | source |",
                "|---|---|---|",
            ]
            lines += [
                f"| {_md_cell(e.fact)} | {_md_cell(e.value)} | {_md_cell(e.source)} |" for e in f.evidence
            ]
            lines += ["", "</details>", ""]
        meta = [f"`{f.rule}` ({f.family}: {FAMILIES.get(f.family, '')})", *scope, f"`{f.docs}`"]
        lines.append(" · ".join(meta))
        lines.append("")
    if not report.findings:
        lines += ["No findings.", ""]
    lines += ["### Sources", "", "| kind | origin | status | detail |", "|---|---|---|---|"]
    lines += [
        f"| {_md_cell(s.kind)} | {_md_cell(s.origin)} | {_md_cell(status_word(s))} | {_md_cell(s.detail)} |"
        for s in report.sources
    ]
    lines.append("")
    if report.skipped:
        lines += [f"Skipped rules (missing inputs): {_md_cell(_skipped_text(report.skipped))}", ""]
    for e in report.errors:
        lines += [f"**Rule failed:** {_md_cell(_error_text(e))}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- rich text


def _finding_panel(f: Finding) -> Panel:
    from rich.console import Group, RenderableType
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = []
    if f.caused_by:
        parts.append(
            Text(f"A consequence of {f.caused_by} above: its fix should clear this too.", style="italic")
        )
        parts.append(Text(""))
    fixes = fix_lines(f)
    if fixes:
        fix = Text()
        for i, line in enumerate(fixes):
            if i:
                fix.append("\n")
            fix.append("Fix: " if i == 0 else "or:  ", style="bold green")
            fix.append(line, style="bold")
            why = f.fixes[i].why if i < len(f.fixes) else ""
            if why:
                fix.append(f"  ({why})", style="dim")
        parts.append(fix)
        parts.append(Text(""))
    parts.append(Text(f.summary))
    if f.evidence:
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False, expand=False)
        table.add_column("fact", overflow="fold")
        table.add_column("value", overflow="fold")
        table.add_column("source", style="dim", overflow="fold")
        for e in f.evidence:
            table.add_row(Text(e.fact), Text(e.value), Text(e.source))
        parts.append(Text(""))
        parts.append(table)
    scope = []
    if f.engine:
        scope.append(f"engine {f.engine}")
    if f.gpus:
        scope.append("GPU " + ",".join(str(g) for g in f.gpus))
    footer = Text("".join(s + " · " for s in scope), style="dim")
    footer.append(f.docs, style="italic")
    parts.append(Text(""))
    parts.append(footer)
    title = Text("↳ " if f.caused_by else "")
    title.append(f.severity.upper(), style=_SEVERITY_STYLE.get(f.severity, "bold"))
    title.append(" " + f.title, style="bold")
    return Panel(
        Group(*parts),
        title=title,
        title_align="left",
        border_style=_SEVERITY_STYLE.get(f.severity, "").replace("bold ", ""),
        expand=True,
    )


def make_console(stream: Any = None) -> Console:
    """The console every text face prints to: the terminal's width on a TTY; 120 columns when
    piped (CI logs, ``tee``), where rich's 80-column default would fold every source line.
    Colour is off for non-TTYs and with NO_COLOR (rich's own rules)."""
    import os
    import sys

    out = stream or sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    width = None if tty else int(os.environ.get("COLUMNS", "120"))
    return _pipe_aware_console()(file=out, width=width, highlight=False)


@functools.lru_cache(maxsize=1)
def _pipe_aware_console() -> type[Console]:
    """rich's Console, subclassed on first use (rich is imported only by the text renderer)."""
    from rich.console import Console

    class _PipeAwareConsole(Console):
        """rich's Console exits 1 on a broken pipe (``| head``); kvdoctor's exit code is the
        diagnosis's, so the error goes back to the face, which keeps its own code."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _PipeAwareConsole


#: the text report's line per engine on how its GPU memory was matched to it (engines[].attribution)
_ATTRIBUTION_TEXT = {
    "pid": "attributed by pid (its processes hold it)",
    "gpu_uuid": "attributed by GPU UUID (NVML's pids are another PID namespace's; the GPUs its "
    "container was given)",
}


def _vllm_line(engine: dict[str, Any]) -> str | None:
    """The text report's line on the vLLM knowledge applied to an engine (``engines[].vllm``):
    given for a vLLM ≥ 0.34 engine (its KV sizing mode, its evidence, the gmu in effect) and
    whenever something was assumed (an unknown version: 0.33's defaults); None otherwise."""
    v = engine.get("vllm") or {}
    mode, assumption = v.get("sizing_mode"), v.get("assumption")
    v34 = str(v.get("defaults_version") or "").startswith("0.34")
    if not assumption and not v34:
        return None
    text = f"vLLM of {engine.get('id')}: {v.get('version') or 'version unknown'}"
    if v34 and mode:
        how = "extensible (measured after warm-up)" if mode == "extensible" else "by estimate"
        text += f", KV cache sized {how}"
        src = str(v.get("sizing_mode_source") or "")
        if src and not v.get("sizing_mode_assumed"):  # an assumed mode is said below
            text += f" ({src})"
        if v.get("gmu"):
            text += f"; gmu {v['gmu']}"
    if assumption:
        said = str(assumption)
        if said.startswith("vLLM version unknown: "):  # the version is said already
            said = said[len("vLLM version unknown: ") :]
        text += f"; {said}"
    return text


def render_text(report: Report, console: Console) -> None:
    """Print the report with rich: a header (health; one line per source: read, missing or
    why it failed), one panel per finding worst first with the fix first, then a line of
    skipped rules. Colour follows the console (none when not a TTY or with NO_COLOR). Control
    characters in any text are escaped (:func:`printable`)."""
    from rich.padding import Padding
    from rich.text import Text

    report = printable(report)

    counts: dict[str, int] = {}
    for f in report.findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    head = Text("kvdoctor: ", style="bold")
    unknown = exit_code(report) == EXIT_UNKNOWN
    if unknown:
        # Nothing was read: "OK" would claim a diagnosis that never happened.
        head.append("UNKNOWN", style="bold magenta")
        head.append(" — no source could be read")
    else:
        head.append(report.health.upper(), style=_SEVERITY_STYLE.get(report.health, "bold"))
    if unknown:
        pass
    elif report.findings:
        detail = ", ".join(f"{counts[s]} {s}" for s in ("critical", "warning", "info") if s in counts)
        head.append(f" — {len(report.findings)} finding{'s' if len(report.findings) != 1 else ''} ({detail})")
    else:
        head.append(" — no findings")
    console.print(head)
    cut = cut_text(report.sources)
    if cut:
        console.print(Text(f"  ⚠ {cut}", style="yellow"), overflow="fold")
    for s in report.sources:
        mark, style = _PART_MARK if s.cut and s.status == "ok" else _STATUS_MARK.get(s.status, ("?", ""))
        line = Text(f"  {mark} ", style=style)
        line.append(_source_line(s), style="dim" if s.status == "missing" else "")
        console.print(line, overflow="fold")
    if not report.sources:
        console.print(Text("  ✗ no source was read", style="red"))
    configured = config_text(report.config)
    if configured:
        console.print(Text(f"  ⚙ {configured}", style="dim"), overflow="fold")
    # each engine with a finding says what vLLM knowledge it got; those without one are counted
    # on one line (a fleet of healthy pods would otherwise print one line each)
    with_findings = {f.engine for f in report.findings}
    quiet: list[str] = []
    for e in report.engines:
        vline = _vllm_line(e)
        if vline and (e.get("id") in with_findings or len(report.engines) <= 3):
            console.print(Text(f"  {vline}", style="dim"), overflow="fold")
        elif vline:
            quiet.append(str((e.get("vllm") or {}).get("assumption") or "vLLM 0.34 knowledge applied"))
        if e.get("attribution") in _ATTRIBUTION_TEXT:
            gpus = ", ".join(str(i) for i in e.get("gpus") or []) or "?"
            console.print(
                Text(
                    f"  GPU memory of {e['id']} (GPU {gpus}): {_ATTRIBUTION_TEXT[e['attribution']]}",
                    style="dim",
                ),
                overflow="fold",
            )
    if quiet:
        console.print(
            Text(
                f"  {len(quiet)} engines without findings: {quiet[0]}"
                + (" (and others)" if len(set(quiet)) > 1 else ""),
                style="dim",
            ),
            overflow="fold",
        )
    console.print()
    for f in report.findings:
        depth = depth_of(f, report.findings)
        # Consequences sit indented under their root cause: one fix to read, not four symptoms.
        console.print(Padding(_finding_panel(f), (0, 0, 0, 4 * depth)) if depth else _finding_panel(f))
    if unknown and cut:
        console.print(
            Text(
                "Nothing was read before the time budget ran out: give --time-budget more seconds (0: no limit).",
                style="yellow",
            )
        )
    elif unknown:
        console.print(
            Text(
                "Nothing to diagnose here. Point kvdoctor at a vLLM server (--metrics URL, --log FILE), a support "
                "bundle (--bundle DIR|.tar.gz) or single artifacts (--nvidia-smi, --log, --cmdline); "
                "or see an example with --demo.",
                style="yellow",
            )
        )
    elif report.skipped:
        console.print(Text(f"Skipped rules (missing inputs): {_skipped_text(report.skipped)}", style="dim"))
    for e in report.errors:
        console.print(
            Text(f"Rule failed (its finding may be missing): {_error_text(e)}", style="red"), overflow="fold"
        )
