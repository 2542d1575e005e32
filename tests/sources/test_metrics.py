"""vLLM /metrics parsing (vllm-facts.md §1, §7), bundle scrapes and the live HTTP scrape."""

from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.facts import SourceError
from kvdoctor.sources.metrics import (
    DISPLAY_HISTOGRAMS,
    READ_HISTOGRAMS,
    load_metrics_dir,
    parse_metrics,
    probe_endpoints,
    scrape,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "metrics"
SAMPLE_033 = DATA / "vllm-0.33.0-sample.txt"
B17 = DATA / "b17"
REAL_CPU = DATA / "real-cpu-preemptions"


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- V1 pages


def test_033_full_page_fields() -> None:
    [em] = parse_metrics(_read(SAMPLE_033), origin="sample", timestamp=123.0)
    assert em.timestamp == 123.0
    assert em.engine == "0"
    assert em.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert em.engine_generation == "v1"
    assert em.stats_enabled is True
    assert em.kv_cache_usage == 0.4375
    assert em.num_requests_running == 12.0
    assert em.num_requests_waiting == 3.0
    assert em.num_requests_swapped is None
    assert em.num_preemptions_total == 1.0
    assert em.prompt_tokens_total == 2560.0
    assert em.generation_tokens_total == 12.0
    assert em.request_success_total == 1.0  # Σ over stop/length/abort/error/repetition
    assert em.prefix_cache_queries_total == 2560.0
    assert em.prefix_cache_hits_total == 512.0
    assert set(em.histograms) == set(READ_HISTOGRAMS)
    # cache_config_info labels, strings as given, engine label not among them (§1.3)
    assert em.cache_config["num_gpu_blocks"] == "27165"
    assert em.cache_config["block_size"] == "16"
    assert em.cache_config["kv_cache_size_tokens"] == "434640"
    assert em.cache_config["kv_cache_memory_bytes"] == "None"
    assert "engine" not in em.cache_config
    assert len(em.cache_config) == 37


def test_033_iteration_tokens_is_a_histogram_ending_in_total() -> None:
    [em] = parse_metrics(_read(SAMPLE_033))
    h = em.histograms["vllm:iteration_tokens_total"]
    les = [le for le, _ in h.buckets]
    assert les == sorted(les) and math.isinf(les[-1])
    assert les[:-1] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # §1.4
    assert h.buckets[-1][1] == h.count
    assert h.count > 0


def test_all_histograms_on_request_and_no_created_series() -> None:
    [em] = parse_metrics(_read(SAMPLE_033), histograms=None)
    assert "vllm:time_to_first_token_seconds" in em.histograms
    assert "vllm:request_num_preemptions" in em.histograms
    assert not any(k.endswith("_created") for k in em.histograms)
    ttft = em.histograms["vllm:time_to_first_token_seconds"]
    assert [le for le, _ in ttft.buckets][:3] == [0.001, 0.005, 0.01]
    [em2] = parse_metrics(_read(SAMPLE_033), histograms=DISPLAY_HISTOGRAMS)
    assert "vllm:inter_token_latency_seconds" in em2.histograms
    assert "vllm:request_num_preemptions" not in em2.histograms


def test_b17_both_generations_prefers_new_names() -> None:
    text = _read(B17 / "1753784342.txt")
    [em] = parse_metrics(text)
    assert em.kv_cache_usage == 0.962
    assert em.num_preemptions_total == 31.0
    assert em.request_success_total == 4.0
    assert em.cache_config["swap_space"] == "4"  # old-version key kept as given
    # make the old names disagree: the new ones must still win, nothing counted twice
    text = text.replace(
        'vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.962',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.111',
    ).replace(
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0',
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 99.0',
    )
    [em] = parse_metrics(text)
    assert em.kv_cache_usage == 0.962
    assert em.prefix_cache_queries_total == 0.0


def test_old_v1_names_only_fall_back() -> None:
    # ≤0.8.x V1: only gpu_cache_usage_perc and gpu_prefix_cache_* exist (§1.5)
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.7\n'
        "# TYPE vllm:gpu_prefix_cache_queries_total counter\n"
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
    )
    [em] = parse_metrics(text)
    assert em.kv_cache_usage == 0.7
    assert em.prefix_cache_queries_total == 100.0
    assert em.prefix_cache_hits_total == 40.0
    assert em.engine_generation == "v1"  # engine label


