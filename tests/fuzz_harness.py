"""A deterministic fuzz harness over every kvdoctor parser (issue 8, class 11).

Each target is a public parser taking text (or bytes); seeds come from ``tests/data``. Inputs are
made by seeded mutations (byte flips, truncation, splices, repeats, huge numbers, NaN/inf,
control bytes, deep nesting, long lines). The contract every parser must meet:

- it returns, or raises :class:`kvdoctor.facts.SourceError` — nothing else;
- within ``time_limit`` seconds per input;
- without allocating more than ``memory_limit`` bytes (tracemalloc peak).

Run ``python -m tests.fuzz_harness [iterations]`` for a longer local pass; ``tests/test_fuzz.py``
runs it in CI with a small, fixed budget.
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdoctor.facts import SourceError

DATA = Path(__file__).resolve().parent / "data"


def _seeds(*patterns: str, limit: int = 12, max_bytes: int = 200_000) -> list[bytes]:
    out: list[bytes] = []
    for pattern in patterns:
        for p in sorted(DATA.glob(pattern)):
            if p.is_file() and p.stat().st_size <= max_bytes:
                out.append(p.read_bytes())
            if len(out) >= limit:
                return out
    return out


@dataclass
class Target:
    """One parser under fuzz: ``call(text)`` with the mutated input."""

    name: str
    call: Callable[[str], Any]
    seeds: list[bytes] = field(default_factory=list)
    #: extra fragments spliced into inputs (the parser's own vocabulary).
    words: list[bytes] = field(default_factory=list)


def _targets() -> list[Target]:
    from kvdoctor import redact
    from kvdoctor.sources import (
        cmdline,
        dmesg,
        env,
        limits,
        metrics,
        model_config,
        nvidia_smi,
        processes,
        vllm_log,
    )

    def log(text: str) -> Any:
        return vllm_log.parse_log(text, origin="fuzz.log")

    def follower_lines(text: str) -> Any:
        parsed = [vllm_log.parse_line(ln) for ln in text.split("\n")[:50]]
        return parsed

    def argv(text: str) -> Any:
        return cmdline.parse_argv(text.split(" "), origin="fuzz")

    def model(text: str) -> Any:
        return model_config.parse_model_config(text, origin="config.json")

    def log_file(text: str) -> Any:
        import gzip
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvdoctor-fuzz-") as tmp:
            data = text.encode("utf-8", errors="replace")
            p = Path(tmp) / "vllm.log"
            p.write_bytes(data)
            vllm_log.parse_log_file(p, progress=False)
            g = Path(tmp) / "vllm.log.gz"
            g.write_bytes(
                gzip.compress(data)[: max(10, len(data) // 3)] if len(data) % 2 else gzip.compress(data)
            )
            return vllm_log.parse_log_file(g, progress=False)

    def bundle_dir(text: str) -> Any:
        import tempfile

        from kvdoctor.sources.bundle import load_bundle

        names = [
            "cmdline.txt",
            "config.json",
            "metrics.txt",
            "nvidia-smi.txt",
            "ps.txt",
            "env.txt",
            "dmesg.txt",
        ]
        with tempfile.TemporaryDirectory(prefix="kvdoctor-fuzz-") as tmp:
            root = Path(tmp)
            name = names[len(text) % len(names)]
            (root / name).write_text(text, encoding="utf-8", errors="replace")
            (root / "engine-args.yaml").write_text(text[:2000], encoding="utf-8", errors="replace")
            return load_bundle(root)  # never raises for bad content: statuses

    def recording(text: str) -> Any:
        import tempfile

        from kvdoctor.feeds import read_to_end
        from kvdoctor.sources.recording import RecordingFeed

        with tempfile.TemporaryDirectory(prefix="kvdoctor-fuzz-") as tmp:
            p = Path(tmp) / "r.jsonl"
            p.write_text(text, encoding="utf-8", errors="replace")
            feed = RecordingFeed(p)  # SourceError for a file that is no recording
            try:
                return read_to_end(feed)
            finally:
                feed.close()

    def diagnose_log(text: str) -> Any:
        # the whole pipeline over one log: a line the parser reads must not break a later stage
        import tempfile

        from kvdoctor.sources.bundle import load_bundle

        with tempfile.TemporaryDirectory(prefix="kvdoctor-fuzz-") as tmp:
            root = Path(tmp)
            (root / "vllm.log").write_text(text, encoding="utf-8", errors="replace")
            return _pipeline().evaluate(load_bundle(root).timeline, now=0.0)

    def bundle_archive(text: str) -> Any:
        # archives as people make them: the bundle in a directory (with directory members)
        # beside other top-level files; the mutated text is one of the bundle's files
        import io
        import tarfile
        import tempfile

        from kvdoctor.sources.bundle import load_bundle

        names = ["vllm.log", "cmdline.txt", "nvidia-smi.txt", "metrics/1700000000.txt", "engine-args.yaml"]
        with tempfile.TemporaryDirectory(prefix="kvdoctor-fuzz-") as tmp:
            p = Path(tmp) / "b.tar.gz"
            data = text.encode("utf-8", errors="replace")
            name = names[len(text) % len(names)]
            with tarfile.open(p, "w:gz") as tar:
                for d in ("b", "b/metrics"):
                    info = tarfile.TarInfo(d)
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                for member, body in (("b/" + name, data), ("notes.yaml", data[:200])):
                    info = tarfile.TarInfo(member)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
            loaded = load_bundle(p)
            # the oracle: directory members are structure, and the bundle is found beside notes.yaml
            for st in loaded.snapshot.sources:
                if "not a regular file" in st.detail or (
                    st.status == "missing" and st.origin.endswith(name.split("/")[0])
                ):
                    raise AssertionError(f"archive read wrong: {st.kind} {st.status} {st.detail[:60]}")
            return loaded

    def redact_all(text: str) -> Any:
        redact.redact_text(text)
        redact.redact_argv(text.split(" "))
        redact.redact_env({"HTTP_PROXY": text, "X": text})
        return vllm_log.redact(text)

    log_words = [
        b"CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of which 1.0 MiB is free.",
        b"INFO 07-01 09:12:43 [loggers.py:123] Engine 000: Avg prompt throughput: 1.0 tokens/s, Running: 3 reqs, GPU KV cache usage: 99.0%",
        b"(EngineCore_DP0 pid=277) ERROR 07-01 09:12:43 [core.py:1] ",
        b"non-default args: {'model': 'x', 'api_key': 'sk-1234567890abcdef1234'}",
        b"args: Namespace(model='m', max_model_len=4096, gpu_memory_utilization=0.9)",
        b"Model loading took 15.0 GiB and 12.3 seconds",
        b"Available KV cache memory: -3.5 GiB",
        b"Received request cmpl-1: prompt: 'hello, params: x', params: SamplingParams(n=1)",
        b'Traceback (most recent call last):\n  File "x.py", line 1\n',
        b"\x1b[32m",
        b"2025-07-01T09:12:43.123Z stdout F ",
    ]
    # vLLM 0.34 (sources/log_v034.py, vllm-facts §9)
    log_words_034 = [
        b"Memory after warmup: 62.25 GiB free, 0.06 GiB committed to the KV cache, 1.86 GiB kept for transient activations (1.66 GiB allocated at peak, 1.86 GiB of torch reservation growth); 7576 KV cache blocks (59.19 GiB) fit within the requested 79.19 GiB. Torch may reserve up to 18.34 GiB.",
        b"Extended KV cache to 7576 blocks (59.19 GiB).",
        b"gpu_memory_utilization=0.9 caps this instance at 71.27 GiB, keeping 6.13 GiB of free device memory out of the KV cache.",
        b"--max-model-len auto reduced max_model_len from 131072 to 4096 (0.5 GiB GPU left for the KV cache after CUDA graph capture and warmup). Requests longer than 4096 tokens will be rejected. ",
        b"Disabling the extensible KV cache: another rank cannot use it. The KV cache will be sized from profiling estimates instead of measured memory.",
        b"The extensible KV cache already takes all device memory left after the model, its activations, CUDA graphs and warmup;",
        b"within `gpu_memory_utilization`=0.9; increase it",
        b"VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed.",
        b"RuntimeError: GPU driver error 2: out of memory",
    ]
    return [
        Target(
            "vllm_log.parse_log",
            log,
            _seeds("hostile/*.log", "vllm_log/*.log", "bundles/*/vllm.log"),
            log_words,
        ),
        Target("vllm_log.parse_log (0.34)", log, _seeds("bundles-034/*/vllm.log"), log_words + log_words_034),
        Target("vllm_log.parse_line", follower_lines, _seeds("vllm_log/*.log", limit=3), log_words),
        Target(
            "metrics.parse_metrics",
            lambda t: metrics.parse_metrics(t, origin="m.txt", timestamp=1.0),
            _seeds("metrics/*.txt", "bundles/*/metrics.txt", "bench/*.txt"),
            [
                b'vllm:num_requests_running{engine="0",model_name="m"} ',
                b"# TYPE vllm:x histogram\n",
                b'le="+Inf"',
            ],
        ),
        Target(
            "nvidia_smi.parse_nvidia_smi_text",
            lambda t: nvidia_smi.parse_nvidia_smi_text(t, origin="smi"),
            _seeds(
                "hostile/nvidia-smi*.txt",
                "nvidia_smi/*.txt",
                "nvidia_smi/*.csv",
                "nvidia_smi/*.xml",
                "bundles/*/nvidia-smi.txt",
            ),
            [b"|", b"MiB", b"<gpu>", b"</gpu>", b"<!DOCTYPE x [<!ENTITY a 'aaaa'>]>", b"&a;"],
        ),
        Target(
            "nvidia_smi.parse_compute_apps_csv",
            lambda t: nvidia_smi.parse_compute_apps_csv(t, origin="apps.csv"),
            _seeds("nvidia_smi/*compute-apps*.csv", "bundles/*/compute-apps.csv"),
            [b",", b"MiB", b"\n"],
        ),
        Target(
            "cmdline.parse_cmdline_text",
            lambda t: cmdline.parse_cmdline_text(t, origin="cmdline.txt"),
            _seeds("hostile/cmdline*.txt", "cmdline/*.txt", "bundles/*/cmdline.txt"),
            [
                b" --tensor-parallel-size ",
                b" --gpu-memory-utilization ",
                b" --api-key ",
                b"'",
                b"\\\n",
                b" --config x.yaml",
            ],
        ),
        Target(
            "cmdline.parse_argv", argv, _seeds("cmdline/*.txt", limit=4), [b" --max-model-len ", b" -tp "]
        ),
        Target(
            "env.parse_env_text",
            lambda t: env.parse_env_text(t, origin="env.txt"),
            _seeds("hostile/env*.txt", "bundles/*/env.txt"),
            [b"CUDA_VISIBLE_DEVICES=", b"HF_TOKEN=", b"=", b"\n"],
        ),
        Target(
            "processes.parse_ps_text",
            lambda t: processes.parse_ps_text(t, origin="ps.txt"),
            _seeds("bundles/*/ps.txt", "cmdline/ps*.txt", "cmdline/top.txt"),
            [b"  PID ", b" vllm serve ", b"\n"],
        ),
        Target(
            "dmesg.parse_dmesg",
            lambda t: dmesg.parse_dmesg(t, origin="dmesg.txt"),
            _seeds("bundles/*/dmesg.txt"),
            [b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", b"\n"],
        ),
        Target(
            "model_config.parse_model_config",
            model,
            _seeds("models/*.json", "bundles/*/config.json"),
            [b'"num_hidden_layers": ', b'"hidden_size": ', b"[", b"{", b"1e999"],
        ),
        Target("redact", redact_all, _seeds("cmdline/*.txt", limit=4), [b"://u:p@h", b"--api-key ", b"'"]),
        Target("vllm_log.parse_log_file", log_file, _seeds("vllm_log/*.log", limit=4), log_words),
        Target("bundle.load_bundle", bundle_dir, _seeds("bundles/r0*/*.txt", "models/*.json", limit=8), []),
        Target(
            "limits.load_yaml_bounded",
            lambda t: limits.load_yaml_bounded(t, "engine-args.yaml"),
            _seeds("hostile/*.yaml", "cmdline/*.yaml"),
            [b"&a ", b"*a", b"[*a,*a,*a,*a]", b"\n- ", b": ", b"!!python/object:os.system"],
        ),
        Target(
            "recording.RecordingFeed",
            recording,
            _seeds("hostile/*.jsonl", "recordings/*.jsonl"),
            [b'{"$": {"log": ', b'{"timestamp": 1.0, "metrics": [', b"[" * 1200, b"1e999", b"\n"],
        ),
        Target(
            "bundle.load_bundle(archive)",
            bundle_archive,
            _seeds("hostile/*.log", "hostile/*.yaml", "bundles/healthy*/*.txt", limit=8),
            log_words,
        ),
        Target(
            "diagnose.log", diagnose_log, _seeds("hostile/*.log", "bundles/k2*/vllm.log", limit=6), log_words
        ),
    ]


_PIPELINE: list[Any] = []


def _pipeline() -> Any:
    if not _PIPELINE:
        from kvdoctor.pipeline import Pipeline

        _PIPELINE.append(Pipeline.load())
    return _PIPELINE[0]


_NUMS = [b"1" * 400, b"nan", b"inf", b"-inf", b"1e309", b"-0", b"99999999999999999999", b"-1", b"0.0"]
_JUNK = [b"\x00", b"\xff\xfe", b"\r", b"\x1b[", b"\t", b"\\", b"'", b'"', b"(", b"[", b"{", "\u2580".encode()]


def mutate(rng: random.Random, seed: bytes, words: list[bytes]) -> bytes:
    """One seeded mutation of ``seed`` (a few stacked operations)."""
    data = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(14)
        n = len(data)
        pos = rng.randrange(n + 1) if n else 0
        if op == 0 and n:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(n)] = rng.randrange(256)
        elif op == 1:  # truncate
            del data[pos:]
        elif op == 2:  # insert junk
            data[pos:pos] = rng.choice(_JUNK) * rng.randint(1, 50)
        elif op == 3:  # insert a number
            data[pos:pos] = rng.choice(_NUMS)
        elif op == 4 and words:  # insert vocabulary
            data[pos:pos] = rng.choice(words)
        elif op == 5 and n:  # duplicate a slice many times
            a = rng.randrange(n)
            piece = bytes(data[a : a + rng.randint(1, 200)])
            data[pos:pos] = piece * rng.randint(2, 60)
        elif op == 6 and n:  # replace digits by huge / odd numbers
            text = bytes(data)
            i = rng.randrange(n)
            j = text.find(b"1", i)
            if j >= 0:
                data[j : j + 1] = rng.choice(_NUMS)
        elif op == 7:  # a very long line
            data[pos:pos] = (rng.choice(words) if words else b"x") * rng.randint(50, 400)
        elif op == 8 and n:  # delete a slice
            del data[pos : pos + rng.randint(1, 500)]
        elif op == 9:  # deep nesting
            depth = rng.randint(100, 3000)
            data[pos:pos] = b"[" * depth + b"{" * (depth // 10)
        elif op == 10 and n:  # splice the tail of another part
            a = rng.randrange(n)
            data[pos:pos] = data[a:]
        elif op == 11:  # a list or dict where a scalar stood (vLLM's nargs='+' args, a garbled repr)
            i = data.find(b"': ", pos)
            if i < 0:
                i = data.find(b"=", pos)
            if i >= 0:
                data[i + 1 : i + 1] = rng.choice(
                    [b" ['qwen3', 'q2'],", b" [8000],", b" {'a': [1]},", b"['x'],"]
                )
        elif op == 12:  # a run of one character (quadratic "(.*?)\s+X" patterns)
            data[pos:pos] = rng.choice([b" ", b"\t", b"a", b"1", b"#"]) * rng.randint(1000, 64_000)
        elif op == 13:  # YAML anchors and aliases (a "billion laughs" bomb)
            data[pos:pos] = (
                b"a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
            )
        if len(data) > 400_000:
            del data[400_000:]
    return bytes(data)


@dataclass
class Failure:
    target: str
    kind: str  # "exception" | "slow" | "memory"
    detail: str
    data: bytes


def run(
    iterations: int,
    *,
    seed: int = 8,
    time_limit: float = 2.0,
    memory_limit: int = 256 * 1024 * 1024,
    targets: list[Target] | None = None,
    measure_memory_every: int = 10,
) -> tuple[int, list[Failure]]:
    """Run ``iterations`` mutated inputs per target. Returns (inputs run, failures)."""
    rng = random.Random(seed)
    failures: list[Failure] = []
    total = 0
    for target in targets or _targets():
        seeds = target.seeds or [b""]
        for i in range(iterations):
            base = seeds[i % len(seeds)]
            data = base if i < len(seeds) else mutate(rng, base, target.words)
            text = data.decode("utf-8", errors="replace")
            trace = i % measure_memory_every == 0
            if trace:
                tracemalloc.start()
            t0 = time.process_time()
            try:
                target.call(text)
            except SourceError as e:
                if "\n" in str(e):
                    failures.append(Failure(target.name, "exception", "multi-line SourceError", data))
            except RecursionError:
                failures.append(Failure(target.name, "exception", "RecursionError", data))
            except Exception as e:  # the contract: nothing but SourceError
                failures.append(
                    Failure(target.name, "exception", f"{type(e).__name__}: {str(e)[:100]}", data)
                )
            elapsed = time.process_time() - t0
            if trace:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                if peak > memory_limit:
                    failures.append(Failure(target.name, "memory", f"{peak} bytes", data))
            if elapsed > time_limit:
                # tracemalloc slows Python several times, and a shared CI core stalls: an input
                # is slow only when a second, untraced run is slow too
                t0 = time.process_time()
                try:
                    target.call(text)
                except Exception:
                    pass
                again = time.process_time() - t0
                if again > time_limit:
                    failures.append(Failure(target.name, "slow", f"{min(elapsed, again):.2f} s", data))
            total += 1
    return total, failures


if __name__ == "__main__":
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    count, fails = run(n, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    print(f"{count} inputs, {len(fails)} failures")
    seen: set[tuple[str, str]] = set()
    out = Path("/tmp/kvdoctor-fuzz")
    out.mkdir(exist_ok=True)
    for k, f in enumerate(fails):
        key = (f.target, f.detail[:40])
        if key in seen:
            continue
        seen.add(key)
        (out / f"{k}.bin").write_bytes(f.data)
        print(json.dumps({"target": f.target, "kind": f.kind, "detail": f.detail, "file": f"{out}/{k}.bin"}))
