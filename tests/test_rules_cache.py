"""The compiled-rules disk cache (issue 8, class 10): a second process reads the rules from it,
a changed rule file or another key is never served from it, and a cache that is corrupt,
truncated, foreign, not private or holds code compile_expr would not make is ignored (the rules
are parsed again)."""

from __future__ import annotations

import dataclasses
import marshal
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvdoctor import rules_engine as RE
from kvdoctor.pipeline import variable_catalogue

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "rules"
#: rule files that name no other rule (``explains:``): any subset of them loads
_STANDALONE = [f for f in sorted(RULES.glob("*.yaml")) if "explains:" not in f.read_text()]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv(RE.ENV_CACHE_DIR, str(d))
    RE._RULES_CACHE.clear()
    return d


#: fields holding expressions or templates (compared through their parts: sets have no fixed repr)
_EXPRESSION_FIELDS = {"title", "summary", "evidence", "when", "let", "severity_if", "fix", "gpus"}


def _dump(rules: list[RE.Rule]) -> list[tuple[object, ...]]:
    # rules compare field by field, each expression by its source, where, names and its
    # code object (compared by value: the code a load serves is exactly the code a parse makes)
    out = []
    for r in rules:
        exprs = tuple(
            (e.source, e.where, e.line, sorted(e.names), sorted(e.calls), e.code) for e in RE._all_exprs(r)
        )
        plain = tuple(repr(getattr(r, f)) for f in RE._RULE_FIELDS if f not in _EXPRESSION_FIELDS)
        templates = tuple(
            (t.source, tuple(p if isinstance(p, str) else p[1] for p in t.parts))
            for t in (r.title, r.summary, *(x for e in r.evidence for x in (e.fact, e.value, e.source)))
        )
        keys = ([n for n, _ in r.let], [s for _, s in r.severity_if], [k for k, _ in r.fix])
        out.append((*plain, *templates, *exprs, repr(keys)))
    return out


def _files(cache: Path) -> list[Path]:
    return list(cache.glob(f"rules-*{RE._CACHE_SUFFIX}"))


def _write(f: Path, payload: bytes) -> None:
    """A cache file around ``payload`` with the right magic and CRC."""
    f.write_bytes(RE._CACHE_MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload)


def _read(f: Path) -> tuple[str, tuple[tuple[object, ...], ...]]:
    key, rules = marshal.loads(f.read_bytes()[len(RE._CACHE_MAGIC) + 4 :])
    return key, rules


def _copy_rules(tmp_path: Path, n: int = 3) -> Path:
    d = tmp_path / "rules"
    d.mkdir()
    for f in _STANDALONE[:n]:
        (d / f.name).write_bytes(f.read_bytes())
    return d


def _load(d: Path) -> list[RE.Rule]:
    RE._RULES_CACHE.clear()  # a new process: only the disk cache remains
    return RE.load_rules([d], known_names=variable_catalogue())


