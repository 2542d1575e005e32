#!/usr/bin/env python3
"""Writes the bundles of tests/data/bundles/ named ``p2-*``: rules of families K/U/P/W on vLLM
0.34 (spec/vllm-0.34.md §2, §3.1) and issue 24 kinds 3, 4, 7, 8, each one that fires and a near
miss. The 0.34 log lines are vllm-facts §9's format strings, taken from
tests/data/bundles-034/build.py (its ``Log``, ``smi`` and templates); 0.33 lines are the ones
the existing r*/k* bundles carry.

Run: ``python tests/data/build_p2_bundles.py`` (rewrites the p2-* directories).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "bundles"
_spec = importlib.util.spec_from_file_location("build034", HERE / "bundles-034" / "build.py")
assert _spec is not None and _spec.loader is not None
b34 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(b34)

GiB, MiB = 2**30, 2**20
T_MIB = 81090  # H100 80GB HBM3 as torch sees it (79.19 GiB)
SMI_TOTAL = 81559
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def write(name: str, files: dict[str, str], expected: dict) -> None:
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def smi(used: int, procs: list[tuple[int, str, int]], util: int = 0) -> str:
    return b34.smi("NVIDIA H100 80GB HBM3", used, SMI_TOTAL, procs).replace(
        "|      0%      Default", f"|    {util:>3}%      Default"
    )


def ps(rows: list[tuple[int, int, str]]) -> str:
    head = "    PID    PPID %CPU   RSS     ELAPSED COMMAND         COMMAND\n"
    return head + "".join(
        f"{pid:7d} {ppid:7d}  3.1 2911232    01:12:44 {cmd.split()[0][-15:]:<15} {cmd}\n"
        for pid, ppid, cmd in rows
    )


def ext_engine_log(
    api: int, core: int, args: str, *, pool_mib: int, f1_mib: int, kept_mib: int = 1900, tail: list[str] = ()
) -> str:
    """A healthy 0.34 extensible Llama-3.1-8B start on one H100 (§9.2's engine), then ``tail``."""
    log = b34.Log("12-07")
    log.banner(api, "0.34.0", LLAMA, args)
    log.engine(core, "0.34.0", LLAMA, 131072)
    log.add("EngineCore", core, b34.BACKEND, src="cuda.py:549")
    log.add(
        "EngineCore",
        core,
        "Model loading took 14.99 GiB memory and 5.604417 seconds",
        src="model_runner.py:441",
    )
    log.add("EngineCore", core, b34.AVAILABLE % b34.gib(T_MIB - 16000 - 1400), src="gpu_worker.py:795")
    log.add("EngineCore", core, b34.GRAPHS % (9, 576 / 1024), src="model_runner.py:1216")
    n = pool_mib // 8
    cap = 16100 + f1_mib - pool_mib - 512
    log.add(
        "EngineCore",
        core,
        b34.AFTER_WARMUP
        % (b34.gib(f1_mib), b34.gib(64), b34.gib(kept_mib), b34.gib(1700), b34.gib(kept_mib), n,
           b34.gib(pool_mib), b34.gib(T_MIB), b34.gib(cap)),
        src="extensible_kv_cache.py:693",
    )  # fmt: skip
    tokens, conc = b34.cap_tokens(n, 131072, 64)
    log.add(
        "EngineCore",
        core,
        b34.CAPACITY % ("GPU", f"{tokens:,}", f"{131072:,}", conc),
        src="kv_cache_utils.py:1168",
    )
    log.add("EngineCore", core, b34.EXTENDED % (n, pool_mib / 1024), src="extensible_kv_cache.py:536")
    log.add(
        "EngineCore",
        core,
        "init engine (profile, create kv cache, warmup model) took 50.62 s",
        src="core.py:450",
    )
    log.add("APIServer", api, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
    for line in tail:
        log.add("APIServer", api, line, src="loggers.py:336")
    return log.text()


CONFIG = json.dumps(b34.LLAMA_8B, indent=1) + "\n"
UNSET_ARGS = "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct'}"


def n1_bundles() -> None:
    """N1 shared-gpu-gmu-unset: a notebook beside a gmu-unset 0.34 engine (warning), the same with
    the engine's run-time OOM at < 1 GiB free (critical), and near misses: explicit gmu, a
    monitoring tool's 200 MiB context, the same notebook beside a 0.33 engine."""
    pool = 60608  # 59.19 GiB
    log = ext_engine_log(2041, 2187, UNSET_ARGS, pool_mib=pool, f1_mib=63740, tail=[b34.HEALTHY_TRAFFIC])
    engine_used = 16100 + pool + 1900
    note_mib = 2970
    procs = [(2187, "VLLM::EngineCore", engine_used), (7311, "/opt/conda/bin/python3.11", note_mib)]
    table = ps([(2041, 1, f"/opt/venv/bin/python /opt/venv/bin/vllm serve {LLAMA}"), (2187, 2041, "VLLM::EngineCore"),
                (7311, 7002, "/opt/conda/bin/python3.11 -m ipykernel_launcher -f kernel-3.json")])  # fmt: skip
    gmu = int((T_MIB - note_mib - 512) / T_MIB * 100) / 100
    write(
        "p2-v34-n1-notebook-beside-gmu-unset",
        {
            "vllm.log": log,
            "cmdline.txt": f"vllm serve {LLAMA}\n",
            "nvidia-smi.txt": smi(engine_used + note_mib + 10, procs),
            "ps.txt": table,
            "config.json": CONFIG,
        },
        {
            "fires": ["shared-gpu-gmu-unset"],
            "not_fires": [
                "gpu-shared-with-foreign-process",
                "colocated-engines-overcommit",
                "orphaned-engine-processes",
            ],
            "flags": {"shared-gpu-gmu-unset": {"--gpu-memory-utilization": [gmu - 0.01, gmu]}},
            "max_health": "warning",
            "note": (
                "vLLM 0.34, gmu unset, extensible (Memory after warmup logged): Llama-3.1-8B commits 59.19 GiB of KV on"
                f" one H100 while a Jupyter kernel (pid 7311) holds {note_mib} MiB. spec/vllm-0.34.md N1: warning"
                f" (nothing failed yet), fix gmu = floor_0.01((T - {note_mib} MiB - 0.5 GiB)/T) = {gmu}; the gmu rule"
                " of 0.33 (gpu-shared-with-foreign-process) gives way."
            ),
        },
    )
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19"
        " GiB of which 412.00 MiB is free. Process 7311 has 6.20 GiB memory in use. Including non-PyTorch memory,"
        " this process has 72.45 GiB memory in use. Of the allocated memory 70.10 GiB is allocated by PyTorch, with"
        " 61.20 GiB allowed; and 1.21 GiB is reserved by PyTorch but unallocated."
    )
    traffic = (
        "Engine 000: Avg prompt throughput: 8123.0 tokens/s, Avg generation throughput: 412.0 tokens/s, Running: 48"
        " reqs, Waiting: 0 reqs, GPU KV cache usage: 41.0%, Prefix cache hit rate: 0.0%"
    )
    log_oom = ext_engine_log(2041, 2187, UNSET_ARGS, pool_mib=pool, f1_mib=63740, tail=[traffic])
    log_oom += (
        "(EngineCore pid=2187) ERROR 12-07 10:05:10 [core.py:1011] EngineCore encountered a fatal error.\n"
    )
    log_oom += f"(EngineCore pid=2187) ERROR 12-07 10:05:10 [core.py:1011] {oom}\n"
    note_big = 6350
    write(
        "p2-v34-n1-notebook-grew-engine-oom",
        {
            "vllm.log": log_oom,
            "cmdline.txt": f"vllm serve {LLAMA}\n",
            "nvidia-smi.txt": smi(
                engine_used + note_big + 10,
                [(2187, "VLLM::EngineCore", engine_used), (7311, "/opt/conda/bin/python3.11", note_big)],
                util=97,
            ),
            "ps.txt": table,
            "config.json": CONFIG,
        },
        {
            "fires": ["shared-gpu-gmu-unset"],
            "not_fires": ["gpu-shared-with-foreign-process", "idle-preallocation"],
            "flags": {"shared-gpu-gmu-unset": {"--gpu-memory-utilization": [0.9, 0.92]}},
            "note": (
                "The same engine and notebook; the notebook grew to 6.2 GiB and the engine's next step ran out of"
                " memory with 412 MiB free (spec N1 critical evidence (b)). gmu = floor_0.01((79.19 - 6.2 - 0.5)/79.19)"
                " = 0.91, as in spec §3.1's worked example."
            ),
        },
    )
    expl = ext_engine_log(2041, 2187, "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct', 'gpu_memory_utilization': 0.9}",
                          pool_mib=54336, f1_mib=63740, tail=[b34.HEALTHY_TRAFFIC])  # fmt: skip
    used9 = 16100 + 54336 + 1900
    write(
        "p2-v34-n1-near-miss-explicit-gmu",
        {
            "vllm.log": expl,
            "cmdline.txt": f"vllm serve {LLAMA} --gpu-memory-utilization 0.9\n",
            "nvidia-smi.txt": smi(
                used9 + note_mib + 10,
                [(2187, "VLLM::EngineCore", used9), (7311, "/opt/conda/bin/python3.11", note_mib)],
            ),
            "ps.txt": table.replace(
                f"vllm serve {LLAMA}", f"vllm serve {LLAMA} --gpu-memory-utilization 0.9"
            ),
            "config.json": CONFIG,
        },
        {
            "fires": ["gpu-shared-with-foreign-process"],
            "not_fires": ["shared-gpu-gmu-unset"],
            "max_health": "warning",
            "note": (
                "Near miss for N1: the 0.34 engine has an explicit gmu 0.9 (vLLM's cap WARNING would be expected), so"
                " it is capped and the notebook keeps its room; gpu-shared-with-foreign-process keeps the NVML evidence"
                " (spec §2) and says the gmu is a cap, not a fit to free memory."
            ),
        },
    )
    write(
        "p2-v34-n1-near-miss-monitoring-context",
        {
            "vllm.log": log,
            "cmdline.txt": f"vllm serve {LLAMA}\n",
            "nvidia-smi.txt": smi(
                engine_used + 210,
                [(2187, "VLLM::EngineCore", engine_used), (7311, "/usr/bin/dcgm-exporter", 200)],
            ),
            "ps.txt": table.replace(
                "/opt/conda/bin/python3.11 -m ipykernel_launcher -f kernel-3.json", "/usr/bin/dcgm-exporter"
            ),
            "config.json": CONFIG,
        },
        {
            "fires": [],
            "not_fires": ["shared-gpu-gmu-unset", "gpu-shared-with-foreign-process"],
            "max_health": "info",
            "note": "Near miss for N1: the only other process is a 200 MiB CUDA context of a monitoring tool (< 0.25 GiB).",
        },
    )


def _from_r10(name: str, edits: dict[str, list[tuple[str, str]]], expected: dict) -> None:
    """A copy of r10-two-engines-stacked-gpu0 (two 0.33 engines unpinned on a 2 x L40S host) with
    textual edits per file."""
    src = OUT / "r10-two-engines-stacked-gpu0"
    files = {p.name: p.read_text() for p in src.iterdir() if p.name != "expected.json"}
    for fname, pairs in edits.items():
        for old, new in pairs:
            assert old in files[fname], (fname, old)
            files[fname] = files[fname].replace(old, new)
    write(name, files, expected)


def stacked_bundles() -> None:
    """Issue 24 kind 4: stacking is the cause, overcommit its consequence."""
    gmus = [
        ("--port 8000 --gpu-memory-utilization 0.45", "--port 8000 --gpu-memory-utilization 0.5"),
        ("--port 8001 --gpu-memory-utilization 0.45", "--port 8001 --gpu-memory-utilization 0.48"),
    ]
    smi_edits = [
        ("   41690MiB /  46068MiB", "   45120MiB /  46068MiB"),
        ("VLLM::EngineCore                      20610MiB", "VLLM::EngineCore                      22900MiB"),
        ("VLLM::EngineCore                      20590MiB", "VLLM::EngineCore                      22210MiB"),
    ]
    apps = [("5120, VLLM::EngineCore, 20610 MiB", "5120, VLLM::EngineCore, 22900 MiB"),
            ("5388, VLLM::EngineCore, 20590 MiB", "5388, VLLM::EngineCore, 22210 MiB")]  # fmt: skip
    edits = {"cmdline.txt": gmus, "ps.txt": gmus, "nvidia-smi.txt": smi_edits, "compute-apps.csv": apps}
    _from_r10(
        "p2-stacked-engines-overcommit-gpu1-idle",
        edits,
        {
            "fires": ["engines-stacked-on-one-gpu", "colocated-engines-overcommit"],
            "not_fires": ["gpu-shared-with-foreign-process", "orphaned-engine-processes"],
            "flags": {"engines-stacked-on-one-gpu": {"CUDA_VISIBLE_DEVICES": "1"}},
            "caused_by": {"colocated-engines-overcommit": "engines-stacked-on-one-gpu"},
            "note": (
                "Issue 24 kind 4: two unpinned 0.33 engines (gmu 0.5 + 0.48 = 0.98 > 0.95) on GPU 0 of a 2 x L40S"
                " host while GPU 1 is empty. Stacking is the cause (CUDA_VISIBLE_DEVICES=1 for one engine), the"
                " overcommit its consequence: colocated-engines-overcommit is caused_by engines-stacked-on-one-gpu."
            ),
        },
    )
    gpu1 = [("|      0%      Default |", "|     91%      Default |"),
            ("       1MiB /  46068MiB", "   30411MiB /  46068MiB")]  # fmt: skip
    proc = "|    0   N/A  N/A             5388      C   VLLM::EngineCore                      22210MiB|"
    job = "\n|    1   N/A  N/A             9001      C   /usr/bin/python3 train.py              30400MiB|"
    _from_r10(
        "p2-stacked-near-miss-overcommit-gpu1-busy",
        {**edits, "nvidia-smi.txt": [*smi_edits, *gpu1, (proc, proc + job)]},
        {
            "fires": ["colocated-engines-overcommit"],
            "not_fires": ["engines-stacked-on-one-gpu"],
            "flags": {"colocated-engines-overcommit": {"--gpu-memory-utilization": [0.46, 0.49]}},
            "note": (
                "Near miss for kind 4: the same overcommitted pair, but GPU 1 runs a training job (30 GiB, 91 %):"
                " nowhere to move an engine, so the overcommit is the root finding with its gmu split."
            ),
        },
    )


SLEEP_LOG = """\
(APIServer pid=5011) INFO 12-07 09:00:01 [api_server.py:1] vLLM API server version 0.33.0
(APIServer pid=5011) INFO 12-07 09:00:01 [startup.py:96] non-default args: {'model_tag': 'meta-llama/Llama-3.1-8B-Instruct', 'port': 8000, 'enable_sleep_mode': True, 'gpu_memory_utilization': 0.6, 'max_model_len': 16384}
(EngineCore pid=5120) INFO 12-07 09:00:09 [core.py:133] Initializing a V1 LLM engine (v0.33.0) with config: model='meta-llama/Llama-3.1-8B-Instruct', dtype=torch.bfloat16, max_seq_len=16384, tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=False, kv_cache_dtype=auto, served_model_name=meta-llama/Llama-3.1-8B-Instruct
(EngineCore pid=5120) INFO 12-07 09:00:30 [core.py:450] init engine (profile, create kv cache, warmup model) took 20.10 s
(APIServer pid=5011) INFO 12-07 09:00:31 [entry.py:139] Starting vLLM server on http://0.0.0.0:8000
(APIServer pid=6011) INFO 12-07 09:02:01 [api_server.py:1] vLLM API server version 0.33.0
(APIServer pid=6011) INFO 12-07 09:02:01 [startup.py:96] non-default args: {'model_tag': 'Qwen/Qwen3-4B', 'port': 8001, 'enable_sleep_mode': True, 'gpu_memory_utilization': 0.6, 'max_model_len': 16384}
(EngineCore pid=6120) INFO 12-07 09:02:09 [core.py:133] Initializing a V1 LLM engine (v0.33.0) with config: model='Qwen/Qwen3-4B', dtype=torch.bfloat16, max_seq_len=16384, tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=False, kv_cache_dtype=auto, served_model_name=Qwen/Qwen3-4B
(EngineCore pid=6120) INFO 12-07 09:02:30 [core.py:450] init engine (profile, create kv cache, warmup model) took 20.10 s
(APIServer pid=6011) INFO 12-07 09:02:31 [entry.py:139] Starting vLLM server on http://0.0.0.0:8001
(EngineCore pid=6120) INFO 12-07 09:03:02 [abstract.py:409] It took 1.204311 seconds to fall asleep.
"""
WAKE = "(EngineCore pid=6120) INFO 12-07 09:20:02 [abstract.py:440] It took 3.104311 seconds to wake up tags None.\n"


def sleep_swap_bundles() -> None:
    """Issue 24 kind 7: two sleep-mode engines on one H100 (gmu 0.6 each), sleep state per engine
    from their own lines of one journald log (no /metrics)."""
    src = OUT / "c2-sleep-swap-pair-state-unknown"
    files = {n: (src / n).read_text() for n in ("cmdline.txt", "nvidia-smi.txt", "ps.txt")}
    write(
        "p2-sleep-swap-pair-asleep-by-log",
        {**files, "vllm.log": SLEEP_LOG},
        {
            "fires": [],
            "not_fires": ["colocated-engines-overcommit", "low-util-host-bound", "idle-preallocation",
                          "orphaned-engine-processes", "gpu-shared-with-foreign-process"],
            "note": (
                "Issue 24 kind 7: c2-sleep-swap-pair-state-unknown with the two servers' journald log: Qwen3-4B's"
                " own engine core (pid 6120) logged 'It took 1.20 s to fall asleep.' and no wake-up, so it is asleep"
                " and holds 1.30 GiB: 0.6 x 79.65 + 1.30 GiB fits 0.95 x T. Engines that alternate are no overcommit."
            ),
        },
    )  # fmt: skip
    write(
        "p2-sleep-swap-near-miss-woke-again",
        {**files, "vllm.log": SLEEP_LOG + WAKE},
        {
            "fires": ["colocated-engines-overcommit"],
            "not_fires": ["orphaned-engine-processes"],
            "note": (
                "Near miss for kind 7: the same log, but Qwen3-4B woke up again (full wake, 'It took 3.10 s to wake"
                " up tags None.') while Llama is awake: both hold gmu 0.6 of the card, 1.20 > 0.95."
            ),
        },
    )


def _dp_metrics(page: str, running: list[int], kv: list[float]) -> str:
    """One scrape of c2-dp-engine-load-skew-dp8-v014 with nothing waiting and the given running
    requests and KV usage per engine."""
    import re

    def sub(metric: str, values: list) -> None:
        nonlocal page
        for i, x in enumerate(values):
            page = re.sub(
                rf'^({re.escape(metric)}\{{engine="{i}",[^}}]*\}}) \S+$',
                rf"\g<1> {float(x)}",
                page,
                flags=re.M,
            )

    sub("vllm:num_requests_running", running)
    sub("vllm:num_requests_waiting", [0] * len(running))
    sub("vllm:kv_cache_usage_perc", kv)
    return page


def dp_running_skew_bundles() -> None:
    """Issue 24 kind 8: DP engines with nothing waiting, running requests concentrated on some."""
    src = OUT / "c2-dp-engine-load-skew-dp8-v014"
    base = {n: (src / n).read_text() for n in ("cmdline.txt", "config.json", "nvidia-smi.txt", "vllm.log")}
    pages = sorted((src / "metrics").iterdir())
    skew = [[52, 49, 0, 0, 1, 0, 0, 0], [55, 47, 0, 1, 0, 0, 0, 0], [50, 51, 0, 0, 0, 1, 0, 0]]
    kv = [0.31, 0.29, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0]
    smi0 = base["nvidia-smi.txt"]
    busy_smi = smi0.replace("|      0%      Default |", "|     97%      Default |", 2)
    even_smi = smi0.replace("|      0%      Default |", "|     58%      Default |")
    write(
        "p2-dp-running-skew-nothing-waiting",
        {
            **base,
            "nvidia-smi.txt": busy_smi,
            **{
                f"metrics/{p.name}": _dp_metrics(p.read_text(), r, kv)
                for p, r in zip(pages, skew, strict=True)
            },
        },
        {
            "fires": ["dp-engine-load-skew"],
            "not_fires": ["low-util-kv-saturated", "low-util-host-bound"],
            "note": (
                "Issue 24 kind 8 (vllm#48808): dp 8 of Qwen3-4B on vLLM 0.14, nothing waiting on any engine in three"
                " scrapes over 30 s, but engines 0 and 1 run 47-55 requests each while engines 2-7 run 0-1. No queue"
                " and no full KV, yet the load sits on two of eight GPUs (97 % busy; the others idle)."
            ),
        },
    )
    even = [
        [13, 12, 14, 12, 13, 11, 12, 14],
        [12, 13, 12, 14, 13, 12, 11, 13],
        [14, 12, 13, 12, 12, 13, 12, 12],
    ]
    write(
        "p2-dp-running-even-near-miss",
        {
            **base,
            "nvidia-smi.txt": even_smi,
            **{
                f"metrics/{p.name}": _dp_metrics(p.read_text(), r, [0.1] * 8)
                for p, r in zip(pages, even, strict=True)
            },
        },
        {
            "fires": [],
            "not_fires": ["dp-engine-load-skew"],
            "note": "Near miss for kind 8: the same dp 8 with nothing waiting and 11-14 requests running on every engine.",
        },
    )
    trickle = [[2, 1, 0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0], [2, 0, 1, 0, 0, 0, 0, 0]]
    write(
        "p2-dp-running-trickle-near-miss",
        {
            **base,
            **{
                f"metrics/{p.name}": _dp_metrics(p.read_text(), r, [0.01] * 8)
                for p, r in zip(pages, trickle, strict=True)
            },
        },
        {
            "fires": [],
            "not_fires": ["dp-engine-load-skew"],
            "note": "Near miss for kind 8: a trickle (3 requests over 8 engines): an uneven spread of so few means nothing.",
        },
    )


def _hist(name: str, model: str, buckets: list[tuple[str, int]], total: float) -> str:
    lab = f'engine="0",model_name="{model}"'
    rows = [f"# TYPE {name} histogram"]
    rows += [f'{name}_bucket{{{lab},le="{le}"}} {float(c)}' for le, c in buckets]
    rows += [f"{name}_count{{{lab}}} {float(buckets[-1][1])}", f"{name}_sum{{{lab}}} {total}"]
    return "\n".join(rows) + "\n"


def _kv_page(
    model: str, scale: int, kv: float, running: int, waiting: int, prompt_mid: int, gen_mid: int
) -> str:
    """A 0.34 /metrics page: cache_config_info (block 64, extensible), usage gauges and the
    request length histograms (most requests near ``prompt_mid`` / ``gen_mid`` tokens)."""
    lab = f'engine="0",model_name="{model}"'
    les = ["1", "2", "5", "10", "20", "50", "100", "200", "500", "1000", "2000", "5000", "10000", "+Inf"]

    def counts(mid: int) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le in les:
            top = float("inf") if le == "+Inf" else float(le)
            acc = (
                scale
                if top >= 2 * mid
                else (scale // 10 if top >= mid else (scale // 50 if top >= mid / 2 else 0))
            )
            out.append((le, acc))
        return out

    return (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="64",cache_dtype="auto",enable_extensible_kv_cache="True",engine="0",'
        'gpu_memory_utilization="None",kv_cache_memory_bytes="None",num_gpu_blocks="7576"} 1.0\n'
        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{lab}}} {kv}\n"
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{lab}}} {float(running)}\n"
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{lab}}} {float(waiting)}\n"
        f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{{{lab}}} 0.0\n"
        f"# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{{{lab}}} {float(scale * prompt_mid)}\n"
        f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{{lab}}} {float(scale * gen_mid)}\n"
        + _hist("vllm:request_prompt_tokens", model, counts(prompt_mid), float(scale * prompt_mid))
        + _hist("vllm:request_generation_tokens", model, counts(gen_mid), float(scale * gen_mid))
    )


