"""Hostile input, faults and big logs (issue 27): what a fresh fuzz and a fault soak broke.

One section per item of the issue. Each failure has a seed in ``tests/data/hostile`` that the
fuzz harness (tests/fuzz_harness.py) mutates too.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.facts import SourceError

DATA = Path(__file__).parent / "data"
HOSTILE = DATA / "hostile"
HEALTHY = DATA / "bundles" / "healthy-idle-gmu092"


def run(*args: str) -> tuple[int, str, str]:
    """The CLI in-process; an exception escaping a command fails the test (the real entry point
    would turn it into "internal error")."""
    r = CliRunner().invoke(cli, list(args))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def sources_of(out: str) -> list[dict[str, str]]:
    return json.loads(out)["sources"]


# --------------------------------------------------------------------------- 1. one odd line


@pytest.mark.parametrize("seed", ["args-list-restart.log", "namespace-list-restart.log"])
def test_list_valued_identity_args_in_a_restart_keep_the_diagnosis(seed: str) -> None:
    # 'served_model_name': ['qwen3'] (vLLM's nargs='+') in the second run's args dump once ended
    # the run with "internal error (TypeError)"
    code, out, _ = run("diagnose", "--log", str(HOSTILE / seed), "--format", "json")
    assert code in (0, 1, 2, 3)
    log = next(s for s in sources_of(out) if s["kind"] == "log")
    assert log["status"] == "ok"


def test_served_model_name_list_is_its_first_name() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    log = parse_log((HOSTILE / "args-list-restart.log").read_text())
    args = [e.values["args"] for e in log.events if e.kind == "args"]
    assert args[-1]["served_model_name"] == "qwen3"
    # near miss: a plain string stays as it is
    one = parse_log(
        "INFO 11-29 17:58:01 [a.py:1] non-default args: {'served_model_name': 'q', 'port': 8001}\n"
    )
    assert [e.values["args"] for e in one.events if e.kind == "args"][0] == {
        "served_model_name": "q",
        "port": 8001,
    }


def test_namespace_identity_that_is_no_scalar_is_dropped_not_fatal() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    log = parse_log((HOSTILE / "namespace-list-restart.log").read_text())
    last = [e.values["args"] for e in log.events if e.kind == "args"][-1]
    assert last["served_model_name"] == "qwen3" and "port" not in last and "host" not in last
    assert last["max_model_len"] == 8192


def test_recording_with_one_deeply_nested_line_loses_only_that_line(tmp_path: Path) -> None:
    code, out, _ = run(
        "diagnose", "--recording", str(HOSTILE / "recording-nested-line.jsonl"), "--format", "json"
    )
    rec = next(s for s in sources_of(out) if s["kind"] == "recording")
    assert (
        rec["status"] == "ok"
        and "1 unreadable line" in rec["detail"]
        and "nested too deeply" in rec["detail"]
    )
    assert code in (0, 1, 2)
    # the same line as a Snapshot line (not a state line)
    lines = (HOSTILE / "recording-nested-line.jsonl").read_text().splitlines()
    nested = '{"timestamp": 1.0, "metrics": ' + "[" * 1000 + "]" * 1000 + "}"
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join([lines[0], *lines[2:], nested]) + "\n")
    code, out, _ = run("diagnose", "--recording", str(p), "--format", "json")
    rec = next(s for s in sources_of(out) if s["kind"] == "recording")
    assert rec["status"] == "ok" and "2 snapshot(s)" in rec["detail"]


def test_version_of_thousands_of_digits_is_no_version() -> None:
    from kvdoctor.sources.vllm_log import parse_log
    from kvdoctor.vllm_flags import parse_version

    assert parse_version("0." + "1" * 4400) is None
    assert parse_version("0.1234567890") is None
    # near misses: every real spelling still parses
    assert parse_version("0.10.2+cu128") == (0, 10, 2)
    assert parse_version("v0.11.0rc1") == (0, 11, 0)
    assert parse_version("0.6.3.post1") == (0, 6, 3)
    log = parse_log((HOSTILE / "version-4400-digits.log").read_text())
    assert log.vllm_version is None and any(e.kind == "args" for e in log.events)
    code, out, _ = run("diagnose", "--log", str(HOSTILE / "version-4400-digits.log"), "--format", "json")
    assert next(s for s in sources_of(out) if s["kind"] == "log")["status"] == "ok"


def test_a_pid_of_thousands_of_digits_costs_its_line() -> None:
    # "(APIServer pid=999…) …": int() of it raised outside the matcher's guard and the whole log
    # was "unreadable input"
    from kvdoctor.sources.vllm_log import parse_log

    text = (HOSTILE / "pid-5000-digits.log").read_text()
    log = parse_log(text)
    assert log.line_count == text.count("\n") and any(e.kind == "args" for e in log.events)
    code, out, _ = run("diagnose", "--log", str(HOSTILE / "pid-5000-digits.log"), "--format", "json")
    assert next(s for s in sources_of(out) if s["kind"] == "log")["status"] == "ok"


def test_plan_refuses_a_version_it_cannot_compare() -> None:
    code, _, err = run("plan", "Qwen/Qwen3-8B", "--gpu", "H100", "--vllm-version", "0." + "9" * 5000)
    assert code != 0 and ("not a vLLM version" in err or "unknown --vllm-version" in err)
    assert "9" * 100 not in err


# --------------------------------------------------------------------------- 2. time bounded


def test_yaml_alias_bomb_as_config_is_refused(tmp_path: Path) -> None:
    bomb = HOSTILE / "yaml-alias-bomb.yaml"
    code, out, _ = run("diagnose", "--cmdline", f"vllm serve m --config {bomb}", "--format", "json")
    errors = [s["detail"] for s in sources_of(out) if s["kind"] == "cmdline" and s["status"] == "error"]
    assert any("YAML aliases" in d for d in errors), errors


def test_yaml_alias_bomb_as_engine_args_is_refused(tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(HEALTHY, b)
    (b / "cmdline.txt").unlink()
    shutil.copy(HOSTILE / "yaml-alias-bomb.yaml", b / "engine-args.yaml")
    t0 = time.process_time()
    code, out, _ = run("diagnose", "--bundle", str(b), "--format", "json")
    assert time.process_time() - t0 < 10
    cmd = [s for s in sources_of(out) if s["kind"] == "cmdline"]
    assert cmd and cmd[0]["status"] == "error" and "YAML aliases" in cmd[0]["detail"]


def test_yaml_without_aliases_still_reads(tmp_path: Path) -> None:
    from kvdoctor.sources.limits import load_yaml_bounded

    assert load_yaml_bounded("max-model-len: 4096\nenable-prefix-caching: true\n", "c.yaml") == {
        "max-model-len": 4096,
        "enable-prefix-caching": True,
    }
    with pytest.raises(SourceError, match="not valid YAML"):
        load_yaml_bounded("a: [\n", "c.yaml")


def test_nvidia_smi_gpu_name_padded_with_spaces_parses_in_linear_time() -> None:
    from kvdoctor.sources.nvidia_smi import parse_nvidia_smi_text

    text = (HOSTILE / "nvidia-smi-padded-name.txt").read_text()
    moments = parse_nvidia_smi_text(text)
    assert moments[0][0].name.startswith("NVIDIA") and moments[0][0].name.endswith("H100 x")
    # 64,000 spaces in the name: once 30 s; the line is over the table-line cap (skipped)
    big = (
        (HEALTHY / "nvidia-smi.txt")
        .read_text()
        .replace("NVIDIA H100 80GB HBM3", "NVIDIA" + " " * 64_000 + "H100")
    )
    t0 = time.process_time()
    with pytest.raises(SourceError):
        parse_nvidia_smi_text(big)
    assert time.process_time() - t0 < 2
    # a process name padded the same way
    procs = (
        (HEALTHY / "nvidia-smi.txt").read_text().replace("VLLM::EngineCore  ", "VLLM" + " " * 3000 + "Core x")
    )
    t0 = time.process_time()
    gpu = parse_nvidia_smi_text(procs)[0][0]
    assert time.process_time() - t0 < 2 and gpu.processes[0].pid == 2314


def test_env_value_padded_with_spaces_parses_in_linear_time() -> None:
    from kvdoctor.sources.env import parse_env_text

    t0 = time.process_time()
    env = parse_env_text("X=a" + " " * 64_000 + "b\nY=1 # comment\nZ=a#b\n", origin="env.txt")
    assert time.process_time() - t0 < 1
    assert env["Y"] == "1" and env["Z"] == "a#b" and env["X"].startswith("a") and env["X"].endswith("b")


def _bomb_gz(path: Path, mib: int) -> None:
    line = b"INFO 11-29 17:58:01 [loggers.py:123] Engine 000: Avg prompt throughput: 1.0 tokens/s\n"
    block = line * (1024 * 1024 // len(line))
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    with path.open("wb") as fh:
        for _ in range(mib):
            fh.write(c.compress(block))
        fh.write(c.flush())


def test_gzip_bomb_log_is_refused_early(tmp_path: Path) -> None:
    from kvdoctor.sources.vllm_log import parse_log_file

    p = tmp_path / "vllm.log.gz"
    _bomb_gz(p, 256)  # 256 MiB of lines in well under 1 MiB: a ratio no real log has
    assert p.stat().st_size < 1024 * 1024
    with pytest.raises(SourceError, match="gzip bomb"):
        parse_log_file(p, progress=False)


def test_gzip_log_of_ordinary_ratio_reads(tmp_path: Path) -> None:
    from kvdoctor.sources.vllm_log import parse_log_file

    # near miss: a real log compresses 10-30×; a small one is read whatever its ratio
    text = (HEALTHY / "vllm.log").read_bytes() * 50
    p = tmp_path / "vllm.log.gz"
    p.write_bytes(gzip.compress(text))
    assert parse_log_file(p, progress=False).events


def test_cmdline_of_a_thousand_commands_is_cut_and_says_so(tmp_path: Path) -> None:
    lines = [f"vllm serve m{i} --port {8000 + i} --gpu-memory-utilization 0.01" for i in range(1000)]
    p = tmp_path / "cmdline.txt"
    p.write_text("\n".join(lines) + "\n")
    t0 = time.process_time()
    code, out, _ = run("diagnose", "--cmdline", str(p), "--format", "json")
    assert time.process_time() - t0 < 20
    st = next(s for s in sources_of(out) if s["kind"] == "cmdline")
    assert st["status"] == "ok" and "the first 64 read" in st["detail"]
    # near miss: a node's few commands are all read, nothing said
    p.write_text("\n".join(lines[:3]) + "\n")
    code, out, _ = run("diagnose", "--cmdline", str(p), "--format", "json")
    st = next(s for s in sources_of(out) if s["kind"] == "cmdline")
    assert st["detail"] == "3 engine command(s)"


# --------------------------------------------------------------------------- 3. secrets


@pytest.mark.parametrize(
    "line,secret",
    [
        ("INFO [x.py:1] headers: {'authorization': 'tok123secret', 'host': 'h'}", "tok123secret"),
        ('INFO [x.py:1] headers: {"Authorization": "tok123secret"}', "tok123secret"),
        ("INFO [x.py:1] request from 1.2.3.4 X-Api-Key: abcdef123456 path=/v1", "abcdef123456"),
        ("INFO [x.py:1] got header x-api-key=abcdef123456", "abcdef123456"),
        ("INFO [x.py:1] headers Cookie: session=abcdef123; uid=42", "abcdef123"),
        ("Set-Cookie: sid=abcdef123; HttpOnly", "abcdef123"),
        ("authorization: tok123secret", "tok123secret"),
        (
            "INFO 01-01 00:00:00 [logger.py:1] Generated response cmpl-1: output: 'the plan is X', "
            "output_token_ids: [1, 2, 3], finish_reason: stop",
            "the plan is X",
        ),
        ("user:S3CRETPW@127.0.0.1:1/metrics cannot read", "S3CRETPW"),
        ("//user:S3CRETPW@host/metrics", "S3CRETPW"),
    ],
)
def test_secret_shapes_that_once_leaked_are_redacted(line: str, secret: str) -> None:
    from kvdoctor.sources.vllm_log import redact

    out = redact(line)
    assert secret not in out and ("***" in out or "<redacted" in out)


@pytest.mark.parametrize(
    "line",
    [
        "INFO [x.py:1] enable_auth=False cookie_jar=None",
        "INFO [x.py:1] git@github.com:org/repo",
        "INFO 12:00:01 user@host started",
        "INFO [x.py:1] Starting vLLM server on http://0.0.0.0:8000",
        "INFO [x.py:1] Avg generation throughput: 12.0 tokens/s, output: 3 reqs",
    ],
)
def test_near_misses_stay_as_they_are(line: str) -> None:
    from kvdoctor.sources.vllm_log import redact

    assert redact(line) == line


def test_multi_line_prompt_and_output_in_a_log_copy_are_redacted() -> None:
    from kvdoctor.bundle_writer import redact_log_text

    text = (
        "INFO 01-01 00:00:00 [logger.py:1] Received request cmpl-1: prompt: 'first line\n"
        "my password is hunter2\n"
        "last line', params: SamplingParams(n=1), prompt_token_ids: [1, 2]\n"
        "INFO 01-01 00:00:01 [logger.py:1] Received request cmpl-2: prompt: 'cut short\n"
        "INFO 01-01 00:00:02 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s\n"
        "INFO 01-01 00:00:03 [logger.py:1] Generated response cmpl-1: output: 'answer\n"
        "secret answer line', output_token_ids: [1], finish_reason: stop\n"
        "plain line after\n"
    )
    out = redact_log_text(text)
    for secret in ("first line", "hunter2", "last line", "cut short", "answer", "secret answer"):
        assert secret not in out
    lines = out.splitlines()
    assert len(lines) == len(text.splitlines())
    assert lines[4].endswith("Avg prompt throughput: 1.0 tokens/s") and lines[-1] == "plain line after"
    assert "params: SamplingParams(n=1)" in lines[2] and "finish_reason: stop" in lines[6]


def test_url_password_never_reaches_errors_statuses_or_manifest() -> None:
    from kvdoctor.bundle_writer import Manifest
    from kvdoctor.facts import SourceStatus

    e = SourceError("user:S3CRETPW@h:1/metrics: cannot read", origin="http://u:S3CRETPW@h/m")
    assert "S3CRETPW" not in str(e) and "S3CRETPW" not in (e.origin or "")
    st = SourceStatus("metrics", "http://u:S3CRETPW@h/m", "error", "GET http://u:S3CRETPW@h/m: refused")
    assert "S3CRETPW" not in st.origin + st.detail
    m = Manifest(input="x")
    m.add("metrics/1.txt", "metrics", "http://u:S3CRETPW@h/m", "ok", "")
    assert "S3CRETPW" not in m.to_json()


@pytest.mark.parametrize(
    "value,words",
    [
        ("ftp://user:S3CRETPW@h/x", "unsupported scheme 'ftp'"),
        ("http://h:99999/metrics", "port out of range"),
        ("user:S3CRETPW@127.0.0.1:1/metrics", "a URL needs http:// or https://"),
        ("//user:S3CRETPW@127.0.0.1:1/metrics", "a URL needs http:// or https://"),
    ],
)
def test_metrics_location_errors_in_the_users_words(value: str, words: str) -> None:
    code, out, err = run("diagnose", "--metrics", value, "--no-nvml")
    assert code in (2, 3) and words in err and "S3CRETPW" not in out + err  # 3 via main()
    assert len([ln for ln in err.splitlines() if ln.strip()]) <= 3  # usage, hint, the error


def test_bundle_url_is_said_to_be_one_without_its_password() -> None:
    code, out, err = run("diagnose", "--bundle", "https://u:S3CRETPW@127.0.0.1:1/b.tgz")
    assert code in (2, 3) and "a URL" in err and "S3CRETPW" not in out + err


def test_url_and_label_credentials_reach_no_output(tmp_path: Path, fake_metrics_server) -> None:  # type: ignore[no-untyped-def]
    # --metrics http://user:PW@… and a model_name label that is a URL with credentials: neither
    # in JSON, markdown, a recording or any file of `bundle -o`
    from tests.conftest import B17_PAGES

    pages = [
        p.read_bytes().replace(b'model_name="', b'model_name="http://bob:LABELPW@hf.example/')
        for p in B17_PAGES
    ]
    fake_metrics_server.reset(pages)
    url = fake_metrics_server.url.replace("http://", "http://alice:URLPW@")
    outputs = []
    for fmt in ("json", "markdown", "text"):
        _, out, err = run("diagnose", "--metrics", url, "--no-nvml", "--format", fmt)
        outputs.append(out + err)
    fake_metrics_server.reset()
    run(
        "record",
        "--metrics",
        url,
        "--no-nvml",
        "-o",
        str(tmp_path / "r.jsonl"),
        "--duration",
        "1",
        "--interval",
        "0.3",
    )
    outputs.append((tmp_path / "r.jsonl").read_text())
    fake_metrics_server.reset()
    run(
        "bundle",
        "--metrics",
        url,
        "--no-nvml",
        "-o",
        str(tmp_path / "b"),
        "--window",
        "1",
        "--interval",
        "0.3",
    )
    files = [p for p in (tmp_path / "b").rglob("*") if p.is_file()]
    assert any(p.parent.name == "metrics" for p in files) and any(p.name == "manifest.json" for p in files)
    outputs += [p.read_text(errors="replace") for p in files]
    from kvdoctor.sources.metrics import parse_metrics

    # the label is kept, its password is not
    assert {m.model_name for m in parse_metrics(pages[0].decode())} == {
        "http://bob:***@hf.example/meta-llama/Llama-3.1-8B-Instruct"
    }
    for text in outputs:
        assert "URLPW" not in text and "LABELPW" not in text


# --------------------------------------------------------------------------- 6, 7. archives


def _tar(tmp_path: Path, name: str, *members: str) -> Path:
    import tarfile

    root = tmp_path / "src"
    if not root.exists():
        shutil.copytree(HEALTHY, root / "b")
        (root / "notes.yaml").write_text("a: 1\n")
        (root / "readme.json").write_text("{}\n")
    out = tmp_path / name
    with tarfile.open(out, "w:gz") as tar:
        for m in members:
            tar.add(root / m, arcname=m)
    return out


def test_archive_with_a_metrics_directory_reads_clean(tmp_path: Path) -> None:
    # tar czf of a bundle holds directory members (b/, b/metrics/): structure, not errors
    code, out, _ = run("diagnose", "--bundle", str(_tar(tmp_path, "plain.tgz", "b")), "--format", "json")
    sources = sources_of(out)
    assert [s for s in sources if s["status"] == "error"] == []
    assert {s["kind"] for s in sources if s["status"] == "ok"} >= {"nvidia-smi", "log", "metrics", "cmdline"}


def test_bundle_found_inside_an_archive_with_other_top_level_files(tmp_path: Path) -> None:
    p = _tar(tmp_path, "x.tgz", "b", "notes.yaml", "readme.json")
    code, out, _ = run("diagnose", "--bundle", str(p), "--format", "json")
    sources = sources_of(out)
    assert [s for s in sources if s["status"] == "missing"] == []
    assert json.loads(out)["health"] != "unknown"
    # near miss: the same files at the top level stay the bundle
    flat = tmp_path / "flat.tgz"
    import tarfile

    with tarfile.open(flat, "w:gz") as tar:
        for f in (tmp_path / "src" / "b").iterdir():
            tar.add(f, arcname=f.name)
        tar.add(tmp_path / "src" / "notes.yaml", arcname="notes.yaml")
    code, out, _ = run("diagnose", "--bundle", str(flat), "--format", "json")
    assert [s for s in sources_of(out) if s["status"] == "missing"] == []


@pytest.mark.parametrize(
    "content,words",
    [
        (b"garbage, not an archive\n", "not a gzip/tar archive"),
        (gzip.compress(b"hello\n"), "gzip data, but not a tar archive"),
        (None, "corrupt or truncated gzip"),
    ],
    ids=["not-an-archive", "gzip-not-tar", "cut-gzip"],
)
def test_corrupt_archive_says_what_it_is(tmp_path: Path, content: bytes | None, words: str) -> None:
    if content is None:  # a real bundle archive cut short inside its first member
        content = _tar(tmp_path, "whole.tgz", "b").read_bytes()[:60]
    p = tmp_path / "b.tar.gz"
    p.write_bytes(content)
    code, out, err = run("diagnose", "--bundle", str(p))
    assert code in (2, 3) and words in err and "Error" not in err.replace("Error:", "")
    assert "ReadError" not in err


# --------------------------------------------------------------------------- 8. one-shot words


def test_one_shot_diagnose_says_nothing_of_retrying() -> None:
    from kvdoctor.sampler import LiveOptions, Sampler
    from tests.test_sampler import Flaky

    for one_shot, expect in ((True, False), (False, True)):
        flaky = Flaky()
        sampler = Sampler(
            LiveOptions(use_nvml=False, use_processes=False, interval_s=0.5, one_shot=one_shot),
            sources=[flaky],
        )
        try:
            details = [sampler.sample().sources[0].detail for _ in range(3)]
        finally:
            sampler.close()
        assert any("retrying in" in d for d in details) is expect, details


def test_a_source_that_cannot_exist_here_is_reported_once_and_not_retried() -> None:
    from kvdoctor.facts import SourceUnavailable
    from kvdoctor.sampler import LiveOptions, Reading, Sampler

    class NoDriver:
        kind, origin, timeout_s = "nvml", "NVML", 1.0
        reads = 0

        def read(self) -> Reading:
            NoDriver.reads += 1
            raise SourceUnavailable("NVML unavailable: NVML Shared Library Not Found")

        def close(self) -> None:
            pass

    sampler = Sampler(LiveOptions(use_nvml=False, use_processes=False, interval_s=0.01), sources=[NoDriver()])
    try:
        snaps = [sampler.sample() for _ in range(5)]
    finally:
        sampler.close()
    assert NoDriver.reads == 1
    st = [s.sources[0] for s in snaps]
    assert {s.status for s in st} == {"missing"} and all("not retried" in s.detail for s in st)


def test_nvml_without_its_library_is_unavailable_not_an_error() -> None:
    from kvdoctor.facts import SourceUnavailable
    from kvdoctor.sources.nvml import NvmlReader

    class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's own name
        pass

    class FakePynvml:
        def nvmlInit(self) -> None:  # noqa: N802
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    reader = NvmlReader()
    reader._nvml = FakePynvml()
    with pytest.raises(SourceUnavailable, match="no NVIDIA driver"):
        reader.open()


# --------------------------------------------------------------------------- 5. nothing left behind

_STALL = """
import sys, time
import kvdoctor.bundle_writer as bw, kvdoctor.sources.bundle as sb
def stall(real):
    def f(*a, **k):
        print("stalled", flush=True)
        time.sleep(60)
        return real(*a, **k)
    return f