def test_real_cpu_full_scrape_with_http_metrics() -> None:
    [em] = parse_metrics(_read(REAL_CPU / "1795975381.txt"), timestamp=1795975381.0)
    assert em.model_name == "/models/tinyllama"
    assert em.num_preemptions_total == 48.0
    assert em.kv_cache_usage == 0.0
    assert em.request_success_total == 48.0
    assert em.cache_config["num_gpu_blocks"] == "4"
    assert em.cache_config["num_gpu_blocks_override"] == "4"
    h = em.histograms["vllm:request_prompt_tokens"]
    assert h.count == 48.0 and h.sum == 2001.0
    assert h.buckets[5] == (50.0, 48.0)


# --------------------------------------------------------------------------- V0 pages


def test_b20_v0_page() -> None:
    [em] = parse_metrics(_read(DATA / "b20-v0.txt"))
    assert em.engine is None
    assert em.model_name == "qwen2-0.5b"
    assert em.engine_generation == "v0"
    assert em.kv_cache_usage == 1.0
    assert em.num_requests_running == 219.0
    assert em.num_requests_waiting == 768.0
    assert em.num_requests_swapped == 0.0
    assert em.num_preemptions_total is None
    assert em.request_success_total == 14211.0  # 14174 stop + 37 length
    # V0 cache_config_info has no engine and no model_name label: attached to the engine
    assert em.cache_config["num_gpu_blocks"] == "365870"
    assert em.cache_config["swap_space_bytes"] == "4294967296"
    h = em.histograms["vllm:request_prompt_tokens"]
    assert h.buckets[-3:] == [(10000.0, 2211.0), (20000.0, 9940.0), (math.inf, 14211.0)]


def test_b21_v0_idle_page() -> None:
    [em] = parse_metrics(_read(DATA / "b21-v0.txt"))
    assert em.engine_generation == "v0"
    assert (em.kv_cache_usage, em.num_requests_running, em.num_requests_waiting) == (0.0, 0.0, 0.0)
    assert em.cache_config["num_gpu_blocks"] == "7415"


def test_time_per_output_token_stands_in_for_inter_token_latency() -> None:
    [em] = parse_metrics(_read(DATA / "b20-v0.txt"), histograms=DISPLAY_HISTOGRAMS)
    old = em.histograms["vllm:time_per_output_token_seconds"]
    assert em.histograms["vllm:inter_token_latency_seconds"] is old
    assert old.count == 4000.0


# --------------------------------------------------------------------------- several engines


def test_data_parallel_engines_and_models_kept_apart() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="a"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 2.0\n'
        'vllm:num_requests_running{model_name="b",engine="1"} 7.0\n'  # label order differs
        'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.5\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="200"} 1.0\n'
    )
    ems = parse_metrics(text)
    got = {(e.engine, e.model_name): e for e in ems}
    assert set(got) == {("0", "a"), ("1", "a"), ("1", "b")}
    assert got[("0", "a")].num_requests_running == 1.0
    assert got[("1", "a")].num_requests_running == 2.0
    assert got[("1", "b")].num_requests_running == 7.0
    assert got[("1", "a")].kv_cache_usage == 0.5
    assert got[("0", "a")].kv_cache_usage is None
    assert got[("0", "a")].cache_config["num_gpu_blocks"] == "100"
    assert got[("1", "b")].cache_config["num_gpu_blocks"] == "200"


def test_cache_config_without_engine_label_goes_to_every_engine() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="a"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 2.0\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="7"} 1.0\n'
    )
    ems = parse_metrics(text)
    assert [e.cache_config["block_size"] for e in ems] == ["32", "32"]


def test_escaped_label_values() -> None:
    text = 'vllm:num_requests_waiting{engine="0",model_name="we\\"ird\\\\name"} 4\n'
    [em] = parse_metrics(text)
    assert em.model_name == 'we"ird\\name'
    assert em.num_requests_waiting == 4.0


