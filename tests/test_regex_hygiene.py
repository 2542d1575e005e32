"""Regex hygiene (issue 8, class 4): no module-level regex backtracks super-linearly.

Every pattern kvdoctor keeps at module level (also inside dicts and tuples), compiled or
compiled on first use (:class:`kvdoctor.lazyre.LazyPattern`, compiled here), is run
against adversarial fillers — runs of digits, letters, spaces, quotes, brackets, separators and
the pieces patterns commonly repeat — at growing lengths. A pattern must finish each search
inside a time budget that a linear scan meets a hundred times over; a quadratic one (a 3 KB
CUDA OOM line once took 63 s) does not.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import time
from collections.abc import Callable

import pytest

import kvdoctor
import kvdoctor.derive
import kvdoctor.sidecar
import kvdoctor.sources
from kvdoctor.lazyre import LazyPattern

_SKIP = ("kvdoctor.__main__", "kvdoctor.tui", "kvdoctor.watch", "kvdoctor.faces")
FILLERS = [
    "1",
    "1.",
    "1 ",
    "1.1 ",
    "-1",
    "a",
    "A",
    "e",
    "a1",
    " ",
    "\t",
    "a b",
    "1 a",
    "--a",
    "-",
    "(",
    ")",
    "[",
    "{",
    "'",
    '"',
    ":",
    "a:",
    "a=",
    "=",
    ",",
    ", ",
    "x=1, ",
    "'a': ",
    "\\",
    "%",
    "GiB ",
    "://",
    "@",
    "a:a",
    "/",
    "|",
    "\u2580",
    "a\n",
    "<a>",
    "&",
    "_",
    "a_",
    "MiB/",
    "1MiB ",
    ". ",
    "# ",
]
LENGTHS = (1_000, 4_000, 16_000)
BUDGET_S = 0.25  # per search at the largest length; linear patterns take ~1 ms


def _modules() -> list[str]:
    names = []
    for pkg in (kvdoctor, kvdoctor.sources, kvdoctor.derive, kvdoctor.sidecar):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if not info.ispkg and not info.name.startswith(_SKIP):
                names.append(info.name)
    return sorted(set(names))


def _patterns() -> list[tuple[str, re.Pattern[str]]]:
    out: list[tuple[str, re.Pattern[str]]] = []
    for name in _modules():
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional face (Textual) not installed
            continue
        for attr, value in vars(mod).items():
            items: list[tuple[str, object]] = [(attr, value)]
            if isinstance(value, dict):
                items = [(f"{attr}[{k}]", v) for k, v in value.items()]
            elif isinstance(value, (tuple, list)):
                items = [(f"{attr}[{i}]", v) for i, v in enumerate(value)]
            for label, pat in items:
                if isinstance(pat, LazyPattern):
                    pat = pat.compiled  # what the parser compiles on first use
                if isinstance(pat, re.Pattern) and isinstance(pat.pattern, str):
                    out.append((f"{name}.{label}", pat))
    return out


PATTERNS = _patterns()


def test_patterns_found() -> None:
    # the scan sees the parsers' tables (the log parser keeps ~80 in one dict), lazy ones too
    assert len(PATTERNS) > 170
    assert any(".vllm_log._RE[oom_legacy]" in n for n, _ in PATTERNS)
    assert any(".log_catalogue2._RE[cumem_sleep]" in n for n, _ in PATTERNS)
    assert any(n.endswith("nvidia_smi._MEM_RE") for n, _ in PATTERNS)
    assert any(n.endswith("redact._LINE_KEY") for n, _ in PATTERNS)


def test_no_module_level_pattern_is_missed() -> None:
    # every module-level ``re.compile``/``lazy_re`` assignment in the package is one the scan
    # tests (a pattern the discovery cannot see would go untested)
    import pathlib

    root = pathlib.Path(kvdoctor.__file__).parent
    assign = re.compile(r"^(_?[A-Z][A-Z0-9_]*)(?:: [^=]+)? = (?:re\.compile|lazy_re)\(", re.M)
    found = {n.rsplit(".", 1)[-1] for n, _ in PATTERNS}
    missed = []
    for path in sorted(root.rglob("*.py")):
        mod = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        if mod.startswith(_SKIP):
            continue
        for m in assign.finditer(path.read_text(encoding="utf-8")):
            if m.group(1) not in found:
                missed.append(f"{mod}.{m.group(1)}")
    assert missed == []


def _search_cpu_time(pattern: re.Pattern[str], text: str, n: int) -> float:
    t0 = time.process_time()
    pattern.search(text)
    pattern.search(text + "\n")
    for _ in pattern.finditer(text[: n // 4]):
        pass
    return time.process_time() - t0


@pytest.mark.parametrize("name,pattern", PATTERNS, ids=[n for n, _ in PATTERNS])
def test_no_superlinear_backtracking(name: str, pattern: re.Pattern[str]) -> None:
    for filler in FILLERS:
        for n in LENGTHS:
            text = filler * (n // len(filler))
            # CPU time, best of two: a loaded CI core stalls wall time, never a linear pattern's
            # CPU time by a hundredfold
            elapsed = min(_search_cpu_time(pattern, text, n) for _ in range(2 if n == LENGTHS[-1] else 1))
            assert elapsed < BUDGET_S, f"{name} on {filler!r}×{n}: {elapsed:.2f} s"


def test_long_cuda_oom_line_parses_quickly() -> None:
    # The worst line the fuzzing pass found: a 3 KB CUDA OOM message of digits took 63 s.
    from kvdoctor.sources.vllm_log import parse_log

    line = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " + "1" * 3000 + " allowed;"
    t0 = time.process_time()
    log = parse_log(line + "\n" + line.replace("1", "9") + "\n")
    assert time.process_time() - t0 < 2.0
    assert [e.kind for e in log.events][:1] == ["cuda_oom"]


def test_bounded_patterns_still_read_real_lines() -> None:
    from kvdoctor.sources.nvidia_smi import _MEM_RE, _POWER_RE

    assert _POWER_RE.search("N/A   34C    P0    70W / 300W ").groups() == ("70W", "300W")
    assert _POWER_RE.search("N/A   P0    N/A /  N/A").groups() == ("N/A", "N/A")
    assert _MEM_RE.search("  1234MiB / 81559MiB ").groups() == ("1234", "81559")


# Structured probes (issue 27): a run of one character between a prefix a pattern needs to start
# matching and an ending that fails it at the very end ("0" + 64,000 spaces + "H100": the padded
# GPU name "(.*?)\s+(On|Off)" took 30 s; an env value of spaces "\s+#" 8.5 s). A run of a single
# filler alone cannot find these: the pattern never gets past its first token.
PREFIXES = ["0 ", "| 0 ", "a ", "X=a", "'a': '"]
RUNS = [" ", "\t", "a", "1 "]
PROBE_LEN = 16_000
#: patterns of modules another change owns (rules files are kvdoctor's own, not user input).
KNOWN = {"kvdoctor.rules_engine._DURATION", "rules_engine:955"}


def _cpu(call: Callable[[str], object], text: str) -> float:
    t0 = time.process_time()
    call(text)
    call(text + "\n")
    return time.process_time() - t0


def _probe(call: Callable[[str], object]) -> str | None:
    for prefix in PREFIXES:
        for run in RUNS:
            text = prefix + run * (PROBE_LEN // len(run)) + "\x00x"
            # CPU time; a slow one is measured again (a loaded CI core)
            if _cpu(call, text) >= BUDGET_S and (elapsed := _cpu(call, text)) >= BUDGET_S:
                return f"{prefix!r} + {run!r}×{PROBE_LEN}: {elapsed:.2f} s"
    return None


@pytest.mark.parametrize("name,pattern", PATTERNS, ids=[n for n, _ in PATTERNS])
def test_no_superlinear_backtracking_after_a_prefix(name: str, pattern: re.Pattern[str]) -> None:
    if name in KNOWN:
        pytest.skip("owned by the rules-engine rewrite")
    slow = _probe(pattern.search)
    assert slow is None, f"{name} on {slow}"


def _inline_patterns() -> list[tuple[str, re.Pattern[str], str]]:
    """Literal patterns passed straight to ``re.search/match/split/sub/…`` inside functions of
    the sources and the top-level modules (not kept at module level, so the scan above misses
    them), with the method they are used with."""
    import ast
    import pathlib

    root = pathlib.Path(kvdoctor.__file__).parent
    calls = {"search", "match", "fullmatch", "split", "sub", "subn", "findall", "finditer", "compile"}
    out: list[tuple[str, re.Pattern[str], str]] = []
    for path in sorted([*root.glob("*.py"), *(root / "sources").glob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "re"
                and node.func.attr in calls
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                flags = 0
                for arg in [*node.args[1:], *(kw.value for kw in node.keywords)]:
                    if isinstance(arg, ast.Attribute) and isinstance(
                        getattr(re, arg.attr, None), re.RegexFlag
                    ):
                        flags |= getattr(re, arg.attr)
                method = node.func.attr if node.func.attr in ("match", "fullmatch") else "search"
                out.append((f"{path.stem}:{node.lineno}", re.compile(node.args[0].value, flags), method))
    return out


INLINE = _inline_patterns()


def test_inline_patterns_found() -> None:
    assert len(INLINE) >= 5 and any(n.startswith("processes:") for n, _, _ in INLINE)


@pytest.mark.parametrize("name,pattern,method", INLINE, ids=[n for n, _, _ in INLINE])
def test_inline_pattern_has_no_superlinear_backtracking(
    name: str, pattern: re.Pattern[str], method: str
) -> None:
    if name in KNOWN:
        pytest.skip("owned by the rules-engine rewrite")
    call = getattr(pattern, method)
    for filler in FILLERS:
        text = filler * (LENGTHS[-1] // len(filler))
        elapsed = min(_cpu(call, text) for _ in range(2))
        assert elapsed < BUDGET_S, f"{name} on {filler!r}: {elapsed:.2f} s"
    slow = _probe(call)
    assert slow is None, f"{name} on {slow}"
