"""The live /metrics scrape over stdlib http.client (``kvdoctor.sources.metrics.ScrapeClient``):
keep-alive reuse, reconnecting after the server closed, never reusing a half-read response,
Basic auth from the URL, proxies from the environment, one deadline for drip-fed headers, TLS.

The hostile cases (dead, 500, hanging, drip-fed body, garbage, 50 MB, gzip bomb, credentials in
messages) are tests/test_hostile.py's and tests/sources/test_metrics.py's.
"""

from __future__ import annotations

import base64
import http.server
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdoctor.facts import SourceError
from kvdoctor.sources.metrics import ScrapeClient, scrape

PAGE = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'


class _Server:
    """A local HTTP/1.1 (keep-alive) server counting connections; ``respond(handler)`` answers
    each request (the default: PAGE as text/plain with a Content-Length)."""

    def __init__(
        self,
        respond: Callable[[http.server.BaseHTTPRequestHandler], None] | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        srv = self
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str]]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # as uvicorn's asyncio sockets
            timeout = idle_timeout  # an idle kept connection is closed then (uvicorn: 5 s)

            def setup(self) -> None:
                srv.connections += 1
                super().setup()

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                srv.requests.append((self.requestline, dict(self.headers.items())))
                (respond or _page)(self)

            def do_CONNECT(self) -> None:  # noqa: N802
                self.do_GET()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _page(h: http.server.BaseHTTPRequestHandler, code: int = 200, body: bytes = PAGE) -> None:
    h.send_response(code)
    h.send_header("Content-Type", "text/plain; version=0.0.4")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.close()


def test_one_connection_is_kept_alive_across_scrapes(server: _Server) -> None:
    client = ScrapeClient()
    try:
        for _ in range(3):
            text, _ts = scrape(server.url, timeout=5.0, client=client)
            assert text == PAGE.decode()
    finally:
        client.close()
    assert len(server.requests) == 3 and server.connections == 1
    # without a client each scrape has its own connection, closed after it
    for _ in range(2):
        scrape(server.url, timeout=5.0)
    assert server.connections == 3


def test_a_connection_the_server_closed_is_replaced() -> None:
    """The server closes idle keep-alive connections (uvicorn after --timeout-keep-alive): the
    next scrape connects again instead of failing."""
    srv = _Server(idle_timeout=0.2)
    client = ScrapeClient()
    try:
        scrape(srv.url, timeout=5.0, client=client)
        time.sleep(0.6)  # the server has closed it meanwhile
        text, _ = scrape(srv.url, timeout=5.0, client=client)
        assert text == PAGE.decode()
        assert scrape(srv.url, timeout=5.0, client=client)[0] == PAGE.decode()
    finally:
        client.close()
        srv.close()
    assert srv.connections == 2


