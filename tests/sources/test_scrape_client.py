"""The live /metrics scrape (``kvdoctor.sources.metrics.ScrapeClient``: the connection by stdlib
http.client, the response parsed by httptools): keep-alive reuse, reconnecting after the server
closed, never reusing a half-read response, Basic auth from the URL, proxies from the
environment, one deadline for drip-fed headers, TLS; chunked, dripped, read-to-close and
refused responses, the header block's cap, the request's bytes.

The hostile cases (dead, 500, hanging, drip-fed body, garbage, 50 MB, gzip bomb, credentials in
messages) are tests/test_hostile.py's and tests/sources/test_metrics.py's.
"""

from __future__ import annotations

import base64
import contextlib
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


# --------------------------------------------------------------------------- the response, as httptools parses it


class _Raw:
    """A loopback server writing raw bytes: ``answer(conn, n)`` answers the n-th request (0-based,
    over all connections) on the accepted socket ``conn``; returns False to close the connection
    after it. Counts connections and the bytes it managed to send."""

    def __init__(self, answer: Callable[[socket.socket, int], bool]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.connections = 0
        self.requests = 0
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        threading.Thread(target=self._serve, args=(answer,), daemon=True).start()

    def _serve(self, answer: Callable[[socket.socket, int], bool]) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn, answer), daemon=True).start()

    def _one(self, conn: socket.socket, answer: Callable[[socket.socket, int], bool]) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with conn:
                while True:
                    req = b""
                    while b"\r\n\r\n" not in req:
                        data = conn.recv(65536)
                        if not data:
                            return
                        req += data
                    n = self.requests
                    self.requests += 1
                    if not answer(conn, n):
                        return
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def _head(extra: bytes = b"", length: int | None = len(PAGE)) -> bytes:
    cl = b"Content-Length: %d\r\n" % length if length is not None else b""
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n" + cl + extra + b"\r\n"


def _chunked(body: bytes, size: int) -> bytes:
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)
    )
    return out + b"0\r\n\r\n"


@contextlib.contextmanager
def _serving(answer: Callable[[socket.socket, int], bool]) -> Iterator[_Raw]:
    """A :class:`_Raw` server for the ``with`` block, closed after it."""
    srv = _Raw(answer)
    try:
        yield srv
    finally:
        srv.close()


def _scrapes(url: str, n: int, **kw: float) -> list[str]:
    client = ScrapeClient()
    try:
        return [scrape(url, timeout=kw.get("timeout", 5.0), client=client)[0] for _ in range(n)]
    finally:
        client.close()


def test_a_chunked_page_is_read_and_its_connection_kept() -> None:
    big = PAGE * 300  # ~26 KB in 1000-byte chunks, one with a chunk extension
    body = _chunked(big, 1000).replace(b"3e8\r\n", b"3e8;ext=1\r\n", 1)

    with _serving(
        lambda c, n: c.sendall(_head(b"Transfer-Encoding: chunked\r\n", None) + body) is None
    ) as srv:
        assert _scrapes(srv.url, 5) == [big.decode()] * 5
    assert srv.requests == 5 and srv.connections == 1


def test_keep_alive_one_connection_for_many_scrapes_with_gzip() -> None:
    import gzip

    body = gzip.compress(PAGE)
    reply = _head(b"Content-Encoding: gzip\r\n", len(body)) + body
    with _serving(lambda c, n: c.sendall(reply) is None) as srv:
        assert _scrapes(srv.url, 20) == [PAGE.decode()] * 20
    assert srv.connections == 1


def test_connection_close_and_http_1_0_are_not_reused() -> None:
    replies = [
        _head(b"Connection: close\r\n") + PAGE,
        _head().replace(b"HTTP/1.1", b"HTTP/1.0") + PAGE,
    ]
    for reply in replies:
        srv = _Raw(lambda c, n, reply=reply: c.sendall(reply) is None)  # the server would keep it
        try:
            assert _scrapes(srv.url, 3) == [PAGE.decode()] * 3
        finally:
            srv.close()
        assert srv.connections == 3


def test_a_body_without_length_is_read_to_the_close() -> None:
    def answer(c: socket.socket, n: int) -> bool:
        c.sendall(_head(length=None) + PAGE[:20])
        time.sleep(0.05)
        c.sendall(PAGE[20:])
        return False  # the close ends the body

    with _serving(answer) as srv:
        assert _scrapes(srv.url, 2) == [PAGE.decode()] * 2
    assert srv.connections == 2