def kv_occupancy_bundles() -> None:
    """Issue 28 item 5 for low-util-kv-saturated: a 0.34 engine (block 64, FLASH_ATTN) whose "KV 96 %"
    is a quarter padding (short chat requests), and a near miss with long requests."""
    log = ext_engine_log(2041, 2187, UNSET_ARGS, pool_mib=60608, f1_mib=63740)
    used = 16100 + 60608 + 1900
    for name, prompt, gen, note in (
        (
            "p2-v34-kv-saturated-short-requests-block64",
            30,
            12,
            "vLLM 0.34 (block 64, FLASH_ATTN): GPU 24 % busy, KV 96 % (block usage) with 30 waiting; typical request"
            " ~105 tokens from the length histograms, so (64 - 1)/2 = 31.5 padding tokens per request make the"
            " token/block ratio ~0.77 < 0.8: token occupancy ~74 %, and --block-size 16 (valid on FLASH_ATTN) is"
            " among the fixes (tests/rules/test_low_util_kv_saturated_occupancy.py).",
        ),
        (
            "p2-v34-kv-saturated-long-requests-near-miss",
            1500,
            600,
            "Near miss for the --block-size 16 advice: the same 0.34 engine with ~2,100-token requests; padding is"
            " ~1.5 %, so the finding stands without --block-size 16.",
        ),
    ):
        pages = {
            f"metrics/{1796000000 + 15 * i}.txt": _kv_page(LLAMA, 1000 + 50 * i, 0.96, 180, 30, prompt, gen)
            for i in range(4)
        }
        write(
            name,
            {
                "vllm.log": log,
                "cmdline.txt": f"vllm serve {LLAMA}\n",
                "nvidia-smi.txt": smi(used, [(2187, "VLLM::EngineCore", used)], util=24),
                "config.json": CONFIG,
                **pages,
            },
            {"fires": ["low-util-kv-saturated"], "not_fires": ["idle-preallocation"], "note": note},
        )


