"""wake-up-oom and sleep-memory-not-released on vLLM 0.34's extensible KV cache (spec/vllm-0.34.md
§2): the VMM driver OOM of the KV recommit after a wake, a checkpoint restore or a KV loan; K is
the committed pool; the cuMem pool excludes the extensible KV. 0.33 behaviour kept."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvdoctor.pipeline import Pipeline
from kvdoctor.sources.bundle import load_bundle

BUNDLES = Path(__file__).parent.parent / "data" / "bundles"
WAKE = BUNDLES / "d2-v34-wake-up-oom-vmm-recommit"


def _report(bundle: Path):  # type: ignore[no-untyped-def]
    return Pipeline.load().evaluate(load_bundle(bundle).timeline, now=0)


def _finding(bundle: Path, rule: str):  # type: ignore[no-untyped-def]
    got = [f for f in _report(bundle).findings if f.rule == rule]
    return got[0] if got else None


def _with_log(tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path / "b"
    shutil.copytree(WAKE, out)
    log = out / "vllm.log"
    log.write_text(edit(log.read_text()))
    return out


def test_the_vmm_recommit_oom_after_a_wake_fires_with_the_committed_pool() -> None:
    f = _finding(WAKE, "wake-up-oom")
    assert f is not None
    assert "GPU driver error 2: out of memory" in f.summary
    # W 7.55 + the committed 24.75 GiB, not W + 'Available KV cache memory' 27.10 GiB
    assert "32.30 GiB" in f.summary and "24.75 GiB" in f.summary
    assert "next start" in f.summary
    assert f.fixes[0].flags["--gpu-memory-utilization"] == "0.39"


def test_a_checkpoint_restore_that_cannot_recommit_fires(tmp_path: Path) -> None:
    def edit(text: str) -> str:
        lines = [ln for ln in text.splitlines() if "fall asleep" not in ln and "Sleep mode freed" not in ln]
        lines = [ln for ln in lines if "CuMemAllocator" not in ln]
        return "\n".join(
            ln.replace(
                "[api_router.py:50] wake up the engine with tags: None",
                "[core.py:2500] Restoring from a process checkpoint",
            )
            for ln in lines
        )

    f = _finding(_with_log(tmp_path, edit), "wake-up-oom")
    assert f is not None and "checkpoint restore" in f.summary
    assert "24.75 GiB per GPU" in f.summary  # a restore wakes ['kv_cache']: the committed pool only


def test_a_kv_loan_recommit_fires_without_sleep_lines(tmp_path: Path) -> None:
    def edit(text: str) -> str:
        lines = [ln for ln in text.splitlines() if "sleep" not in ln.lower() and "asleep" not in ln]
        return "\n".join(
            ln.replace(
                "(APIServer pid=91) INFO 12-07 12:30:00 [api_router.py:50] wake up the engine with tags: None",
                "(EngineCore pid=180) INFO 12-07 12:30:00 [extensible_kv_cache.py:781] Releasing the emptied KV"
                " cache's memory for a weight update: 3.10 GiB free, about 9.00 GiB needed.",
            )
            for ln in lines
        )

    f = _finding(_with_log(tmp_path, edit), "wake-up-oom")
    assert f is not None and "KV loan" in f.summary


def test_the_same_driver_error_at_startup_is_no_wake() -> None:
    report = _report(BUNDLES / "d2-v34-vmm-oom-at-startup-not-wake")
    assert "wake-up-oom" not in {f.rule for f in report.findings}


def test_the_033_cumem_wake_oom_is_unchanged() -> None:
    f = _finding(BUNDLES / "c2-wake-up-oom-neighbour-awake", "wake-up-oom")
    assert f is not None and "cumem_allocator.cpp" in f.summary and "next start" not in f.summary
    assert f.fixes[0].flags["--gpu-memory-utilization"] == "0.23"


def test_sleep_k_is_the_committed_pool_on_ext() -> None:
    assert _finding(BUNDLES / "d2-v34-sleep-released-ext-healthy", "sleep-memory-not-released") is None
    f = _finding(BUNDLES / "d2-v34-sleep-not-released-ext", "sleep-memory-not-released")
    assert f is not None
    assert "41.30 GiB weights + KV" in f.summary  # 7.55 + 33.75, not 7.55 + 69.10
    # the cuMem pool freed W: on ext it is not 'short' (the KV lives outside it)
    assert "pool itself was short" not in f.summary and "outside it" in f.summary


def test_sleep_033_twins_unchanged() -> None:
    assert _finding(BUNDLES / "c2-sleep-not-released-v014-3090", "sleep-memory-not-released") is not None
    assert _finding(BUNDLES / "c2-sleep-released-v013-3090", "sleep-memory-not-released") is None
