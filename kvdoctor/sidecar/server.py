"""``kvdoctor sidecar``: the live loop, evaluated every --interval, served over HTTP.

One process per serving pod. A thread runs :class:`~kvdoctor.sampler.LiveLoop` over the feed
the input flags open (live by default; ``--bundle``/``--recording`` for tests and demos) and,
after each cycle, updates the finding transitions (``for:`` / ``clear_for:``), the source
health and the :class:`~kvdoctor.sidecar.exposition.View` the endpoints read. A finite feed that
ends keeps being evaluated (its last Timeline) at the same interval, so ``for:`` elapses and the
endpoints stay current. Endpoints, all read-only (GET/HEAD; anything else 405):

- ``/metrics``  Prometheus text (prometheus-client), see :mod:`kvdoctor.sidecar.exposition`;
- ``/healthz``  200 while the process serves (liveness);
- ``/readyz``   200 while an engine source (vLLM /metrics, or a log file that exists) was read
  successfully within :func:`ready_max_age_s` (10 s, or 3 --interval when longer) — one slow
  or failed read does not flip it, an endpoint down or a log deleted for longer does, and so
  does a cycle loop that stopped; else 503 with the reason (a readiness signal for the sidecar
  itself; it never gates vLLM);
- ``/findings`` the last Report as JSON (spec/report.md);
- ``/``         a landing page linking them.

stdout gets JSON lines: ``started``, each finding ``fired`` / ``resolved`` (with ``first_seen``
and ``duration_s``), ``error`` (a bug in a cycle: the loop goes on), ``stopped``. SIGTERM and
SIGINT stop the loop and the server; the process exits within 2 s.
"""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from kvdoctor.breakdown import engine_preemption_rates, gpu_breakdown
from kvdoctor.facts import Snapshot, Timeline
from kvdoctor.pipeline import Pipeline
from kvdoctor.redact import redact_text
from kvdoctor.sampler import Cycle, LiveLoop, SnapshotFeed, error_status
from kvdoctor.sidecar.exposition import SidecarCollector, SourceHealthTracker, View, exposition_text
from kvdoctor.sidecar.transitions import Transitions, event_line, iso, rule_timings
from kvdoctor.sources.limits import reason_of

if TYPE_CHECKING:
    from kvdoctor.report import Report

#: source kinds that read an engine (readiness): vLLM's /metrics or its log.
ENGINE_SOURCE_KINDS = frozenset({"metrics", "log"})
DEFAULT_LISTEN = "127.0.0.1:8479"

_LANDING = """<!doctype html>
<html><head><meta charset="utf-8"><title>kvdoctor sidecar</title></head>
<body><h1>kvdoctor sidecar</h1>
<p>Why is this vLLM GPU out of memory (or idle), and which flag fixes it.</p>
<ul>
<li><a href="metrics">/metrics</a> Prometheus series of kvdoctor's evaluation cycle</li>
<li><a href="findings">/findings</a> the last report (JSON, kvdoctor.report/2)</li>
<li><a href="healthz">/healthz</a> liveness</li>
<li><a href="readyz">/readyz</a> readiness: an engine source was read in the last 10 s (3 intervals when longer)</li>
</ul></body></html>
"""


def _recent(timeline: Timeline, window_s: float) -> Timeline:
    """The Snapshots of the last ``window_s`` seconds (a rate needs no more; the sidecar keeps
    --history of them), as a Timeline of their own; the whole one when they carry no time."""
    snaps = timeline.snapshots
    latest = snaps[-1].timestamp if snaps else None
    if latest is None:
        return timeline
    i = len(snaps)
    while i > 0 and (snaps[i - 1].timestamp or 0.0) >= latest - window_s - 1.0:
        i -= 1
    return Timeline(snaps[i:], max_len=timeline.max_len)


#: environment variables a pod spec sets from the downward API (fieldRef metadata.namespace /
#: metadata.name): log field → variable
POD_ENV = {"namespace": "POD_NAMESPACE", "pod": "POD_NAME"}


def pod_identity(env: dict[str, str]) -> dict[str, str]:
    """``{"namespace": …, "pod": …}`` from ``env`` (:data:`POD_ENV`; unset or empty ones left
    out, each value at most 253 characters: a Kubernetes name)."""
    return {k: env[v][:253] for k, v in POD_ENV.items() if env.get(v)}