def held_outside_bundles() -> None:
    """Issue 24 kind 3: "another process" only when one is visible. b05's startup refusal (0.9.1)
    with an nvidia-smi that lists no process (a container without host pids): the memory is held
    outside vLLM, and nothing names "the other process"."""
    src = HERE / "cases" / "b05-foreign-process-blocks-startup"
    files = {n: (src / n).read_text() for n in ("cmdline.txt", "vllm.log", "nvidia-smi.txt")}
    row = "|    0   N/A  N/A           48213      C   /opt/conda/bin/python3.10             15790MiB |"
    assert row in files["nvidia-smi.txt"]
    files["nvidia-smi.txt"] = files["nvidia-smi.txt"].replace(
        row, "|  No running processes found                                                             |"
    )
    write(
        "p2-free-below-util-no-process-visible",
        files,
        {
            "fires": ["gpu-shared-with-foreign-process"],
            "not_fires": ["orphaned-engine-processes", "weights-not-sharded"],
            "flags": {"gpu-shared-with-foreign-process": {"--gpu-memory-utilization": [0.55, 0.66]}},
            "note": (
                "Issue 24 kind 3: b05's refusal ('Free memory on device … 31.44/47.38 GiB … less than desired GPU"
                " memory utilization (0.95 …)') but nvidia-smi inside a container lists no process: the finding is"
                " titled 'Memory on the engine's GPU is held outside vLLM' and never says 'another process'. b05 itself"
                " (pid 48213 visible) is the near miss that keeps 'Another process holds memory'."
            ),
        },
    )