# --------------------------------------------------------------------------- no stats, bad input


HTTP_ONLY = (
    "# HELP http_requests_total Total number of requests by method, status and handler.\n"
    "# TYPE http_requests_total counter\n"
    'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 48.0\n'
    'http_request_size_bytes_count{handler="/v1/completions"} 48.0\n'
    'python_info{implementation="CPython"} 1.0\n'
)


def test_disable_log_stats_page() -> None:
    [em] = parse_metrics(HTTP_ONLY, timestamp=5.0)
    assert em.stats_enabled is False
    assert em.timestamp == 5.0
    assert em.kv_cache_usage is None


def test_empty_page() -> None:
    for text in ("", "   \n\n"):
        with pytest.raises(SourceError, match="empty /metrics page"):
            parse_metrics(text, origin="m.txt")


def test_binary_garbage_is_one_line_error() -> None:
    blob = bytes(range(256)).decode("latin-1") * 20
    with pytest.raises(SourceError) as ei:
        parse_metrics(blob, origin="metrics.txt")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("metrics.txt:1:") and "binary" in msg


def test_html_and_python_only_pages() -> None:
    with pytest.raises(SourceError, match="HTML or JSON"):
        parse_metrics("<html><body>502 Bad Gateway</body></html>", origin="u")
    with pytest.raises(SourceError, match="no vllm:\\* or http_\\* metrics"):
        parse_metrics("# TYPE process_open_fds gauge\nprocess_open_fds 71.0\n")


def test_bad_line_is_dropped_and_rest_is_read() -> None:
    text = _read(SAMPLE_033).replace(
        'vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct" 3.0 garbage',
    )
    [em] = parse_metrics(text)
    assert em.num_requests_waiting is None
    assert em.num_requests_running == 12.0
    assert em.kv_cache_usage == 0.4375
    assert em.cache_config["num_gpu_blocks"] == "27165"


def test_only_bad_vllm_lines_report_line_number() -> None:
    text = "# a comment\nvllm:num_requests_running{engine=0} 1\n"
    with pytest.raises(SourceError) as ei:
        parse_metrics(text, origin="x.txt")
    assert ei.value.line == 2 and ei.value.origin == "x.txt"
    assert "\n" not in str(ei.value)


def test_truncated_page_salvages_what_came() -> None:
    text = _read(SAMPLE_033)
    cut = text.index("vllm:iteration_tokens_total_bucket") + 200
    [em] = parse_metrics(text[:cut])
    assert em.num_requests_running == 12.0
    assert em.num_preemptions_total == 1.0
    h = em.histograms["vllm:iteration_tokens_total"]
    assert math.isinf(h.buckets[-1][0])  # +Inf synthesised so quantiles still work
    assert em.cache_config == {}  # cache_config_info sits at the end of the page


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_fuzz_text_never_crashes(text: str) -> None:
    try:
        parse_metrics(text)
    except SourceError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=3000))
def test_fuzz_mutated_page_never_crashes(junk: bytes, pos: int) -> None:
    text = _read(B17 / "1753784342.txt")[:6000]
    text = text[:pos] + junk.decode("utf-8", errors="replace") + text[pos:]
    try:
        parse_metrics(text)
    except SourceError:
        pass


# --------------------------------------------------------------------------- bundle directory


def test_load_b17_metrics_dir() -> None:
    series, errors = load_metrics_dir(B17)
    assert errors == []
    assert [t for t, _ in series] == [1753784342.0 + 10 * i for i in range(8)]
    assert [ems[0].num_preemptions_total for _, ems in series] == [31, 35, 38, 43, 46, 50, 54, 58]
    assert all(ems[0].timestamp == t for t, ems in series)