def test_second_load_comes_from_disk_and_equals_a_parse(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _copy_rules(tmp_path)
    first = _load(d)
    files = _files(cache)
    assert len(files) == 1
    assert oct(files[0].stat().st_mode & 0o777) == "0o600" and oct(cache.stat().st_mode & 0o777) == "0o700"

    def no_parse(*a: object, **k: object) -> None:
        raise AssertionError("parsed although cached")

    monkeypatch.setattr(RE, "_load_rules_uncached", no_parse)
    second = _load(d)
    assert _dump(second) == _dump(first) and len(second) == 3


def test_a_changed_rule_file_is_parsed_again(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    before = _load(d)
    f = sorted(d.glob("*.yaml"))[0]
    lines = f.read_text().splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith("title:"))
    lines[i] = "title: A changed title"
    f.write_text("\n".join(lines) + "\n")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    after = _load(d)
    assert before[0].title.source != "A changed title"
    assert after[0].title.source == "A changed title"
    assert len(_files(cache)) == 2


def test_invalid_rules_are_never_cached(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    (d / "broken.yaml").write_text("id: broken\nfamily: K\n")
    for _ in range(2):  # the second load fails the same way: nothing cached the error away
        with pytest.raises(RE.RuleFileError):
            _load(d)
    assert not _files(cache)


def _corrupt(kind: str, good: bytes) -> bytes:
    head = len(RE._CACHE_MAGIC) + 4
    if kind == "empty":
        return b""
    if kind == "garbage":
        return b"not a cache file"
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "bit-flip":  # the CRC no longer matches
        i = head + (len(good) - head) // 2
        return good[:i] + bytes([good[i] ^ 0x10]) + good[i + 1 :]
    payload = marshal.dumps(("another key", ())) if kind == "other-key" else b"\x00\x01junk"
    return RE._CACHE_MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated", "bit-flip", "other-key", "not-marshal"])
def test_a_bad_cache_file_is_ignored(cache: Path, tmp_path: Path, kind: str) -> None:
    d = _copy_rules(tmp_path)
    want = _dump(_load(d))
    (f,) = _files(cache)
    f.write_bytes(_corrupt(kind, f.read_bytes()))
    assert RE._disk_cache_get(RE._rules_key([d], True, variable_catalogue())) is None
    assert _dump(_load(d)) == want  # parsed again
    assert RE._disk_cache_get(RE._rules_key([d], True, variable_catalogue())) is not None  # and rebuilt


def test_a_cache_others_can_write_is_not_read(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _copy_rules(tmp_path)
    _load(d)
    (f,) = _files(cache)
    calls = []
    real = RE._load_rules_uncached

    def counting(*a: object, **k: object) -> list[RE.Rule]:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(RE, "_load_rules_uncached", counting)
    f.chmod(0o666)
    _load(d)
    f.chmod(0o600)
    cache.chmod(0o777)
    _load(d)
    cache.chmod(0o700)
    _load(d)
    assert len(calls) == 2  # the group/world-writable file, then directory, were not trusted


def test_an_unwritable_or_disabled_cache_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _copy_rules(tmp_path)
    monkeypatch.setenv(RE.ENV_CACHE_DIR, "")
    assert len(_load(d)) == 3
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(RE.ENV_CACHE_DIR, str(blocker / "sub"))  # cannot be made
    assert len(_load(d)) == 3


def test_the_cache_key_is_the_same_in_every_process(cache: Path) -> None:
    # sets in the key are canonical: string hashing differs per process
    code = (
        "from kvdoctor import rules_engine as R; from kvdoctor.pipeline import variable_catalogue;"
        "k = R._rules_key([R.default_rules_dir()], False, variable_catalogue()); print(R._cache_file(k)[0].name)"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(names) == 1 and next(iter(names)).startswith("rules-")


def test_cache_files_are_bounded(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RE, "_CACHE_MAX_FILES", 3)
    for i in range(6):
        d = tmp_path / f"set{i}"
        d.mkdir()
        f = _STANDALONE[i]
        (d / f.name).write_bytes(f.read_bytes())
        _load(d)
    assert len(_files(cache)) == 3


def _tamper_when(f: Path, code: object) -> None:
    """Rewrite the cache file with the first rule's ``when`` compiled to ``code`` (a valid
    file otherwise: magic, CRC and key all right)."""
    key, rules = _read(f)
    first = list(rules[0])
    when = list(first[RE._RULE_FIELDS.index("when")])  # type: ignore[arg-type]
    when[-1] = code
    first[RE._RULE_FIELDS.index("when")] = tuple(when)
    _write(f, marshal.dumps((key, (tuple(first), *rules[1:]))))


@pytest.mark.parametrize(
    "src",
    [
        "x.__class__",  # attribute access: compile_expr refuses it
        "__import__('os').system('touch /tmp/kvdoctor-pwned')",  # a builtin, an attribute
        "open('/tmp/kvdoctor-pwned', 'w')",  # a global no compiled expression names
    ],
)
def test_cached_code_no_rule_file_makes_is_never_run(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: str
) -> None:
    d = _copy_rules(tmp_path)
    parsed = _load(d)
    (f,) = _files(cache)
    evil = compile(f"lambda __n, __f: {src}", "x", "eval").co_consts[0]
    _tamper_when(f, marshal.dumps(evil))
    monkeypatch.setattr(RE, "_load_rules_uncached", lambda *a, **k: pytest.fail("parsed"))
    cached = _load(d)  # the file is well formed: its code is checked when first used
    variables = {n: 1 for n in variable_catalogue()}
    ctx = [RE.RuleContext(engine=None, variables=variables, inputs={"log", "metrics", "config", "gpus"})]
    got, want = RE.evaluate(cached, ctx), RE.evaluate(parsed, ctx)
    assert cached[0].when.code is None  # refused: simpleeval evaluated the source instead
    assert [x.to_dict() for x in got.findings] == [x.to_dict() for x in want.findings]
    assert [str(e) for e in got.errors] == [str(e) for e in want.errors]
    assert not Path("/tmp/kvdoctor-pwned").exists()


def test_a_cache_holding_a_code_object_where_bytes_belong_is_ignored(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    want = _dump(_load(d))
    (f,) = _files(cache)
    _tamper_when(f, compile("lambda __n, __f: 1", "x", "eval").co_consts[0])
    assert RE._disk_cache_get(RE._rules_key([d], True, variable_catalogue())) is None
    assert _dump(_load(d)) == want  # parsed again from the files


def test_a_cache_of_another_shape_is_ignored(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    want = _dump(_load(d))
    (f,) = _files(cache)
    key, rules = _read(f)
    for bad in (
        (rules[0][:-1], *rules[1:]),  # a field short
        (tuple(["x" if i == 1 else v for i, v in enumerate(rules[0])]), *rules[1:]),  # family "x"
        ("not a rule",),
    ):
        _write(f, marshal.dumps((key, bad)))
        assert RE._disk_cache_get(RE._rules_key([d], True, variable_catalogue())) is None
    assert _dump(_load(d)) == want


def test_the_cache_stores_every_field_of_a_rule() -> None:
    # a field added to Rule and not to the cache would be lost on a cached load
    assert RE._RULE_FIELDS == tuple(f.name for f in dataclasses.fields(RE.Rule))


def test_rules_from_the_cache_evaluate_as_parsed_ones(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path, n=len(_STANDALONE))
    parsed = _load(d)
    cached = _load(d)
    assert cached is not parsed and _files(cache)
    ctx = RE.RuleContext(engine="e0", variables={n: None for n in variable_catalogue()}, inputs={"log"})

    def run(rules: list[RE.Rule]) -> tuple[object, ...]:
        ev = RE.evaluate(rules, [ctx])
        return ([f.to_dict() for f in ev.findings], [str(e) for e in ev.errors], len(ev.skipped))

    assert run(cached) == run(parsed)


def test_writing_the_cache_removes_the_pickles_of_the_former_format(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    cache.mkdir(mode=0o700)
    old = cache / "rules-0123abcd000100.pickle"
    old.write_bytes(b"\x80\x05N.")
    _load(d)
    assert _files(cache) and not old.exists()
