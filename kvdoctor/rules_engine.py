"""The rule engine: rules as data (``rules/<id>.yaml``), compiled once, evaluated per engine.

A rule file is validated strictly at load (unknown keys, bad family/severity, id ≠ file stem,
expression syntax, names no context provides) and rejected with ``file:line: reason``
(:class:`RuleFileError`). Expressions are Python expression syntax with simpleeval's semantics
(a safe evaluator: no attribute access, no imports, no lambdas) over the variables of a
:class:`RuleContext` (built by ``kvdoctor.derive``), the rule's ``thresholds`` and its ``let``
values, with the functions of :data:`FUNCTIONS`. Each expression is checked and compiled once at
load into a Python function that keeps simpleeval's guards (see "compiled form" below; ~0.3 µs
to evaluate instead of simpleeval's tree walk); the few constructs whose simpleeval semantics
native code would not reproduce exactly are evaluated by simpleeval itself. Compiled rules are
kept across processes in a per-user marshal cache (see "the disk cache").

Run-time evaluation never raises: a ``let`` that fails (None in arithmetic, ZeroDivision, …)
becomes None, a failing ``when`` counts as not firing, a failing template field renders "N/A",
a failing ``fix`` entry is dropped; every such error is kept in :attr:`Evaluation.errors`.

Rule schema: see spec/rules.md and the module's ``_TOP_KEYS``; an example::

    id: max-model-len-exceeds-kv-capacity
    family: K
    severity: critical
    title: The KV cache holds fewer tokens than --max-model-len
    needs: [config, log]
    thresholds: {margin_gib: 0.5}
    let: {cap_tokens: "kv_tokens if kv_tokens is not None else v0_kv_tokens"}
    when: "cap_tokens is not None and cap_tokens < max_model_len"
    severity_if: [{when: "oom_seen", severity: critical}]
    summary: "The KV cache holds {cap_tokens:,} tokens."
    evidence: [{fact: KV cache capacity, value: "{cap_tokens:,} tokens", source: "vllm.log line {cap_line}"}]
    fix: {--max-model-len: "max_model_len_for_tokens(cap_tokens, block_size)"}
    gpus: engine_gpus
    explains: [kv-budget-exhausted]   # findings this one is the root cause of
    for: 30s                          # a sidecar fires it once it held this long (diagnose: ignored)
    clear_for: 2m                     # … and clears it once it was false this long (default: for)
    doc: |
      ## What ...

``explains``: rule ids whose findings this rule's finding, when both fire for one engine, is the
root cause of (validated by :func:`load_rules`: every id exists, no cycle). Each such
consequence carries ``caused_by`` (this rule's id) and reports list it under its root.
``for`` / ``clear_for``: seconds (a number, or "30s", "5m", "1h") a condition must hold before a
long-running face (sidecar, watch) fires the rule, and must be false before it clears it
(hysteresis; default = ``for``, which defaults to 0). One-shot ``diagnose`` ignores both.
"""

from __future__ import annotations

import ast
import functools
import keyword
import marshal
import math
import os
import re
import stat
import sys
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import is_, is_not, ne
from pathlib import Path
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any, TypeVar

from kvdoctor.findings import FAMILIES, SEVERITIES, SEVERITY_ORDER, Evidence, Finding, Skipped, sort_findings
from kvdoctor.fix_validity import valid_fix
from kvdoctor.units import GiB, MiB, ceil_to, floor_to, fmt_bytes, gib

if TYPE_CHECKING:  # PyYAML is imported when a rule or config file is parsed, not to start
    import yaml

# --------------------------------------------------------------------------- functions


def mib(nbytes: float | None) -> float | None:
    """Bytes → MiB (float); None stays None."""
    return None if nbytes is None else nbytes / MiB


def coalesce(*values: Any) -> Any:
    """The first argument that is not None, else None (``coalesce(kv_tokens, v0_kv_tokens)``)."""
    for v in values:
        if v is not None:
            return v
    return None


#: Functions callable from rule expressions; the KV arithmetic ones come from
#: ``kvdoctor.rule_functions`` (kvmath wrappers), merged below. More via :func:`register_function`.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "int": int,
    "float": float,
    "str": str,
    "len": len,
    "sum": sum,
    "any": any,
    "all": all,
    "sorted": sorted,
    "list": list,
    "floor_to": floor_to,
    "ceil_to": ceil_to,
    "gib": gib,
    "mib": mib,
    "fmt_bytes": fmt_bytes,
    "coalesce": coalesce,
}


def _kv_functions() -> dict[str, Callable[..., Any]]:
    from kvdoctor.rule_functions import RULE_FUNCTIONS

    return RULE_FUNCTIONS


FUNCTIONS.update(_kv_functions())

#: Constants visible to every expression (a rule may write ``x * GiB``).
CONSTANTS: dict[str, Any] = {"GiB": GiB, "MiB": MiB}