def engine_indexes(snapshot: Snapshot, report: Report) -> dict[str, str]:
    """Report engine id → vLLM's engine index (the ``engine`` label of its /metrics series,
    "0"), where the cycle's pages name exactly one for it (matched by ``model_name``: the
    engine's id or served model); engines with several (data parallel) or none are left out."""
    out: dict[str, str] = {}
    pages = [(m.model_name, m.engine) for m in snapshot.metrics if m.engine is not None]
    for e in report.engines:
        names = {str(e.get("id")), str(e.get("model"))}
        found = {idx for model, idx in pages if model in names}
        if not found and len(report.engines) == 1:  # one engine: its pages, whatever they call it
            found = {idx for _, idx in pages}
        if len(found) == 1:
            out[str(e.get("id"))] = str(found.pop())
    return out


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8479"`` / ``":8479"`` / ``"[::1]:8479"`` → (host, port). Raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {value!r}: expected HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


#: /readyz stays 200 this long after the last successful engine read (at least).
READY_MIN_AGE_S = 10.0


def ready_max_age_s(interval_s: float) -> float:
    """Seconds after the last successful engine-source read that /readyz still answers 200:
    :data:`READY_MIN_AGE_S`, or three ``--interval`` s when that is longer."""
    return max(READY_MIN_AGE_S, 3.0 * interval_s)