def rank_imbalance_bundles() -> None:
    """spec §2 parallel-rank-imbalance on 0.34: Llama-3.1-8B TP 2 on two H100s, each rank's own
    'Memory after warmup' line; rank 1 shares its GPU with something vLLM measured (no nvidia-smi
    in the bundle), so it commits fewer blocks and bounds the pool."""
    for name, n1, fires, note in (
        ("p2-v34-tp2-rank1-fewer-blocks-after-warmup", 6400, True,
         "TP 2, vLLM 0.34 extensible, log only: rank 0 measures 7,576 blocks of 4 MiB after warm-up, rank 1 6,400;"
         " the pool is the minimum (6,400), so rank 0 leaves (7,576 - 6,400) x 4 MiB = 4.59 GiB unused."),
        ("p2-v34-tp2-ranks-even-near-miss", 7540, False,
         "Near miss: the same TP 2 engine with 7,576 and 7,540 blocks per rank (0.14 GiB apart)."),
    ):  # fmt: skip
        log = b34.Log("12-07")
        log.banner(
            900,
            "0.34.0",
            LLAMA,
            "{'model_tag': 'meta-llama/Llama-3.1-8B-Instruct', 'tensor_parallel_size': 2}",
        )
        log.add(
            "EngineCore",
            910,
            f"Initializing a V1 LLM engine (v0.34.0) with config: model='{LLAMA}', dtype=torch.bfloat16,"
            " max_seq_len=131072, tensor_parallel_size=2, pipeline_parallel_size=1, enforce_eager=False,"
            " kv_cache_dtype=auto",
            src="core.py:153",
        )
        for rank, n in ((0, 7576), (1, n1)):
            pool = n * 4
            log.add(
                f"Worker_TP{rank}",
                920 + rank,
                "Model loading took 7.50 GiB memory and 4.1 seconds",
                src="model_runner.py:441",
            )
            log.add(
                f"Worker_TP{rank}",
                920 + rank,
                b34.AFTER_WARMUP
                % (b34.gib(pool + 3200), b34.gib(64), b34.gib(1900), b34.gib(1700), b34.gib(1900), n,
                   b34.gib(pool), b34.gib(T_MIB), b34.gib(pool + 9000)),
                src="extensible_kv_cache.py:693",
            )  # fmt: skip
        n_min = min(7576, n1)
        log.add("EngineCore", 910, b34.EXTENDED % (n_min, n_min * 4 / 1024), src="extensible_kv_cache.py:536")
        log.add(
            "EngineCore",
            910,
            "init engine (profile, create kv cache, warmup model) took 61.0 s",
            src="core.py:450",
        )
        log.add("APIServer", 900, "Starting vLLM server on http://0.0.0.0:8000", src="entry.py:139")
        write(
            name,
            {
                "vllm.log": log.text(),
                "cmdline.txt": f"vllm serve {LLAMA} --tensor-parallel-size 2\n",
                "config.json": CONFIG,
            },
            {
                "fires": ["parallel-rank-imbalance"] if fires else [],
                "not_fires": [] if fires else ["parallel-rank-imbalance"],
                "note": note,
            },
        )


