"""## What
A CUDA OOM while vLLM profiles a multimodal model before serving (the traceback runs through
`get_multimodal_embeddings` / `embed_multimodal` / `_execute_mm_encoder` / the vision tower),
or the warning that the sequence used for profiling is too short to hold the multimodal
embeddings of the worst case.

## Why
Before sizing the KV cache vLLM runs the encoder on the worst case: the maximum number of
items per prompt (`--limit-mm-per-prompt`) at the processor's maximum resolution, for the
profiled batch. High-resolution processors (Qwen2-VL's default max_pixels) make that
activation peak huge. If the profiling sequence cannot even hold those embeddings, the profile
under-measures the peak and the OOM comes later, at run time.

On vLLM ≥ 0.34 with the extensible KV cache the warm-up before the KV sizing
(`run_kv_cache_sizing_warmup`, `warmup_kernels`) also runs encoder batches, ones profiling does
not reach, so the OOM may come from those frames rather than `profile_run`: both match.

## How to confirm
The OOM traceback during startup (before "Starting vLLM server") with multimodal frames, or the
WARNING "The sequence length used for profiling … is too short to hold the multi-modal
embeddings in the worst case".

## Fix
`--limit-mm-per-prompt '{"image":1}'` (fewer items per prompt), and where it helps
`--mm-processor-kwargs '{"max_pixels": …}'`, a small `--max-num-seqs`, or `--enforce-eager`.

## Sources
vllm-facts.md §2.1 (the profiling run: "a dummy forward at max_num_batched_tokens plus sampler
and encoder warmups"; the multimodal IPC reservation), §3.6 (the OOM message), §1.3
(`mm_*` cache config).
"""

from __future__ import annotations

import json
from typing import NamedTuple

from kvdoctor.findings import Severity
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, is_valid, na


class Thresholds(NamedTuple):
    """None: the rule has no tunable thresholds."""


#: one image per prompt: the smallest worst case vLLM profiles for an image model
LIMIT = '{"image":1}'
#: the image-size cap of Qwen-VL style processors (1024 × 28 × 28 pixels)
PROCESSOR_KWARGS = '{"max_pixels":802816}'
#: the small batch of sequences profiled at once
SMALL_MAX_NUM_SEQS = 8


def _same_json(text: str | None, want: str) -> bool:
    """Whether ``text`` (a flag's JSON value) is ``want`` (spacing and key order aside)."""
    if not text:
        return False
    try:
        return bool(json.loads(text) == json.loads(want))
    except ValueError:
        return False


def check(f: Facts, t: Thresholds) -> Hit | None:
    oom, line = f["mm_profile_oom"], f["mm_profile_line"]
    if not (oom or f["mm_profile_too_short"]):
        return None
    limit_now, seqs = f["limit_mm_per_prompt"], f["max_num_seqs_effective"]

    alternatives: list[str] = []
    fixes: list[Fix] = []
    if not _same_json(limit_now, LIMIT):
        now = f" (now {limit_now})" if limit_now else ""
        alternatives.append(f"--limit-mm-per-prompt '{LIMIT}'{now} for one image per prompt")
        fixes.append(
            Fix(flags={"--limit-mm-per-prompt": LIMIT}, why="one image per prompt in the profiled worst case")
        )
    alternatives.append(
        f"--mm-processor-kwargs '{PROCESSOR_KWARGS}' to cap the image size (Qwen-VL style processors)"
    )
    fixes.append(
        Fix(
            flags={"--mm-processor-kwargs": PROCESSOR_KWARGS},
            why="smaller images in the profiled worst case, for Qwen-VL style processors",
        )
    )
    small = min(SMALL_MAX_NUM_SEQS, seqs) if seqs else SMALL_MAX_NUM_SEQS
    if is_valid(f, "--max-num-seqs", small):
        alternatives.append(f"--max-num-seqs {small} to profile fewer dummy items at once")
        fixes.append(Fix(flags={"--max-num-seqs": str(small)}, why="fewer dummy items profiled at once"))
    if not f["enforce_eager"] and is_valid(f, "--enforce-eager", True):
        alternatives.append("--enforce-eager to drop the CUDA graph memory")
        fixes.append(
            Fix(flags={"--enforce-eager": ""}, why="no CUDA graph memory, at the cost of slower decode")
        )

    warmup = oom and f["oom_phase"] == "kv_sizing_warmup"
    if warmup:
        # 0.34 extensible: the sizing warm-up reaches encoder batches profiling does not
        # (gpu_worker.py:1024-1027)
        cause = (
            f"vLLM ran out of GPU memory in the warm-up before it sized the KV cache (vllm.log line {na(line)}),"
            " running the multimodal encoder on worst-case inputs: the warm-up reaches encoder batches the"
            " profile run does not, and the dummy images/videos did not fit."
        )
    elif oom:
        cause = (
            f"vLLM ran out of GPU memory while profiling the multimodal encoder with its worst-case inputs"
            f" (vllm.log line {na(line)}): the dummy images/videos for every sequence did not fit."
        )
    else:
        cause = (
            f"vLLM warned (vllm.log line {na(line)}) that the profiling sequence is too short to hold the"
            " multimodal embeddings of the worst case, so the profile under-estimates the activation peak"
            " and large multimodal inputs can fail at run time."
        )
    summary = f"{cause} Shrink the worst case: " + "; or ".join(alternatives) + "."

    evidence: list[Evidence] = []
    if oom:
        hints = ", ".join(map(str, f["oom_hints"] or ()))
        evidence.append(
            Evidence(
                "OOM during the KV-sizing warm-up (multimodal encoder)"
                if warmup
                else "OOM during the multimodal profile run",
                f"traceback in {hints} code",
                f"vllm.log line {na(line)}",
            )
        )
    elif f["mm_profile_too_short"]:
        evidence.append(
            Evidence(
                "profiling sequence too short for the multimodal worst case",
                "logged",
                f"vllm.log line {na(line)}",
            )
        )
    if limit_now:
        evidence.append(Evidence("limit_mm_per_prompt", limit_now, "launch command"))
    if seqs:
        source = "launch command / log args" if f["max_num_seqs_explicit"] else "vLLM device default"
        evidence.append(Evidence("max_num_seqs", str(seqs), source))
    severity: Severity | None = "warning" if not oom and not f["startup_failed"] else None
    return Hit(
        summary=summary,
        evidence=evidence,
        fixes=fixes,
        gpus=f["engine_gpus"] or (),
        severity=severity,
    )


RULE = Rule(
    id="multimodal-profile-oom",
    family="K",
    severity="critical",
    title="The multimodal profiling run ran out of memory (or cannot cover the worst case)",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    explains=("engine-crashed",),
    needs=("log",),
    flags=("--limit-mm-per-prompt", "--mm-processor-kwargs", "--max-num-seqs", "--enforce-eager"),
)
