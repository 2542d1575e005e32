"""## What
The engine died (vLLM logged "EngineCore failed to start", "Engine core initialization
failed", `EngineDeadError`, V0's "Engine process failed to start", or a traceback before serving
after which the engine got no further) of an error no specific rule recognises: no CUDA OOM, no
KV sizing or memory check error, no invalid kv_cache_dtype, no cuMem / Triton / FlashInfer /
0.34 VMM error in the same run. A crashed engine is never OK: this finding quotes the error it
died of.

## Why
Engines also die of NCCL and driver errors, a configuration vLLM rejects (`ValueError: …`), a
model or tokenizer that does not load, a missing kernel for the GPU. kvdoctor reads memory and
KV sizing; for these it can say only that the engine is down, which line says why, and what it
could not tell.

## How to confirm
The quoted exception line (the last one of the crash's tracebacks that is not the API server's
wrapper `EngineDeadError` / "Engine core initialization failed") and the traceback above it in
vllm.log.

## Fix
None computed: the error is outside what kvdoctor's rules know. A specific rule that explains
the crash (an OOM rule, a KV sizing rule, `gpu-hardware-errors`) takes its place.

## Sources
Issue 24 kind 5; vllm-facts.md §3.5 (engine death lines); kvdoctor/sources/vllm_log.py
(``engine_failed`` and ``exception`` events).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvdoctor.redact import redact_text
from kvdoctor.rulekit import Evidence, Facts, Hit, Rule, na

#: characters of the error line quoted (it is already bounded by the log parser)
_QUOTE_CHARS = 300
_FLAG = re.compile(r"(?<![\w-])--[a-z]")


@dataclass(frozen=True)
class Thresholds:
    """None: any crash no specific error explains counts."""


def _gpus(indices: Iterable[int] | None) -> list[int]:
    return sorted(set(indices or ()))


def check(f: Facts, t: Thresholds) -> Hit | None:
    # a specific rule explains it: an error it reads in the log (crash_explained), a
    # --kv-cache-dtype the version or the GPU rejects (invalid-kv-cache-dtype), a failed wake
    # (wake-up-oom)
    if not f["engine_crashed"] or f["crash_explained"] or f["invalid_kv_dtype"] or f["wake_oom"]:
        return None
    engine_gpus = set(f["engine_gpus"] or ())
    failing = set(f["hw_error_gpus"] or ()) if (f["xid_hw_count"] or f["ecc_gpus"]) else set()
    if failing and (not engine_gpus or failing & engine_gpus):
        return None  # a failing GPU explains it (gpu-hardware-errors)
    text = redact_text(f["engine_error_text"] or "")[:_QUOTE_CHARS]
    line, crash_line = f["engine_error_line"], f["engine_crash_line"]
    at = f"vllm.log line {na(line)}"
    when = "while serving" if f["log_stats_count"] else "at startup"
    # the quote is vLLM's words: one that names a --flag stays in the evidence, so the words
    # name no flag kvdoctor does not advise
    quote = (
        f"{text!r}"
        if text and not _FLAG.search(text)
        else f"{na(f['engine_error_exception'])} (quoted below)"
    )
    words = f"The engine died {when}, of {quote} ({at}). "
    if f["xid_app_desc"]:
        words += (
            f"The kernel log has application XIDs ({f['xid_app_desc']}): the program's kernels faulted,"
            " not the device. No kvdoctor rule tells which kernel or setting caused it"
        )
    else:
        words += (
            "No kvdoctor rule recognises this error, so it cannot tell whether the configuration, the model,"
            " the driver or the device caused it, nor which setting would fix it"
        )
    words += f"; read the traceback above line {na(line)} of vllm.log."
    release = f["vllm_version"]
    words += f" vLLM {release}." if release else " The vLLM version is unknown."
    evidence = [Evidence("error the engine died of", text or "N/A", at)]
    if crash_line is not None and crash_line != line:
        evidence.append(
            Evidence(
                "engine death",
                "EngineCore failed to start / fatal error / EngineDeadError",
                f"vllm.log line {crash_line}",
            )
        )
    return Hit(summary=words, evidence=evidence, gpus=_gpus(f["engine_gpus"]))


RULE = Rule(
    id="engine-crashed",
    family="P",
    severity="critical",
    title="The engine crashed of an error kvdoctor does not recognise",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("log",),
)
