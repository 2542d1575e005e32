"""engine-crashed (issue 24 kind 5): a crashed engine is never OK. The log parser's
``exception`` events and derive's engine_crashed / engine_error_text / crash_explained, the
rule's words, its giving way to a specific rule, and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from kvdoctor.rules.engine_crashed import RULE

from kvdoctor.cli import cli
from kvdoctor.derive.base import LogView
from kvdoctor.derive.log import _crash
from kvdoctor.sources.vllm_log import parse_log
from tests.rules._words import facts, finding

BUNDLES = Path(__file__).parent.parent / "data" / "bundles"
_EC = "(EngineCore pid=120) ERROR 03-10 07:30:27 [core.py:1584] "


def _vars(text: str) -> dict:
    log = parse_log(text)
    v: dict = dict.fromkeys(
        ("engine_crashed", "engine_crash_line", "engine_error_text", "engine_error_line")
        + ("engine_error_exception", "crash_explained")
    )
    _crash(v, LogView(log, log.events))
    return v


def _startup(error: str, *, after: str = "") -> str:
    return "\n".join(
        [
            "(APIServer pid=1) INFO 03-10 07:30:11 [api_utils.py:347] vLLM server version 0.33.0, serving model m",
            _EC + "EngineCore failed to start.",
            _EC + "Traceback (most recent call last):",
            _EC + '  File "/x/vllm/v1/worker/gpu_worker.py", line 248, in init_device',
            _EC + error,
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            after,
        ]
    )


def test_the_real_error_is_quoted_not_the_wrapper() -> None:
    v = _vars(_startup("RuntimeError: NCCL error: unhandled cuda error, NCCL version 2.27.3"))
    assert v["engine_crashed"] is True and v["crash_explained"] is False
    assert v["engine_error_text"] == "RuntimeError: NCCL error: unhandled cuda error, NCCL version 2.27.3"
    assert v["engine_error_line"] == 5 and v["engine_crash_line"] == 2
    assert v["engine_error_exception"] == "RuntimeError"


def test_the_quote_is_bounded_and_redacted() -> None:
    secret = "hf_" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
    v = _vars(_startup(f"OSError: token={secret} cannot reach https://bob:hunter2@proxy:3128 " + "x" * 2000))
    text = v["engine_error_text"]
    assert len(text) <= 300
    assert secret not in text and "hunter2" not in text
    hit = finding(RULE, facts(**v))
    assert hit is not None and secret not in hit.summary and "hunter2" not in hit.summary


def test_a_recognised_error_explains_the_crash() -> None:
    v = _vars(
        _startup(
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
        )
    )
    assert v["engine_crashed"] is True and v["crash_explained"] is True
    assert finding(RULE, facts(**v)) is None


def test_a_startup_traceback_the_engine_survived_is_no_crash() -> None:
    # a traceback before serving, after which the engine loaded its model and sized its KV
    text = "\n".join(
        [
            "(APIServer pid=1) ERROR 03-10 07:30:12 [registry.py:90] Error in loading optional plugin",
            "(APIServer pid=1) ERROR 03-10 07:30:12 [registry.py:90] ModuleNotFoundError: No module named 'x'",
            "(EngineCore pid=120) INFO 03-10 07:30:41 [gpu_model_runner.py:5089] Model loading took 14.99 GiB"
            " memory and 9.113372 seconds",
            "(EngineCore pid=120) INFO 03-10 07:30:58 [gpu_worker.py:773] Available KV cache memory: 24.31 GiB",
        ]
    )
    v = _vars(text)
    assert v["engine_crashed"] is False
    assert finding(RULE, facts(**v)) is None


def test_a_startup_traceback_with_no_progress_after_it_is_a_crash() -> None:
    text = "\n".join(
        [
            "(APIServer pid=1) INFO 03-10 07:30:11 [api_utils.py:347] vLLM server version 0.33.0, serving model m",
            "Traceback (most recent call last):",
            '  File "/usr/local/bin/vllm", line 10, in <module>',
            "ValueError: invalid literal for int() with base 10: 'auto'",
        ]
    )
    v = _vars(text)
    assert v["engine_crashed"] is True and v["engine_error_line"] == 4


def test_a_failing_gpu_or_a_rejected_kv_dtype_takes_its_place() -> None:
    base = _vars(_startup("RuntimeError: CUDA error: unspecified launch failure"))
    assert finding(RULE, facts(**base)) is not None
    assert finding(RULE, facts(**base, xid_hw_count=1, hw_error_gpus=[0], engine_gpus=[0])) is None
    assert finding(RULE, facts(**base, invalid_kv_dtype=True)) is None
    # a failing GPU that is not this engine's explains nothing
    assert finding(RULE, facts(**base, xid_hw_count=1, hw_error_gpus=[1], engine_gpus=[0])) is not None


def test_a_healthy_engine_has_no_crash() -> None:
    v = _vars((BUNDLES / "r01-healthy-busy-tp2-h100" / "vllm.log").read_text())
    assert v["engine_crashed"] is False


def _diagnose(bundle: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["diagnose", "--bundle", str(BUNDLES / bundle), "--format", "json"])
    return result.exit_code, json.loads(result.stdout)


def test_diagnose_exits_2_and_quotes_the_error() -> None:
    code, report = _diagnose("d2-engine-crashed-nccl-tp2-v033")
    assert code == 2
    (f,) = [f for f in report["findings"] if f["rule"] == "engine-crashed"]
    assert "NCCL error: unhandled system error" in f["summary"]
    assert "vllm.log line 35" in f["summary"]


def test_a_quote_naming_a_flag_stays_in_the_evidence() -> None:
    code, report = _diagnose("d2-engine-crashed-startup-bf16-v100")
    assert code == 2
    (f,) = [f for f in report["findings"] if f["rule"] == "engine-crashed"]
    assert "--dtype" not in f["summary"] and "ValueError" in f["summary"]
    assert "sk-live" not in json.dumps(report)
    assert any("--dtype=half" in str(e) for e in f["evidence"])


def test_every_error_kind_of_the_parser_is_classified() -> None:
    """A new error kind in the log parser must say whether a specific rule reads it."""
    from kvdoctor.derive.log import RECOGNISED_ERROR_KINDS, UNRECOGNISED_ERROR_KINDS
    from kvdoctor.sources.vllm_log import _ERROR_KINDS

    assert _ERROR_KINDS <= RECOGNISED_ERROR_KINDS | UNRECOGNISED_ERROR_KINDS
    assert not RECOGNISED_ERROR_KINDS & UNRECOGNISED_ERROR_KINDS
