"""Engine identity and several nodes (issue 7 items 1 and 3), the gaps left after the first pass:
a ``vllm preload`` weights daemon is the deployment's, pasted tables named by a shell prompt are
nodes of their own, and every per-GPU comparison (empty and stacked GPUs, growth series) keys
GPUs by (node, index). The fire / near-miss bundles run through ``tests/test_cases.py``; these
tests pin the mechanisms on the facts and variables between the sources and the rules."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from kvdoctor.facts import EngineConfig, Gpu, GpuProcess, HostProcess, LogEvent, Snapshot, Timeline
from kvdoctor.sources.bundle import load_bundle
from kvdoctor.sources.nvidia_smi import latest_gpus, parse_nvidia_smi_table

BUNDLES = Path(__file__).parent / "data" / "bundles"
GiB = 2**30
MiB = 2**20


def _variables(bundle: Path | str, configs: list[EngineConfig] | None = None) -> dict:
    from kvdoctor.derive import build_contexts

    loaded = load_bundle(BUNDLES / bundle if isinstance(bundle, str) else bundle)
    _engines, contexts, _kv = build_contexts(Timeline(snapshots=[loaded.snapshot]), loaded.configs)
    return contexts[0][1]


def _table(node: str) -> str:
    return (BUNDLES / "k3-two-nodes-heavy-stage0" / "nodes" / node / "nvidia-smi.txt").read_text()


# --------------------------------------------------------------------------- tables named by a prompt


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("root@gpu-node-a:~# nvidia-smi", "ops@gpu-node-b:~$ nvidia-smi"),
        ("[ops@gpu-node-a ~]$ nvidia-smi", "[ops@gpu-node-b ~]$ nvidia-smi"),
        ("==> gpu-node-a <==", "==> gpu-node-b <=="),
        ("### gpu-node-a", "### gpu-node-b"),
    ],
)
def test_a_prompt_or_header_names_the_tables_host(first: str, second: str) -> None:
    text = f"{first}\n{_table('gpu-node-a')}\n{second}\n{_table('gpu-node-b')}"
    moments = parse_nvidia_smi_table(text, "nvidia-smi.txt")
    gpus = latest_gpus(moments)
    # identical bus ids, but two hosts: four GPUs of one moment, not two moments of one node
    assert len(moments) == 1
    assert [(g.node, g.index) for g in gpus] == [
        ("gpu-node-a", 0),
        ("gpu-node-a", 1),
        ("gpu-node-b", 0),
        ("gpu-node-b", 1),
    ]
    assert gpus[0].memory_used_bytes == 75610 * MiB and gpus[2].memory_used_bytes == 70010 * MiB


def test_the_same_host_again_is_a_later_moment_and_other_commands_name_nothing() -> None:
    a = _table("gpu-node-a")
    later = a.replace("75610MiB", "75710MiB")
    moments = parse_nvidia_smi_table(
        f"root@gpu-node-a:~# nvidia-smi\n{a}\nroot@gpu-node-a:~# nvidia-smi\n{later}", "x"
    )
    assert len(moments) == 2 and all(g.node is None for m in moments for g in m)
    assert latest_gpus(moments)[0].memory_used_bytes == 75710 * MiB
    # a prompt that ran something else does not name the next table's host: bus ids decide
    same = parse_nvidia_smi_table(f"root@gpu-node-b:~# uptime\n{a}\n{later}", "x")
    assert len(same) == 2 and all(g.node is None for m in same for g in m)


def test_prompt_named_tables_key_the_heavy_rank_by_node() -> None:
    v = _variables("k3-prompt-named-tables-heavy-stage0")
    assert (v["rank_heavy_node"], v["rank_heavy_gpu"], v["rank_heavy_stage"]) == ("gpu-node-a", 0, 0)
    assert v["rank_spread_bytes"] == (75600 - 70000) * MiB


# --------------------------------------------------------------------------- empty / stacked GPUs by node


def test_empty_gpus_are_those_of_the_stacked_gpus_node() -> None:
    v = _variables("k3-stacked-idle-gpu-same-node")
    assert (v["stacked_node"], v["stacked_gpu"], v["gpu_node"]) == ("gpu-a", 0, "gpu-a")
    assert v["gpus_without_processes"] == [1]
    assert v["gpu_used_map"] == {0: 41690 * MiB, 1: 312 * MiB}
    other = _variables("k3-stacked-idle-gpu-other-node")
    assert other["stacked_node"] == "gpu-a" and other["gpus_without_processes"] == []


# --------------------------------------------------------------------------- growth series by node


def _gpu(node: str, used_gib: float, t: float) -> Gpu:
    return Gpu(
        index=0,
        node=node,
        memory_used_bytes=int(used_gib * GiB),
        memory_total_bytes=80 * GiB,
        timestamp=t,
        processes=[GpuProcess(pid=100 if node == "a" else 200, name="VLLM::Worker_PP0", used_bytes=None)],
    )


def test_growth_series_are_keyed_by_node_and_index() -> None:
    from kvdoctor.derive import build_contexts

    # pp 2 over two nodes, GPU 0 of each: node a flat at 70 GiB, node b rising 1 GiB per 10 min.
    series = [[_gpu("a", 70.0, 600.0 * k), _gpu("b", 40.0 + k, 600.0 * k)] for k in range(7)]
    snap = Snapshot(timestamp=3600.0, gpus=list(series[-1]), gpu_series=series)
    cfg = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", pipeline_parallel_size=2)
    _e, contexts, _kv = build_contexts(Timeline(snapshots=[snap]), [cfg])
    v = contexts[0][1]
    assert v["engine_gpu_keys"] == [("a", 0), ("b", 0)]
    assert (v["mem_growth_node"], v["mem_growth_gpu"], v["mem_growth_points"]) == ("b", 0, 7)
    assert v["mem_growth_bytes_per_hour"] == pytest.approx(6 * GiB)
    assert v["mem_growth_rise_bytes"] == 6 * GiB


# --------------------------------------------------------------------------- nodes/<host>/ bundles


def _two_node_bundle(tmp: Path, ps_on: tuple[str, ...]) -> Path:
    src = BUNDLES / "k3-two-nodes-heavy-stage0"
    root = tmp / "b"
    shutil.copytree(src, root)
    rows = {"gpu-node-a": 4101, "gpu-node-b": 5101}
    for node in ps_on:
        (root / "nodes" / node / "ps.txt").write_text(
            "    PID    PPID %CPU   RSS     ELAPSED COMMAND         COMMAND\n"
            f"  {rows[node]}       1 97.0 4100232    02:11:22 ray::RayWorkerW ray::RayWorkerWrapper\n"
        )
    return root


def test_node_process_tables_are_merged_and_known_only_when_every_node_has_one(tmp_path: Path) -> None:
    both = load_bundle(_two_node_bundle(tmp_path / "1", ("gpu-node-a", "gpu-node-b"))).snapshot
    assert {p.pid for p in both.processes} == {4101, 5101} and both.process_table_known
    # a GPU process on node b is not "dead" because node a's table does not list it
    one = load_bundle(_two_node_bundle(tmp_path / "2", ("gpu-node-a",))).snapshot
    assert {p.pid for p in one.processes} == {4101} and not one.process_table_known


# --------------------------------------------------------------------------- the `vllm preload` daemon


@pytest.mark.parametrize(
    ("argv", "daemon"),
    [
        (["vllm", "preload", "meta-llama/Llama-3.1-8B-Instruct"], True),
        (["/usr/bin/python3", "/usr/local/bin/vllm", "preload", "m", "--tensor-parallel-size", "2"], True),
        (["python3", "-m", "vllm.entrypoints.cli.main", "preload", "m"], True),
        (["vllm", "serve", "m"], False),
        (["grep", "vllm", "preload"], False),
        (["python3", "finetune_lora.py", "--devices", "0,1"], False),
    ],
)
def test_weight_daemon_command_lines(argv: list[str], daemon: bool) -> None:
    from kvdoctor.sources.processes import is_weight_daemon_cmdline, launch_fields, vllm_role

    assert is_weight_daemon_cmdline(argv) is daemon
    role = vllm_role(argv[0].rsplit("/", 1)[-1], argv)
    assert (role == "weight_daemon") is daemon
    if daemon:
        assert launch_fields(argv) == {}  # no server: no model, no gmu of an engine


def test_the_cli_module_serves_only_with_serve() -> None:
    from kvdoctor.sources.processes import launch_fields, vllm_role

    argv = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-4B", "--port", "8001"]
    assert vllm_role("python3", argv) == "api_server"
    assert launch_fields(argv)["launch_model"] == "Qwen/Qwen3-4B"


@pytest.mark.parametrize(
    ("message", "want"),
    [
        (
            "Externally held weights on device cuda:0 (14.96 GiB) exceed the desired GPU memory "
            "utilization (0.15, 11.92 GiB). Increase GPU memory utilization.",
            {"bytes": int(14.96 * GiB), "device": "cuda:0", "error": True},
        ),
        (
            "Externally held weights: 7.51 GiB on cuda:1",
            {"bytes": int(7.51 * GiB), "device": None, "error": False},
        ),
        (
            "Free memory on device cuda:0 (40.1/79.25 GiB) on startup is less than the engine's budget "
            "after excluding external process's weights (52.3 GiB).",
            {"bytes": None, "device": "cuda:0", "error": True, "free_bytes": int(40.1 * GiB)},
        ),
        ("External prefix cache hit rate: 0.0%", None),
    ],
)
def test_externally_held_weights_lines(message: str, want: dict | None) -> None:
    from kvdoctor.sources.log_engines import external_weights_line

    got = external_weights_line(message)
    if want is None:
        assert got is None
    else:
        assert got is not None and {k: got[k] for k in want} == want


def test_the_log_event_is_emitted() -> None:
    from kvdoctor.sources.vllm_log import parse_log

    log = parse_log(
        "(Worker pid=311) ERROR 03-10 08:00:40 [utils.py:741] Externally held weights on device cuda:0 "
        "(14.96 GiB) exceed the desired GPU memory utilization (0.15, 11.92 GiB).\n"
    )
    (ev,) = log.of("external_weights")
    assert ev.values["bytes"] == int(14.96 * GiB) and ev.pid == 311


def test_weight_daemon_pids_from_the_logs_external_weights() -> None:
    from kvdoctor.derive.engines import weight_daemon_pids

    gpu = Gpu(
        index=0,
        memory_used_bytes=75700 * MiB,
        memory_total_bytes=81920 * MiB,
        processes=[
            GpuProcess(pid=7, name="python3", used_bytes=8200 * MiB),
            GpuProcess(pid=311, name="VLLM::Worker_TP0", used_bytes=67490 * MiB),
            GpuProcess(pid=9120, name="python", used_bytes=5330 * MiB),
        ],
    )
    snap = Snapshot(gpus=[gpu])
    held = LogEvent(kind="external_weights", line=1, values={"bytes": int(7.51 * GiB)})
    assert weight_daemon_pids(snap, [held], frozenset({311})) == {7}
    assert weight_daemon_pids(snap, [], frozenset({311})) == frozenset()


def test_the_preload_daemon_is_the_deployments_not_foreign() -> None:
    v = _variables("k1-preload-daemon-not-foreign")
    assert v["foreign_pids"] == [] and v["stacked_gpu"] is None and v["orphan_pids"] == []
    assert v["engine_gpus"] == [0, 1]
    job = _variables("k1-preload-near-miss-real-foreign")
    assert job["foreign_pids"] == [7, 7]


# --------------------------------------------------------------------------- engines from a log alone


def test_engines_from_a_log_split_without_a_command_line() -> None:
    from kvdoctor.derive import build_contexts

    loaded = load_bundle(BUNDLES / "k2-log-only-two-engines-overcommit")
    assert loaded.configs == []
    engines, contexts, _kv = build_contexts(Timeline(snapshots=[loaded.snapshot]), loaded.configs)
    got = {e.id: (e.config.gpu_memory_utilization, e.config.port, e.pids, e.gpus) for e in engines}
    assert got == {
        "meta-llama/Llama-3.1-8B-Instruct": (0.45, 8000, [5011, 5120, 5130], [0]),
        "Qwen/Qwen3-4B": (0.6, 8001, [6201, 6310, 6320], [0]),
    }
    assert all("gpu_memory_utilization" in e.config.explicit for e in engines)
    assert [c[1]["colocated_gmus"] for c in contexts] == [[0.45, 0.6], [0.45, 0.6]]


def test_a_launch_command_takes_its_own_log_engines_args() -> None:
    from kvdoctor.derive.engines import build_engines
    from kvdoctor.sources.cmdline import parse_argv

    loaded = load_bundle(BUNDLES / "k2-log-only-two-engines-overcommit")
    # only the Qwen engine's command is known: it matches its log engine by model, not position
    cfg = parse_argv(["vllm", "serve", "Qwen/Qwen3-4B", "--max-model-len", "8192"])
    (eng,) = build_engines(loaded.snapshot, [cfg])
    assert (eng.config.max_model_len, eng.config.gpu_memory_utilization) == (8192, 0.6)
    assert eng.pids == [6201, 6310, 6320]


# --------------------------------------------------------------------------- per-rank figures from the log


def test_worker_lines_with_ip_are_a_second_source_for_rank_spread() -> None:
    v = _variables("k3-ray-worker-ip-heavy-rank")
    assert (v["rank_heavy_node"], v["rank_heavy_pid"], v["rank_heavy_gpu"]) == ("10.0.0.3", 5101, None)
    assert v["rank_spread_bytes"] == pytest.approx(5.6 * GiB, abs=2)
    assert "Available KV cache memory" in v["rank_spread_source"]
    assert _variables("k3-ray-worker-ip-balanced")["rank_spread_bytes"] <= int(0.11 * GiB)
    # with every rank on the GPUs, nvidia-smi stays the source
    assert _variables("r11-tp2-foreign-process-on-rank1")["rank_spread_source"] == "nvidia-smi"


def test_log_ranks_need_a_stage_under_pipeline_parallelism(tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(BUNDLES / "k3-ray-worker-ip-heavy-rank", root)
    (root / "cmdline.txt").write_text(
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2 --pipeline-parallel-size 2"
        " --max-model-len 65536 --distributed-executor-backend ray\n"
    )
    # Ray workers name no PP rank: which stage is heavy is unknown, so no layer partition is guessed
    v = _variables(root)
    assert v["rank_spread_source"] in (None, "nvidia-smi") and v["rank_heavy_pid"] is None
    log = (root / "vllm.log").read_text()
    named = log.replace("(RayWorkerWrapper pid=5101, ip=10.0.0.3)", "(Worker_PP1_TP0 pid=5101, ip=10.0.0.3)")
    (root / "vllm.log").write_text(named)
    v = _variables(root)
    assert (v["rank_heavy_pid"], v["rank_heavy_stage"], v["rank_heavy_node"]) == (5101, 1, "10.0.0.3")


def test_a_nodes_own_log_adds_its_ranks_figures() -> None:
    loaded = load_bundle(BUNDLES / "k3-node-logs-heavy-rank")
    log = loaded.snapshot.log
    assert log is not None
    figures = {(e.host, e.pid) for e in log.of("available_kv_memory")}
    assert figures == {(None, 3111), (None, 3112), ("gpu-node-b", 2211), ("gpu-node-b", 2212)}
    # the added figures sit in the bundle log's latest run: their pids are no earlier run's
    assert min(e.line for e in log.of("available_kv_memory") if e.host) >= max(
        e.line for e in log.events if not e.host
    )
    v = _variables("k3-node-logs-heavy-rank")
    assert (v["rank_heavy_node"], v["rank_heavy_pid"]) == ("gpu-node-b", 2212)
    assert v["orphan_pids"] == []


def test_a_sleeping_engine_does_not_own_the_daemons_weights() -> None:
    from kvdoctor.derive import build_contexts

    gpu = Gpu(
        index=0,
        memory_used_bytes=10 * GiB,
        memory_total_bytes=80 * GiB,
        processes=[
            GpuProcess(pid=7, name="python3", used_bytes=8 * GiB),
            GpuProcess(pid=99, name="VLLM::EngineCore", used_bytes=2 * GiB),
        ],
    )
    snap = Snapshot(
        gpus=[gpu],
        processes=[
            HostProcess(pid=7, name="vllm", cmdline=["vllm", "preload", "m"], vllm_role="weight_daemon"),
            HostProcess(
                pid=99, name="VLLM::EngineCor", cmdline=["VLLM::EngineCore"], vllm_role="engine_core"
            ),
        ],
        process_table_known=True,
    )
    _e, contexts, _kv = build_contexts(Timeline(snapshots=[snap]), [EngineConfig(model="m")])
    v = contexts[0][1]
    assert v["foreign_pids"] == [] and v["stacked_gpu"] is None
    assert v["sleep_engine_gpu_bytes"] == 2 * GiB


def test_each_engine_of_a_log_reads_its_own_lines() -> None:
    from kvdoctor.derive import build_contexts

    loaded = load_bundle(BUNDLES / "k2-log-only-two-engines-overcommit")
    _e, contexts, _kv = build_contexts(Timeline(snapshots=[loaded.snapshot]), loaded.configs)
    got = {eid: (v["oom_count"], v["startup_failed"]) for eid, v, _inputs in contexts}
    # the Qwen engine ran out of memory while profiling; the Llama engine started fine
    assert got == {"meta-llama/Llama-3.1-8B-Instruct": (0, False), "Qwen/Qwen3-4B": (1, True)}


@pytest.mark.parametrize(
    "bundle",
    [
        "r04-dp2-engines-preempting",
        "r22-dp2-storm-on-engine1-only",
        "r17-restart-old-failure-current-healthy",
    ],
)
def test_data_parallel_engines_and_a_restart_are_one_server(bundle: str) -> None:
    from kvdoctor.derive.engines import build_engines, separate_log_engines

    loaded = load_bundle(BUNDLES / bundle)
    assert loaded.snapshot.log is not None and len(loaded.snapshot.log.engines) == 2
    assert separate_log_engines(loaded.snapshot.log) == []
    assert len(build_engines(loaded.snapshot, [])) == 1


# --------------------------------------------------------------------------- kernel XIDs by node


def test_a_nodes_xid_names_that_nodes_gpu(tmp_path: Path) -> None:
    src = BUNDLES / "r28-xid79-gpu-fell-off-bus"
    root = tmp_path / "b"
    for node in ("gpu-node-a", "gpu-node-b"):
        (root / "nodes" / node).mkdir(parents=True)
        shutil.copy(src / "nvidia-smi.txt", root / "nodes" / node / "nvidia-smi.txt")
    shutil.copy(src / "cmdline.txt", root / "cmdline.txt")
    shutil.copy(src / "dmesg.txt", root / "nodes" / "gpu-node-b" / "dmesg.txt")
    snap = load_bundle(root).snapshot
    assert {x["node"] for x in snap.xid_events} == {"gpu-node-b"}
    v = _variables(root)
    # identical bus ids on both nodes: the XID is node b's GPU 0, never node a's
    assert "GPU 0 of node gpu-node-b (00000000:07:00.0)" in v["xid_desc"]
    assert "gpu-node-a" not in v["xid_desc"]


@pytest.mark.parametrize("header", ["### Before", "### nvidia-smi", "==> nvidia-smi.txt <==", "## Output"])
def test_a_report_heading_names_no_host(header: str) -> None:
    a = _table("gpu-node-a")
    later = a.replace("75610MiB", "75710MiB")
    moments = parse_nvidia_smi_table(f"{header}\n{a}\n### After\n{later}", "x")
    # headings of one machine's readings: two moments of one node, not two nodes
    assert len(moments) == 2 and all(g.node is None for m in moments for g in m)


def test_gpu_count_is_the_engines_node_when_the_bundle_spans_nodes(tmp_path: Path) -> None:
    # Engine spanning both nodes (TP×PP over Ray): every node's GPUs count.
    assert _variables("k3-two-nodes-heavy-stage0")["gpu_count"] == 4
    # The same two nodes with a TP=2 engine on one of them (the other node's cards empty): it
    # counts that node's GPUs only; a TP suggestion must not reach the other node's cards.
    root = tmp_path / "b"
    shutil.copytree(BUNDLES / "k3-two-nodes-heavy-stage0", root)
    snap = load_bundle(root).snapshot
    nodes = {g.node for g in snap.gpus}
    assert len(nodes) == 2
    one = next(iter(sorted(n for n in nodes if n)))
    from kvdoctor.derive import build_contexts

    kept = [g for g in snap.gpus if g.node == one] + [
        dataclasses.replace(g, processes=[]) for g in snap.gpus if g.node != one
    ]
    loaded = load_bundle(root)
    tp2 = [dataclasses.replace(c, pipeline_parallel_size=1) for c in loaded.configs]
    _e, contexts, _kv = build_contexts(Timeline(snapshots=[dataclasses.replace(snap, gpus=kept)]), tp2)
    v = contexts[0][1]
    assert {n for n, _ in v["engine_gpu_keys"]} == {one}
    assert v["gpu_count"] == sum(1 for g in snap.gpus if g.node == one)