def two_034_engines_bundles() -> None:
    """spec §2 colocated-engines-overcommit and §3.1 N1 with two 0.34 engines on one H100: Qwen3-4B
    (explicit gmu 0.5) started first; Llama-3.1-8B (gmu unset = 1.0, extensible) started beside it and
    committed what Qwen left. Its log is the bundle's vllm.log."""
    qwen_mib = 40200
    pool = 19000
    log = ext_engine_log(
        6011, 6120, UNSET_ARGS, pool_mib=pool, f1_mib=pool + 3200, tail=[b34.HEALTHY_TRAFFIC]
    )
    llama_mib = 16100 + pool + 1900
    rows = [
        (
            5011,
            1,
            "/opt/venv/bin/python /opt/venv/bin/vllm serve Qwen/Qwen3-4B --port 8001 --gpu-memory-utilization 0.5",
        ),
        (5120, 5011, "VLLM::EngineCore"),
        (6011, 1, f"/opt/venv/bin/python /opt/venv/bin/vllm serve {LLAMA} --port 8000"),
        (6120, 6011, "VLLM::EngineCore"),
    ]
    procs = [(5120, "VLLM::EngineCore", qwen_mib), (6120, "VLLM::EngineCore", llama_mib)]
    write(
        "p2-v34-two-engines-one-gmu-unset-overcommit",
        {
            "vllm.log": log,
            "cmdline.txt": f"vllm serve Qwen/Qwen3-4B --port 8001 --gpu-memory-utilization 0.5\nvllm serve {LLAMA} --port 8000\n",
            "ps.txt": ps(rows),
            "nvidia-smi.txt": smi(qwen_mib + llama_mib + 10, procs),
            "config.json": CONFIG,
        },
        {
            "fires": ["colocated-engines-overcommit"],
            "not_fires": [
                "shared-gpu-gmu-unset",
                "gpu-shared-with-foreign-process",
                "engines-stacked-on-one-gpu",
            ],
            "flags": {"colocated-engines-overcommit": {"--gpu-memory-utilization": [0.31, 0.64]}},
            "note": (
                "Two 0.34 engines on one H100, not pinned: Qwen3-4B at an explicit gmu 0.5, Llama-3.1-8B with gmu"
                " unset (u = 1.0 on the extensible path, spec §1). The gmu sum with u resolved is 1.5 > 0.95: the"
                " later engine got only what the first left (an 18.55 GiB pool, no startup refusal on 0.34). Split"
                " proportionally: Qwen 0.31, Llama 0.63. One engine has an explicit gmu, so the split is"
                " colocated-engines-overcommit's, not shared-gpu-gmu-unset's."
            ),
        },
    )
    rows_unset = [(pid, pp, c.replace(" --gpu-memory-utilization 0.5", "")) for pid, pp, c in rows]
    write(
        "p2-v34-two-engines-both-gmu-unset",
        {
            "vllm.log": log,
            "cmdline.txt": f"vllm serve Qwen/Qwen3-4B --port 8001\nvllm serve {LLAMA} --port 8000\n",
            "ps.txt": ps(rows_unset),
            "nvidia-smi.txt": smi(qwen_mib + llama_mib + 10, procs),
            "config.json": CONFIG,
        },
        {
            "fires": ["shared-gpu-gmu-unset"],
            "not_fires": ["colocated-engines-overcommit", "gpu-shared-with-foreign-process"],
            "flags": {"shared-gpu-gmu-unset": {"--gpu-memory-utilization": [0.47, 0.47]}},
            "note": (
                "The same pair with both engines' gmu unset (1.0 + 1.0): spec §3.1 gives the colocated split"
                " (0.47 each, sum 0.94) once, in shared-gpu-gmu-unset; colocated-engines-overcommit does not repeat it."
            ),
        },
    )