class Sidecar:
    """The sidecar's state and threads. ``clock`` gives unix seconds (transitions' time base).

    ``max_len`` bounds the Timeline (snapshots kept), and so the memory; :meth:`start` binds the
    server (OSError when the address is taken) and starts the loop thread; :meth:`stop` ends
    both (returns within about ``timeout_s``)."""

    def __init__(
        self,
        feed: SnapshotFeed,
        pipeline: Pipeline,
        *,
        interval_s: float = 5.0,
        listen: str = DEFAULT_LISTEN,
        max_len: int = 720,
        out: IO[str] | None = None,
        clock: Callable[[], float] = time.time,
        identity: dict[str, str] | None = None,
    ) -> None:
        from kvdoctor import __version__

        #: fields every JSON log line starts with (the pod's namespace and name, from the
        #: downward API: :func:`pod_identity`), so a log pipeline can tell the sidecars apart
        self.identity = {k: v for k, v in (identity or {}).items() if v}
        self.feed = feed
        self.pipeline = pipeline
        self.interval_s = interval_s
        self.listen = listen
        self.loop = LiveLoop(feed, pipeline, interval_s=interval_s, max_len=max_len)
        self.transitions = Transitions(rule_timings(pipeline.rules))
        self.health = SourceHealthTracker()
        self.collector = SidecarCollector(__version__)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.process_collector = ProcessCollector(registry=self.registry)
        self.out = out or sys.stdout
        self.clock = clock
        self.stop_event = threading.Event()
        self._report: Report | None = None
        self._report_json: tuple[Report | None, str] = (None, "{}")
        #: clock time of the last cycle that read an engine source, and what it read
        self._engine_ok_at: float | None = None
        self._engine_ok_what = ""
        #: why the last cycle read no engine source ("" when it did)
        self._engine_problem = "no cycle yet"
        self.cycles = 0
        self._out_lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        #: a socket pair whose write end wakes the HTTP thread's selector on stop
        self._wake: tuple[socket.socket, socket.socket] | None = None

    # ------------------------------------------------------------------ cycle

    def log(self, event: dict[str, Any]) -> None:
        """Write one JSON line to stdout (flushed); never raises (a closed stdout is ignored)."""
        with self._out_lock:
            try:
                self.out.write(event_line({**self.identity, **event} if self.identity else event) + "\n")
                self.out.flush()
            except (OSError, ValueError):
                pass

    def on_cycle(self, cycle: Cycle) -> None:
        """Fold one cycle in: transitions (logged), source health, readiness, the view."""
        report = cycle.report
        if report is None:
            return
        now = self.clock()
        for event in self.transitions.update(report.findings, now):
            self.log(event)
        self.health.update(cycle.snapshot.sources, now)
        statuses = report.sources  # redacted copies: /readyz may be read by anyone in the pod
        engine_ok = [s for s in statuses if s.kind in ENGINE_SOURCE_KINDS and s.status == "ok"]
        if engine_ok:
            self._engine_ok_at = now
            self._engine_ok_what = ", ".join(f"{s.kind} {s.origin}" for s in engine_ok)
            self._engine_problem = ""
        else:
            bad = [
                f"{s.kind} {s.origin}: {s.status} {s.detail}".strip()
                for s in statuses
                if s.kind in ENGINE_SOURCE_KINDS
            ]
            self._engine_problem = "no engine source read in the last cycle" + (
                f" ({'; '.join(bad)})" if bad else ""
            )
        self.cycles += 1
        # What the view shows is fixed now (this cycle's facts, report, window and source
        # health); the memory breakdown and the rates are worked out from them when a scrape
        # first reads the view (Prometheus scrapes less often than the sidecar cycles).
        snapshot, window_s = cycle.snapshot, self.pipeline.window_s
        recent = _recent(cycle.timeline, window_s)
        findings = self.transitions.active()
        sources = {key: h.copy() for key, h in self.health.sources.items()}  # updated in place
        evaluations, duration_s = self.cycles, cycle.duration_s

        def view() -> View:
            return View(
                findings=findings,
                breakdown=gpu_breakdown(snapshot, report),
                gpu_info=[{"index": g["index"], "uuid": g["uuid"], "name": g["name"]} for g in report.gpus],
                engines=list(report.engines),
                preemptions_per_s=engine_preemption_rates(recent, report, window_s),
                engine_index=engine_indexes(snapshot, report),
                sources=sources,
                last_evaluation=now,
                evaluation_duration_s=duration_s,
                evaluations=evaluations,
            )

        self.collector.publish(view)
        self._report = report

    @property
    def ready(self) -> bool:
        """True while an engine source was read successfully within :func:`ready_max_age_s`
        (judged when asked: a cycle loop that stopped makes it False too)."""
        at = self._engine_ok_at
        return at is not None and self.clock() - at <= ready_max_age_s(self.interval_s)

    @property
    def ready_reason(self) -> str:
        """One line for /readyz: what was read and how long ago, or why nothing was."""
        at = self._engine_ok_at
        if at is None:
            return self._engine_problem or "no engine source read yet"
        age = max(0.0, self.clock() - at)
        limit = ready_max_age_s(self.interval_s)
        head = f"engine source read {age:.1f}s ago: {self._engine_ok_what}"
        if age > limit:
            head = (
                f"no engine source read for {age:.0f}s (more than {limit:g}s); last: {self._engine_ok_what}"
            )
        return head + (f"; {self._engine_problem}" if self._engine_problem else "")

    def metrics_page(self) -> bytes:
        """The ``/metrics`` body: what ``generate_latest(self.registry)`` writes (this
        sidecar's series, then the process collector's), with the series' text made once per
        cycle (:meth:`SidecarCollector.text`)."""
        return (self.collector.text() + exposition_text(self.process_collector.collect())).encode("utf-8")

    @property
    def report_json(self) -> str:
        """The last cycle's report as spec/report.md JSON, rendered when first asked for
        (/findings) and kept until the next cycle: an unread report costs nothing."""
        from kvdoctor.report import render_json

        report = self._report
        done, text = self._report_json
        if report is None or report is done:
            return text
        text = render_json(report)
        self._report_json = (report, text)
        return text

    def _hold(self) -> None:
        """A finite feed ended: evaluate its last Timeline at the interval until stopped."""
        timeline = self.loop.timeline
        while not self.stop_event.wait(self.interval_s):
            latest = timeline.latest
            if latest is None:
                continue
            t0 = time.monotonic()
            report = self.pipeline.evaluate(timeline)
            self.on_cycle(Cycle(self.cycles, latest, timeline, report, time.monotonic() - t0))

    def _run_loop(self) -> None:
        # The loop never raises for a source; a bug in a cycle is logged and the loop goes on.
        while not self.stop_event.is_set():
            try:
                self.loop.run(self.on_cycle, self.stop_event, pace_finite=True)
                if not self.stop_event.is_set() and not self.feed.live:
                    self._hold()
                return
            except Exception as e:  # keep serving whatever a cycle did
                status = error_status("sidecar", "cycle", e)
                self.log(
                    {
                        "event": "error",
                        "time": iso(self.clock()),
                        "detail": redact_text(f"{type(e).__name__}: {status.detail}"),
                    }
                )
                self.stop_event.wait(self.interval_s)

    # ------------------------------------------------------------------ HTTP

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvdoctor-sidecar"
            sys_version = ""
            protocol_version = "HTTP/1.1"
            #: seconds a client may take per request: a hanging one cannot pin a thread.
            timeout = 5

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                """No access log on stdout: stdout carries the transition lines only."""

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                try:
                    self._route()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away
                except Exception as e:  # a bug in a view: one line, never a traceback
                    self._send(500, f"{type(e).__name__}\n".encode(), "text/plain; charset=utf-8")

            def _route(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, sidecar.metrics_page(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    code = 200 if sidecar.ready else 503
                    self._send(code, (sidecar.ready_reason + "\n").encode(), "text/plain; charset=utf-8")
                elif path == "/findings":
                    self._send(200, (sidecar.report_json + "\n").encode(), "application/json")
                elif path in ("/", "/index.html"):
                    self._send(200, _LANDING.encode(), "text/html; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            do_HEAD = do_GET  # noqa: N815

            def _read_only(self) -> None:
                self.send_response(405)
                self.send_header("Allow", "GET, HEAD")
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _read_only  # noqa: N815

        return Handler

    @property
    def busy(self) -> bool:
        """True when a thread is still inside a read after :meth:`stop` (a source that hangs up
        to its own timeout)."""
        return any(t.is_alive() for t in self._threads)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on (the real port when --listen gave 0)."""
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Bind the server and start the HTTP and loop threads. Raises OSError when the address
        cannot be bound and ValueError for a malformed --listen."""
        host, port = parse_listen(self.listen)
        sidecar = self

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                """A request that failed: one JSON line on stdout, never a traceback on stderr
                (socketserver's default); a client that went away (a probe's reset, a scrape
                cancelled) is no error at all."""
                exc = sys.exc_info()[1]
                if exc is None or isinstance(exc, (ConnectionError, TimeoutError)):
                    return
                sidecar.log({"event": "http_error", "reason": reason_of(exc)})

        self._server = Server((host, port), self._handler())
        self._wake = socket.socketpair()
        h, p = self.address
        self.log(
            {
                "event": "started",
                "listen": f"{h}:{p}",
                "interval_s": self.interval_s,
                "input": self.feed.label,
            }
        )
        for target, name in (
            (self._serve_http, "http"),
            (self._run_loop, "loop"),
        ):
            t = threading.Thread(target=target, name=f"kvdoctor-sidecar-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve_http(self) -> None:
        """Accept connections until :meth:`stop`: the thread sleeps in the selector until a
        client connects or stop wakes it (socketserver's serve_forever wakes every poll
        interval to look for a shutdown: two wake-ups a second of an idle sidecar)."""
        server = self._server
        assert server is not None and self._wake is not None
        with selectors.DefaultSelector() as sel:
            sel.register(server.socket, selectors.EVENT_READ)
            sel.register(self._wake[0], selectors.EVENT_READ)
            while not self.stop_event.is_set():
                ready = sel.select()
                if self.stop_event.is_set() or any(key.fileobj is self._wake[0] for key, _ in ready):
                    return
                try:  # socketserver's documented steps for one request
                    request, client_address = server.get_request()
                except OSError:
                    continue  # the client went away before accept
                if server.verify_request(request, client_address):
                    try:
                        server.process_request(request, client_address)  # a thread per request
                    except Exception:
                        server.handle_error(request, client_address)
                        server.shutdown_request(request)
                else:
                    server.shutdown_request(request)

    def stop(self, timeout_s: float = 0.5) -> None:
        """Stop the loop and the server; waits at most about ``timeout_s`` for the loop thread
        (a read in progress is bounded by the sources' own timeouts; the thread is a daemon)."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s  # for every thread together
        if self._wake is not None:
            try:
                self._wake[1].send(b"\0")  # wakes _serve_http's selector
            except OSError:
                pass
        http = next((t for t in self._threads if t.name.endswith("-http")), None)
        if http is not None:
            http.join(max(0.0, deadline - time.monotonic()))  # before its listening socket closes
        if self._server is not None:
            self._server.server_close()
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
            self._wake = None
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        try:
            self.feed.close()
        except Exception:
            pass
        self.log({"event": "stopped", "cycles": self.cycles})


def serve(sidecar: Sidecar) -> None:
    """Start ``sidecar`` and block until SIGTERM/SIGINT (or its stop event); then stop it."""
    import signal

    def _stop(signum: int, frame: Any) -> None:
        sidecar.stop_event.set()

    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        sidecar.start()
        # No timeout: a signal handler runs in this thread even while it waits on a lock, and
        # its set() ends the wait (an idle sidecar's main thread need not wake every second).
        sidecar.stop_event.wait()
    finally:
        sidecar.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
