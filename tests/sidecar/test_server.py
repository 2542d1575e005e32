"""The sidecar end to end in-process: /metrics (promtool-clean), /healthz, /readyz, /findings, /,
the transitions log, read-only endpoints; and as a process: SIGTERM/SIGINT exit within 2 s."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.pipeline import Pipeline
from kvdoctor.sidecar.server import Sidecar, parse_listen
from tests.sidecar.conftest import DATA, FakeVllm, get, live_feed, wait_for

B05 = DATA / "cases" / "b05-foreign-process-blocks-startup"


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def series(base: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, v) for n, labels, v in samples(get(base + "/metrics").text) if n == name]


def test_metrics_pass_promtool_and_follow_conventions(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: series(base, "kvdoctor_finding"))
    resp = get(base + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (.ci/run installs the Debian package prometheus)")
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "_created" not in text
    helps = [line for line in text.splitlines() if line.startswith("# HELP kvdoctor_")]
    assert helps and all("kvdoctor" in h for h in helps)
    assert all("evaluation cycle" in h for h in helps if "build_info" not in h)
    assert "_percent" not in text  # ratios, never percentages


def parts_uuid(base: str) -> str:
    """The one uuid the memory series carry (they join DCGM's UUID)."""
    (uuid,) = {lb["uuid"] for lb, _ in series(base, "kvdoctor_gpu_memory_bytes")}
    return uuid


def test_bundle_finding_flags_and_memory_breakdown(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    base = sc.base  # type: ignore[attr-defined]
    (labels, value), *_ = wait_for(lambda: series(base, "kvdoctor_finding"))
    assert value == 1.0
    assert labels == {
        "rule": "gpu-shared-with-foreign-process",
        "severity": "critical",
        "family": "K",
        "model_name": "Qwen/Qwen2.5-7B-Instruct",  # vLLM's model_name
        "engine": "",  # vLLM's engine index: no /metrics page in this bundle names one
        "gpu": "0",
    }
    flags = series(base, "kvdoctor_suggested_flag_info")
    assert [(lb["flag"], lb["value"]) for lb, _ in flags] == [("--gpu-memory-utilization", "0.65")]
    parts = {lb["part"]: v for lb, v in series(base, "kvdoctor_gpu_memory_bytes")}
    (total,) = [v for _, v in series(base, "kvdoctor_gpu_memory_total_bytes")]
    # nvidia-smi.txt: 15796 MiB used of 49140 MiB, 15790 MiB of it by pid 48213, not vLLM.
    assert parts["foreign"] == 15790 * 2**20
    assert parts["free"] == total - 15796 * 2**20 == (49140 - 15796) * 2**20
    assert "other_engines" not in parts  # a part nothing holds is not exported
    assert (
        parts["engine"] == (15796 - 15790) * 2**20
    )  # used beyond the listed processes: the engine placed there
    (util,) = series(base, "kvdoctor_gpu_utilization_ratio")
    assert 0 <= util[1] <= 1
    (info,) = series(base, "kvdoctor_gpu_info")
    assert info[0]["model_name"] == "Qwen/Qwen2.5-7B-Instruct" and info[0]["attribution"] == "gpu"
    # the same uuid on every GPU series ("" here: this bundle's nvidia-smi table prints none;
    # live NVML always gives one, tests/sidecar/test_container.py)
    assert info[0]["uuid"] == parts_uuid(base) == ""
    (build,) = series(base, "kvdoctor_build_info")
    assert build[0]["version"]
    up = {lb["source"]: v for lb, v in series(base, "kvdoctor_source_up")}
    assert up["nvidia-smi"] == 1.0 and up["log"] == 1.0
    # read-only and landing page
    assert httpx.post(base + "/metrics", timeout=5).status_code == 405
    landing = get(base + "/").text
    assert all(f'href="{p}"' in landing for p in ("metrics", "findings", "healthz", "readyz"))
    assert get(base + "/nope").status_code == 404
    assert get(base + "/healthz").status_code == 200


def test_findings_endpoint_is_the_report(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    base = sc.base  # type: ignore[attr-defined]
    report = wait_for(lambda: get(base + "/findings").json() or None)
    assert report["schema"] == "kvdoctor.report/2"
    assert [f["rule"] for f in report["findings"]][:1] == ["gpu-shared-with-foreign-process"]


def test_live_storm_fires_logs_and_readyz(start_sidecar: Callable[..., Sidecar], fake_vllm: FakeVllm) -> None:
    sc = start_sidecar(live_feed(fake_vllm.url), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    got = wait_for(
        lambda: [lb for lb, _ in series(base, "kvdoctor_finding") if lb["rule"] == "preemption-storm"], 15
    )
    # vLLM's label meanings: its series of the same engine join on (model_name, engine)
    assert got[0]["model_name"] == "meta-llama/Llama-3.1-8B-Instruct" and got[0]["engine"] == "0"
    assert got[0]["severity"] == "warning"
    r = get(base + "/readyz")
    assert r.status_code == 200 and "metrics" in r.text
    cap = series(base, "kvdoctor_engine_kv_capacity_tokens")
    usage = series(base, "kvdoctor_engine_kv_usage_ratio")
    rate = series(base, "kvdoctor_engine_preemptions_per_second")
    assert cap and cap[0][1] > 0 and usage and 0.9 <= usage[0][1] <= 1 and rate and rate[0][1] > 0
    assert usage[0][0] == {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}
    events = [json.loads(line) for line in sc.out.lines()]  # type: ignore[attr-defined]
    assert events[0]["event"] == "started"
    fired = [e for e in events if e.get("event") == "fired" and e["rule"] == "preemption-storm"]
    assert fired and fired[0]["first_seen"].endswith("Z") and "duration_s" in fired[0]


def test_readyz_is_503_without_an_engine_source(start_sidecar: Callable[..., Sidecar]) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    sc = start_sidecar(live_feed(f"http://127.0.0.1:{port}/metrics"), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: sc.cycles >= 2)
    r = get(base + "/readyz")
    assert r.status_code == 503 and "connection refused" in r.text
    assert get(base + "/healthz").status_code == 200
    (err,) = [v for lb, v in series(base, "kvdoctor_source_errors_total") if lb["source"] == "metrics"]
    assert err >= 2


def test_log_lines_name_the_pod_from_the_downward_api() -> None:
    from kvdoctor.sidecar.server import pod_identity

    ident = pod_identity({"POD_NAMESPACE": "ml", "POD_NAME": "vllm-0", "HOSTNAME": "x"})
    assert ident == {"namespace": "ml", "pod": "vllm-0"}
    assert pod_identity({"POD_NAME": ""}) == {}  # near miss: unset or empty adds nothing
    out = io.StringIO()
    sc = Sidecar(open_feed(InputOptions(bundle=B05)), Pipeline.load(), out=out, identity=ident)
    try:
        sc.log({"event": "fired", "rule": "r"})
    finally:
        sc.feed.close()
    assert json.loads(out.getvalue()) == {"namespace": "ml", "pod": "vllm-0", "event": "fired", "rule": "r"}


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:8479") == ("127.0.0.1", 8479)
    assert parse_listen(":9000") == ("0.0.0.0", 9000)
    assert parse_listen("[::1]:8479") == ("::1", 8479)
    with pytest.raises(ValueError):
        parse_listen("8479x")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_process_within_two_seconds(sig: signal.Signals, fake_vllm: FakeVllm) -> None:
    port = _free_port()
    fake_vllm.mode = "hang"  # a read in progress must not hold the exit
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdoctor", "sidecar", "--metrics", fake_vllm.url, "--no-nvml"]
        + ["--listen", f"127.0.0.1:{port}", "--interval", "0.5", "--timeout", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        wait_for(lambda: _answers(port), 20)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = proc.communicate()
    assert rc == 0, err
    assert elapsed < 2.0, elapsed
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0]["event"] == "started" and events[-1]["event"] == "stopped"
    assert "Traceback" not in err


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_busy_port_is_a_one_line_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvdoctor",
                "sidecar",
                "--bundle",
                str(B05),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        s.close()
    assert r.returncode == 3
    assert r.stderr.strip().startswith("kvdoctor: cannot listen on") and "Traceback" not in r.stderr


def test_credentials_in_a_metrics_url_never_reach_an_endpoint(start_sidecar: Callable[..., Sidecar]) -> None:
    port = _free_port()
    secret = "s3cr3t-pass"
    sc = start_sidecar(live_feed(f"http://admin:{secret}@127.0.0.1:{port}/metrics"), interval_s=0.2)
    base = sc.base  # type: ignore[attr-defined]
    wait_for(lambda: sc.cycles >= 2)
    for path in ("/readyz", "/metrics", "/findings"):
        assert secret not in get(base + path).text
    assert all(secret not in line for line in sc.out.lines())  # type: ignore[attr-defined]


def test_a_failing_cycle_is_logged_and_the_loop_goes_on(start_sidecar: Callable[..., Sidecar]) -> None:
    from kvdoctor.pipeline import Pipeline

    class Flaky(Pipeline):
        calls = 0

        def evaluate(self, timeline, *, now=None):  # type: ignore[no-untyped-def]
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise RuntimeError("bug with token hf_abcdefghijklmnopqrstuvwxyz123456")
            return super().evaluate(timeline, now=now)

    real = Pipeline.load()
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)), pipeline=Flaky(rules=real.rules), interval_s=0.1)
    wait_for(lambda: sc.cycles >= 3)
    events = [json.loads(line) for line in sc.out.lines()]  # type: ignore[attr-defined]
    (err,) = [e for e in events if e["event"] == "error"]
    assert err["detail"].startswith("RuntimeError") and "hf_abcdefghijklmnop" not in err["detail"]
    assert get(sc.base + "/healthz").status_code == 200  # type: ignore[attr-defined]


def test_preemption_rate_reads_only_the_window_of_a_long_history() -> None:
    from kvdoctor.facts import EngineMetrics, Snapshot, Timeline
    from kvdoctor.sidecar.server import _recent

    snaps = [
        Snapshot(
            timestamp=1000.0 + t, metrics=[EngineMetrics(timestamp=1000.0 + t, num_preemptions_total=2.0 * t)]
        )
        for t in range(600)
    ]
    timeline = Timeline(snaps, max_len=720)
    recent = _recent(timeline, 60.0)
    assert recent.snapshots[0].timestamp == 1000.0 + 599 - 61 and recent.snapshots[-1] is snaps[-1]
    assert len(timeline.snapshots) == 600  # the sidecar's own Timeline is left as it was
    assert _recent(Timeline([Snapshot()]), 60.0).snapshots == [Snapshot()]


def test_findings_json_is_rendered_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import io

    from kvdoctor import report as report_mod
    from kvdoctor.pipeline import Pipeline

    calls: list[int] = []
    real = report_mod.render_json
    monkeypatch.setattr(report_mod, "render_json", lambda r: calls.append(1) or real(r))
    feed = open_feed(InputOptions(bundle=B05))
    sc = Sidecar(feed, Pipeline.load(), interval_s=1.0, out=io.StringIO())
    try:
        cycle = sc.loop.step()
        assert cycle is not None
        for _ in range(3):
            sc.on_cycle(cycle)
        assert calls == []  # three cycles, nobody asked
        doc = json.loads(sc.report_json)
        assert doc["schema"] == "kvdoctor.report/2" and sc.report_json and calls == [1]  # kept
        sc.on_cycle(dataclasses.replace(cycle, report=sc.pipeline.evaluate(cycle.timeline)))
        assert json.loads(sc.report_json) == doc and calls == [1, 1]  # a new report: rendered anew
    finally:
        feed.close()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc: a thread's context switches")
def test_an_idle_http_thread_sleeps_until_a_client_or_stop(start_sidecar: Callable[..., Sidecar]) -> None:
    # socketserver's serve_forever woke every poll interval to look for a shutdown request
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    base = sc.base  # type: ignore[attr-defined]
    get(base + "/healthz")
    (http,) = [t for t in sc._threads if t.name.endswith("-http")]

    def switches() -> int:
        status = Path(f"/proc/self/task/{http.native_id}/status").read_text()
        return int(
            next(ln.split()[1] for ln in status.splitlines() if ln.startswith("voluntary_ctxt_switches"))
        )

    time.sleep(0.2)  # the request's thread handed off
    before = switches()
    time.sleep(1.6)
    assert switches() - before == 0  # not one wake-up in 1.6 s (0.5 s polls woke 3 times)
    assert get(base + "/healthz").status_code == 200  # and a client still wakes it
    sc.stop()
    http.join(2.0)
    assert not http.is_alive()


def test_a_client_that_resets_leaves_no_traceback(
    start_sidecar: Callable[..., Sidecar], capfd: pytest.CaptureFixture[str]
) -> None:
    # a TCP probe or a cancelled scrape resets the connection mid-request: socketserver's
    # default printed a traceback on stderr for each; the sidecar goes on serving
    import struct

    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    host, port = sc.address
    for _ in range(3):
        s = socket.create_connection((host, port))
        s.send(b"GET /metr")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    assert get(sc.base + "/healthz").status_code == 200  # type: ignore[attr-defined]
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err


def test_a_failing_request_is_one_log_line(start_sidecar: Callable[..., Sidecar]) -> None:
    sc = start_sidecar(open_feed(InputOptions(bundle=B05)))
    lines: list[str] = []
    sc.log = lambda event: lines.append(json.dumps(event))  # type: ignore[method-assign]
    server = sc._server
    assert server is not None
    try:
        raise ValueError("a handler bug quoting input: secret-token")
    except ValueError:
        server.handle_error(None, ("127.0.0.1", 1))
    (line,) = lines
    assert '"http_error"' in line and "ValueError" in line and "secret-token" not in line