def register_function(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn`` callable as ``name(...)`` in rule expressions.

    Raises ValueError when ``name`` is not an identifier, ``fn`` is not callable, or ``fn`` is
    one simpleeval forbids (eval, exec, open, getattr, type, os.system, …: see
    ``simpleeval.DISALLOW_FUNCTIONS``).
    """
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"function name {name!r} is not an identifier")
    if not callable(fn):
        raise ValueError(f"{name!r}: {fn!r} is not callable")
    if _is_forbidden(fn):
        raise ValueError(f"{name!r}: {fn!r} is a function rule expressions must not call")
    FUNCTIONS[name] = fn
    _VETTED[name] = fn


# --------------------------------------------------------------------------- errors


class RuleFileError(Exception):
    """A rule file (or rules directory) is invalid.

    ``str(err)`` is one line: ``"rules/foo.yaml:12: unknown name 'kv_tokns' in when"``
    (``path: reason`` when no line is known). ``line`` is 1-based.
    """

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


# --------------------------------------------------------------------------- YAML with lines


class _LineDict(dict):  # type: ignore[type-arg]
    """A YAML mapping that remembers the 1-based line of each key and value."""

    line: int = 0
    key_lines: dict[Any, int]
    value_lines: dict[Any, int]


class _LineList(list):  # type: ignore[type-arg]
    """A YAML sequence that remembers the 1-based line of each item."""

    line: int = 0
    lines: list[int]


class _DuplicateKey(Exception):
    def __init__(self, line: int, key: Any) -> None:
        self.line = line
        self.key = key


def _close_matches(word: str, candidates: Any, n: int = 1) -> list[str]:
    """difflib's close matches (imported for an error message only)."""
    import difflib

    return difflib.get_close_matches(word, candidates, n=n)


def _value_line(node: yaml.Node) -> int:
    import yaml

    line = node.start_mark.line + 1
    # A block scalar ("|", ">") starts at its indicator; its text begins on the next line.
    if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
        line += 1
    return line


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    out = _LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    out.value_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise _DuplicateKey(key_node.start_mark.line + 1, "<unhashable key>") from None
        if key in out:
            raise _DuplicateKey(key_node.start_mark.line + 1, key)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
        out.value_lines[key] = _value_line(value_node)
    return out


def _construct_seq(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> _LineList:
    out = _LineList(loader.construct_object(n, deep=True) for n in node.value)
    out.line = node.start_mark.line + 1
    out.lines = [_value_line(n) for n in node.value]
    return out


@functools.lru_cache(maxsize=1)
def _line_loader() -> Any:
    """SafeLoader (libyaml's CSafeLoader when present: the pure-Python scanner takes ~5 ms per
    rule file) whose mappings/sequences carry line numbers and reject duplicate keys. Built on
    first use: PyYAML is not imported while the rules come from the cache."""
    import yaml

    base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class _LineLoader(base):  # type: ignore[misc, valid-type]
        pass

    _LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
    _LineLoader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)
    return _LineLoader


def load_yaml_with_lines(path: str | Path, display: str | None = None) -> Any:
    """Read one YAML document safely; mappings are dicts with ``key_lines``/``value_lines``.

    Raises :class:`RuleFileError` (``display`` or ``path`` as the file name) for unreadable
    files, non-UTF-8 bytes, YAML syntax errors (with line) and duplicate keys.
    """
    shown = display or str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise RuleFileError(shown, None, f"cannot read: {err.strerror or err}") from None
    if b"\x00" in raw:
        raise RuleFileError(
            shown, raw[: raw.index(b"\x00")].count(b"\n") + 1, "binary data (NUL byte), not YAML text"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RuleFileError(shown, line, "not UTF-8 text") from None
    import yaml

    try:
        return yaml.load(text, Loader=_line_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as err:
        raise RuleFileError(shown, err.line, f"duplicate key {err.key!r}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        yaml_line = mark.line + 1 if mark is not None else None
        reason = err.problem or err.context or "invalid YAML"
        raise RuleFileError(shown, yaml_line, f"YAML syntax error: {reason}") from None
    except yaml.YAMLError as err:
        raise RuleFileError(shown, None, f"YAML error: {str(err).splitlines()[0]}") from None


# --------------------------------------------------------------------------- expressions

# Node types simpleeval cannot evaluate, or that we refuse (attribute access is off).
_FORBIDDEN_NODES: dict[type, str] = {
    ast.Attribute: "attribute access",
    ast.Lambda: "lambda",
    ast.NamedExpr: "assignment expression (:=)",
    ast.SetComp: "set comprehension",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.Starred: "starred expression",
}
_OPERATOR_BASES = (ast.operator, ast.unaryop, ast.cmpop)
#: the operators simpleeval evaluates (``simpleeval.DEFAULT_OPERATORS``; a test keeps the two
#: equal): any other (``@``) is refused at load
_ALLOWED_OPERATORS: frozenset[type] = frozenset(
    {
        ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.RShift, ast.LShift, ast.Pow, ast.Mod,
        ast.Eq, ast.NotEq, ast.Gt, ast.Lt, ast.GtE, ast.LtE, ast.Not, ast.USub, ast.UAdd,
        ast.BitXor, ast.BitOr, ast.BitAnd, ast.Invert, ast.In, ast.NotIn, ast.Is, ast.IsNot,
    }
)  # fmt: skip


class _Lazy:
    """:attr:`Expr.compiled` before the expression is compiled (see :attr:`Expr.code`)."""

    def __repr__(self) -> str:
        return "LAZY"


#: not compiled yet: :attr:`Expr.code` compiles the source on first use
LAZY = _Lazy()


@dataclass(frozen=True)
class Expr:
    """One compiled expression: ``source`` text, where it sits in the rule file (``where`` e.g.
    "when", "let cap_tokens", ``line``), the free ``names`` it reads, the ``calls`` it makes and
    its ``code``: the function body :func:`compile_expr` compiled (see "compiled form"), None
    for one evaluated by simpleeval (constructs whose exact simpleeval semantics native code
    would not give: f-strings, dict/set displays, tuple targets, ``**`` arguments, …).

    ``compiled``: that code object, :data:`LAZY` (compiled from ``source`` on first use: a
    process writing no cache compiles only what it evaluates) or its marshal bytes (from the
    disk cache: loaded and checked by :func:`_load_code` on first use, so a start loads only the
    expressions it evaluates; code that fails the check is never run, simpleeval evaluates the
    source instead).
    ``fn(names, functions)`` evaluates it: ``names`` a :class:`_Names` mapping (a name it lacks
    reads as None), ``functions`` the callable functions (:func:`_functions`); it raises what
    the expression raises. ``node`` is the parsed expression (parsed again on first use; the
    cache holds no syntax trees)."""

    source: str
    where: str
    line: int | None
    names: frozenset[str]
    calls: frozenset[str]
    compiled: Any = field(default=LAZY, repr=False, compare=False)
    fn: Callable[[Any, Any], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fn", self._first_call)

    @property
    def code(self) -> CodeType | None:
        """The compiled code (None: evaluated by simpleeval)."""
        code = self.compiled
        if code is LAZY:
            code = _compile_source(self.source)
        elif isinstance(code, bytes):
            code = _load_code(code)
        else:
            return code  # type: ignore[no-any-return]
        object.__setattr__(self, "compiled", code)
        return code

    def _first_call(self, names: Any, functions: Any) -> Any:
        code = self.code
        fn = _fallback_fn(self.source) if code is None else FunctionType(code, _EXPR_GLOBALS)
        object.__setattr__(self, "fn", fn)  # later calls go straight to it
        return fn(names, functions)

    @functools.cached_property
    def node(self) -> ast.AST:
        """The parsed expression (``ast`` node)."""
        return _parse_expression(self.source).body


def _parse_expression(src: str) -> ast.Expression:
    try:
        return ast.parse(src.strip(), mode="eval")
    except SyntaxError:
        if "\n" not in src:
            raise
        # A multi-line YAML block: let the expression span lines as if parenthesised.
        return ast.parse("(\n" + src + "\n)", mode="eval")


#: expression text → its compiled code (None: left to simpleeval), this process's: rule sets
#: sharing expressions (copies of the catalogue, tests' rule directories) compile each once
_COMPILED: dict[str, CodeType | None] = {}


def _compile_source(src: str) -> CodeType | None:
    """The compiled code of expression text ``src`` (:func:`_compile_tree`; None: left to
    simpleeval), once per process."""
    try:
        return _COMPILED[src]
    except KeyError:
        pass
    try:
        code = _compile_tree(_parse_expression(src), _CODE_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        code = None
    if len(_COMPILED) > 8192:
        _COMPILED.clear()
    _COMPILED[src] = code
    return code


def compile_expr(src: Any, *, path: str, line: int | None, where: str) -> Expr:
    """Parse, check and compile one expression (a YAML string, or a bare number/bool constant).

    Raises :class:`RuleFileError` on syntax errors, on expressions nested too deeply to parse,
    and on constructs the evaluator refuses (attribute access, lambda, walrus, operators
    simpleeval lacks).
    """
    if isinstance(src, bool) or isinstance(src, (int, float)):
        src = repr(src)
    if not isinstance(src, str) or not src.strip():
        raise RuleFileError(path, line, f"{where}: expected an expression string, got {type(src).__name__}")
    try:
        tree = _parse_expression(src)
    except SyntaxError as err:
        err_line = line + (err.lineno or 1) - 1 if line is not None and "\n" in src.strip() else line
        raise RuleFileError(path, err_line, f"syntax error in {where}: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise RuleFileError(path, line, f"{where} is nested too deeply") from None
    loads: list[ast.Name] = []
    bound: set[str] = set()
    calls: set[str] = set()
    func_nodes: set[int] = set()
    for node in ast.walk(tree):
        kind = type(node)
        if kind in _FORBIDDEN_NODES:
            raise RuleFileError(path, line, f"{_FORBIDDEN_NODES[kind]} is not allowed in {where}")
        if isinstance(node, _OPERATOR_BASES) and kind not in _ALLOWED_OPERATORS:
            raise RuleFileError(path, line, f"operator {kind.__name__} is not allowed in {where}")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise RuleFileError(path, line, f"only named functions can be called in {where}")
            calls.add(node.func.id)
            func_nodes.add(id(node.func))
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loads.append(node)
            else:  # a comprehension target
                bound.add(node.id)
    # A called name is a function, not a variable read (unless also read bare elsewhere).
    names = {n.id for n in loads if id(n) not in func_nodes}
    free = names - bound
    # compiled when first evaluated or cached (Expr.code): a process without a cache to
    # write (none, or not writable) compiles only the expressions it evaluates
    return Expr(src, where, line, frozenset(free), frozenset(calls), _COMPILED.get(src, LAZY))


# --------------------------------------------------------------------------- compiled form
#
# An expression becomes one Python function ``def e(__n, __f): return <body>``: every name it
# reads is ``__n["name"]`` (the rule's names: a missing one reads None, as under simpleeval),
# every call ``__f["fn"](…)`` (the functions of this evaluation; an unknown one raises
# FunctionNotDefined), and each operator simpleeval guards is a call of the same guard
# (``+`` → _g_add: no sequence over MAX_STRING_LENGTH, ``*`` → _g_mult, ``**`` → _g_pow: no
# operand over MAX_POWER, ``<<``/``>>``: MAX_SHIFT); comprehensions are lists (a generator is
# evaluated eagerly, as simpleeval does) whose iterables count elements (_g_iter: at most
# MAX_COMPREHENSION_LENGTH per evaluation). The function's globals are these guards and no
# builtins: the code reaches nothing a rule does not name. Whatever native code would not
# evaluate exactly as simpleeval does is left to simpleeval (``code`` None).

#: simpleeval's limits (a test keeps them equal to the library's)
MAX_STRING_LENGTH = 100000
MAX_COMPREHENSION_LENGTH = 10000
MAX_POWER = 4000000
MAX_SHIFT = 10000
MAX_SHIFT_BASE = int(sys.float_info.max)


def _simpleeval_error(kind: str, *args: Any) -> Exception:
    """simpleeval's own exception ``kind`` (imported when an expression fails, never to start)."""
    import simpleeval

    err: Exception = getattr(simpleeval, kind)(*args)
    return err


# The guards are simpleeval's safe_add / safe_mult / safe_power / safe_lshift / safe_rshift,
# same tests, same messages, same exception classes.
def _g_add(a: Any, b: Any) -> Any:
    t = type(a)
    if t is type(b):  # the usual cases first: numbers (no length), texts (their lengths)
        if t is int or t is float:
            return a + b
        if t is str and len(a) + len(b) <= MAX_STRING_LENGTH:
            return a + b
    if hasattr(a, "__len__") and hasattr(b, "__len__") and len(a) + len(b) > MAX_STRING_LENGTH:
        raise _simpleeval_error(
            "IterableTooLong", "Sorry, adding those two together would make something too long."
        )
    return a + b


def _g_mult(a: Any, b: Any) -> Any:
    t = type(a)
    if (t is int or t is float) and (type(b) is int or type(b) is float):  # no length
        return a * b
    if hasattr(a, "__len__") and b * len(a) > MAX_STRING_LENGTH:
        raise _simpleeval_error("IterableTooLong", "Sorry, I will not evaluate something that long.")
    if hasattr(b, "__len__") and a * len(b) > MAX_STRING_LENGTH:
        raise _simpleeval_error("IterableTooLong", "Sorry, I will not evaluate something that long.")
    return a * b


def _g_pow(a: Any, b: Any) -> Any:
    if abs(a) > MAX_POWER or abs(b) > MAX_POWER:
        raise _simpleeval_error("NumberTooHigh", f"Sorry! I don't want to evaluate {a} ** {b}")
    return a**b


def _g_lshift(a: Any, b: Any) -> Any:
    if abs(b) > MAX_SHIFT or abs(a) > MAX_SHIFT_BASE:
        raise _simpleeval_error("NumberTooHigh", f"Sorry! I don't want to evaluate {a} << {b}")
    return a << b


def _g_rshift(a: Any, b: Any) -> Any:
    if abs(b) > MAX_SHIFT or abs(a) > MAX_SHIFT_BASE:
        raise _simpleeval_error("NumberTooHigh", f"Sorry! I don't want to evaluate {a} >> {b}")
    return a >> b


def _g_iter(count: list[int], iterable: Any) -> Iterator[Any]:
    """A comprehension's iterable, counted: simpleeval's MAX_COMPREHENSION_LENGTH elements drawn
    over all comprehensions of one evaluation (``count``: that evaluation's counter)."""
    for item in iterable:
        count[0] += 1
        if count[0] > MAX_COMPREHENSION_LENGTH:
            raise _simpleeval_error("IterableTooLong", "Comprehension generates too many elements")
        yield item


_GUARDS: dict[type, str] = {
    ast.Add: "_g_add",
    ast.Mult: "_g_mult",
    ast.Pow: "_g_pow",
    ast.LShift: "_g_lshift",
    ast.RShift: "_g_rshift",
}
#: the only globals compiled expressions see (no builtins: ``__builtins__`` is empty)
_EXPR_GLOBALS: dict[str, Any] = {
    "__builtins__": {},
    "_g_add": _g_add,
    "_g_mult": _g_mult,
    "_g_pow": _g_pow,
    "_g_lshift": _g_lshift,
    "_g_rshift": _g_rshift,
    "_g_iter": _g_iter,
}
_NAMES_ARG, _FUNCS_ARG, _COUNT_VAR = "__n", "__f", "__c"
_N = TypeVar("_N", bound=ast.AST)
#: names the compiled code itself uses: a comprehension target must not shadow them
_RESERVED = frozenset({_NAMES_ARG, _FUNCS_ARG, _COUNT_VAR, *_EXPR_GLOBALS})


#: the file name compiled expressions carry (one for all: a traceback never reaches a user, and
#: the cache stores it once)
_CODE_FILENAME = "<kvdoctor rule expression>"
#: where the function around an expression "is" (the expression keeps its own positions)
_TOP = {"lineno": 1, "col_offset": 0, "end_lineno": 1, "end_col_offset": 0}


def _at(like: Any, node: _N) -> _N:
    """``node`` (made by :class:`_Lower`) placed where ``like`` is in the source: Python's
    compiler wants every node located (ast.fix_missing_locations would walk the whole tree)."""
    n: Any = node
    n.lineno, n.col_offset = like.lineno, like.col_offset
    n.end_lineno, n.end_col_offset = like.end_lineno, like.end_col_offset
    return node


def _top(node: _N) -> _N:
    """``node`` placed at :data:`_TOP` (the function around the expression)."""
    for attr, value in _TOP.items():
        setattr(node, attr, value)
    return node


class _NotNative(Exception):
    """The expression holds a construct compiled code would not evaluate exactly as simpleeval."""


#: the nodes :class:`_Lower` visits (contexts and operators it leaves as they are)
_VISITED = (ast.expr, ast.keyword, ast.comprehension)


class _Lower(ast.NodeTransformer):
    """Rewrites a checked expression into the body of its function (see the section comment).

    ``scopes``: the target names of the comprehensions around the node being visited (those
    names stay Python locals of the comprehension); ``comprehensions``: whether any was seen
    (the function then makes its counter)."""

    def __init__(self) -> None:
        self.scopes: list[frozenset[str]] = []
        self.comprehensions = False

    def generic_visit(self, node: ast.AST) -> ast.AST:
        # simpleeval-only constructs: its order of evaluation (dict value before key), its
        # f-string rules (conversions ignored), its keyword unpacking differ from Python's
        if isinstance(node, (ast.Dict, ast.Set, ast.DictComp, ast.JoinedStr, ast.FormattedValue)):
            raise _NotNative(type(node).__name__)
        # what compile_expr refuses is never compiled (an Expr made by hand is compiled too):
        # simpleeval then refuses it when evaluated
        if type(node) in _FORBIDDEN_NODES:
            raise _NotNative(type(node).__name__)
        ops = node.ops if isinstance(node, ast.Compare) else [getattr(node, "op", None)]
        if any(isinstance(op, _OPERATOR_BASES) and type(op) not in _ALLOWED_OPERATORS for op in ops):
            raise _NotNative("operator")
        # NodeTransformer's, minus the visits of contexts and operators (a third of the nodes)
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                value[:] = [self.visit(v) if isinstance(v, _VISITED) else v for v in value]
            elif isinstance(value, _VISITED):
                setattr(node, name, self.visit(value))
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, (str, bytes)) and len(node.value) > MAX_STRING_LENGTH:
            raise _NotNative("long literal")  # simpleeval refuses it when evaluated
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if not isinstance(node.ctx, ast.Load) or any(node.id in s for s in self.scopes):
            return node
        return _at(
            node,
            ast.Subscript(
                _at(node, ast.Name(_NAMES_ARG, ast.Load())), _at(node, ast.Constant(node.id)), ast.Load()
            ),
        )

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        if type(node.op) not in _ALLOWED_OPERATORS:
            raise _NotNative("operator")
        left, right = self.visit(node.left), self.visit(node.right)
        guard = _GUARDS.get(type(node.op))
        if guard is None:
            return _at(node, ast.BinOp(left, node.op, right))
        return _at(node, ast.Call(_at(node, ast.Name(guard, ast.Load())), [left, right], []))

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if not isinstance(node.func, ast.Name) or any(k.arg is None for k in node.keywords):
            raise _NotNative("call")
        f = node.func
        func = _at(
            f, ast.Subscript(_at(f, ast.Name(_FUNCS_ARG, ast.Load())), _at(f, ast.Constant(f.id)), ast.Load())
        )
        args = [self.visit(a) for a in node.args]
        keywords = [_at(k, ast.keyword(k.arg, self.visit(k.value))) for k in node.keywords]
        return _at(node, ast.Call(func, args, keywords))

    def visit_GeneratorExp(self, node: ast.GeneratorExp) -> ast.AST:
        return self._comprehension(node, node.elt, node.generators)

    def visit_ListComp(self, node: ast.ListComp) -> ast.AST:
        return self._comprehension(node, node.elt, node.generators)

    def _comprehension(self, node: ast.expr, elt: ast.expr, generators: list[ast.comprehension]) -> ast.AST:
        targets: list[str] = []
        for g in generators:
            if not isinstance(g.target, ast.Name):
                raise _NotNative("target")  # simpleeval zips tuple targets, Python unpacks
            if g.target.id in _RESERVED:
                raise _NotNative("target")  # would shadow the function's own names
            targets.append(g.target.id)
        # simpleeval reads a target not yet bound (a later generator's, in an earlier iterable
        # or condition) from the names around; Python would fail: leave such a case to it
        for i, g in enumerate(generators):
            later = set(targets[i:]) if i else set()
            later_ifs = set(targets[i + 1 :])
            for part, unbound in ((g.iter, later), *((c, later_ifs) for c in g.ifs)):
                if unbound and any(isinstance(n, ast.Name) and n.id in unbound for n in ast.walk(part)):
                    raise _NotNative("unbound target")
        self.comprehensions = True
        out: list[ast.comprehension] = []
        first_iter = self.visit(generators[0].iter)  # evaluated in the enclosing scope
        self.scopes.append(frozenset(targets))
        try:
            for i, g in enumerate(generators):
                it = first_iter if i == 0 else self.visit(g.iter)
                at = g.iter
                count = _at(at, ast.Name(_COUNT_VAR, ast.Load()))
                counted = _at(at, ast.Call(_at(at, ast.Name("_g_iter", ast.Load())), [count, it], []))
                out.append(ast.comprehension(g.target, counted, [self.visit(c) for c in g.ifs], 0))
            body = self.visit(elt)
        finally:
            self.scopes.pop()
        return _at(node, ast.ListComp(body, out))


def _compile_tree(tree: ast.Expression, filename: str) -> CodeType | None:
    """The code of ``def e(__n, __f): return <lowered body>``, or None when the expression is
    left to simpleeval (a construct :class:`_Lower` does not compile, or one Python's compiler
    refuses though it parses, e.g. a repeated keyword argument)."""
    lower = _Lower()
    try:
        body = lower.visit(tree.body)  # the tree is compile_expr's own, used once
        stmts: list[ast.stmt] = [_top(ast.Return(body))]
        if lower.comprehensions:
            counter = _top(ast.List([_top(ast.Constant(0))], ast.Load()))
            stmts.insert(0, _top(ast.Assign([_top(ast.Name(_COUNT_VAR, ast.Store()))], counter)))
        params = [_top(ast.arg(_NAMES_ARG)), _top(ast.arg(_FUNCS_ARG))]
        args = ast.arguments([], params, None, [], [], None, [])
        module = ast.Module([_top(ast.FunctionDef("expression", args, stmts, [], None))], [])
        with warnings.catch_warnings():  # e.g. "is" with a literal: simpleeval's semantics hold
            warnings.simplefilter("ignore")
            code = compile(module, filename, "exec", dont_inherit=True)
    except (_NotNative, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return next(c for c in code.co_consts if isinstance(c, CodeType))


def _fallback_fn(source: str) -> Callable[[Any, Any], Any]:
    """An expression simpleeval evaluates (imported and parsed on first use)."""
    parsed: list[ast.AST] = []

    def run(names: Any, functions: Any) -> Any:
        from simpleeval import EvalWithCompoundTypes

        if not parsed:
            parsed.append(_parse_expression(source).body)
        ev = EvalWithCompoundTypes(functions=dict(functions), names=names)
        ev.nodes.pop(ast.Attribute, None)  # refused at load; at run time too
        return ev.eval(source, previously_parsed=parsed[0])

    return run


@dataclass(frozen=True)
class Template:
    """A text with ``{expr}`` / ``{expr:fmt}`` fields (``{{``/``}}`` are literal braces).

    ``parts`` alternate literal strings and ``(Expr, format_spec)`` pairs.
    """

    source: str
    parts: tuple[str | tuple[Expr, str], ...]

    @property
    def exprs(self) -> list[Expr]:
        """The compiled fields, in order."""
        return [p[0] for p in self.parts if isinstance(p, tuple)]


def compile_template(src: Any, *, path: str, line: int | None, where: str) -> Template:
    """Split a template into literals and compiled fields.

    Raises :class:`RuleFileError` on an unclosed ``{``, a lone ``}``, an empty field, or a
    field whose expression does not compile.
    """
    if isinstance(src, (int, float)) and not isinstance(src, bool):
        src = str(src)
    if not isinstance(src, str):
        raise RuleFileError(path, line, f"{where}: expected text, got {type(src).__name__}")
    parts: list[str | tuple[Expr, str]] = []
    buf: list[str] = []
    i, n = 0, len(src)
    while i < n:
        ch = src[i]
        if ch == "{" and src.startswith("{{", i):
            buf.append("{")
            i += 2
        elif ch == "}" and src.startswith("}}", i):
            buf.append("}")
            i += 2
        elif ch == "}":
            raise RuleFileError(path, line, f"single '}}' in {where} (write '}}}}' for a literal brace)")
        elif ch == "{":
            end, colon = _scan_field(src, i + 1)
            if end < 0:
                raise RuleFileError(path, line, f"unclosed '{{' in {where}")
            body = src[i + 1 : end]
            expr_src, spec = (body[: colon - i - 1], body[colon - i :]) if colon >= 0 else (body, "")
            if not expr_src.strip():
                raise RuleFileError(path, line, f"empty field '{{}}' in {where}")
            if buf:
                parts.append("".join(buf))
                buf = []
            parts.append((compile_expr(expr_src, path=path, line=line, where=where), spec))
            i = end + 1
        else:
            buf.append(ch)
            i += 1
    if buf:
        parts.append("".join(buf))
    return Template(src, tuple(parts))


def _scan_field(src: str, start: int) -> tuple[int, int]:
    """From just after ``{``: index of the closing ``}`` and of the first top-level ``:`` (-1)."""
    depth = 0
    quote = ""
    colon = -1
    i = start
    while i < len(src):
        ch = src[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "}":
            if depth == 0:
                return i, colon
            depth -= 1
        elif ch == ":" and depth == 0 and colon < 0:
            colon = i
        i += 1
    return -1, -1


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class EvidenceSpec:
    """One ``evidence`` item: templates for fact/value/source and an optional ``when``."""

    fact: Template
    value: Template
    source: Template
    when: Expr | None = None


@dataclass(frozen=True)
class Rule:
    """A compiled rule (one ``rules/<id>.yaml``). ``thresholds`` hold the effective values
    (defaults, or user overrides via :meth:`with_thresholds`); ``path`` is the file shown in
    errors."""

    id: str
    family: str
    severity: str
    title: Template
    summary: Template
    evidence: tuple[EvidenceSpec, ...]
    when: Expr
    doc: str
    needs: tuple[str, ...] = ()
    needs_any: tuple[str, ...] = ()
    thresholds: dict[str, Any] = field(default_factory=dict)
    let: tuple[tuple[str, Expr], ...] = ()
    severity_if: tuple[tuple[Expr, str], ...] = ()
    fix: tuple[tuple[str, Expr], ...] = ()
    gpus: Expr | None = None
    path: str = ""
    #: 1-based line of each threshold name in the file, for user-config messages.
    threshold_lines: dict[str, int] = field(default_factory=dict)
    #: rule ids this rule's finding is the root cause of (``explains:``).
    explains: tuple[str, ...] = ()
    #: 1-based line of ``explains:`` (for load_rules' errors); None when absent.
    explains_line: int | None = None
    #: seconds the condition must hold before a long-running face fires it (``for:``, default 0).
    for_s: float = 0.0
    #: seconds the condition must be false before such a face clears it (``clear_for:``,
    #: hysteresis; default ``for_s``).
    clear_for_s: float = 0.0

    def with_thresholds(self, overrides: dict[str, Any]) -> Rule:
        """A copy with some thresholds replaced. Raises KeyError for a name the rule lacks and
        TypeError for a value of another kind (number/text/bool) than the default."""
        merged = dict(self.thresholds)
        for name, value in overrides.items():
            if name not in merged:
                raise KeyError(name)
            if _threshold_kind(value) != _threshold_kind(merged[name]):
                raise TypeError(
                    f"threshold {name!r} of rule {self.id!r} must be a {_threshold_kind(merged[name])}, "
                    f"got {value!r}"
                )
            merged[name] = value
        return replace(self, thresholds=merged)


def _threshold_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "text"
    return type(value).__name__


_TOP_KEYS = {
    "id",
    "family",
    "severity",
    "title",
    "needs",
    "needs_any",
    "thresholds",
    "let",
    "when",
    "severity_if",
    "summary",
    "evidence",
    "fix",
    "gpus",
    "doc",
    "explains",
    "for",
    "clear_for",
}
_REQUIRED = ("id", "family", "severity", "title", "when", "summary", "evidence", "doc")
_DOC_SECTIONS = ("## What", "## Why", "## How to confirm", "## Fix", "## Sources")
_SLUG = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_INPUT = re.compile(r"^[a-z][a-z0-9_-]*$")


def key_line(d: Any, key: Any) -> int | None:
    """1-based line of ``key`` in a mapping read by :func:`load_yaml_with_lines` (None if unknown)."""
    lines = getattr(d, "key_lines", None)
    return lines.get(key) if lines else getattr(d, "line", None) or None


def value_line(d: Any, key: Any) -> int | None:
    """1-based line where the value of ``key`` starts (None if unknown)."""
    lines = getattr(d, "value_lines", None)
    return lines.get(key) if lines else getattr(d, "line", None) or None


def _check_keys(d: Any, allowed: set[str], required: Iterable[str], path: str, what: str) -> None:
    for key in d:
        if key not in allowed:
            hint = _close_matches(str(key), sorted(allowed), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise RuleFileError(path, key_line(d, key), f"unknown key {key!r} in {what}{extra}")
    for key in required:
        if key not in d:
            raise RuleFileError(
                path, getattr(d, "line", None) or None, f"missing required key '{key}' in {what}"
            )


def _str_list(value: Any, path: str, line: int | None, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and _INPUT.match(v) for v in value):
        raise RuleFileError(path, line, f"{what} must be a list of input names like [log, metrics]")
    return tuple(value)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any, path: str, line: int | None, what: str) -> float:
    """``for`` / ``clear_for``: seconds as a number ≥ 0, or a text "500ms", "30s", "5m", "1h"
    (Prometheus-style). Raises :class:`RuleFileError`."""
    if isinstance(value, bool):
        raise RuleFileError(path, line, f"{what} must be a duration like 30, '30s' or '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNIT[m.group(2)]
    else:
        raise RuleFileError(path, line, f"{what} must be a duration like 30, '30s' or '5m'")
    if not math.isfinite(seconds) or seconds < 0:
        raise RuleFileError(path, line, f"{what} must be a duration ≥ 0 seconds")
    return seconds


def _check_identifier(name: Any, path: str, line: int | None, what: str) -> None:
    """Threshold and let names become expression names: they must be identifiers."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise RuleFileError(path, line, f"{what} name {name!r} is not an identifier")


def _parse_rule(data: Any, path: str, stem: str) -> Rule:
    if data is None:
        raise RuleFileError(path, None, "empty rule file")
    if not isinstance(data, dict):
        raise RuleFileError(path, getattr(data, "line", 1) or 1, "a rule file must be a mapping of keys")
    _check_keys(data, _TOP_KEYS, _REQUIRED, path, "rule")

    rid = data["id"]
    if not isinstance(rid, str) or not _SLUG.match(rid):
        raise RuleFileError(
            path, value_line(data, "id"), f"id {rid!r} is not a slug like 'kv-budget-exhausted'"
        )
    if rid != stem:
        raise RuleFileError(path, value_line(data, "id"), f"id '{rid}' does not match the file name '{stem}'")
    family = data["family"]
    if family not in FAMILIES:
        raise RuleFileError(
            path, value_line(data, "family"), f"family {family!r} is not one of {'|'.join(FAMILIES)}"
        )
    severity = data["severity"]
    if severity not in SEVERITIES:
        raise RuleFileError(
            path, value_line(data, "severity"), f"severity {severity!r} is not one of {'|'.join(SEVERITIES)}"
        )
    doc = data["doc"]
    if not isinstance(doc, str) or not doc.strip():
        raise RuleFileError(path, value_line(data, "doc"), "doc must be markdown text")
    for section in _DOC_SECTIONS:
        if not re.search(rf"^{re.escape(section)}\s*$", doc, re.MULTILINE):
            raise RuleFileError(path, value_line(data, "doc"), f"doc lacks the section '{section}'")

    needs = _str_list(data.get("needs", []), path, value_line(data, "needs"), "needs")
    needs_any = _str_list(data.get("needs_any", []), path, value_line(data, "needs_any"), "needs_any")

    thresholds: dict[str, Any] = {}
    threshold_lines: dict[str, int] = {}
    raw_th = data.get("thresholds", {})
    if not isinstance(raw_th, dict):
        raise RuleFileError(path, value_line(data, "thresholds"), "thresholds must be a mapping name: value")
    for name, value in raw_th.items():
        tl = key_line(raw_th, name)
        _check_identifier(name, path, tl, "threshold")
        if _threshold_kind(value) not in ("number", "text", "bool"):
            raise RuleFileError(path, tl, f"threshold {name!r} must be a number, text or true/false")
        if name in FUNCTIONS:
            raise RuleFileError(path, tl, f"threshold {name!r} shadows the function of that name")
        thresholds[name] = value
        threshold_lines[name] = tl or 0

    lets: list[tuple[str, Expr]] = []
    raw_let = data.get("let", {})
    if not isinstance(raw_let, dict):
        raise RuleFileError(path, value_line(data, "let"), "let must be a mapping name: expression")
    for name, src in raw_let.items():
        ll = key_line(raw_let, name)
        _check_identifier(name, path, ll, "let")
        if name in FUNCTIONS or name in thresholds:
            raise RuleFileError(path, ll, f"let name {name!r} shadows a function or threshold")
        lets.append((name, compile_expr(src, path=path, line=value_line(raw_let, name), where=f"let {name}")))

    when = compile_expr(data["when"], path=path, line=value_line(data, "when"), where="when")

    sev_if: list[tuple[Expr, str]] = []
    raw_sev = data.get("severity_if", [])
    if not isinstance(raw_sev, list):
        raise RuleFileError(
            path, value_line(data, "severity_if"), "severity_if must be a list of {when, severity}"
        )
    for idx, item in enumerate(raw_sev):
        il = raw_sev.lines[idx] if isinstance(raw_sev, _LineList) else None
        if not isinstance(item, dict):
            raise RuleFileError(path, il, "each severity_if item must be {when: ..., severity: ...}")
        _check_keys(item, {"when", "severity"}, ("when", "severity"), path, "severity_if item")
        if item["severity"] not in SEVERITIES:
            raise RuleFileError(
                path,
                value_line(item, "severity"),
                f"severity {item['severity']!r} is not one of {'|'.join(SEVERITIES)}",
            )
        expr = compile_expr(item["when"], path=path, line=value_line(item, "when"), where="severity_if when")
        sev_if.append((expr, item["severity"]))

    title = compile_template(data["title"], path=path, line=value_line(data, "title"), where="title")
    summary = compile_template(data["summary"], path=path, line=value_line(data, "summary"), where="summary")

    raw_ev = data["evidence"]
    if not isinstance(raw_ev, list) or not raw_ev:
        raise RuleFileError(path, value_line(data, "evidence"), "evidence must be a non-empty list")
    evidence: list[EvidenceSpec] = []
    for idx, item in enumerate(raw_ev):
        il = raw_ev.lines[idx] if isinstance(raw_ev, _LineList) else None
        if not isinstance(item, dict):
            raise RuleFileError(path, il, "each evidence item must be {fact, value, source[, when]}")
        _check_keys(
            item, {"fact", "value", "source", "when"}, ("fact", "value", "source"), path, "evidence item"
        )
        evidence.append(
            EvidenceSpec(
                fact=compile_template(
                    item["fact"], path=path, line=value_line(item, "fact"), where="evidence fact"
                ),
                value=compile_template(
                    item["value"], path=path, line=value_line(item, "value"), where="evidence value"
                ),
                source=compile_template(
                    item["source"], path=path, line=value_line(item, "source"), where="evidence source"
                ),
                when=compile_expr(
                    item["when"], path=path, line=value_line(item, "when"), where="evidence when"
                )
                if "when" in item
                else None,
            )
        )

    fix: list[tuple[str, Expr]] = []
    raw_fix = data.get("fix", {})
    if not isinstance(raw_fix, dict):
        raise RuleFileError(path, value_line(data, "fix"), "fix must be a mapping flag: expression")
    for key, src in raw_fix.items():
        fl = key_line(raw_fix, key)
        if not isinstance(key, str) or not (_FLAG.match(key) or _ENV.match(key)):
            raise RuleFileError(
                path,
                fl,
                f"fix key {key!r} is neither a vLLM flag (--max-model-len) nor an environment variable",
            )
        fix.append((key, compile_expr(src, path=path, line=value_line(raw_fix, key), where=f"fix {key}")))

    gpus = (
        compile_expr(data["gpus"], path=path, line=value_line(data, "gpus"), where="gpus")
        if "gpus" in data
        else None
    )

    raw_explains = data.get("explains", [])
    explains_line = value_line(data, "explains") if "explains" in data else None
    if not isinstance(raw_explains, list) or not all(
        isinstance(x, str) and _SLUG.match(x) for x in raw_explains
    ):
        raise RuleFileError(
            path, explains_line, "explains must be a list of rule ids like [kv-budget-exhausted]"
        )
    if rid in raw_explains:
        raise RuleFileError(path, explains_line, f"rule '{rid}' cannot explain itself")
    for_s = parse_duration(data["for"], path, value_line(data, "for"), "for") if "for" in data else 0.0
    clear_for_s = (
        parse_duration(data["clear_for"], path, value_line(data, "clear_for"), "clear_for")
        if "clear_for" in data
        else for_s
    )

    return Rule(
        id=rid,
        family=family,
        severity=severity,
        title=title,
        summary=summary,
        evidence=tuple(evidence),
        when=when,
        doc=doc,
        needs=needs,
        needs_any=needs_any,
        thresholds=thresholds,
        let=tuple(lets),
        severity_if=tuple(sev_if),
        fix=tuple(fix),
        gpus=gpus,
        path=path,
        threshold_lines=threshold_lines,
        explains=tuple(dict.fromkeys(raw_explains)),
        explains_line=explains_line,
        for_s=for_s,
        clear_for_s=clear_for_s,
    )


def _all_exprs(rule: Rule) -> Iterator[Expr]:
    """Every expression of a rule in evaluation order (lets first, in their order)."""
    for _, e in rule.let:
        yield e
    yield rule.when
    for e, _ in rule.severity_if:
        yield e
    yield from rule.title.exprs
    yield from rule.summary.exprs
    for ev in rule.evidence:
        if ev.when is not None:
            yield ev.when
        yield from ev.fact.exprs
        yield from ev.value.exprs
        yield from ev.source.exprs
    for _, e in rule.fix:
        yield e
    if rule.gpus is not None:
        yield rule.gpus


def check_names(rule: Rule, known_names: set[str]) -> None:
    """Check every name a rule reads is a context variable (``known_names``), a threshold, a
    ``let`` defined before use, a constant or a function, and every call is a known function.

    Raises :class:`RuleFileError` with the line of the offending expression.
    """
    base = set(known_names) | set(rule.thresholds) | set(FUNCTIONS) | set(CONSTANTS)
    let_names = [name for name, _ in rule.let]
    defined: set[str] = set()
    for name, expr in rule.let:
        _check_expr_names(rule, expr, base | defined, let_names)
        defined.add(name)
    allowed = base | defined
    for expr in _all_exprs(rule):
        if expr.where.startswith("let "):
            continue
        _check_expr_names(rule, expr, allowed, let_names)


def _check_expr_names(rule: Rule, expr: Expr, allowed: set[str], let_names: list[str]) -> None:
    for call in sorted(expr.calls):
        if call not in FUNCTIONS:
            hint = _close_matches(call, list(FUNCTIONS), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise RuleFileError(rule.path, expr.line, f"unknown function '{call}' in {expr.where}{extra}")
    for name in sorted(expr.names):
        if name in allowed:
            continue
        if name in let_names:
            reason = f"let '{name}' is used in {expr.where} before it is defined"
        else:
            hint = _close_matches(name, sorted(allowed - set(FUNCTIONS)), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            reason = f"unknown name '{name}' in {expr.where}{extra}"
        raise RuleFileError(rule.path, expr.line, reason)


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def load_rule_file(path: str | Path, known_names: set[str] | None = None) -> Rule:
    """Load and validate one rule file (``<id>.yaml``).

    ``known_names``: the catalogue of context variables (``kvdoctor.derive.VARIABLES``); when
    given, unknown names and unknown functions are errors. Raises :class:`RuleFileError`.
    """
    p = Path(path)
    shown = _display_path(p)
    rule = _parse_rule(load_yaml_with_lines(p, shown), shown, p.stem)
    if known_names is not None:
        check_names(rule, known_names)
    return rule


def default_rules_dir() -> Path:
    """The shipped rule catalogue: ``kvdoctor/rules`` inside an installed wheel, else the
    repository's top-level ``rules/`` (editable/dev installs). May not exist or be empty."""
    # the package's own directory, as importlib.resources.files("kvdoctor") names it for a
    # package on disk (importing importlib.resources costs a cold start ~10 ms)
    packaged = Path(__file__).resolve().parent / "rules"
    if packaged.is_dir() and any(packaged.glob("*.yaml")):
        return packaged
    return Path(__file__).resolve().parents[1] / "rules"


def load_rules(dirs: Iterable[str | Path] | None = None, known_names: set[str] | None = None) -> list[Rule]:
    """Load every ``*.yaml`` rule of ``dirs`` (default: :func:`default_rules_dir`), sorted by id.

    A missing default directory gives zero rules; a missing explicit directory, an invalid file
    or an id defined twice raises :class:`RuleFileError` (file:line: reason). Rules are parsed
    and compiled once per process: a cache keyed on the rule files (path, size, mtime) and the
    known names returns the same (immutable) rules while no file changed. Across processes the
    compiled rules are kept in a user cache file under the same key (:func:`_disk_cache_get`),
    so a command's cold start reads neither YAML nor expression source.
    """
    explicit = dirs is not None
    paths = [Path(d) for d in dirs] if dirs is not None else [default_rules_dir()]
    key = _rules_key(paths, explicit, known_names)
    cached = _RULES_CACHE.get(key) if key is not None else None
    if cached is not None:
        return list(cached)
    from_disk = _disk_cache_get(key) if key is not None else None
    if from_disk is not None:
        result = list(from_disk)
    else:
        result = _load_rules_uncached(paths, explicit, known_names)
        if key is not None:
            _disk_cache_put(key, tuple(result))
    if key is not None:
        if len(_RULES_CACHE) > 16:
            _RULES_CACHE.clear()
        _RULES_CACHE[key] = tuple(result)
    return result


_RULES_CACHE: dict[Any, tuple[Rule, ...]] = {}


def _rules_key(paths: list[Path], explicit: bool, known_names: set[str] | None) -> Any:
    """(dirs, every rule file's path/size/mtime, known names, the functions rules may call),
    or None when a file cannot be stat'ed (then nothing is cached)."""
    files: list[tuple[str, int, int]] = []
    try:
        for d in paths:
            if not d.is_dir():
                files.append((str(d), -1, -1))
                continue
            for f in sorted([*d.glob("*.yaml"), *d.glob("*.yml")]):
                st = f.stat()
                files.append((str(f), st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    names = frozenset(known_names) if known_names is not None else None
    # registered functions decide which calls validate (check_names)
    return (explicit, tuple(str(p) for p in paths), tuple(files), names, frozenset(FUNCTIONS))


# --------------------------------------------------------------------------- the disk cache

#: Set to a directory to keep the compiled-rules cache there, or to "" to keep none.
ENV_CACHE_DIR = "KVDOCTOR_CACHE_DIR"
#: bump when what a cache file holds changes shape
_CACHE_FORMAT = 2
_CACHE_MAX_BYTES = 16 * 1024 * 1024
_CACHE_MAX_FILES = 32


def _cache_dir() -> Path | None:
    """``$KVDOCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvdoctor``, else ``~/.cache/kvdoctor``;
    None when caching is off (the variable set to "") or there is no home."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME")
    if base:
        return Path(base) / "kvdoctor"
    try:
        return Path.home() / ".cache" / "kvdoctor"
    except (RuntimeError, KeyError, OSError):
        return None


def _code_fingerprint() -> tuple[Any, ...]:
    """What else decides the compiled form: the cache format, Python's exact version and
    implementation (the bytecode of the code objects, marshal's format), kvdoctor's version and
    the files of the code that parses, validates and compiles rules (this module, ``findings``:
    families and severities)."""
    from kvdoctor import __version__, findings

    files: list[tuple[Any, ...]] = []
    for f in (__file__, findings.__file__ or ""):
        try:
            st = os.stat(f)
            files.append((f, st.st_size, st.st_mtime_ns))
        except OSError:
            files.append((f,))
    python = (sys.version, sys.implementation.cache_tag, marshal.version)
    return (_CACHE_FORMAT, python, __version__, tuple(files))


def _canonical(value: Any) -> Any:
    """``value`` with every set as a sorted tuple: a set's repr follows string hashing, which
    differs per process (PYTHONHASHSEED), and the cache key must not."""
    if isinstance(value, (set, frozenset)):
        return ("<set>", *sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, tuple):
        return tuple(_canonical(v) for v in value)
    return value


def _cache_file(key: Any) -> tuple[Path, str] | None:
    d = _cache_dir()
    if d is None:
        return None
    full = repr(_canonical((_code_fingerprint(), key)))
    # a name, not a check (the file holds the full key, compared on read): crc32 is enough
    # and costs no hashlib import
    raw = full.encode("utf-8", "replace")
    return d / f"rules-{zlib.crc32(raw):08x}{len(raw):06x}{_CACHE_SUFFIX}", full


def _private_dir(d: Path, create: bool) -> bool:
    """True when ``d`` is a directory of this user that nobody else can write (made 0700 when
    ``create``); a cache anyone else could write is never read."""
    try:
        if create:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return False
    owner_ok = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
    return stat.S_ISDIR(st.st_mode) and owner_ok and not st.st_mode & 0o022


# The cache file: _CACHE_MAGIC, the CRC-32 of the rest (4 bytes, little-endian), then
# marshal.dumps((full key, rules as plain data)): strings, numbers, tuples, dicts, frozensets,
# and each expression's code object (compile_expr's) as marshal bytes of its own, loaded when
# the expression is first evaluated (Expr.code). Trust model: marshal is Python's .pyc format, and a
# cache file is trusted like a .pyc: it is read only from a directory of this user that nobody
# else can write (_private_dir), only from a regular file of this user, not writable by
# others, opened without following a link. Anyone able to write there can already run code as
# this user. Within that, a file is used only when its magic, CRC and full key (Python's exact
# version, kvdoctor's version, this module's and findings' files, every rule file's stat, the
# known names and functions) match and its data has the shape _rule_from_data expects: a
# corrupt, truncated, foreign or stale file is ignored and rebuilt. A code object runs only
# once it names nothing but the guards compiled code calls (_code_ok: no attribute, no other
# global, no builtin); one that does not is never run (simpleeval evaluates the source).
_CACHE_MAGIC = b"kvdoctor-rules\x00\x02"
_CACHE_SUFFIX = ".marshal"
#: the names compiled code may look up (its globals; attributes and builtins: none)
_CODE_NAMES = frozenset(_EXPR_GLOBALS) - {"__builtins__"}


def _code_ok(code: Any) -> bool:
    """``code`` is a code object naming only the guards, as compile_expr's are (recursively:
    a comprehension's code is a constant of its expression's)."""
    if type(code) is not CodeType or not _CODE_NAMES.issuperset(code.co_names):
        return False
    return all(_code_ok(c) for c in code.co_consts if type(c) is CodeType)


def _load_code(blob: bytes) -> CodeType | None:
    """The code object of a cache's marshal ``blob``, or None when it is not one compile_expr
    makes (:func:`_code_ok`) or not marshal data at all."""
    try:
        code = marshal.loads(blob)
    except Exception:  # noqa: BLE001 - corrupt: evaluated from the source instead
        return None
    return code if _code_ok(code) else None


def _expr_data(e: Expr | None) -> tuple[Any, ...] | None:
    if e is None:
        return None
    code = e.compiled if isinstance(e.compiled, bytes) else e.code  # compiled now if still LAZY
    blob = code if isinstance(code, bytes) else None if code is None else marshal.dumps(code)
    return (e.source, e.where, e.line, e.names, e.calls, blob)


def _expr_from(d: Any) -> Expr | None:
    """The :class:`Expr` :func:`_expr_data` stored (ValueError for data of another shape)."""
    if d is None:
        return None
    # what Expr(...) makes, without its frozen __init__ (~850 of them per start)
    e = object.__new__(Expr)
    v = e.__dict__
    v["source"], v["where"], v["line"], v["names"], v["calls"], v["compiled"] = d
    v["fn"] = e._first_call
    blob, line = v["compiled"], v["line"]
    if not (
        type(v["source"]) is str
        and type(v["where"]) is str
        and (line is None or type(line) is int)
        and type(v["names"]) is frozenset
        and type(v["calls"]) is frozenset
        and (blob is None or type(blob) is bytes)  # never a code object: those are checked on load
    ):
        raise ValueError("not an expression")
    return e


def _tpl_data(t: Template) -> tuple[Any, ...]:
    return (t.source, tuple(p if isinstance(p, str) else (_expr_data(p[0]), p[1]) for p in t.parts))


def _tpl_from(d: Any) -> Template:
    """The :class:`Template` :func:`_tpl_data` stored (ValueError for data of another shape)."""
    source, parts = d
    out: list[str | tuple[Expr, str]] = []
    for p in parts:
        if type(p) is str:
            out.append(p)
            continue
        expr, spec = p
        e = _expr_from(expr)
        if e is None or type(spec) is not str:
            raise ValueError("not a template field")
        out.append((e, spec))
    if type(source) is not str:
        raise ValueError("not a template")
    t = object.__new__(Template)
    t.__dict__["source"], t.__dict__["parts"] = source, tuple(out)
    return t


def _required(e: Expr | None) -> Expr:
    if e is None:
        raise ValueError("missing expression")
    return e


#: the fields of Rule, in order, as _rule_data stores them (a test keeps this equal to Rule's)
_RULE_FIELDS = (
    "id", "family", "severity", "title", "summary", "evidence", "when", "doc", "needs", "needs_any",
    "thresholds", "let", "severity_if", "fix", "gpus", "path", "threshold_lines", "explains",
    "explains_line", "for_s", "clear_for_s",
)  # fmt: skip


def _rule_data(r: Rule) -> tuple[Any, ...]:
    """``r`` as plain data marshal stores (see :func:`_rule_from_data`)."""
    return (
        r.id,
        r.family,
        r.severity,
        _tpl_data(r.title),
        _tpl_data(r.summary),
        tuple(
            (_tpl_data(e.fact), _tpl_data(e.value), _tpl_data(e.source), _expr_data(e.when))
            for e in r.evidence
        ),
        _expr_data(r.when),
        r.doc,
        r.needs,
        r.needs_any,
        dict(r.thresholds),
        tuple((n, _expr_data(e)) for n, e in r.let),
        tuple((_expr_data(e), s) for e, s in r.severity_if),
        tuple((k, _expr_data(e)) for k, e in r.fix),
        _expr_data(r.gpus),
        r.path,
        dict(r.threshold_lines),
        r.explains,
        r.explains_line,
        r.for_s,
        r.clear_for_s,
    )


def _rule_from_data(d: Any) -> Rule:
    """The rule :func:`_rule_data` stored; ValueError/TypeError for data of another shape."""
    (rid, family, severity, title, summary, evidence, when, doc, needs, needs_any, thresholds, let,
     severity_if, fix, gpus, path, threshold_lines, explains, explains_line, for_s, clear_for_s) = d  # fmt: skip
    texts = (rid, family, severity, doc, path)
    if not all(type(x) is str for x in texts) or family not in FAMILIES or severity not in SEVERITIES:
        raise ValueError("not a rule")
    for names in (needs, needs_any, explains):
        if type(names) is not tuple or not all(type(x) is str for x in names):
            raise ValueError("not a list of names")
    if type(thresholds) is not dict or type(threshold_lines) is not dict:
        raise ValueError("not thresholds")
    if not all(_threshold_kind(v) in ("number", "text", "bool") for v in thresholds.values()):
        raise ValueError("not a threshold")
    if severity_if and not all(s in SEVERITIES for _, s in severity_if):
        raise ValueError("not a severity")
    return Rule(
        id=rid,
        family=family,
        severity=severity,
        title=_tpl_from(title),
        summary=_tpl_from(summary),
        evidence=tuple(
            EvidenceSpec(_tpl_from(f), _tpl_from(v), _tpl_from(s), _expr_from(w)) for f, v, s, w in evidence
        ),
        when=_required(_expr_from(when)),
        doc=doc,
        needs=needs,
        needs_any=needs_any,
        thresholds=thresholds,
        let=tuple((str(n), _required(_expr_from(e))) for n, e in let),
        severity_if=tuple((_required(_expr_from(e)), str(s)) for e, s in severity_if),
        fix=tuple((str(k), _required(_expr_from(e))) for k, e in fix),
        gpus=_expr_from(gpus),
        path=path,
        threshold_lines=threshold_lines,
        explains=explains,
        explains_line=explains_line if explains_line is None else int(explains_line),
        for_s=float(for_s),
        clear_for_s=float(clear_for_s),
    )


def _disk_cache_get(key: Any) -> tuple[Rule, ...] | None:
    """The compiled rules a previous process stored under ``key``, or None: no file, another
    key (a hash collision or another kvdoctor), a file not this user's own or writable by
    others, too large, or not a valid cache (all silently ignored: the rules are then parsed).
    See the trust model above."""
    where = _cache_file(key)
    if where is None:
        return None
    path, full = where
    if not _private_dir(path.parent, create=False):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_size > _CACHE_MAX_BYTES:
                return None
            if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
                return None
            data = fh.read(_CACHE_MAX_BYTES + 1)
        head = len(_CACHE_MAGIC)
        if not data.startswith(_CACHE_MAGIC) or len(data) < head + 4:
            return None
        payload = memoryview(data)[head + 4 :]
        if int.from_bytes(data[head : head + 4], "little") != zlib.crc32(payload):
            return None
        stored_key, rules = marshal.loads(payload)
        if stored_key != full or type(rules) is not tuple:
            return None
        return tuple(_rule_from_data(r) for r in rules)
    except Exception:  # a truncated, corrupt or foreign file is no cache
        return None


def _disk_cache_put(key: Any, rules: tuple[Rule, ...]) -> None:
    """Store ``rules`` under ``key`` (atomically: a temporary file renamed into place, mode
    0600), keeping at most :data:`_CACHE_MAX_FILES` files. Never raises: an unwritable cache
    only means the next process parses the rules again."""
    where = _cache_file(key)
    if where is None:
        return
    path, full = where
    if not _private_dir(path.parent, create=True):
        return
    import tempfile

    tmp = None
    try:
        payload = marshal.dumps((full, tuple(_rule_data(r) for r in rules)))
        data = _CACHE_MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload
        if len(data) > _CACHE_MAX_BYTES:
            return
        fd, tmp = tempfile.mkstemp(prefix=".rules-", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        tmp = None
        old = sorted(path.parent.glob(f"rules-*{_CACHE_SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for stale in old[: max(0, len(old) - _CACHE_MAX_FILES)]:
            stale.unlink(missing_ok=True)
        for stale in path.parent.glob("rules-*.pickle"):  # the cache of kvdoctor before marshal
            stale.unlink(missing_ok=True)
    except Exception:  # a value marshal cannot store, disk full, a race with another process
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _load_rules_uncached(paths: list[Path], explicit: bool, known_names: set[str] | None) -> list[Rule]:
    rules: dict[str, Rule] = {}
    for d in paths:
        if not d.is_dir():
            if explicit:
                raise RuleFileError(_display_path(d), None, "rules directory does not exist")
            continue
        files = sorted([*d.glob("*.yaml"), *d.glob("*.yml")])
        for f in files:
            rule = load_rule_file(f, known_names)
            if rule.id in rules:
                raise RuleFileError(
                    rule.path, None, f"rule id '{rule.id}' is also defined in {rules[rule.id].path}"
                )
            rules[rule.id] = rule
    check_explains(rules.values())
    return [rules[k] for k in sorted(rules)]


def check_explains(rules: Iterable[Rule]) -> None:
    """Every ``explains`` id names a loaded rule, and no rule explains itself through others.

    Raises :class:`RuleFileError` at the ``explains:`` line of the offending rule."""
    by_id = {r.id: r for r in rules}
    for r in by_id.values():
        for target in r.explains:
            if target not in by_id:
                hint = _close_matches(target, sorted(by_id), n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise RuleFileError(r.path, r.explains_line, f"explains unknown rule '{target}'{extra}")
    # A cycle would leave every finding in it a consequence of another: no root to read first.
    state: dict[str, int] = {}

    def visit(rid: str, trail: list[str]) -> None:
        state[rid] = 1
        for nxt in by_id[rid].explains:
            if state.get(nxt) == 1:
                loop = " → ".join([*trail[trail.index(nxt) :], nxt]) if nxt in trail else f"{rid} → {nxt}"
                raise RuleFileError(
                    by_id[rid].path, by_id[rid].explains_line, f"explains forms a cycle: {loop}"
                )
            if state.get(nxt) is None:
                visit(nxt, [*trail, nxt])
        state[rid] = 2

    for rid in sorted(by_id):
        if state.get(rid) is None:
            visit(rid, [rid])


# --------------------------------------------------------------------------- evaluation


@dataclass
class RuleContext:
    """The variables rules read for one engine (or the host, ``engine=None``).

    ``variables``: name → value (bytes, fractions, seconds, counts; None when unknown), built by
    ``kvdoctor.derive``. ``inputs``: the inputs present ("log", "metrics", "config", …) that
    rules' ``needs``/``needs_any`` refer to.
    """

    engine: str | None
    variables: dict[str, Any]
    inputs: set[str] = field(default_factory=set)


@dataclass
class EvalError:
    """A run-time evaluation error kept for debugging (never raised)."""

    rule: str
    engine: str | None
    where: str
    message: str

    def __str__(self) -> str:
        eng = f" [{self.engine}]" if self.engine else ""
        return f"{self.rule}{eng} {self.where}: {self.message}"


@dataclass
class Evaluation:
    """Result of :func:`evaluate`; unpacks as ``findings, skipped = evaluate(...)``."""

    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    errors: list[EvalError] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        yield self.findings
        yield self.skipped


class _Names(dict):  # type: ignore[type-arg]
    """Expression names; a name no context provides reads as None (and is noted).

    ``base``: the names under these (the context's variables, read-only, then
    :data:`CONSTANTS`): a name this mapping lacks is looked up there before it counts as
    missing. :func:`evaluate` fills a rule's own mapping with the names its expressions read
    and its thresholds (a copy of every context variable per rule was a fifth of the rules'
    time) and leaves the rest to ``base``; with a memo, with its thresholds only
    (:class:`_ReadNames`).
    """

    missing: set[str]
    base: Mapping[str, Any] = {}  # noqa: RUF012 - read-only default: no names under
    #: the names looked up under it, in order (:class:`_ReadNames`); None: not noted
    read: list[str] | None = None

    def __missing__(self, key: str) -> Any:
        base = self.base
        if key in base:
            return base[key]
        # the constants sit under the variables (a variable of that name would hide one)
        if key in CONSTANTS:
            return CONSTANTS[key]
        self.missing.add(key)
        return None


class _ReadNames(_Names):
    """:class:`_Names` that notes in ``read`` every name it looked up under it (the context
    variables, constants and missing names one evaluation actually read: a ``when`` that
    short-circuits reads only what decided it). Starts with the rule's thresholds only; a
    name found under it is kept here, so each is noted once (a missing one at each read)."""

    read: list[str]

    def __missing__(self, key: str) -> Any:
        self.read.append(key)
        base = self.base
        if key in base:
            value = self[key] = base[key]
            return value
        if key in CONSTANTS:
            value = self[key] = CONSTANTS[key]
            return value
        self.missing.add(key)
        return None


_NA = "N/A"


class _UnknownFunction(Exception):
    """A compiled expression called a function this evaluation lacks (reported as simpleeval's
    FunctionNotDefined, which names the expression)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Functions(dict):  # type: ignore[type-arg]
    """The functions one evaluation's expressions call (``__f["name"]``)."""

    def __missing__(self, key: str) -> Any:
        raise _UnknownFunction(key)


def _forbidden(*args: Any, **kwargs: Any) -> Any:
    raise _simpleeval_error("FeatureNotAvailable", "This function is forbidden")


def _is_forbidden(fn: Any) -> bool:
    """simpleeval's test: a module, or one of ``simpleeval.DISALLOW_FUNCTIONS`` (eval, open,
    getattr, type, os.system, …)."""
    import types

    import simpleeval

    if isinstance(fn, types.ModuleType):
        return True
    try:
        return fn in simpleeval.DISALLOW_FUNCTIONS
    except TypeError:  # unhashable: none of those
        return False


#: name → function already checked by :func:`_is_forbidden` and found callable (the shipped
#: ones are: a test checks them)
_VETTED: dict[str, Any] = dict(FUNCTIONS)


def _functions() -> _Functions:
    """The functions of one evaluation: :data:`FUNCTIONS` as it is now (a function simpleeval
    forbids, put there without :func:`register_function`, raises FeatureNotAvailable when
    called), plus list/tuple/dict/set, which simpleeval's EvalWithCompoundTypes always adds."""
    out = _Functions()
    for name, fn in FUNCTIONS.items():
        if _VETTED.get(name) is not fn:
            if _is_forbidden(fn):
                fn = _forbidden
            else:
                _VETTED[name] = fn
        out[name] = fn
    out.update(list=list, tuple=tuple, dict=dict, set=set)
    return out


#: (the names and the functions of FUNCTIONS it was made from, :func:`_functions` of them):
#: one evaluation's functions are the same mapping while FUNCTIONS holds the very same ones
_FUNCTIONS_NOW: list[Any] = [(), (), None]


def _current_functions() -> _Functions:
    """:func:`_functions`, made again only when :data:`FUNCTIONS` changed (a function added,
    removed or replaced: names and functions compared by identity, no copy of the items);
    the mapping is read-only to its users."""
    names, fns, cached = _FUNCTIONS_NOW
    if (
        cached is None
        or len(FUNCTIONS) != len(names)
        or not all(map(is_, FUNCTIONS.values(), fns))
        or not all(map(is_, FUNCTIONS, names))
    ):
        cached = _functions()
        _FUNCTIONS_NOW[:] = [tuple(FUNCTIONS), tuple(FUNCTIONS.values()), cached]
    return cached  # type: ignore[no-any-return]


class _Runner:
    """Evaluates one rule over one context, collecting errors instead of raising.

    ``names``: the rule's names (context variables, constants, thresholds, then its ``let``
    values as they are computed); ``functions``: :func:`_functions`."""

    __slots__ = ("names", "functions", "rule", "engine", "errors")  # one is made per rule evaluated

    def __init__(
        self, names: _Names, functions: _Functions, rule: Rule, engine: str | None, errors: list[EvalError]
    ):
        self.names = names
        self.functions = functions
        self.rule = rule
        self.engine = engine
        self.errors = errors

    def fail(self, expr: Expr, err: Exception) -> None:
        """Keep ``err`` (raised by ``expr``) as an :class:`EvalError`: "Type: message"."""
        if isinstance(err, _UnknownFunction):
            err = _simpleeval_error("FunctionNotDefined", err.name, expr.source)
        self.errors.append(EvalError(self.rule.id, self.engine, expr.where, f"{type(err).__name__}: {err}"))

    def value(self, expr: Expr) -> Any:
        try:
            return expr.fn(self.names, self.functions)
        except Exception as err:  # noqa: BLE001 - a rule must never crash the run
            self.fail(expr, err)
            return None

    def truthy(self, expr: Expr) -> bool:
        v = self.value(expr)
        try:
            return bool(v)
        except Exception as err:  # noqa: BLE001 - e.g. ambiguous truth values
            self.fail(expr, err)
            return False

    def render(self, tpl: Template) -> str:
        out: list[str] = []
        for part in tpl.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            expr, spec = part
            _append_formatted(self, out, expr, spec, self.value(expr))
        return "".join(out)


def _render(run: _Runner, tpl: Template) -> str:
    """``run.render(tpl)`` of a plain :class:`_Runner` (its ``value`` inline): every field
    rendered (:func:`_render_traced` with no earlier rendering)."""
    return _render_traced(run, tpl, (), _UNSET, frozenset(), 0)[0]


def _append_formatted(run: _Runner, out: list[str], expr: Any, spec: str, v: Any) -> None:
    """``format(v, spec)`` onto ``out``; ``N/A`` for None or a format spec the value refuses (an
    EvalError on ``run``)."""
    if v is None:
        out.append(_NA)
        return
    try:
        out.append(format(v, spec))
    except Exception as err:  # noqa: BLE001 - bad format spec for this value
        run.errors.append(
            EvalError(run.rule.id, run.engine, expr.where, f"format {{{expr.source}:{spec}}}: {err}")
        )
        out.append(_NA)


class _ReferenceRunner(_Runner):
    """simpleeval evaluates each expression from its syntax tree: the semantics the compiled
    form keeps (``evaluate(..., reference=True)``: the differential test, ``bench/rules.py``)."""

    evaluator: Any = None

    def value(self, expr: Expr) -> Any:
        self.evaluator.names = self.names
        try:
            return self.evaluator.eval(expr.source, previously_parsed=expr.node)
        except Exception as err:  # noqa: BLE001 - a rule must never crash the run
            self.fail(expr, err)
            return None


def format_flag_value(value: Any) -> str | None:
    """How a ``fix`` value is written: ints "23648", floats with up to 2 decimals trimmed
    ("0.63", "0.9", "2"), strings as-is, lists comma-joined ("2,3" for CUDA_VISIBLE_DEVICES),
    True → "" (a flag without argument, e.g. --enforce-eager); None/False/NaN → None (drop)."""
    if value is None or value is False:
        return None
    if value is True:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        text = f"{value:.2f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    if isinstance(value, (list, tuple)):
        return ",".join(str(format_flag_value(v) or "") for v in value)
    return str(value)


def _as_gpu_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise TypeError("gpus must be a list of GPU indices")
    if isinstance(value, int):
        return [value]
    return sorted({int(v) for v in value})


#: a step of a trace not evaluated (the rule did not get that far, or the when was false)
_UNSET: Any = object()
#: no names changed (an evaluation without a trace to reuse)
_NO_CHANGES: frozenset[str] = frozenset()
#: the types whose equal values read alike (a float also needs its zero's sign: :func:`_same`)
_SAME_TYPES = frozenset({bool, int, str, type(None)})


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` read alike in every expression: a scalar of the same type, equal
    (floats: a zero's sign too). Anything else is taken as changed (a container may have been
    changed in place since)."""
    t = type(a)
    if t is not type(b):
        return False
    if t in _SAME_TYPES:
        return bool(a == b)
    if t is float:
        return a == b and (a != 0 or math.copysign(1.0, a) == math.copysign(1.0, b))
    return False


#: a rule's trace: per step (:func:`_step_plan`'s order) its outcome (value, rendering, checked
#: fix), the context names it read and, for a template, its fields' (:func:`_render_traced`);
#: :data:`_UNSET` for a step not reached
_Trace = tuple[list[Any], list[Any], list[Any]]


def _render_traced(
    run: _Runner,
    tpl: Template,
    fields: tuple[tuple[tuple[str, ...], int], ...],
    prev: Any,
    changed: Set[str],
    lets_changed: int,
) -> tuple[str, tuple[str, ...]]:
    """:func:`_render` of a plain runner, field by field: (the text, each part's text).
    ``prev``: each part's text from the last rendering (:data:`_UNSET`: none); a field none
    of whose names (``fields``: per field, the names it may read, and the lets it reads as a
    bit mask) is in ``changed`` and that reads no let in ``lets_changed`` (bit k: let k got
    another value) keeps its text."""
    names, functions = run.names, run.functions
    out: list[str] = []
    k = 0
    for part in tpl.parts:
        if isinstance(part, str):
            out.append(part)
            continue
        if prev is not _UNSET:
            own, lets = fields[k]
            k += 1
            if not lets & lets_changed and changed.isdisjoint(own):
                out.append(prev[len(out)])
                continue
        expr, spec = part
        try:
            v = expr.fn(names, functions)
        except Exception as err:  # noqa: BLE001 - a rule must never crash the run
            run.fail(expr, err)
            v = None
        _append_formatted(run, out, expr, spec, v)
    return "".join(out), tuple(out)


def _evaluate_rule(
    run: _Runner,
    names: _Names,
    base: Mapping[str, Any],
    info: _RuleInfo,
    prev: _Trace | None = None,
    changed: Set[str] = _NO_CHANGES,
) -> tuple[Finding | None, _Trace | None, frozenset[str]]:
    """One rule over one context (``names``: its names over ``base``, the context's
    variables): (the finding or None, its trace, the names it read).

    In order: each ``let`` (a let that fails is None), the ``when`` (failing: not firing), the
    first ``severity_if`` that holds, each evidence item whose ``when`` holds (fact, value,
    source rendered), each ``fix`` (formatted, dropped when :func:`valid_fix` refuses it), the
    ``gpus``, the title and the summary; errors go to ``run``.

    With a :class:`_ReadNames` (a memo's evaluation), the trace and reads are kept: each
    step's outcome and the context names it read (its static reads looked up so far: a
    name an earlier step fetched counts), and the names its outcome depends on: those it read
    when it did not fire, else every name any of its steps may read and the fix checks'. ``prev``: the trace of this rule's last evaluation for this context, kept
    only from an evaluation that raised no error and read no missing name: a step reached
    then is not evaluated again when none of the names it read is in ``changed`` (strictly
    compared since: :func:`_changes`) and no let it reads got another value
    (:func:`_same`); its outcome is the one kept (an expression's value is a function of the
    values it reads; evaluated again, it would raise no error either). Without, the trace is
    None and the reads empty."""
    rule = run.rule
    plain = type(run) is _Runner  # its value inline; a reference runner's own (simpleeval)
    value, truthy = run.value, run.truthy
    render = _render if plain else type(run).render
    functions = run.functions
    read = names.read
    direct = info.direct
    if prev is None:
        pv = pr = pf = info.blank
    else:
        pv, pr, pf = prev
    tv: list[Any] = [_UNSET] * len(direct)
    tr: list[Any] = [_UNSET] * len(direct)
    tf: list[Any] = [_UNSET] * len(direct)
    fields = info.fields
    lets_changed = 0  # bit k set: let k got another value
    more: list[Any] = []  # reads no fresh step noted in ``read``: the reused lets' and when's
    dirty = 0  # bit i set: a name step i may read changed, or a let it reads
    readers = info.let_readers
    nlet = len(rule.let)
    # it fired last time: its reads were every name its steps may read (see the end), so a
    # step is evaluated again only when one of those changed (or a let it reads): no
    # per-step reads to note or compare
    fired = prev is not None and pv[nlet] is True
    track = read is not None and not fired
    if fired:
        masks = info.direct_masks
        for n in changed:
            dirty |= masks.get(n, 0)
    i = 0
    for name, expr in rule.let:
        p = pv[i]
        if p is _UNSET or dirty >> i & 1 or track and not changed.isdisjoint(pr[i]):
            if plain:
                try:  # run.value, inline (the most frequent step)
                    v = expr.fn(names, functions)
                except Exception as err:  # noqa: BLE001 - a rule must never crash the run
                    run.fail(expr, err)
                    v = None
            else:
                v = value(expr)
            if track:
                tr[i] = list(filter(names.__contains__, direct[i]))
            if prev is not None and not _same(v, p):
                dirty |= readers[i]
                lets_changed |= 1 << i
        elif track:
            v = p
            tr[i] = r = pr[i]
            more.append(r)
        else:
            v = p
        names[name] = tv[i] = v
        i += 1
    p = pv[i]
    if p is _UNSET or dirty >> i & 1 or track and not changed.isdisjoint(pr[i]):
        if plain:
            try:  # run.truthy, inline (every rule evaluated reaches it)
                v = rule.when.fn(names, functions)
            except Exception as err:  # noqa: BLE001 - a rule must never crash the run
                run.fail(rule.when, err)
                v = None
            try:
                v = bool(v)
            except Exception as err:  # noqa: BLE001 - e.g. ambiguous truth values
                run.fail(rule.when, err)
                v = False
        else:
            v = truthy(rule.when)
        if track:
            tr[i] = list(filter(names.__contains__, direct[i]))
    else:
        v = p
        if track:
            tr[i] = r = pr[i]
            more.append(r)
    tv[i] = v
    if not v:
        if read is None:
            return None, None, _NO_CHANGES
        if fired:  # the reads of its reused steps were not noted: what they may read, and
            # no trace (the next evaluation notes each step's reads again)
            return None, None, info.when_reads.union(read)
        return None, (tv, tr, tf), frozenset(read).union(*more) if more else frozenset(read)
    i += 1
    severity = rule.severity
    for expr, sev in rule.severity_if:
        p = pv[i]
        if p is _UNSET or dirty >> i & 1:
            p = truthy(expr)
        tv[i] = p
        i += 1
        if p:
            severity = sev
            break
    i = nlet + 1 + len(rule.severity_if)

    def rendered(at: tuple[tuple[int, Any], ...]) -> list[str]:
        # the templates at those steps: kept, or rendered again when a name they read changed
        out = []
        for j, tpl in at:
            p = pv[j]
            if p is _UNSET or dirty >> j & 1:
                if read is None:
                    p = render(run, tpl)
                else:
                    p, tf[j] = _render_traced(run, tpl, fields[j], pf[j], changed, lets_changed)
            else:
                tf[j] = pf[j]
            out.append(p)
            tv[j] = p
        return out

    evidence = []
    for e in rule.evidence:
        if e.when is not None:
            p = pv[i]
            if p is _UNSET or dirty >> i & 1:
                p = truthy(e.when)
            tv[i] = p
            if not p:
                i += 4
                continue
        evidence.append(Evidence(*rendered(((i + 1, e.fact), (i + 2, e.value), (i + 3, e.source)))))
        i += 4
    flags: dict[str, str] = {}
    checks = []  # the names the fix checks read
    for key, expr in rule.fix:
        # the flag's value, or None: dropped (its reads: the names the check read)
        p = pv[i]
        if p is _UNSET or dirty >> i & 1 or not changed.isdisjoint(pr[i]):
            p = format_flag_value(value(expr))
            tr[i] = ()
            if p is not None:
                # A fix vLLM would reject, or one already in effect, is no fix (kvdoctor.fix_validity).
                if read is None:
                    why = valid_fix(key, p, base)
                else:
                    checked = _Reads(base)
                    why = valid_fix(key, p, checked)
                    tr[i] = checked.read
                if why is not None:
                    run.errors.append(EvalError(rule.id, run.engine, f"fix {key}", f"dropped {p}: {why}"))
                    p = None
        else:
            tr[i] = pr[i]
        checks.append(tr[i])
        tv[i] = p
        if p is not None:
            flags[key] = p
        i += 1
    gpus: list[int] = []
    if rule.gpus is not None:
        p = pv[i]
        if p is _UNSET or dirty >> i & 1:
            try:
                p = tuple(_as_gpu_list(value(rule.gpus)))
            except (TypeError, ValueError) as err:
                run.errors.append(EvalError(rule.id, run.engine, "gpus", f"{type(err).__name__}: {err}"))
                p = ()
        tv[i] = p
        gpus = list(p)
    i += 1
    texts = rendered(((i, rule.title), (i + 1, rule.summary)))
    finding = Finding(
        rule=rule.id,
        severity=severity,  # type: ignore[arg-type]
        family=rule.family,  # type: ignore[arg-type]
        title=texts[0],
        summary=texts[1],
        evidence=evidence,
        suggested_flags=flags,
        gpus=gpus,
        engine=run.engine,
    )
    if read is None:
        return finding, None, _NO_CHANGES
    # a rule that fired: every name any step may read (a superset: its steps after the when
    # are reused by those names, see above) and the names the fix checks read
    return finding, (tv, tr, tf), info.reads.union(*checks) if checks else info.reads


def link_causes(rules: Iterable[Rule], findings: list[Finding]) -> None:
    """Set ``caused_by`` on each finding another fired finding explains (``explains:``), for
    the same engine or where either is about the host (engine None). The worst such root wins
    (then rule id); a link that would close a cycle is dropped. Only ``caused_by`` of the given
    (freshly made) findings is set."""
    explains = {r.id: set(r.explains) for r in rules if r.explains}
    explained = set().union(*explains.values()) if explains else set()
    for f in findings:
        if f.rule not in explained:
            continue
        causes = [
            g
            for g in findings
            if g is not f
            and f.rule in explains.get(g.rule, set())
            and (g.engine == f.engine or g.engine is None or f.engine is None)
        ]
        if causes:
            causes.sort(key=lambda g: (-SEVERITY_ORDER.get(g.severity, 0), g.rule))
            f.caused_by = causes[0].rule
    by_rule = {f.rule: f for f in findings}
    for f in findings:
        if not f.caused_by:
            continue
        seen = {f.rule}
        cur = by_rule.get(f.caused_by) if f.caused_by else None
        while cur is not None and cur.caused_by:
            if cur.caused_by in seen:
                f.caused_by = None
                break
            seen.add(cur.rule)
            cur = by_rule.get(cur.caused_by)


# --------------------------------------------------------------------------- the rule memo
#
# A long-running face (sidecar, watch) evaluates the same rules every cycle over variables that
# mostly hold still (configs, log facts, GPU identities). :class:`RuleMemo` keeps, per engine,
# what each rule's last evaluation gave (finding or none, and its errors) together with the
# names that evaluation read; a rule none of whose names changed since is not evaluated again:
# its result is rebuilt from what was kept. Exact by construction: an evaluation is a function
# of the values of the names it reads (expressions, templates, the fix check), compared strictly
# (:func:`_frozen`: 1, 1.0 and True differ, so do -0.0 and 0.0, and a list's or dict's order);
# rules calling a function that is not one of the shipped (pure) ones are never kept.
# The names kept are those the evaluation actually read (:class:`_ReadNames`: a ``when`` that
# short-circuits read only what decided it), a step reused counting what it read when it was
# evaluated. A rule evaluated again re-evaluates only the steps whose names changed or that read
# a let whose value changed (:func:`_evaluate_rule`); the causes and order of the findings are
# reused while their keys hold (:func:`_link_and_sort`).


@dataclass(frozen=True)
class _RuleInfo:
    """What a rule reads of its context, found once per rule: ``when_reads`` the names its
    ``let``s and ``when`` read (all a rule that does not fire reads), ``reads`` every name any
    of its expressions read (neither counts its thresholds, nor a let's name once the let is
    defined), ``calls`` the functions it calls."""

    rule: Rule
    when_reads: frozenset[str]
    reads: frozenset[str]
    calls: frozenset[str]
    #: per step of an evaluation (:func:`_evaluate_rule`'s order), the names it may read that
    #: are neither a threshold nor a let defined before it (see :func:`_step_plan`)
    direct: tuple[tuple[str, ...], ...] = ()
    #: per let, the steps reading it, as a bit mask (bit i: step i)
    let_readers: tuple[int, ...] = ()
    #: name → the steps whose ``direct`` names hold it, as a bit mask
    direct_masks: dict[str, int] = field(default_factory=dict)
    #: per step, for a template, per field: the names it may read (as ``direct``) and the
    #: lets it reads, as a bit mask (bit k: let k); empty for an expression
    fields: tuple[tuple[tuple[tuple[str, ...], int], ...], ...] = ()
    #: a trace of no step reached (read only)
    blank: list[Any] = field(default_factory=list)
    #: ``when_reads`` as a tuple (the names a rule's own names mapping starts with)
    when_keys: tuple[str, ...] = ()


_StepPlan = tuple[
    tuple[tuple[str, ...], ...],
    tuple[int, ...],
    tuple[tuple[tuple[tuple[str, ...], int], ...], ...],
]


def _step_plan(rule: Rule) -> _StepPlan:
    """The steps of an evaluation of ``rule``, in the order of :func:`_evaluate_rule`'s trace
    (each let, the when, each severity_if, per evidence item its when, fact, value and source,
    each fix, the gpus, the title, the summary): (per step, the names it may read that are
    neither a threshold, fixed for the rule, nor a let defined before it: the context
    variables and constants it may read; per let, the steps that may read it, a bit mask;
    per step, for a template, per field, the names it may read and the lets it reads, a bit
    mask). A let reading its own name reads the variable (it is not defined yet)."""
    thresholds = set(rule.thresholds)
    lets: dict[str, int] = {}  # let name → its index (its step's)
    readers = [0] * len(rule.let)
    direct: list[tuple[str, ...]] = []
    fields: list[tuple[tuple[tuple[str, ...], int], ...]] = []

    def reads(e: Expr) -> tuple[tuple[str, ...], int]:
        out: set[str] = set()
        mask = 0
        for n in _expr_reads(e):
            if n in lets:
                mask |= 1 << lets[n]
            elif n not in thresholds:
                out.add(n)
        return tuple(sorted(out)), mask

    def step(*exprs: Expr | None, template: bool = False) -> None:
        each = [reads(e) for e in exprs if e is not None]
        for k in range(len(rule.let)):
            if any(mask >> k & 1 for _, mask in each):
                readers[k] |= 1 << len(direct)
        direct.append(tuple(sorted({n for names, _ in each for n in names})))
        fields.append(tuple(each) if template else ())

    for k, (name, e) in enumerate(rule.let):
        step(e)
        lets[name] = k
    step(rule.when)
    for e, _ in rule.severity_if:
        step(e)
    for ev in rule.evidence:
        step(ev.when)
        for t in (ev.fact, ev.value, ev.source):
            step(*t.exprs, template=True)
    for _, e in rule.fix:
        step(e)
    step(rule.gpus)
    step(*rule.title.exprs, template=True)
    step(*rule.summary.exprs, template=True)
    return tuple(direct), tuple(readers), tuple(fields)


def _expr_reads(expr: Expr) -> frozenset[str]:
    """The names ``expr`` may read: its free names, plus, when it holds a comprehension, every
    name in it (a comprehension's target may be read outside it too: a superset is safe)."""
    if "for" not in expr.source or not any(isinstance(n, ast.comprehension) for n in ast.walk(expr.node)):
        return expr.names  # ("for" in a name or a text: no comprehension)
    return expr.names | {n.id for n in ast.walk(expr.node) if isinstance(n, ast.Name)}


#: id(rule) → its :class:`_RuleInfo` (which holds the rule: an id is not reused while kept)
_RULE_INFO: dict[int, _RuleInfo] = {}


def _rule_info(rule: Rule) -> _RuleInfo:
    info = _RULE_INFO.get(id(rule))
    if info is not None and info.rule is rule:
        return info
    # A threshold, and a let once defined, hide the context variable of that name: the
    # variable is read only by a let's expression at or before its own definition.
    hidden = set(rule.thresholds)
    early: set[str] = set()
    for name, e in rule.let:
        early |= _expr_reads(e)
        if name not in early:
            hidden.add(name)
    first = [e for _, e in rule.let] + [rule.when]
    every = list(_all_exprs(rule))
    direct, readers, fields = _step_plan(rule)
    direct_masks: dict[str, int] = {}
    for i, names in enumerate(direct):
        for n in names:
            direct_masks[n] = direct_masks.get(n, 0) | 1 << i
    info = _RuleInfo(
        rule,
        frozenset().union(*map(_expr_reads, first)) - hidden,
        frozenset().union(*map(_expr_reads, every)) - hidden,
        frozenset().union(*(e.calls for e in every)),
        direct,
        readers,
        direct_masks,
        fields,
        [_UNSET] * len(direct),
    )
    # the names a rule's own mapping starts with: not the functions and constants, which no
    # context has (any name it lacks is looked up under it all the same: _Names)
    object.__setattr__(info, "when_keys", tuple(info.when_reads - set(FUNCTIONS) - set(CONSTANTS)))
    if len(_RULE_INFO) >= 4096:
        _RULE_INFO.clear()
    _RULE_INFO[id(rule)] = info
    return info


#: the shipped functions (all pure) and the ones simpleeval adds: a rule calling only these
#: gives the same result for the same values
_PURE_FUNCTIONS: dict[str, Any] = {**FUNCTIONS, "list": list, "tuple": tuple, "dict": dict, "set": set}
_ABSENT = object()


class _Same:
    """A value :func:`_frozen` compares by identity (an object of no builtin type: facts are
    never mutated, so the same object reads the same); holds it, so its id is not reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _frozen(v: Any) -> Any:
    """``v`` as a value two of which are equal only when every expression reads them alike:
    the type is part of it (``1``, ``1.0`` and ``True`` are equal in Python, not in a rendered
    template), so is the sign of a zero, and a container's order (iteration order decides
    joins and "first"); containers are copied (a later change to ``v`` cannot reach it).
    A container of one plain type (the GPU index lists, the used-bytes maps) is kept as one
    tuple of its items with that type."""
    t = type(v)
    if t is str or v is None:
        return v
    if t is int or t is bool:
        return (t, v)
    if t is float:
        return (t, v, math.copysign(1.0, v)) if v == 0 else (t, v)
    if t is list or t is tuple or t is set or t is frozenset:
        if not v:
            return (t,)
        kinds = set(map(type, v))
        if len(kinds) == 1:
            kind = kinds.pop()
            if kind in _PLAIN or (kind is float and 0.0 not in v):
                return (t, kind, tuple(v))
        return (t, None, *[_frozen(x) for x in v])
    if t is dict:
        if not v:
            return (t,)
        keys, values = set(map(type, v)), set(map(type, v.values()))
        if len(keys) == 1 and len(values) == 1:
            key, value = keys.pop(), values.pop()
            if (key in _PLAIN or (key is float and 0.0 not in v)) and (
                value in _PLAIN or (value is float and 0.0 not in v.values())
            ):
                return (t, key, value, tuple(v.items()))
        return (t, None, *[(_frozen(k), _frozen(x)) for k, x in v.items()])
    return _Same(v)


#: element types a container keeps as they are (equal values of one of these read alike)
_PLAIN = frozenset({str, int, bool, type(None)})
_SCALARS = frozenset({str, int, bool, float, type(None)})


def _safe_frozen(v: Any) -> Any:
    try:
        return _frozen(v)
    except RecursionError:  # nested too deeply to compare: never the same
        return _Same(object())


class _Snapshot:
    """The values of ``names`` in one context, as compared next time: ``values`` (a scalar as
    itself, :data:`_ABSENT` for a name the context lacked, anything else :func:`_frozen`), their
    raw ``types``, the positions of the frozen ones and of the floats; ``watched`` the names as a set."""

    __slots__ = ("names", "values", "types", "frozen", "floats", "watched")

    def __init__(
        self,
        names: tuple[str, ...],
        values: tuple[Any, ...],
        types: tuple[type, ...],
        frozen: tuple[int, ...],
        floats: tuple[int, ...],
        watched: frozenset[str] | None = None,
    ) -> None:
        self.names, self.values, self.types, self.frozen, self.floats = names, values, types, frozen, floats
        self.watched = frozenset(names) if watched is None else watched


def _snapshot(names: tuple[str, ...], raw: list[Any]) -> _Snapshot:
    """The :class:`_Snapshot` of ``raw`` (the values of ``names``, in order; changed in place)."""
    types = tuple(map(type, raw))
    frozen = tuple(i for i, t in enumerate(types) if t not in _SCALARS and raw[i] is not _ABSENT)
    for i in frozen:
        raw[i] = _safe_frozen(raw[i])
    return _Snapshot(names, tuple(raw), types, frozen, tuple(i for i, t in enumerate(types) if t is float))


def _changes(before: _Snapshot, variables: dict[str, Any]) -> tuple[set[str], _Snapshot]:
    """(the names of ``before`` whose value in ``variables`` differs, their snapshot now).

    A value that is the very object kept reads alike (facts are never mutated; a container
    is kept frozen, so never is); only the others are compared (most variables are the same
    objects cycle after cycle: a comparison touches two objects, identity only pointers).
    Python's ``==`` is looser than "reads alike" only across types (``1 == 1.0 == True``,
    :func:`_changes_retyped`) and for the sign of a zero; containers compare frozen."""
    names = before.names
    now = list(map(variables.get, names, repeat(_ABSENT)))
    old, types, frozen = before.values, before.types, before.frozen
    changed: set[str] = set()
    copysign = math.copysign
    for i in compress(range(len(names)), map(is_not, old, now)):
        v, p = now[i], old[i]
        if type(v) is not types[i]:
            return _changes_retyped(before, list(map(variables.get, names, repeat(_ABSENT))))
        if i in frozen:
            now[i] = v = _safe_frozen(v)
            if v != p:
                changed.add(names[i])
        elif v != p or (v == 0 and type(v) is float and copysign(1.0, v) != copysign(1.0, p)):
            changed.add(names[i])
    return changed, _Snapshot(names, tuple(now), types, frozen, before.floats, before.watched)


def _changes_retyped(before: _Snapshot, now: list[Any]) -> tuple[set[str], _Snapshot]:
    """:func:`_changes` where a value's type changed (``now``: the values, raw): every
    position compared, the types first."""
    names = before.names
    types = tuple(map(type, now))
    after = _snapshot(names, now)
    changed = {names[i] for i in compress(range(len(names)), map(is_not, types, before.types))}
    old, new = before.values, after.values
    changed |= {names[i] for i in compress(range(len(names)), map(ne, old, new))}
    copysign = math.copysign
    for i in after.floats:
        v, p = new[i], old[i]
        if v == 0 and type(p) is float and p == 0 and copysign(1.0, v) != copysign(1.0, p):
            changed.add(names[i])
    return changed, after


class _Reads(Mapping[str, Any]):
    """A read-only view of the context that notes each name read (what the fix check reads)."""

    def __init__(self, names: Mapping[str, Any]) -> None:
        self.names = names
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.names[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self.names.get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self.names

    def __iter__(self) -> Iterator[str]:
        raise TypeError("the fix check reads names, it does not list them")

    def __len__(self) -> int:
        return len(self.names)


class _Kept:
    """One rule's evaluation for one engine: the names it read (``reads``), its errors
    (``(where, message)``), its finding's fields (None: it did not fire) and its ``trace``:
    each step's outcome and reads (:func:`_evaluate_rule`), None when the evaluation raised an error
    or read a name no context provided. Read-only once made (a plain class with slots: one
    is made per rule evaluated, every cycle)."""

    __slots__ = ("rule", "functions", "reads", "errors", "finding", "trace")

    def __init__(
        self,
        rule: Rule,
        functions: Any,
        reads: frozenset[str],
        errors: tuple[tuple[str, str], ...],
        finding: tuple[Any, ...] | None,
        trace: _Trace | None = None,
    ) -> None:
        self.rule, self.functions, self.reads, self.errors = rule, functions, reads, errors
        self.finding, self.trace = finding, trace

    def replay(self, engine: str | None, errors: list[EvalError]) -> Finding | None:
        """Its errors appended to ``errors``; a new Finding (nothing shared with the kept one)."""
        rule = self.rule
        errors.extend(EvalError(rule.id, engine, where, message) for where, message in self.errors)
        if self.finding is None:
            return None
        severity, title, summary, evidence, flags, gpus = self.finding
        return Finding(
            rule=rule.id,
            severity=severity,
            family=rule.family,  # type: ignore[arg-type]
            title=title,
            summary=summary,
            evidence=[Evidence(*e) for e in evidence],
            suggested_flags=dict(flags),
            gpus=list(gpus),
            engine=engine,
        )


class RuleMemo:
    """What each rule's last evaluation gave, per engine, while the names it read hold still
    (see "the rule memo" above). One per :class:`~kvdoctor.pipeline.Pipeline`; pass it to
    :func:`evaluate`. Bounded: the last context of at most ``max_engines`` engine ids (a
    snapshot of its variables and one entry per rule it evaluated); entries of a rule not
    evaluated in a cycle are dropped. Thread-safe: an evaluation that finds the memo in use by
    another thread evaluates without it."""

    def __init__(self, max_engines: int = 64) -> None:
        self.max_engines = max_engines
        self.lock = threading.Lock()
        #: engine id → (snapshot of its last variables, id(rule) → _Kept)
        self.engines: dict[str | None, _EngineMemo] = {}
        #: rules evaluated and rules replayed (kept results), over the memo's life
        self.evaluated = 0
        self.replayed = 0
        #: the last evaluation's causes and order of its findings (:func:`_link_and_sort`)
        self.order: _Order | None = None

    def clear(self) -> None:
        """Forget everything (the next evaluation evaluates every rule)."""
        with self.lock:
            self.engines.clear()
            self.order = None


#: (id(rule info), the functions) → whether the rule calls only shipped functions; bounded
_PURE: dict[tuple[int, int], tuple[_RuleInfo, Any, bool]] = {}


def _pure(info: _RuleInfo, functions: Any) -> bool:
    """Whether every function ``info``'s rule calls is, in ``functions``, the shipped one (a
    rule calling any other is never kept: it may not give the same result twice)."""
    key = (id(info), id(functions))
    hit = _PURE.get(key)
    if hit is not None and hit[0] is info and hit[1] is functions:
        return hit[2]
    pure = all(functions.get(c) is _PURE_FUNCTIONS.get(c) for c in info.calls)
    if len(_PURE) >= 4096:
        _PURE.clear()
    _PURE[key] = (info, functions, pure)
    return pure


def _finding_data(f: Finding) -> tuple[Any, ...]:
    return (
        f.severity,
        f.title,
        f.summary,
        tuple((e.fact, e.value, e.source) for e in f.evidence),
        tuple(f.suggested_flags.items()),
        tuple(f.gpus),
    )


def evaluate(
    rules: Iterable[Rule],
    contexts: Iterable[RuleContext],
    *,
    reference: bool = False,
    memo: RuleMemo | None = None,
) -> Evaluation:
    """Evaluate every rule over every context (one per engine).

    A rule whose ``needs`` (all) or ``needs_any`` (one of) inputs are absent from the context
    is :class:`Skipped` with the missing inputs. Findings are deduplicated by (rule, engine),
    keeping the worst severity, and sorted worst first. Never raises on run-time errors of
    expressions; they are listed in :attr:`Evaluation.errors`. ``reference``: evaluate with
    simpleeval instead of the compiled expressions (same result; tests and bench compare).
    ``memo``: a :class:`RuleMemo` kept across calls (a long-running face's): a rule whose
    names did not change since the last call for that engine is not evaluated again (the same
    result, errors included); ignored with ``reference``.
    """
    functions = _current_functions()
    evaluator: Any = None
    if reference:
        from simpleeval import EvalWithCompoundTypes

        evaluator = EvalWithCompoundTypes(functions=dict(functions), names={})
        # Attribute access is refused at load; refuse it at run time too, belt and braces.
        evaluator.nodes.pop(ast.Attribute, None)
        memo = None
    if memo is not None and not memo.lock.acquire(blocking=False):
        memo = None  # another thread's evaluation holds it
    try:
        return _evaluate(list(rules), contexts, functions, evaluator, memo)
    finally:
        if memo is not None:
            memo.lock.release()


class _EngineMemo:
    """One engine's part of a :class:`RuleMemo`: the ``snapshot`` of the names its kept
    results read, the ``kept`` results (id(rule) → :class:`_Kept`), and the ``plan`` made for
    the ``rules``, ``inputs`` and ``functions`` of its last context."""

    __slots__ = ("snapshot", "kept", "rules", "inputs", "functions", "plan")

    def __init__(
        self,
        snapshot: _Snapshot,
        kept: dict[int, _Kept],
        rules: list[Rule],
        inputs: frozenset[str],
        functions: Any,
        plan: _Plan,
    ) -> None:
        self.snapshot, self.kept, self.rules, self.inputs = snapshot, kept, rules, inputs
        self.functions, self.plan = functions, plan


#: a plan: the rules that run, each as (rule, its id(), what it reads, whether its results may
#: be kept: it calls only the shipped functions, see :func:`_pure`), and the rules skipped,
#: each as ((rule id, engine), its Skipped)
_Plan = tuple[list[tuple[Rule, int, _RuleInfo, bool]], list[tuple[tuple[str, str | None], Skipped]]]


def _plan(rules: list[Rule], inputs: Iterable[str], engine: str | None, functions: Any) -> _Plan:
    """The rules that run for ``engine`` (in order: each with its id(), what it reads and
    whether its result may be kept, :func:`_pure` over ``functions``; False when
    ``functions`` is None: no memo) and the rules skipped, with their :class:`Skipped`: a
    rule whose ``needs`` (all) or ``needs_any`` (one of) are absent from ``inputs``. The
    Skipped objects are made once per plan (reports only read them)."""
    runs: list[tuple[Rule, int, _RuleInfo, bool]] = []
    skips: list[tuple[tuple[str, str | None], Skipped]] = []
    for rule in rules:
        missing = [n for n in rule.needs if n not in inputs]
        if rule.needs_any and not any(n in inputs for n in rule.needs_any):
            missing.append("|".join(rule.needs_any))
        if missing:
            if all(k != (rule.id, engine) for k, _ in skips):  # a rule id given twice: the first
                skips.append(((rule.id, engine), Skipped(rule.id, missing, engine)))
            continue
        info = _rule_info(rule)
        runs.append((rule, id(rule), info, functions is not None and _pure(info, functions)))
    return runs, skips


class _Order:
    """The last call's ordering of a :class:`RuleMemo`: for the ``rules`` and the findings'
    ``keys`` ((rule id, engine, severity) in the order they were found), each one's
    ``caused_by`` (:func:`link_causes`) and the positions in :func:`sort_findings` order.
    Both are functions of those keys and the rules' families and ``explains`` alone."""

    __slots__ = ("rules", "keys", "causes", "order")

    def __init__(
        self,
        rules: list[Rule],
        keys: tuple[tuple[str, str | None, str], ...],
        causes: tuple[str | None, ...],
        order: tuple[int, ...],
    ) -> None:
        self.rules, self.keys, self.causes, self.order = rules, keys, causes, order


def _link_and_sort(rules: list[Rule], findings: list[Finding], memo: RuleMemo | None) -> list[Finding]:
    """:func:`link_causes` then :func:`sort_findings` of ``findings`` (fresh ones: only their
    ``caused_by`` is set); with a memo, the last call's result is reused when its rules are
    the same objects and its findings had the same keys."""
    if memo is None:
        link_causes(rules, findings)
        return sort_findings(findings)
    keys = tuple([(f.rule, f.engine, f.severity) for f in findings])
    last = memo.order
    if (
        last is not None
        and last.keys == keys
        and len(last.rules) == len(rules)
        and all(map(is_, last.rules, rules))
    ):
        for f, cause in zip(findings, last.causes, strict=True):
            if cause is not None:
                f.caused_by = cause
        return [findings[i] for i in last.order]
    link_causes(rules, findings)
    ordered = sort_findings(findings)
    position = {id(f): i for i, f in enumerate(findings)}
    memo.order = _Order(
        rules, keys, tuple([f.caused_by for f in findings]), tuple([position[id(f)] for f in ordered])
    )
    return ordered


def _evaluate(
    rules: list[Rule],
    contexts: Iterable[RuleContext],
    functions: _Functions,
    evaluator: Any,
    memo: RuleMemo | None,
) -> Evaluation:
    result = Evaluation()
    errors = result.errors
    found: dict[tuple[str, str | None], Finding] = {}
    skipped: dict[tuple[str, str | None], Skipped] = {}
    for ctx in contexts:
        engine = ctx.engine
        # the context's variables, read-only; the constants are found under them (_Names)
        base = ctx.variables
        changed: set[str] = set()
        kept: dict[int, _Kept] = {}
        now: dict[int, _Kept] = {}
        state = memo.engines.pop(engine, None) if memo is not None else None
        inputs = frozenset(ctx.inputs)
        if (
            state is not None
            and state.inputs == inputs
            and state.functions is functions
            and len(state.rules) == len(rules)
            and all(map(is_, state.rules, rules))
        ):
            plan = state.plan
        else:
            plan = _plan(rules, inputs, engine, functions if memo is not None else None)
        fresh = False  # a rule was evaluated (not replayed) for this context
        if state is not None:
            kept = state.kept
            changed, snapshot = _changes(state.snapshot, base)
        made: list[_Kept] = []  # the results evaluated (not replayed) this time
        runs, skips = plan
        if skipped:  # another context's: the first Skipped of a (rule, engine) stays
            for key, skip in skips:
                skipped.setdefault(key, skip)
        else:
            skipped.update(skips)
        for rule, rid, info, keep in runs:
            last = kept.get(rid)
            if (
                last is not None
                and last.rule is rule
                and last.functions is functions
                and changed.isdisjoint(last.reads)
            ):
                now[rid] = last
                memo.replayed += 1  # type: ignore[union-attr]
                if last.finding is None and not last.errors:
                    continue  # did not fire, nothing to report (most rules, most cycles)
                finding = last.replay(engine, errors)
            else:
                n_errors = len(errors)
                names: _Names
                if keep:  # the names it reads are noted (its memo entry's reads)
                    names = _ReadNames(rule.thresholds)
                    names.read = []
                else:  # the names it may read first, under its thresholds
                    keys = info.when_keys
                    values = list(map(base.get, keys, repeat(_ABSENT)))
                    if any(map(is_, values, repeat(_ABSENT))):  # a name the context lacks
                        names = _Names({n: base[n] for n in keys if n in base})
                    else:
                        names = _Names(zip(keys, values, strict=True))
                    names.update(rule.thresholds)
                names.base = base
                names.missing = set()
                run: _Runner
                if evaluator is None:
                    run = _Runner(names, functions, rule, engine, errors)
                else:
                    run = _ReferenceRunner(names, functions, rule, engine, errors)
                    run.evaluator = evaluator
                # a rule evaluated again re-evaluates only the steps whose names changed
                last_trace = (
                    last.trace
                    if keep and last is not None and last.rule is rule and last.functions is functions
                    else None
                )
                finding, trace, reads = _evaluate_rule(run, names, base, info, last_trace, changed)
                if names.missing:
                    errors.append(
                        EvalError(
                            rule.id,
                            engine,
                            "names",
                            f"not provided, read as None: {', '.join(sorted(names.missing))}",
                        )
                    )
                if memo is not None:
                    memo.evaluated += 1
                    fresh = True
                    if keep:
                        now[rid] = _Kept(
                            rule,
                            functions,
                            reads,
                            tuple([(e.where, e.message) for e in errors[n_errors:]])
                            if len(errors) > n_errors
                            else (),
                            None if finding is None else _finding_data(finding),
                            # reused only from an evaluation without errors (_evaluate_rule)
                            None if names.missing or len(errors) > n_errors else trace,
                        )
                        made.append(now[rid])
            if finding is None:
                continue
            key = (rule.id, engine)
            prev = found.get(key)
            if prev is None or SEVERITY_ORDER[finding.severity] > SEVERITY_ORDER[prev.severity]:
                found[key] = finding
        if memo is not None:
            # the names the kept results read, with their values now, for the next comparison
            # (names no kept result reads any more stay: a superset only costs a comparison)
            if state is None or (fresh and not all(k.reads <= snapshot.watched for k in made)):
                watch = tuple(frozenset().union(*(k.reads for k in now.values())))
                snapshot = _snapshot(watch, list(map(base.get, watch, repeat(_ABSENT))))
            while len(memo.engines) >= memo.max_engines:
                del memo.engines[next(iter(memo.engines))]
            memo.engines[engine] = _EngineMemo(snapshot, now, rules, inputs, functions, plan)
    result.findings = _link_and_sort(rules, list(found.values()), memo)
    # A rule that fired for an engine is not also "skipped" for it.
    result.skipped = [s for k, s in skipped.items() if k not in found]
    return result
