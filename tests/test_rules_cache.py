"""The compiled-rules disk cache (issue 8, class 10): a second process reads the rules from it,
a changed rule file or another key is never served from it, and a cache that is corrupt,
foreign, not private or names any code is ignored (the rules are parsed again)."""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
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


def _dump(rules: list[RE.Rule]) -> list[tuple[str, ...]]:
    # rules compare by their compiled expressions' structure (ast nodes compare by identity)
    out = []
    for r in rules:
        exprs = tuple(ast.dump(e.node) for e in RE._all_exprs(r))
        out.append((r.id, r.family, r.severity, r.path, repr(sorted(r.thresholds.items())), *exprs))
    return out


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
    files = list(cache.glob("rules-*.pickle"))
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
    assert len(list(cache.glob("rules-*.pickle"))) == 2


def test_invalid_rules_are_never_cached(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    (d / "broken.yaml").write_text("id: broken\nfamily: K\n")
    for _ in range(2):  # the second load fails the same way: nothing cached the error away
        with pytest.raises(RE.RuleFileError):
            _load(d)
    assert not list(cache.glob("rules-*.pickle"))


@pytest.mark.parametrize(
    "corrupt",
    [
        b"",
        b"not a pickle",
        pickle.dumps(("another key", ())),
        # a pickle naming code: refused by the restricted unpickler, never run
        b"cos\nsystem\n(S'touch /tmp/kvdoctor-pwned'\ntR.",
    ],
    ids=["empty", "garbage", "other-key", "code"],
)
def test_a_bad_cache_file_is_ignored(cache: Path, tmp_path: Path, corrupt: bytes) -> None:
    d = _copy_rules(tmp_path)
    want = _dump(_load(d))
    (f,) = cache.glob("rules-*.pickle")
    f.write_bytes(corrupt)
    assert _dump(_load(d)) == want  # parsed again
    assert not Path("/tmp/kvdoctor-pwned").exists()


def test_a_cache_others_can_write_is_not_read(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _copy_rules(tmp_path)
    _load(d)
    (f,) = cache.glob("rules-*.pickle")
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
    assert len(list(cache.glob("rules-*.pickle"))) == 3


def test_a_cache_with_an_expression_no_rule_file_allows_is_ignored(cache: Path, tmp_path: Path) -> None:
    d = _copy_rules(tmp_path)
    want = _dump(_load(d))
    (f,) = cache.glob("rules-*.pickle")
    key, rules = pickle.loads(f.read_bytes())
    first = rules[0]
    # what a rule file cannot contain: attribute access (compile_expr refuses it)
    bad = RE.Expr(
        "x.__class__", ast.parse("x.__class__", mode="eval").body, "when", 1, frozenset({"x"}), frozenset()
    )
    tampered = (RE.replace(first, when=bad), *rules[1:])
    f.write_bytes(pickle.dumps((key, tampered)))
    assert RE._disk_cache_get(RE._rules_key([d], True, variable_catalogue())) is None
    assert _dump(_load(d)) == want  # parsed again from the files
