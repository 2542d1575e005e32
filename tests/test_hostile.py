"""Hostile and broken input (issue 8): one guard at every boundary, bounded reads, confined
bundles, no input content in messages, redaction by meaning, algorithmic bounds.

Each section tests one class of the issue; tests/fuzz_harness.py (run by tests/test_fuzz.py)
covers the same contract with mutated inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor.facts import SourceError
from kvdoctor.sources import cmdline, dmesg, env, metrics, model_config, nvidia_smi, processes, vllm_log

# --------------------------------------------------------------------------- 1. one guard


def test_guard_turns_any_parser_exception_into_source_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise KeyError("secret-bytes-from-input")

    # a bug deep inside a parser: callers still get SourceError naming the origin, no input
    monkeypatch.setattr(nvidia_smi, "_check_text", boom)
    with pytest.raises(SourceError) as ei:
        nvidia_smi.parse_compute_apps_csv("gpu_uuid, pid\n", origin="apps.csv")
    assert ei.value.origin == "apps.csv"
    assert "secret-bytes" not in str(ei.value) and "KeyError" in str(ei.value)


def test_deeply_nested_config_json_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="nested too deeply") as ei:
        model_config.parse_model_config("[" * 100_000, origin="config.json")
    assert ei.value.origin == "config.json"


@pytest.mark.parametrize(
    "call",
    [
        lambda t: vllm_log.parse_log(t, "x.log"),
        lambda t: metrics.parse_metrics(t, "m.txt"),
        lambda t: nvidia_smi.parse_nvidia_smi_text(t, "smi.txt"),
        lambda t: nvidia_smi.parse_compute_apps_csv(t, "apps.csv"),
        lambda t: cmdline.parse_cmdline_text(t, "cmdline.txt"),
        lambda t: env.parse_env_text(t, "env.txt"),
        lambda t: processes.parse_ps_text(t, "ps.txt"),
        lambda t: dmesg.parse_dmesg(t, "dmesg.txt"),
        lambda t: model_config.parse_model_config(t, "config.json"),
    ],
)
@pytest.mark.parametrize(
    "text",
    ["", "\x00" * 100, "[" * 50_000, "1" * 5000, "nan inf -inf 1e999", "\ufffd" * 1000, "a=" * 10_000],
)
def test_every_parser_returns_or_raises_source_error(call, text: str) -> None:  # type: ignore[no-untyped-def]
    try:
        call(text)
    except SourceError as e:
        assert "\n" not in str(e)


def test_bad_row_costs_that_row_not_the_file() -> None:
    apps = nvidia_smi.parse_compute_apps_csv(
        "gpu_uuid, pid, used_memory [MiB]\nGPU-a, abc, 1 MiB\nGPU-a, 12, 1e999 MiB\nGPU-b, 42, 10 MiB\n"
    )
    assert [(p.pid, p.gpu_uuid) for p in apps] == [(42, "GPU-b")]
    ps = processes.parse_ps_text("PID COMMAND\nabc bash\n77 vllm\n" + "9" * 400 + " x\n")
    assert [p.pid for p in ps] == [77]
    moments = nvidia_smi.parse_query_gpu_csv("index, memory.used [MiB]\n0, 1, 2\n1, 2\n")
    assert [g.index for g in moments[-1]] == [1]


def test_bad_log_line_costs_that_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = vllm_log._Parser._match_stats

    def flaky(self, pl, key, msg):  # type: ignore[no-untyped-def]
        if "Running: 13 reqs" in msg:
            raise RuntimeError("parser bug")
        return real(self, pl, key, msg)

    monkeypatch.setattr(vllm_log._Parser, "_match_stats", flaky)
    line = "INFO 07-01 09:00:0{} [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, Running: {} reqs"
    log = vllm_log.parse_log("\n".join(line.format(i, n) for i, n in enumerate((12, 13, 14))))
    assert [e.values["running"] for e in log.events if e.kind == "stats"] == [12, 14]


def test_non_finite_numbers_never_reach_facts() -> None:
    smi = "index, temperature.gpu, memory.used [MiB]\n0, " + "9" * 400 + ", 10\n"
    with pytest.raises(SourceError, match="temperature.gpu.*not a number") as ei:
        nvidia_smi.parse_query_gpu_csv(smi)
    assert ei.value.line == 2 and "999" not in str(ei.value)
    # a row with an absurd number is dropped; the good row stays
    moments = nvidia_smi.parse_query_gpu_csv(smi + "1, 41, 10\n")
    assert [(g.index, g.temperature_c) for g in moments[-1]] == [(1, 41.0)]


def _run_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env_ = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", "from kvdoctor.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_,
    )


def test_cli_top_level_guard_exits_3_with_one_line(tmp_path: Path) -> None:
    # A command that blows up inside: one line on stderr, exit 3 (UNKNOWN), no traceback.
    script = tmp_path / "boom.py"
    script.write_text(
        "import kvdoctor.cli as c, click\n"
        "@click.command()\n"
        "def boom():\n"
        "    raise ValueError('password=hunter2')\n"
        "c.COMMANDS['boom'] = ('boom:boom', 'x')\n"
        "c.main()\n"
    )
    r = subprocess.run(
        [sys.executable, str(script), "boom"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 3
    assert "Traceback" not in r.stderr and "hunter2" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "ValueError" in r.stderr


def test_report_json_is_strict() -> None:
    from kvdoctor import report

    src = Path(report.__file__).read_text()
    assert "allow_nan=False" in src
    with pytest.raises(ValueError):
        json.dumps({"x": float("nan")}, allow_nan=False)


# --------------------------------------------------------------------------- 3. hard limits


def test_bounded_read_refuses_oversized_file(tmp_path: Path) -> None:
    from kvdoctor.sources import limits

    p = tmp_path / "big.txt"
    p.write_bytes(b"x" * 5000)
    with pytest.raises(SourceError, match="larger than 4096 bytes"):
        limits.read_bytes(p, 4096)
    assert limits.read_bytes(p, 5000) == b"x" * 5000


def test_fifo_does_not_hang_a_read(tmp_path: Path) -> None:
    import os

    from kvdoctor.sources import limits

    fifo = tmp_path / "nvidia-smi.txt"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match="not a regular file"):
        limits.read_bytes(fifo)
    with pytest.raises(SourceError, match="not a regular file"):
        vllm_log.parse_log_file(fifo)


def test_gzip_log_bomb_stops_at_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip

    monkeypatch.setattr(vllm_log, "MAX_LOG_BYTES", 1 << 20)
    p = tmp_path / "vllm.log.gz"
    p.write_bytes(gzip.compress(b"INFO 01-01 00:00:00 [a.py:1] hello\n" * 100_000))
    with pytest.raises(SourceError, match="decompresses to more than 1 MiB"):
        vllm_log.parse_log_file(p)


def test_overlong_log_line_is_cut_not_buffered(tmp_path: Path) -> None:
    p = tmp_path / "vllm.log"
    with open(p, "wb") as fh:
        fh.write(b"INFO 01-01 00:00:00 [a.py:1] Using max model len 4096\n")
        fh.write(b"x" * (20 << 20) + b"\n")  # one 20 MiB line
        fh.write(b"INFO 01-01 00:00:01 [a.py:1] Using max model len 8192\n")
    log = vllm_log.parse_log_file(p)
    assert log.line_count == 3
    assert [e.values["max_model_len"] for e in log.events] == [4096, 8192]
    lines = list(vllm_log.iter_log_lines(p))
    assert len(lines[1]) == vllm_log.MAX_LINE_CHARS


def test_command_line_capped_before_shlex() -> None:
    with pytest.raises(SourceError, match="longer than 256 KiB"):
        cmdline.parse_cmdline_text("vllm serve m --x '" + "a" * 400_000 + "'\n", origin="cmdline.txt")
    with pytest.raises(SourceError, match="longer than 256 KiB"):
        cmdline.parse_argv(["vllm", "serve", "m", "a" * 400_000])


def test_metrics_engine_count_is_bounded() -> None:
    from kvdoctor.sources.limits import MAX_ENGINES

    page = "".join(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 1\n' for i in range(3000))
    got = metrics.parse_metrics(page, origin="m.txt")
    assert len(got) == MAX_ENGINES


class _Server:
    """A local HTTP server whose handler is given per test."""

    def __init__(self, handler: type) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(body_fn):  # type: ignore[no-untyped-def]
    from http.server import BaseHTTPRequestHandler

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body_fn(self)

        def log_message(self, *args: object) -> None:
            pass

    return H


def test_drip_fed_scrape_ends_on_time() -> None:
    import time

    def drip(h) -> None:  # type: ignore[no-untyped-def]
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.end_headers()
        try:
            for _ in range(100):
                h.wfile.write(b"# x\n")
                h.wfile.flush()
                time.sleep(0.2)  # each byte well inside the read timeout
        except OSError:
            pass

    srv = _Server(_handler(drip))
    try:
        t0 = time.monotonic()
        with pytest.raises(SourceError, match="timed out after 1 s"):
            metrics.scrape(srv.url, timeout=1.0)
        assert time.monotonic() - t0 < 2.5
    finally:
        srv.close()


def _encoded(body: bytes, encoding: str | None = "gzip"):  # type: ignore[no-untyped-def]
    """A handler body answering 200 text/plain with ``body`` under Content-Encoding ``encoding``
    (none when None)."""

    def send(h) -> None:  # type: ignore[no-untyped-def]
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        if encoding is not None:
            h.send_header("Content-Encoding", encoding)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return send


def test_scrape_body_and_content_encoding_are_capped() -> None:
    import gzip

    bomb = gzip.compress(b"# " + b"x" * (8 << 20) + b"\n")

    srv = _Server(_handler(_encoded(bomb)))
    try:
        with pytest.raises(SourceError, match="response larger than 1 MiB"):
            metrics.scrape(srv.url, timeout=5.0, max_bytes=1 << 20)
    finally:
        srv.close()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "identity"])
def test_scrape_inflates_no_more_than_the_cap(encoding: str) -> None:
    """A bomb's network reads (64 KiB of gzip'd zeros is ~64 MiB) are inflated only up to the
    cap: peak allocation stays near max_bytes, not the bomb's inflated size."""
    import tracemalloc
    import zlib

    plain = b"# " + b"0" * (256 << 20) + b"\n"
    if encoding == "identity":
        body, plain = plain[: 8 << 20], b""
    else:
        wbits = 31 if encoding == "gzip" else 15
        z = zlib.compressobj(9, zlib.DEFLATED, wbits)
        body = z.compress(plain) + z.flush()
    del plain

    srv = _Server(_handler(_encoded(body, None if encoding == "identity" else encoding)))
    try:
        tracemalloc.start()
        try:
            with pytest.raises(SourceError, match="response larger than 1 MiB"):
                metrics.scrape(srv.url, timeout=10.0, max_bytes=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        srv.close()
    assert peak < 8 << 20, peak  # the cap (1 MiB) plus a few network reads, never 64 MiB


def test_scrape_refuses_an_encoding_it_did_not_ask_for() -> None:
    srv = _Server(_handler(_encoded(b"\x00\x01\x02\x03", "br")))
    try:
        with pytest.raises(SourceError, match="unsupported Content-Encoding") as ei:
            metrics.scrape(srv.url, timeout=5.0)
        assert "br" not in str(ei.value).split(":")[-1]
    finally:
        srv.close()


def test_scrape_reads_a_gzip_page() -> None:
    import gzip

    page = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
    body = gzip.compress(page)

    srv = _Server(_handler(_encoded(body)))
    try:
        text, _ts = metrics.scrape(srv.url, timeout=5.0)
    finally:
        srv.close()
    assert text == page.decode()


def test_scrape_error_never_echoes_headers_or_password() -> None:
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        conn, _ = sock.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Secret\x01: hunter2-header\r\n\r\n")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://admin:s3cret@127.0.0.1:{sock.getsockname()[1]}/metrics"
    with pytest.raises(SourceError) as ei:
        metrics.scrape(url, timeout=3.0)
    sock.close()
    assert "hunter2" not in str(ei.value) and "s3cret" not in str(ei.value)


# --------------------------------------------------------------------------- 6. no input content in messages

SECRET = "hunter2-SECRET-BYTES"


@pytest.mark.parametrize(
    "call",
    [
        lambda: cmdline.parse_cmdline_text(f"python {SECRET}.py --x\n", origin="cmdline.txt"),
        lambda: cmdline.parse_cmdline_text(f"vllm serve m --max-model-len {SECRET}\n", origin="c"),
        lambda: cmdline.parse_cmdline_text(f"vllm serve m --enforce-eager={SECRET}\n", origin="c"),
        lambda: metrics.parse_metrics(f"<html>{SECRET}</html>", origin="m.txt"),
        lambda: metrics.parse_metrics(f"{SECRET} {SECRET}", origin="m.txt"),
        lambda: metrics.parse_metrics('vllm:num_requests_running{engine="' + SECRET + " 1\n", origin="m.txt"),
        lambda: nvidia_smi.parse_compute_apps_csv(f"gpu_uuid, pid\nGPU-a, {SECRET}\n", origin="a.csv"),
        lambda: nvidia_smi.parse_query_gpu_csv(f"index, timestamp\n0, {SECRET}\n", origin="s.csv"),
        lambda: nvidia_smi.parse_query_gpu_csv(f"{SECRET}, foo\n1, 2\n", origin="s.csv"),
        lambda: processes.parse_ps_text(f"PID COMMAND\n{SECRET} bash\n", origin="ps.txt"),
        lambda: model_config.parse_model_config('{"num_hidden_layers": "' + SECRET + '"}', origin="c.json"),
    ],
)
def test_errors_name_file_line_and_reason_never_content(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SourceError) as ei:
        call()
    assert SECRET not in str(ei.value) and "hunter2" not in str(ei.value)


def test_bundle_yaml_error_does_not_quote_the_file(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import load_bundle

    (tmp_path / "engine-args.yaml").write_text(f"model: [unclosed {SECRET}\n  bad: : :\n")
    loaded = load_bundle(tmp_path)
    details = " ".join(s.detail for s in loaded.snapshot.sources)
    assert "not valid YAML" in details and SECRET not in details


# --------------------------------------------------------------------------- 7. redaction by meaning


@pytest.mark.parametrize(
    "url",
    [
        "http://admin:hunter2@db:5432/x",
        "HTTP://admin:hunter2@db",
        "Postgres://admin:hunter2@db",
        "git+ssh://u:hunter2@host/repo",
        "redis://:hunter2@cache:6379",
        "http://u:hun/ter2@host",  # a "/" in the password
        "http://u:hunter2@x@host",  # an "@" in the password
        "s3://KEY:hunter2/abc@bucket",
    ],
)
def test_any_scheme_userinfo_is_redacted(url: str) -> None:
    from kvdoctor.redact import redact_argv, redact_text

    for text in (url, f"proxy={url} next", f"'{url}'", f"--endpoint {url}"):
        out = redact_text(text)
        assert "hunter2" not in out and "ter2" not in out and "***" in out, out
    assert "hunter2" not in " ".join(redact_argv(["curl", url]))
    assert "hunter2" not in metrics._redact_url(url)


def test_url_without_credentials_is_untouched() -> None:
    from kvdoctor.redact import redact_text

    for text in ("http://host:8000/metrics", "http://host:8000/a@b", "mailto:x@y", "see http://h/p"):
        assert redact_text(text) == text


def test_metrics_url_with_credentials_in_any_spelling_never_printed(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import Artifacts, load_artifacts

    art = Artifacts(metrics=[Path("FTP://admin:hunter2@host/metrics")])
    loaded = load_artifacts(art)
    shown = " ".join(f"{s.origin} {s.detail}" for s in loaded.snapshot.sources)
    assert "hunter2" not in shown


def test_abbreviated_secret_flags_are_redacted() -> None:
    from kvdoctor.redact import redact_argv, redact_text

    argv = [
        "vllm",
        "serve",
        "m",
        "--api-ke",
        "K1",
        "K2",
        "--hf-tok",
        "T1",
        "--api_key=K3",
        "--max-model-len",
        "8",
    ]
    out = redact_argv(argv)
    assert not {"K1", "K2", "T1"} & set(out) and "--api_key=***" in out and "8" in out
    text = redact_text("vllm serve m --api-ke K1 --hf_tok T1 --max-model-len 8")
    assert "K1" not in text and "T1" not in text and "--max-model-len 8" in text
    cfg = cmdline.parse_argv(argv)
    assert "K1" not in (cfg.command or "") and "T1" not in (cfg.command or "")


def test_prompt_redaction_ends_at_the_matching_quote() -> None:
    line = (
        "Received request cmpl-1: prompt: 'ignore this, params: SamplingParams(my secret) it\\'s', "
        "params: SamplingParams(n=1, temperature=0.7), prompt_token_ids: [1, 2, 3]"
    )
    out = vllm_log.redact(line)
    assert "secret" not in out and "ignore" not in out
    assert "params: SamplingParams(n=1, temperature=0.7)" in out
    assert "prompt_token_ids: [<redacted 3 tokens>]" in out
    truncated = vllm_log.redact("Received request x: prompt: 'cut off, params: my secret")
    assert "secret" not in truncated


# --------------------------------------------------------------------------- 5. confined filesystem

CASE = Path(__file__).resolve().parent / "data" / "bundles" / "r01-healthy-busy-tp2-h100"


def _copy_case(dst: Path) -> Path:
    import shutil

    shutil.copytree(CASE, dst)
    return dst


def test_directory_bundle_never_follows_symlinks_out(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import load_bundle

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(f"{SECRET}\n")
    b = _copy_case(tmp_path / "b")
    (b / "env.txt").unlink(missing_ok=True)
    (b / "env.txt").symlink_to(outside / "secret.txt")
    (b / "metrics").mkdir(exist_ok=True)
    (b / "metrics" / "1700000000.txt").symlink_to(outside / "secret.txt")
    loaded = load_bundle(b)
    env_status = [s for s in loaded.snapshot.sources if s.origin.endswith("env.txt")]
    assert (
        env_status and env_status[0].status == "error" and "symlink out of the bundle" in env_status[0].detail
    )
    assert any(
        "symlink out of the bundle" in s.detail for s in loaded.snapshot.sources if "metrics" in s.origin
    )
    assert SECRET not in json.dumps([vars(s) for s in loaded.snapshot.sources])
    assert SECRET not in json.dumps(loaded.snapshot.env)


def test_symlink_inside_bundle_is_followed(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import load_bundle

    b = _copy_case(tmp_path / "b")
    (b / "saved.log").write_bytes((b / "vllm.log").read_bytes())
    (b / "vllm.log").unlink()
    (b / "vllm.log").symlink_to("saved.log")
    assert load_bundle(b).snapshot.log is not None


def test_fifo_in_bundle_does_not_hang(tmp_path: Path) -> None:
    import os

    from kvdoctor.sources.bundle import load_bundle

    b = _copy_case(tmp_path / "b")
    (b / "ps.txt").unlink(missing_ok=True)
    os.mkfifo(b / "ps.txt")
    loaded = load_bundle(b)  # a blocking open would hang here
    st = [s for s in loaded.snapshot.sources if s.origin.endswith("ps.txt")]
    assert st and st[0].status == "error" and "not a regular file" in st[0].detail


@pytest.mark.parametrize("config", ["/etc/passwd", "../outside.yaml", "link.yaml"])
def test_config_in_bundle_resolves_inside_or_is_refused(tmp_path: Path, config: str) -> None:
    from kvdoctor.sources.bundle import load_bundle

    (tmp_path / "outside.yaml").write_text("max-model-len: 1234\n")
    b = tmp_path / "b"
    b.mkdir()
    (b / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    (b / "cmdline.txt").write_text(f"vllm serve m --config {config}\n")
    loaded = load_bundle(b)
    assert all(c.max_model_len != 1234 for c in loaded.configs)
    assert any(
        s.kind == "cmdline" and s.status == "error" and "--config" in s.detail
        for s in loaded.snapshot.sources
    )


def test_config_in_bundle_found_by_name(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import load_bundle

    b = tmp_path / "b"
    b.mkdir()
    (b / "serve.yaml").write_text("max-model-len: 4321\n")
    (b / "cmdline.txt").write_text("vllm serve m --config /srv/conf/serve.yaml\n")
    assert [c.max_model_len for c in load_bundle(b).configs] == [4321]


def _tar(path: Path, members: list[tuple[str, bytes | None, str]]) -> Path:
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type = tarfile.SYMTYPE
                info.linkname = "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return path


def test_tar_keeps_only_read_names_and_skips_bad_members(tmp_path: Path) -> None:
    from kvdoctor.sources.bundle import load_bundle

    log = (CASE / "vllm.log").read_bytes()
    arc = _tar(
        tmp_path / "b.tar.gz",
        [
            ("case/vllm.log", log, "file"),
            ("case/vllm.log", b"second copy", "file"),
            ("case/env.txt", b"", "sym"),
            ("case/../../escape.txt", b"x", "file"),
            ("/abs.txt", b"x", "file"),
            ("case/huge-unrelated.bin", b"\x00" * 1000, "file"),
        ],
    )
    loaded = load_bundle(arc)
    assert loaded.snapshot.log is not None
    details = {s.origin: s.detail for s in loaded.snapshot.sources if s.kind == "bundle"}
    assert any("appears twice" in d for d in details.values())
    assert any("not a regular file" in d for d in details.values())
    assert not (tmp_path / "escape.txt").exists()
    assert "kvdoctor-bundle-" not in json.dumps([vars(s) for s in loaded.snapshot.sources])


def test_tar_oversized_member_skipped_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdoctor.sources import bundle

    monkeypatch.setattr(bundle, "MAX_TAR_MEMBER_BYTES", 1000)
    arc = _tar(
        tmp_path / "b.tar.gz",
        [("b/ps.txt", b"PID COMMAND\n" + b"1 x\n" * 1000, "file"), ("b/env.txt", b"A=1\n", "file")],
    )
    loaded = bundle.load_bundle(arc)
    assert loaded.snapshot.env == {"A": "1"}
    assert any("larger than" in s.detail for s in loaded.snapshot.sources if s.origin.endswith("ps.txt"))


def test_tar_temp_copy_removed_on_sigterm(tmp_path: Path) -> None:
    import os
    import signal
    import time

    arc = _tar(tmp_path / "b.tar.gz", [("b/env.txt", b"A=1\n", "file")])
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvdoctor.sources import bundle\n"
        "real = bundle._load_dir\n"
        "def slow(root, label):\n"
        "    print('ready', flush=True); time.sleep(30); return real(root, label=label)\n"
        "bundle._load_dir = slow\n"
        f"bundle.load_bundle(Path({str(arc)!r}))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmpdir)}
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    assert any(tmpdir.iterdir())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    time.sleep(0.1)
    assert not any(tmpdir.iterdir())


# --------------------------------------------------------------------------- 9. logs of any size

LOGS = sorted((Path(__file__).resolve().parent / "data" / "vllm_log").glob("*.log")) + sorted(
    (Path(__file__).resolve().parent / "data" / "bundles").glob("*/vllm.log")
)


def _line_by_line(text: str) -> list[tuple[str, int, str]]:
    p = vllm_log._Parser("x")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for ln in lines:
        p.feed(ln)
    p.finish()
    p.log.events.sort(key=lambda e: e.line)
    return [(e.kind, e.line, repr(sorted(e.values.items()))) for e in p.log.events]


@pytest.mark.parametrize("path", LOGS, ids=[p.parent.name + "/" + p.name for p in LOGS])
def test_streamed_chunk_parse_equals_line_by_line(path: Path, tmp_path: Path) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    # serving traffic in between: request and access lines are counted, not parsed
    extra = (
        "(APIServer pid=1) INFO 07-01 10:00:00 [logger.py:43] Received request cmpl-1: prompt: "
        "'CUDA out of memory. Tried to allocate 1 GiB; vLLM API server version 9.9', params: x\n"
        '(APIServer pid=1) INFO:     10.0.0.1:5555 - "POST /v1/completions HTTP/1.1" 200 OK\n'
    ) * 50
    text = text + extra + text
    want = _line_by_line(text)
    got = vllm_log.parse_log(text)
    assert [(e.kind, e.line, repr(sorted(e.values.items()))) for e in got.events] == want
    f = tmp_path / "vllm.log"
    f.write_text(text)
    log = vllm_log.parse_log_file(f, progress=False)
    assert [(e.kind, e.line) for e in log.events] == [(k, n) for k, n, _ in want]
    assert log.line_count == text.count("\n")


def test_request_lines_never_become_events() -> None:
    line = (
        "INFO 07-01 10:00:00 [logger.py:43] Received request x: prompt: 'CUDA out of memory. Tried to "
        "allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB of which 1 GiB is free.', params: y"
    )
    assert vllm_log.parse_log(line).events == []


def _stats_log(n: int) -> str:
    head = "INFO 07-01 00:00:00 [api_server.py:1] vLLM API server version 0.10.0\n"
    head += "INFO 07-01 00:00:00 [api_server.py:1] Application startup complete.\n"
    return head + "".join(
        f"INFO 07-01 00:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
        f"Running: {i % 7} reqs, Waiting: 0 reqs, GPU KV cache usage: 50.0%, Preemptions: {i % 3}\n"
        for i in range(n)
    )


def test_bounded_history_keeps_start_end_and_preemption_total() -> None:
    n = 30_000
    log = vllm_log.parse_log(_stats_log(n))
    stats = log.of("stats")
    limit = sum(vllm_log._HISTORY_LIMITS["stats"])
    assert len(stats) == limit
    assert stats[0].line == 3 and stats[-1].line == n + 2  # the run's start and end
    assert sum(e.values["preemptions"] for e in stats) == sum(i % 3 for i in range(n))
    assert log.line_count == n + 2


def test_log_memory_stays_flat(tmp_path: Path) -> None:
    import tracemalloc

    req = (
        "(APIServer pid=1) INFO 07-01 10:00:00 [logger.py:43] Received request cmpl-{0}: prompt: "
        "'hello', params: SamplingParams(n=1), prompt_token_ids: None, lora_request: None.\n"
    )
    peaks = []
    for n in (50_000, 400_000):  # 7 MB and 55 MB of serving traffic
        f = tmp_path / f"{n}.log"
        with open(f, "w") as fh:
            fh.write(_stats_log(100))
            for i in range(n):
                fh.write(req.format(i))
        tracemalloc.start()
        log = vllm_log.parse_log_file(f, progress=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert log.line_count == n + 102
    assert peaks[1] < peaks[0] * 1.5 and peaks[1] < 32 * 1024 * 1024  # 8x the file, not 8x the memory


def test_follower_reads_the_whole_backlog(tmp_path: Path) -> None:
    f = tmp_path / "vllm.log"
    f.write_text(_stats_log(5000))
    follower = vllm_log.LogFollower(f)
    follower.max_read_bytes = 64 * 1024  # far less than the file
    events = follower.poll()
    assert len([e for e in events if e.kind == "stats"]) == 5000
    assert follower.log.line_count == 5002


def test_progress_shown_only_after_two_seconds(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    clock = iter([0.0, 0.5, 3.0, 3.1, 3.5, 9.0])
    monkeypatch.setattr(vllm_log.time, "monotonic", lambda: next(clock))
    p = vllm_log._Progress(__file__)
    p.update(10)  # 0.5 s: nothing
    assert capsys.readouterr().err == ""
    p.update(1 << 20)  # 3 s: shown
    err = capsys.readouterr().err
    assert "reading test_hostile.py" in err and "MiB" in err
    p.done()
    assert "\x1b[K" in capsys.readouterr().err


# --------------------------------------------------------------------------- 2. numbers validated where parsed


@pytest.mark.parametrize(
    "config,match",
    [
        (
            '{"num_hidden_layers": 1000000000, "num_attention_heads": 32, "hidden_size": 4096}',
            "num_hidden_layers",
        ),
        (
            '{"num_hidden_layers": 32, "num_attention_heads": 10000000, "head_dim": 128}',
            "num_attention_heads",
        ),
        ('{"num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 99999999}', "head_dim"),
        (
            '{"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, "vocab_size": -5}',
            "vocab",
        ),
    ],
)
def test_absurd_config_sizes_are_errors(config: str, match: str) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(SourceError, match=match):
        model_config.parse_model_config(config, origin="config.json")
    assert time.perf_counter() - t0 < 1.0  # refused before any per-layer list is built


@pytest.mark.parametrize(
    "flags",
    [
        "--gpu-memory-utilization 1.5",
        "--gpu-memory-utilization 0",
        "--gpu-memory-utilization -0.2",
        "--tensor-parallel-size 100000",
        "--tensor-parallel-size 0",
        "--data-parallel-size 999999",
    ],
)
def test_out_of_range_flags_are_errors(flags: str) -> None:
    with pytest.raises(SourceError, match="out of range") as ei:
        cmdline.parse_cmdline_text(f"vllm serve m {flags}\n", origin="cmdline.txt")
    assert ei.value.line == 1


def test_out_of_range_args_from_a_log_never_become_fields() -> None:
    from kvdoctor.facts import EngineConfig

    cfg = cmdline.update_config_from_args(
        EngineConfig(), {"gpu_memory_utilization": 7.0, "tensor_parallel_size": 2}, explicit=True
    )
    assert cfg.gpu_memory_utilization != 7.0 and cfg.tensor_parallel_size == 2
    assert "gpu_memory_utilization" not in cfg.explicit
    assert cmdline.parse_argv(["vllm", "serve", "m", "--max-model-len", "auto"]).max_model_len == -1


# --------------------------------------------------------------------------- 10. cold start: rules once per process


# --------------------------------------------------------------------------- 8. algorithmic bounds


def test_spawn_chain_is_linear() -> None:
    import time

    n = 20_000
    rows = ["PID PPID COMMAND COMMAND", "1 0 vllm vllm serve m"]
    # each child spawned by the one after it in the file: the old fixed point needed n passes
    rows += [
        f"{i} {i + 1 if i < n else 1} python python -c from multiprocessing.spawn import spawn_main"
        for i in range(2, n + 1)
    ]
    t0 = time.perf_counter()
    procs = processes.parse_ps_text("\n".join(reversed(rows[1:])).join([rows[0] + "\n", "\n"]))
    assert time.perf_counter() - t0 < 10
    assert sum(1 for p in procs if p.vllm_role == "worker") == n - 1


def test_many_engine_labels_parse_quickly() -> None:
    import time

    page = "".join(
        f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 1\n'
        f'vllm:cache_config_info{{engine="{i}",block_size="16"}} 1\n'
        for i in range(5_000)
    )
    t0 = time.perf_counter()
    got = metrics.parse_metrics(page, origin="m.txt")
    assert time.perf_counter() - t0 < 20 and 0 < len(got) <= 1024
