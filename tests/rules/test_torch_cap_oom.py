"""torch-cap-oom (spec/vllm-0.34.md §3.4, N4): a run-time torch OOM at the per-process cap of a
0.34 extensible engine; bundles v34-torch-cap-oom-prefill (fires) and its near misses
(fragmentation, a non-extensible 0.34 engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvdoctor.rules.torch_cap_oom import RULE

from kvdoctor.units import GiB, MiB
from tests.rules._words import assert_words_match_fixes, facts, finding

BUNDLES = Path(__file__).parents[1] / "data" / "bundles"


def _oom(**over: Any) -> dict[str, Any]:
    """The F§9.2 engine: L = 18.34 GiB, the OOM 1.16 GiB past it, 3.02 GiB free, prefill running."""
    base = dict(
        vllm_sizing_mode="extensible",
        runtime_oom=True,
        oom_at_runtime=True,
        oom_line=20,
        oom_requested_bytes=int(1.5 * GiB),
        oom_free_bytes=int(3.02 * GiB),
        oom_reserved_unallocated_bytes=int(0.4 * GiB),
        oom_allowed_bytes=int(18.34 * GiB),
        torch_cap_bytes=int(18.34 * GiB),
        torch_cap_overrun_bytes=int(1.16 * GiB),
        gmu_resolved=1.0,
        gmu=1.0,
        device_total_bytes=int(79.19 * GiB),
        max_num_batched_tokens=8192,
        log_prompt_throughput_last=21480.0,
        oom_gpu=0,
    )
    return facts(**{**base, **over})


def test_the_step_or_the_gmu_that_moves_delta_to_the_cap() -> None:
    f = finding(RULE, _oom())
    assert f is not None and f.severity == "critical"
    assert [x.flags for x in f.fixes] == [
        {"--max-num-batched-tokens": "4096"},
        {"--gpu-memory-utilization": "0.97"},  # floor((79.19 − 1.16 − 0.5) / 79.19, 0.01)
    ]
    assert "WARNING" in f.summary and "--kv-cache-memory-bytes" not in f.summary
    assert_words_match_fixes(f)


def test_without_prefill_in_the_step_no_chunk_and_a_decode_batch_is_halved() -> None:
    f = finding(
        RULE,
        _oom(log_prompt_throughput_last=0.0, runtime_oom_hints=["sampler"], max_num_seqs_effective=1024),
    )
    assert f is not None
    assert [x.flags for x in f.fixes] == [{"--gpu-memory-utilization": "0.97"}, {"--max-num-seqs": "512"}]


@pytest.mark.parametrize(
    "over",
    [
        {"vllm_sizing_mode": "estimate"},  # no torch cap
        {"oom_at_runtime": False},  # a startup OOM: a warm-up or capture rule
        {"oom_requested_bytes": 256 * MiB},  # fits the reserved-but-unallocated pool: fragmentation
        {"runtime_oom_hints": ["logprobs"]},  # logprobs-oom's
        {"oom_frames_rejection_sampler": True},  # spec-decode-sampler-oom's
        {"oom_allowed_bytes": None, "torch_cap_overrun_bytes": -GiB},  # nothing at the cap
    ],
)
def test_near_misses(over: dict[str, Any]) -> None:
    assert finding(RULE, _oom(**over)) is None


def test_bundles() -> None:
    from kvdoctor.pipeline import Pipeline
    from kvdoctor.sources.bundle import load_bundle

    pipeline = Pipeline.load()

    def rules(name: str) -> dict[str, Any]:
        report = pipeline.evaluate(load_bundle(BUNDLES / name).timeline, now=0)
        return {f.rule: f for f in report.findings}

    fired = rules("v34-torch-cap-oom-prefill")["torch-cap-oom"]
    assert fired.suggested_flags == {"--max-num-batched-tokens": "4096"}
    for name in ("v34-torch-cap-oom-fragmentation-near-miss", "v34-estimate-runtime-oom-near-miss"):
        assert "torch-cap-oom" not in rules(name)