def test_a_body_dripped_in_many_small_sends_within_the_deadline() -> None:
    big = PAGE * 40  # ~3.5 KB in 32-byte sends, 1 ms apart: ~0.1 s of a 5 s deadline

    def drip(body: bytes, c: socket.socket) -> None:
        for i in range(0, len(body), 32):
            c.sendall(body[i : i + 32])
            time.sleep(0.001)

    def answer(c: socket.socket, n: int) -> bool:
        if n % 2:
            drip(_head(b"Transfer-Encoding: chunked\r\n", None) + _chunked(big, 100), c)
        else:
            drip(_head(length=len(big)) + big, c)
        return True

    with _serving(answer) as srv:
        assert _scrapes(srv.url, 4) == [big.decode()] * 4
    assert srv.connections == 1


def test_a_header_block_over_the_cap_is_refused_without_reading_on() -> None:
    sent: list[int] = []

    def endless(c: socket.socket, n: int) -> bool:
        c.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: ")
        total = 0
        try:
            while total < 64 << 20:  # one header value that never ends (64 MiB if read)
                c.sendall(b"a" * 4096)
                total += 4096
        except OSError:
            pass
        sent.append(total)
        return False

    def many(c: socket.socket, n: int) -> bool:
        c.sendall(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n")
        return False

    for answer, timeout, why in (
        (endless, 10.0, "response headers larger than 64 KiB"),
        (many, 5.0, "more than 100 response headers"),
    ):
        with _serving(answer) as srv:
            t0 = time.monotonic()
            with pytest.raises(SourceError) as ei:
                scrape(srv.url, timeout=timeout)
            assert time.monotonic() - t0 < timeout / 2  # refused, not timed out
        assert str(ei.value) == f"GET {srv.url}: {why}"
    time.sleep(0.2)
    assert sent and sent[0] < 16 << 20  # the client stopped reading long before 64 MiB


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (b"HTTX/1.1 200 OK\r\n\r\nhunter2", "BadStatusLine"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "BadStatusLine"),
        (b"HTTP/1.1 200 OK\r\nX hunter2: y\r\n\r\n", "InvalidHeader"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhunter2", "InvalidHeader"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: hunter2\r\n\r\n", "InvalidHeader"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz-hunter2\r\n", "InvalidBody"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n# short\n", "IncompleteRead"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n# abc", "IncompleteRead"),
    ],
)
def test_a_response_llhttp_rejects_is_one_line_never_its_bytes(reply: bytes, why: str) -> None:
    with _serving(lambda c, n: c.sendall(reply) and False) as srv:
        with pytest.raises(SourceError) as ei:
            scrape(srv.url, timeout=5.0)
    assert str(ei.value) == f"GET {srv.url}: {why} (the server's response is not valid HTTP)"


def test_interim_1xx_answers_are_skipped() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + _head() + PAGE
    with _serving(lambda c, n: c.sendall(reply) is None) as srv:
        assert _scrapes(srv.url, 2) == [PAGE.decode()] * 2
    assert srv.connections == 1


def test_bytes_past_the_response_make_the_connection_unusable() -> None:
    """A server that answers more than it was asked (stray bytes after the message): the page
    is read, the connection is not reused for the next scrape (it would read them as its answer)."""
    with _serving(lambda c, n: c.sendall(_head() + PAGE + b"HTTP/1.1 200 OK\r\n") is None) as srv:
        assert _scrapes(srv.url, 2) == [PAGE.decode()] * 2
    assert srv.connections == 2


def test_the_request_is_what_http_client_sent() -> None:
    got: list[bytes] = []

    class Capture(_Raw):
        def _one(self, conn: socket.socket, answer: Callable[[socket.socket, int], bool]) -> None:
            got.append(conn.recv(65536))
            conn.sendall(_head() + PAGE)
            conn.close()

    srv = Capture(lambda c, n: False)
    port = srv.sock.getsockname()[1]
    try:
        scrape(f"http://u:p@127.0.0.1:{port}/metrics?x=1", timeout=5.0)
    finally:
        srv.close()
    assert got == [
        b"GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAccept-Encoding: gzip, deflate\r\nAccept: */*\r\n"
        b"Authorization: Basic %s\r\n\r\n" % (port, base64.b64encode(b"u:p"))
    ]