def test_a_close_noticed_only_when_sending_is_retried_once_on_a_new_connection() -> None:
    """A server that drops a kept connection when the next request arrives (no answer at
    all): the request is sent again once on a new connection, within the same deadline."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    accepted: list[int] = []
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(PAGE)) + PAGE

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted.append(1)
            conn.recv(65536)
            conn.sendall(reply)  # one answer, kept alive...
            conn.recv(65536)  # ...then the next request closes it unanswered
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    client = ScrapeClient()
    try:
        assert scrape(url, timeout=5.0, client=client)[0] == PAGE.decode()
        assert scrape(url, timeout=5.0, client=client)[0] == PAGE.decode()
    finally:
        client.close()
        sock.close()
    assert len(accepted) == 2


def test_a_refused_or_oversized_response_is_never_reused() -> None:
    codes = iter([404, 200, 200, 200])
    big = b"# " + b"x" * 4096 + b"\n"

    def respond(h: http.server.BaseHTTPRequestHandler) -> None:
        code = next(codes)
        _page(h, code, big if code == 200 and len(srv.requests) == 2 else PAGE)

    srv = _Server(respond)
    client = ScrapeClient()
    try:
        with pytest.raises(SourceError, match="HTTP 404"):
            scrape(srv.url, timeout=5.0, client=client)
        with pytest.raises(SourceError, match="response larger than"):
            scrape(srv.url, timeout=5.0, client=client, max_bytes=1024)
        assert scrape(srv.url, timeout=5.0, client=client)[0] == PAGE.decode()
        assert scrape(srv.url, timeout=5.0, client=client)[0] == PAGE.decode()
    finally:
        client.close()
        srv.close()
    # a new connection after each refused page; the good ones share one
    assert srv.connections == 3


def test_url_credentials_are_sent_as_basic_auth(server: _Server) -> None:
    url = f"http://us%40er:p%3Ass@127.0.0.1:{server.port}/metrics"
    scrape(url, timeout=5.0)
    _line, headers = server.requests[-1]
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert headers["Host"] == f"127.0.0.1:{server.port}"  # no userinfo in Host
    scrape(server.url, timeout=5.0)
    assert "Authorization" not in server.requests[-1][1]


def test_drip_fed_headers_end_on_time() -> None:
    """One deadline for the status line and headers too, not a timeout per received byte."""

    def drip(h: http.server.BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        try:
            for i in range(50):
                h.wfile.write(b"X-%d: y\r\n" % i)
                h.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    srv = _Server(drip)
    try:
        t0 = time.monotonic()
        with pytest.raises(SourceError, match=r"timed out after 0.5 s"):
            scrape(srv.url, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
    finally:
        srv.close()


def test_redirects_are_not_followed(server: _Server) -> None:
    def moved(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", server.url)
        h.send_header("Content-Length", "0")
        h.end_headers()

    srv = _Server(moved)
    try:
        with pytest.raises(SourceError, match=r"HTTP 302 Found"):
            scrape(srv.url, timeout=5.0)
    finally:
        srv.close()
    assert server.requests == []


# --------------------------------------------------------------------------- proxies


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def test_http_proxy_from_the_environment_forwards_the_scrape(
    server: _Server, no_proxy_env: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY as httpx's trust_env read it: the request goes to the proxy with the absolute
    URL and the proxy's credentials; the target's host name is never resolved here."""
    no_proxy_env.setenv("HTTP_PROXY", f"http://pu:pp@127.0.0.1:{server.port}")
    text, _ = scrape("http://admin:pw@vllm.invalid:8000/metrics", timeout=5.0)
    assert text == PAGE.decode()
    line, headers = server.requests[-1]
    assert line == "GET http://vllm.invalid:8000/metrics HTTP/1.1"
    assert headers["Host"] == "vllm.invalid:8000"
    assert headers["Proxy-Authorization"] == "Basic " + base64.b64encode(b"pu:pp").decode()
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"admin:pw").decode()


def test_no_proxy_and_other_schemes(server: _Server, no_proxy_env: pytest.MonkeyPatch) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead_port}")
    with pytest.raises(SourceError, match="connection refused"):  # the proxy is used...
        scrape(server.url, timeout=5.0)
    no_proxy_env.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert scrape(server.url, timeout=5.0)[0] == PAGE.decode()  # ...unless bypassed
    assert server.requests[-1][0] == "GET /metrics HTTP/1.1"
    no_proxy_env.delenv("NO_PROXY")
    no_proxy_env.delenv("HTTP_PROXY")
    no_proxy_env.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(SourceError) as ei:
        scrape(server.url, timeout=5.0)
    assert str(ei.value) == f"GET {server.url}: unsupported proxy"


def test_https_through_a_proxy_is_a_connect_tunnel(no_proxy_env: pytest.MonkeyPatch) -> None:
    def refuse(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(407, "Proxy Authentication Required hunter2")
        h.send_header("Content-Length", "0")
        h.end_headers()

    proxy = _Server(refuse)
    try:
        no_proxy_env.setenv("HTTPS_PROXY", f"127.0.0.1:{proxy.port}")  # no scheme: http://
        with pytest.raises(SourceError) as ei:
            scrape("https://vllm.invalid/metrics", timeout=5.0)
    finally:
        proxy.close()
    assert proxy.requests[0][0] == "CONNECT vllm.invalid:443 HTTP/1.0"
    assert str(ei.value) == "GET https://vllm.invalid/metrics: cannot connect (the proxy refused the CONNECT)"


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    srv = _Server()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.httpd.socket = ctx.wrap_socket(srv.httpd.socket, server_side=True)
    yield f"https://127.0.0.1:{srv.port}/metrics", cert
    srv.close()


def test_https_verifies_the_certificate(
    tls_server: tuple[str, Path], no_proxy_env: pytest.MonkeyPatch
) -> None:
    url, cert = tls_server
    no_proxy_env.delenv("SSL_CERT_FILE", raising=False)
    no_proxy_env.delenv("SSL_CERT_DIR", raising=False)
    with pytest.raises(SourceError) as ei:
        scrape(url, timeout=5.0)
    assert str(ei.value) == f"GET {url}: cannot connect (TLS: certificate verify failed)"
    no_proxy_env.setenv("SSL_CERT_FILE", str(cert))  # the CA bundle as httpx's trust_env read it
    client = ScrapeClient()
    try:
        for _ in range(2):
            assert scrape(url, timeout=5.0, client=client)[0] == PAGE.decode()
        ctx = client.ssl_context()
        assert client.ssl_context() is ctx  # built once per client
    finally:
        client.close()
