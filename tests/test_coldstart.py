"""Cold start of ``kvdoctor diagnose --bundle`` (issue 8, class 10): what the path must not
import, and the cheap stand-ins it uses behaving exactly like what they replace.

Timings are bench/coldstart.py's (figures, no asserts); these tests keep the gains from
silently regressing: a module import added back at the top of a file fails here.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvdoctor.facts import LogEvent

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = ROOT / "tests" / "data" / "bundles"
CASE = BUNDLES / "r01-healthy-busy-tp2-h100"

#: modules ``diagnose --bundle DIR --format json`` has no use for: the live machinery, the faces'
#: libraries, the helpers only a rarer input needs (strptime's regex tables, importlib.resources)
NOT_IMPORTED = (
    "kvdoctor.sampler",
    "kvdoctor.sources.nvml",
    "kvdoctor.watch",
    "kvdoctor.sidecar",
    "rich",
    "textual",
    "pynvml",
    "psutil",
    "httpx",
    "concurrent.futures",
    "_strptime",
    "difflib",
)
# (importlib.metadata, which finds the rules of the kvdoctor.rules entry-point group, imports
# importlib.resources, tempfile and textwrap: a start pays for them since rules are plugins)

_PROBE = """
import json, sys
from kvdoctor.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
sys.stderr.write("\\nMODULES " + json.dumps([code, sorted(sys.modules)]) + "\\n")
"""


def _modules_after(tmp_path: Path, *args: str) -> tuple[int, set[str], str]:
    """Exit code, ``sys.modules`` at exit and stdout of ``kvdoctor ARGS`` in a fresh interpreter."""
    env = {**os.environ, "KVDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVDOCTOR_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES "))
    code, mods = json.loads(line[len("MODULES ") :])
    return code, set(mods), proc.stdout


def _loaded(mods: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if n in mods or any(m.startswith(n + ".") for m in mods))


@pytest.mark.parametrize("case", ["r01-healthy-busy-tp2-h100", "c2-cumem-oom-at-startup-not-wake"])
def test_diagnose_bundle_json_imports_nothing_it_does_not_need(tmp_path: Path, case: str) -> None:
    code, mods, out = _modules_after(
        tmp_path, "diagnose", "--bundle", str(BUNDLES / case), "--format", "json"
    )
    assert code in (0, 1, 2) and json.loads(out)["findings"] is not None
    assert _loaded(mods, NOT_IMPORTED) == []


def test_the_probe_sees_an_import_when_there_is_one(tmp_path: Path) -> None:
    # the text format renders with rich: the same probe sees it (else the test above proves nothing)
    code, mods, out = _modules_after(tmp_path, "diagnose", "--bundle", str(CASE))
    assert code in (0, 1, 2) and out
    assert "rich" in _loaded(mods, NOT_IMPORTED)
    assert "kvdoctor.sources.bundle" in mods and "kvdoctor.rulekit" in mods


# --------------------------------------------------------------------------- lazy regexes


def test_lazy_pattern_compiles_on_first_use_and_then_is_the_compiled_pattern() -> None:
    from kvdoctor.lazyre import LazyPattern, lazy_re

    p = lazy_re(r"(?P<n>\d+) GiB", re.I)
    assert isinstance(p, LazyPattern) and "_compiled" not in vars(p)
    assert p.pattern == r"(?P<n>\d+) GiB" and p.flags == re.I
    m = p.search("took 12 gib")
    assert m is not None and m.group("n") == "12"
    # after the first use the methods are the compiled pattern's own (no wrapper frame)
    assert p.compiled is re.compile(r"(?P<n>\d+) GiB", re.I)
    assert p.match == p.compiled.match and p.sub == p.compiled.sub
    assert p.groups == 1 and p.groupindex == {"n": 1}


@pytest.mark.parametrize(
    "method", ["match", "search", "fullmatch", "finditer", "findall", "sub", "subn", "split"]
)
def test_every_lazy_method_reads_like_the_compiled_one_on_its_first_call(method: str) -> None:
    from kvdoctor.lazyre import lazy_re

    text = "a1 b22 c333"
    args: tuple[object, ...] = (
        (lambda m: "<" + m.group(0) + ">", text) if method in ("sub", "subn") else (text,)
    )
    want = getattr(re.compile(r"\d+"), method)(*args)
    got = getattr(lazy_re(r"\d+"), method)(*args)
    if method == "finditer":
        want, got = [m.span() for m in want], [m.span() for m in got]
    elif method in ("match", "search", "fullmatch"):
        want, got = want and want.span(), got and got.span()
    assert got == want


def test_a_bad_lazy_pattern_fails_at_first_use() -> None:
    from kvdoctor.lazyre import lazy_re

    p = lazy_re(r"(unclosed")
    with pytest.raises(re.error):
        p.search("x")


def test_a_bundle_compiles_only_the_patterns_its_input_reaches() -> None:
    # a subprocess: this test process has compiled every pattern already (regex hygiene)
    code = (
        "from kvdoctor.lazyre import LazyPattern\n"
        "import gc\n"
        "from kvdoctor.inputs import InputOptions, open_feed\n"
        "from pathlib import Path\n"
        f"open_feed(InputOptions(bundle=Path({str(CASE)!r})))\n"
        "ps = [o for o in gc.get_objects() if isinstance(o, LazyPattern)]\n"
        "print(len(ps), sum('_compiled' in vars(p) for p in ps))\n"
        "from kvdoctor.sources import log_catalogue2, dmesg\n"
        "print(sum('_compiled' in vars(p) for p in log_catalogue2._RE.values() if isinstance(p, LazyPattern)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    (total, compiled), (cat2,) = ([int(x) for x in ln.split()] for ln in out.stdout.splitlines())
    assert total > 80 and 0 < compiled < total // 2
    # the log holds no catalogue-2 line but the engine-init one: its gates keep the rest uncompiled
    assert cat2 <= 1


# --------------------------------------------------------------------------- strptime stand-ins


_DATES = [
    "Sat Aug 26 09:14:38 2023",
    "Tue Dec  1 17:47:54 2026",
    "  Mon Jan 01 00:00:00 2024  ",
    "Thu Feb 29 23:59:59 2024",
    "Wed Feb 29 12:00:00 2023",  # not a leap year
    "Sun Sep 31 10:00:00 2023",
    "Fri Mar 3 7:5:9 2023",
    "Fri Mar 03 24:00:00 2023",
    "Fri Mar 03 10:60:00 2023",
    "Fri Mar 03 10:00:00 23",
    "fri mar 03 10:00:00 2023",
    "Fri Mar 03 10:00 2023",
    "Fri Mar 03 10:00:00:00 2023",
    "Fri Mar 003 10:00:00 2023",
    "Fri Mar ３ 10:00:00 2023",
    "Friday March 03 10:00:00 2023",
    "Fri Mar 03 10:00:00 2023 extra",
    "NVIDIA-SMI 550.54.15",
    "",
    "Fri Mar -3 10:00:00 2023",
]


def _strptime_date(line: str) -> float | None:
    try:
        dt = datetime.strptime(line.strip(), "%a %b %d %H:%M:%S %Y")
    except ValueError:
        return None
    return dt.replace(tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("line", _DATES)
def test_nvidia_smi_date_line_reads_as_strptime_reads_it(line: str) -> None:
    from kvdoctor.sources.nvidia_smi import _parse_date

    assert _parse_date(line) == _strptime_date(line)


@pytest.mark.parametrize(
    "when",
    [
        "07-01 09:12:43",
        "02-29 23:59:59",
        "02-30 10:00:00",
        "13-01 00:00:00",
        "07-01 24:00:00",
        "07-01 09:12:4x",
        "07-01T09:12:43",
        "",
        None,
    ],
)
def test_log_event_time_reads_as_strptime_reads_it(when: str | None) -> None:
    # LogEvent.time is the log header's "MM-DD HH:MM:SS" (vllm_log._LEVEL_RE: two digits each)
    # LogEvent.time is the log header's "MM-DD HH:MM:SS" (vllm_log._LEVEL_RE: two digits each)
    from kvdoctor.derive.requests import _seconds

    try:
        want: float | None = datetime.strptime("2000-" + (when or "")[:14], "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        want = None
    assert _seconds(LogEvent(kind="request", line=1, text="", time=when)) == (want if when else None)


# --------------------------------------------------------------------------- finite feeds


def test_read_to_end_reads_a_finite_feed_as_the_live_loop_does(tmp_path: Path) -> None:
    from kvdoctor.feeds import MAX_LEN, TimelineFeed, read_to_end
    from kvdoctor.sampler import LiveLoop
    from kvdoctor.sampler import TimelineFeed as ReExported
    from kvdoctor.sources.bundle import load_bundle
    from kvdoctor.sources.recording import RecordingWriter, open_recording

    assert ReExported is TimelineFeed
    assert inspect.signature(LiveLoop).parameters["max_len"].default == MAX_LEN
    snaps = load_bundle(BUNDLES / "c2-dp-engine-load-skew-dp8-v014").timeline.snapshots
    assert len(snaps) > 2
    for max_len in (MAX_LEN, 2):
        want = LiveLoop(TimelineFeed(snaps), max_len=max_len).collect(5.0).snapshots
        assert read_to_end(TimelineFeed(snaps), max_len=max_len).snapshots == want
    path = tmp_path / "r.jsonl"
    with RecordingWriter(path) as w:
        for snap in snaps:
            w.write(snap)
    for max_len in (MAX_LEN, 2):
        feed = open_recording(path)
        want = LiveLoop(feed, max_len=max_len).collect(5.0).snapshots
        feed.close()
        feed = open_recording(path)
        got = read_to_end(feed, max_len=max_len).snapshots
        feed.close()
        assert [s.timestamp for s in got] == [s.timestamp for s in want] and len(got) == min(
            max_len, len(snaps)
        )
        assert got == want


def test_read_to_end_refuses_a_live_feed() -> None:
    from kvdoctor.feeds import read_to_end

    class Live:
        live = True

    with pytest.raises(ValueError, match="LiveLoop"):
        read_to_end(Live())


# --------------------------------------------------------------------------- garbage collector


def test_importing_the_cli_leaves_the_garbage_collector_alone() -> None:
    # a process that imports kvdoctor (vLLM with the stat-logger plugin, the tests) keeps its own
    code = "import gc; before = gc.get_threshold(); import kvdoctor.cli; print(gc.get_threshold() == before)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"


def test_a_cold_diagnose_runs_no_collection_and_exits_with_its_code(tmp_path: Path) -> None:
    from kvdoctor.cli import GC_THRESHOLD0

    code = (
        "import gc, sys\n"
        "runs = []\n"
        "from kvdoctor.cli import main\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and runs.append(info['generation']))\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    sys.stderr.write(f'\\nGC {len(runs)} {gc.get_threshold()[0]} {gc.get_freeze_count() > 0} {e.code}\\n')\n"
    )
    env = {**os.environ, "KVDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    args = ["diagnose", "--bundle", str(CASE), "--format", "json"]
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
        )
        _, runs, threshold, frozen, rc = next(
            ln for ln in proc.stderr.splitlines() if ln.startswith("GC ")
        ).split()
        assert (int(runs), int(threshold), frozen) == (0, GC_THRESHOLD0, "True")
        assert int(rc) == proc.returncode and json.loads(proc.stdout)["findings"] is not None


# --------------------------------------------------------------------------- dataclass methods


def _shared_classes() -> list[type]:
    import dataclasses
    import importlib
    import pkgutil

    import kvdoctor

    out = []
    for info in pkgutil.walk_packages(kvdoctor.__path__, "kvdoctor."):
        if info.name.startswith(("kvdoctor.watch", "kvdoctor.integrations", "kvdoctor.__main__")):
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and obj.__module__ == mod.__name__
                and dataclasses.is_dataclass(obj)
                and getattr(obj.__eq__, "__module__", None) == "kvdoctor.dcmethods"
            ):
                out.append(obj)
    return sorted(out, key=lambda c: f"{c.__module__}.{c.__qualname__}")


SHARED = _shared_classes()


def test_the_facts_and_the_path_classes_share_their_methods() -> None:
    names = {c.__qualname__ for c in SHARED}
    assert {"Snapshot", "Gpu", "LogEvent", "EngineConfig", "Finding", "Report", "InputOptions"} <= names
    assert {"Flag", "KvCapacity", "GpuSpec", "Family"} <= names  # frozen ones
    assert len(SHARED) >= 32


@pytest.mark.parametrize("cls", SHARED, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_shared_methods_behave_as_the_generated_ones(cls: type) -> None:
    import copy
    import dataclasses

    fields = dataclasses.fields(cls)
    frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    twin = dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, f.type, dataclasses.field(repr=f.repr, compare=f.compare, hash=f.hash)) for f in fields],
        frozen=frozen,
    )
    twin.__qualname__ = cls.__qualname__
    vals: dict[str, object] = {f.name: f"v{i}" for i, f in enumerate(fields)}
    a, t = cls(**vals), twin(**vals)
    assert repr(a) == repr(t)
    assert a == cls(**vals) and not (a != cls(**vals)) and a == copy.copy(a)
    assert a.__eq__(t) is NotImplemented and (a == t) is False and (a == object()) is False
    for f in fields:
        other = dataclasses.replace(a, **{f.name: "changed"})
        assert (other == a) is (not f.compare) is (dataclasses.replace(t, **{f.name: "changed"}) == t)
    if frozen:
        assert hash(a) == hash(t) == hash(cls(**vals))
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(a, fields[0].name, "x")
    else:
        with pytest.raises(TypeError):
            hash(a)
    # an object that is itself equal: the fields compare as one tuple (identity first), NaN too
    nan = float("nan")
    first = fields[0].name
    a2, t2 = dataclasses.replace(a, **{first: nan}), dataclasses.replace(t, **{first: nan})
    assert (a2 == dataclasses.replace(a2)) is (t2 == dataclasses.replace(t2))
    # a field that refers back to the object prints "..." rather than recursing
    shown = next((f.name for f in fields if f.repr), None)
    if shown is not None:
        object.__setattr__(a, shown, a)
        object.__setattr__(t, shown, t)
        assert repr(a) == repr(t) and "..." in repr(a)


def test_shared_methods_refuses_a_class_with_generated_ones() -> None:
    import dataclasses

    from kvdoctor.dcmethods import shared_methods

    @dataclasses.dataclass
    class Plain:
        x: int

    with pytest.raises(TypeError, match="repr=False, eq=False"):
        shared_methods(Plain)
