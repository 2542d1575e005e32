"""Facts rendered back into the bundle formats read the same facts again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvdoctor.bundle_writer import (
    redact_env_text,
    redact_log_text,
    render_compute_apps_csv,
    render_gpu_csv,
    render_metrics_text,
    render_ps_text,
)
from kvdoctor.facts import GpuProcess, HostProcess
from kvdoctor.sources.metrics import parse_metrics
from kvdoctor.sources.nvidia_smi import (
    attach_processes,
    parse_compute_apps_csv,
    parse_nvidia_smi_file,
    parse_query_gpu_csv,
)
from kvdoctor.sources.processes import parse_ps_text

DATA = Path(__file__).parent / "data"
CASES = DATA / "cases"
PAGES = [
    DATA / "bench" / "vllm-0.33.0-metrics-sample.txt",
    *sorted((CASES / "b17-v1-preemption-thrash-long-prompts" / "metrics").glob("*.txt"))[:2],
    *sorted(CASES.glob("*/metrics.txt")),
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_metrics_rendered_from_facts_parse_back_to_the_same_facts(page: Path) -> None:
    want = parse_metrics(page.read_text(), timestamp=5.0)
    got = parse_metrics(render_metrics_text(want), timestamp=5.0)
    assert got == want


@pytest.mark.parametrize(
    "smi",
    [
        CASES / "b01-tp1-70b-on-8x-a100-40g" / "nvidia-smi.txt",
        CASES / "b05-foreign-process-blocks-startup" / "nvidia-smi.txt",
        DATA / "nvidia_smi" / "v535-mig.txt",
        DATA / "nvidia_smi" / "q-x-v12.xml",
    ],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_gpus_over_time_rendered_as_a_query_gpu_csv_read_back(smi: Path) -> None:
    gpus = parse_nvidia_smi_file(smi)[-1]
    moments = [
        [
            replace(
                g, timestamp=1_700_000_000.0 + t, memory_used_bytes=(g.memory_used_bytes or 0) + t * 2**20
            )
            for g in gpus
        ]
        for t in range(3)
    ]
    back = parse_query_gpu_csv(render_gpu_csv(moments))
    assert len(back) == 3
    for want_m, got_m in zip(moments, back, strict=True):
        for w, g in zip(want_m, got_m, strict=True):
            assert (g.index, g.bus_id, g.name, g.timestamp) == (w.index, w.bus_id, w.name, w.timestamp)
            assert g.memory_used_bytes == w.memory_used_bytes and g.memory_total_bytes == w.memory_total_bytes
            assert (g.utilization_gpu, g.mig_enabled, g.clock_event_reasons) == (
                w.utilization_gpu,
                w.mig_enabled,
                w.clock_event_reasons,
            )


def test_gpu_processes_rendered_as_compute_apps_attach_to_the_same_gpus() -> None:
    gpus = parse_nvidia_smi_file(CASES / "b01-tp1-70b-on-8x-a100-40g" / "nvidia-smi.txt")[-1]
    gpus = [replace(g, uuid=f"GPU-{g.index:04d}") for g in gpus]
    gpus[0] = replace(
        gpus[0], processes=[GpuProcess(pid=77, name="python3", used_bytes=40 * 2**30, type="C")]
    )
    text = render_compute_apps_csv(gpus)
    assert text is not None
    fresh = [replace(g, processes=[]) for g in gpus]
    attach_processes(fresh, parse_compute_apps_csv(text))
    assert [(p.pid, p.used_bytes) for p in fresh[0].processes] == [(77, 40 * 2**30)]
    assert all(not g.processes for g in fresh[1:])
    assert render_compute_apps_csv([replace(g, processes=[]) for g in gpus]) is None


def test_processes_rendered_as_ps_read_back_redacted() -> None:
    procs = [
        HostProcess(
            pid=101,
            ppid=1,
            name="vllm",
            cmdline=["vllm", "serve", "m", "--api-key", "sk-secret-do-not-leak-1234"],
            cpu_percent=12.5,
            rss_bytes=2 * 2**30,
        ),
        HostProcess(pid=102, ppid=101, name="VLLM::EngineCore", cmdline=["VLLM::EngineCore"]),
    ]
    text = render_ps_text(procs)
    assert "sk-secret" not in text
    back = {p.pid: p for p in parse_ps_text(text)}
    assert back[101].ppid == 1 and back[101].rss_bytes == 2 * 2**30 and back[102].ppid == 101
    assert back[101].cmdline[:3] == ["vllm", "serve", "m"]


def test_redaction_of_logs_and_env_files() -> None:
    log = (
        "INFO 01-01 00:00:00 [api_server.py:1] args: --api-key sk-secret-do-not-leak-1234\n"
        "INFO 01-01 00:00:01 [logger.py:41] Received request cmpl-1: prompt: 'tell me my secret', "
        "params: SamplingParams(n=1), prompt_token_ids: [1, 2].\n"
    )
    out = redact_log_text(log)
    assert "sk-secret" not in out and "tell me my secret" not in out and out.count("\n") == 2
    env = redact_env_text(
        "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz\nexport OPENAI_API_KEY=x1\nCUDA_VISIBLE_DEVICES=0,1\n"
    )
    assert env == "HF_TOKEN=***\nOPENAI_API_KEY=***\nCUDA_VISIBLE_DEVICES=0,1\n"


def test_cmdline_comes_from_the_newest_snapshot_that_knew_the_launch_command(tmp_path: Path) -> None:
    # A loaded host: the last process-table read timed out (no processes in the last snapshot);
    # the bundle still carries the API server's command line, redacted, from the read before.
    from kvdoctor.bundle_writer import write_bundle
    from kvdoctor.facts import Snapshot, Timeline

    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--max-model-len", "256"]
    server = HostProcess(
        pid=7, ppid=1, name="python", cmdline=[*argv, "--api-key", "sk-secret-do-not-leak-1234"]
    )
    server.vllm_role = "api_server"
    timeline = Timeline()
    timeline.append(Snapshot(timestamp=1.0, processes=[server]))
    timeline.append(Snapshot(timestamp=2.0))
    out = tmp_path / "b"
    manifest = write_bundle(timeline, out, source="live")
    text = (out / "cmdline.txt").read_text()
    assert "--max-model-len 256" in text and "sk-secret" not in text
    assert any(e.file == "cmdline.txt" and e.status == "ok" for e in manifest.entries)
