"""Offline ``LLM(...)`` under KV pressure with kvdoctor's :class:`LLMWatcher` (run by the vLLM
venv's python from tests/integration/test_inprocess.py).

``python offline_llm.py MODEL_DIR OUT.json``: 32 requests of 160 tokens into a 4-block KV cache.
Besides the watcher, a second thread reads vLLM's own counters from ``llm.get_metrics()`` with
vLLM's reader classes, so the test decides what must fire from vLLM's numbers, not kvdoctor's.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

PROMPT_TOKENS = 100
GENERATED_TOKENS = 60


def tokenizer_ids(llm: object, text: str, n: int) -> list[int]:
    """``n`` token ids of ``text`` repeated, from the engine's own tokenizer."""
    tok = llm.get_tokenizer()  # type: ignore[attr-defined]
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" " + text, add_special_tokens=False)
    return ids[:n]


def main(model: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.reader import Counter, Gauge

    from kvdoctor.integrations.vllm import KvdoctorStatLogger, LLMWatcher

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        seed=0,
    )
    own: list[dict[str, float]] = []
    stop = threading.Event()

    def read_own() -> None:
        while not stop.wait(0.5):
            row = {"t": time.time()}
            for m in llm.get_metrics():
                if isinstance(m, Gauge) and m.name == "vllm:kv_cache_usage_perc":
                    row["kv"] = m.value
                elif isinstance(m, Counter) and m.name == "vllm:num_preemptions":
                    row["preemptions"] = float(m.value)
            own.append(row)

    reader = threading.Thread(target=read_own, daemon=True)
    reader.start()
    watcher = LLMWatcher(llm, interval_s=3.0, sample_interval_s=0.5).start()
    t0 = time.time()
    # 32 requests of 100 prompt + 60 generated tokens: each needs one 128-token block to start
    # and a second one 28 tokens later, so those running together (3 blocks hold them) preempt
    # each other at every block boundary, several times a minute on a slow machine too.
    words = tokenizer_ids(llm, "the cache block token memory engine request", PROMPT_TOKENS)
    prompts = [{"prompt_token_ids": [*words[:-1], words[i % len(words)]]} for i in range(32)]
    params = SamplingParams(max_tokens=GENERATED_TOKENS, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.time() - t0
    watcher.stop()
    stop.set()
    reader.join(timeout=5)
    report = watcher.report
    doc = {
        "elapsed_s": elapsed,
        "plugin_is_stat_logger": issubclass(KvdoctorStatLogger, StatLoggerBase),
        "snapshots": len(watcher.doctor.timeline.snapshots),
        "own": own,
        "transitions": [
            {"rule": t.rule, "kind": t.kind, "after": t.after, "flags": t.suggested_flags}
            for t in watcher.doctor.transitions
        ],
        "report": report.to_dict() if report is not None else None,
    }
    with open(out_path, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