def n1_after_warmup_bundle() -> None:
    """N1 critical evidence (a): a training job (visible, 52 GiB) started first; the 0.34 engine with
    gmu unset started beside it and failed after warm-up with the H3 hint (vllm-facts §9.4)."""
    log = b34.Log("12-07")
    log.banner(2041, "0.34.0", LLAMA, UNSET_ARGS)
    log.engine(2187, "0.34.0", LLAMA, 131072)
    log.add("EngineCore", 2187, b34.BACKEND, src="cuda.py:549")
    log.add(
        "EngineCore",
        2187,
        "Model loading took 14.99 GiB memory and 5.604417 seconds",
        src="model_runner.py:441",
    )
    f0 = T_MIB - 53248 - 560
    a = f0 - 16000 - 1400
    log.add("EngineCore", 2187, b34.AVAILABLE % b34.gib(a), src="gpu_worker.py:795")
    log.add("EngineCore", 2187, b34.GRAPHS % (9, 576 / 1024), src="model_runner.py:1216")
    n = 1040  # 8 MiB blocks: 8,320 MiB
    log.add("EngineCore", 2187,
            b34.AFTER_WARMUP % (b34.gib(n * 8 + 3100), b34.gib(64), b34.gib(1900), b34.gib(1700), b34.gib(1900), n,
                                b34.gib(n * 8), b34.gib(T_MIB), b34.gib(16100 + n * 8 + 2000)),
            src="extensible_kv_cache.py:693")  # fmt: skip
    err = b34.TO_SERVE % (131072, "16.0", b34.gib((n - 1) * 8), (n - 1) * 64, b34.H3_AFTER)
    log.add("EngineCore", 2187, "EngineCore failed to start.", "ERROR", "core.py:1757")
    log.add("EngineCore", 2187, f"ValueError: {err}", "ERROR", "core.py:1757")
    log.raw(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
    )
    table = ps([(2041, 1, f"/opt/venv/bin/python /opt/venv/bin/vllm serve {LLAMA}"),
                (8800, 1, "/usr/bin/python3 train.py --config sft.yaml")])  # fmt: skip
    write(
        "p2-v34-n1-engine-failed-after-warmup-beside-job",
        {
            "vllm.log": log.text(),
            "cmdline.txt": f"vllm serve {LLAMA}\n",
            "nvidia-smi.txt": smi(53248 + 10, [(8800, "/usr/bin/python3", 53248)], util=88),
            "ps.txt": table,
            "config.json": CONFIG,
        },
        {
            "fires": ["shared-gpu-gmu-unset", "max-model-len-exceeds-kv-capacity"],
            "not_fires": ["gpu-shared-with-foreign-process", "orphaned-engine-processes"],
            "flags": {"max-model-len-exceeds-kv-capacity": {"--max-model-len": [8192, (n - 1) * 64]}},
            "note": (
                "spec N1 critical evidence (a): a training job (pid 8800, 52 GiB, listed in ps as no vLLM process) held"
                " the H100 first; Llama-3.1-8B on vLLM 0.34 with gmu unset committed the 1,040 blocks left after its"
                " warm-up and failed with 'To serve at least one request … The extensible KV cache already takes all"
                " device memory left after the model, its activations, CUDA graphs and warmup'. The engine has exited;"
                " the job is foreign because the process table says so. No gmu leaves room for both (the job takes"
                " 52 GiB): move it or stop it."
            ),
        },
    )


if __name__ == "__main__":
    n1_bundles()
    stacked_bundles()
    sleep_swap_bundles()
    dp_running_skew_bundles()
    kv_occupancy_bundles()
    held_outside_bundles()
    rank_imbalance_bundles()
    two_034_engines_bundles()
    n1_after_warmup_bundle()