if sys.argv[1] == "bundle":
    bw.redact_env_text = stall(bw.redact_env_text)  # inside the repack copy (unredacted env.txt)
    bw._REDACTORS["env.txt"] = bw.redact_env_text
else:
    sb._parse_env = stall(sb._parse_env)  # inside the extracted archive copy
from kvdoctor.cli import main
main()
"""


@pytest.mark.parametrize(
    "command,sig",
    [("bundle", "SIGTERM"), ("bundle", "SIGINT"), ("diagnose", "SIGTERM"), ("record", "SIGTERM")],
)
def test_sigterm_leaves_no_temporary_copy(tmp_path: Path, command: str, sig: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    import tarfile

    b = tmp_path / "src" / "b"
    shutil.copytree(HEALTHY, b)
    (b / "env.txt").write_text("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz123456\n")
    archive = tmp_path / "b.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(b, arcname="b")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / ("out.tgz" if command == "bundle" else "r.jsonl")
    args = [command, "--bundle", str(archive)] + (["-o", str(out)] if command != "diagnose" else [])
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmpdir)),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stalled"
        assert list(tmpdir.iterdir())  # the temporary copy is there now
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode in (143, 3, 130) and "Traceback" not in err
    assert list(tmpdir.iterdir()) == []


def _hostile_bundle(tmp_path: Path) -> Path:
    d = tmp_path / "bad\x1b[31mdir\x07x"
    shutil.copytree(HEALTHY, d)
    for p in (d / "metrics").iterdir():
        p.write_text(
            p.read_text().replace('model_name="meta-llama', 'model_name="\x1b]0;pwned\x07meta\x00llama')
        )
    return d


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_control_characters_never_reach_text_or_markdown_raw(tmp_path: Path, fmt: str) -> None:
    d = _hostile_bundle(tmp_path)
    code, out, err = run("diagnose", "--bundle", str(d), "--format", fmt)
    for c in ("\x1b", "\x07", "\x00"):
        assert c not in out + err
    assert "bad\\x1b[31mdir\\x07x" in out  # shown, escaped


def test_escape_controls_keeps_printable_text() -> None:
    from kvdoctor.redact import escape_controls

    assert escape_controls("GPU 0 · 80 GiB\tok\nnext") == "GPU 0 · 80 GiB\tok\nnext"
    assert escape_controls("a\x1b[2Jb\x07\x00\r\x9b") == "a\\x1b[2Jb\\x07\\x00\\x0d\\x9b"


def test_watch_view_escapes_control_characters(tmp_path: Path) -> None:
    from kvdoctor.feeds import TimelineFeed
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle
    from kvdoctor.watch.controller import Controller, View

    d = _hostile_bundle(tmp_path)
    views: list[View] = []
    c = Controller(TimelineFeed(load_bundle(d).timeline.snapshots), Pipeline.load(), views.append)
    try:
        c.loop.paused.set()
        c.seek(0)
    finally:
        c.stop()
    shown = repr([views[-1].sources, views[-1].engines, views[-1].gpus, views[-1].findings])
    assert r"\\x1b]0;pwned\\x07meta" in shown  # the metrics label, escaped (repr doubles the backslash)
    assert "\\x1b" not in shown.replace(r"\\x1b", "")  # no raw ESC (repr: a single backslash)