def test_load_metrics_dir_reports_bad_files_and_uses_the_rest(tmp_path: Path) -> None:
    (tmp_path / "1795975366.txt").write_text(_read(REAL_CPU / "1795975366.txt"))
    (tmp_path / "1795975365.txt").write_text(_read(REAL_CPU / "1795975365.txt"))
    (tmp_path / "1795975367.txt").write_bytes(b"\x00\x01\x02garbage\xff" * 50)
    (tmp_path / "latest.txt").write_text("x")
    (tmp_path / "1795975368.txt").write_text("")
    (tmp_path / "notes.md").write_text("ignored")
    series, errors = load_metrics_dir(tmp_path)
    assert [(t, ems[0].num_preemptions_total) for t, ems in series] == [
        (1795975365.0, 16.0),
        (1795975366.0, 19.0),
    ]
    msgs = sorted(str(e) for e in errors)
    assert len(msgs) == 3
    assert any("1795975367.txt:1: not Prometheus text: binary data" in m for m in msgs)
    assert any("1795975368.txt: empty /metrics page" in m for m in msgs)
    assert any("latest.txt: file name is not <unix-seconds>.txt" in m for m in msgs)


def test_load_metrics_dir_missing(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read metrics directory"):
        load_metrics_dir(tmp_path / "nope")


# --------------------------------------------------------------------------- live HTTP


class _Handler(http.server.BaseHTTPRequestHandler):
    page = b""

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/metrics":
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", self.page)
        elif self.path == "/version":
            self._send(200, "application/json", b'{"version": "0.33.0"}')
        elif self.path == "/v1/models":
            body = {
                "object": "list",
                "data": [{"id": "llama", "object": "model", "root": "/models/llama", "max_model_len": 8192}],
            }
            self._send(200, "application/json", json.dumps(body).encode())
        elif self.path == "/html/metrics":
            self._send(200, "text/html", b"<html>login</html>")
        elif self.path == "/slow/metrics":
            time.sleep(1.0)
            self._send(200, "text/plain", self.page)
        else:
            self._send(404, "text/plain", b"not found")


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the timed-out client of /slow hangs up before the reply: expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    _Handler.page = SAMPLE_033.read_bytes()
    srv = _QuietServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_scrape_live_page(server: str) -> None:
    before = time.time()
    text, ts = scrape(server)  # base URL: /metrics appended
    assert before <= ts <= time.time()
    [em] = parse_metrics(text, origin=server, timestamp=ts)
    assert em.kv_cache_usage == 0.4375
    text2, _ = scrape(server + "/metrics")
    assert text2 == text


def test_scrape_dead_port() -> None:
    port = _dead_port()
    with pytest.raises(SourceError) as ei:
        scrape(f"http://127.0.0.1:{port}/metrics", timeout=1.0)
    assert str(ei.value) == f"GET http://127.0.0.1:{port}/metrics: connection refused"


def test_scrape_http_errors(server: str) -> None:
    with pytest.raises(SourceError, match=r"HTTP 404"):
        scrape(server + "/nothing/here")
    with pytest.raises(SourceError, match=r"not Prometheus text \(Content-Type: text/html\)"):
        scrape(server + "/html/metrics")
    with pytest.raises(SourceError, match=r"timed out after 0.2 s"):
        scrape(server + "/slow/metrics", timeout=0.2)


def test_scrape_hides_url_credentials() -> None:
    port = _dead_port()
    with pytest.raises(SourceError) as ei:
        scrape(f"http://admin:s3cret@127.0.0.1:{port}/metrics", timeout=1.0)
    assert "s3cret" not in str(ei.value) and "admin" not in str(ei.value)


def test_probe_endpoints(server: str) -> None:
    info = probe_endpoints(server + "/metrics")
    assert info["version"] == "0.33.0"
    assert info["models"] == [{"id": "llama", "root": "/models/llama", "max_model_len": 8192}]
    assert info["errors"] == []


def test_probe_dead_endpoint_never_raises() -> None:
    port = _dead_port()
    info = probe_endpoints(f"http://127.0.0.1:{port}", timeout=1.0)
    assert info["version"] is None and info["models"] == []
    assert info["errors"] == [f"GET http://127.0.0.1:{port}/version: connection refused"]


@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1/metrics", "ht!tp://x"])
def test_bad_urls_are_one_line_errors(url: str) -> None:
    with pytest.raises(SourceError) as ei:
        scrape(url, timeout=0.5)
    assert str(ei.value).startswith("GET ") and "\n" not in str(ei.value)
    info = probe_endpoints(url, timeout=0.5)
    assert info["version"] is None and len(info["errors"]) == 1
