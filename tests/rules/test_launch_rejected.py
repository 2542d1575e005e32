"""launch-rejected (issue 24 kind 10): `diagnose --cmdline '…'` alone on a launch vLLM would refuse
(--max-model-len above the model's maximum, TP that does not divide the heads, a flag the version
does not have) is a critical finding with the fix and a non-zero exit; a launch vLLM accepts is OK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kvdoctor.rules.launch_rejected import RULE

from kvdoctor.cli import cli
from tests.rules._words import facts, finding
from tests.test_cases import diagnose_json

DATA = Path(__file__).resolve().parent.parent / "data"


def _cmdline(command: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["diagnose", "--cmdline", command, "--format", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, json.loads(result.stdout)


def test_cmdline_alone_above_the_model_maximum_and_tp_not_dividing_the_heads() -> None:
    code, report = _cmdline(
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 200000 --tensor-parallel-size 3"
    )
    assert code == 2 and report["health"] == "critical"
    (f,) = [x for x in report["findings"] if x["rule"] == "launch-rejected"]
    assert f["family"] == "K" and f["severity"] == "critical"
    # every alternative fixes both problems at once
    assert [a["flags"] for a in f["fixes"]] == [
        {"--max-model-len": "131072", "--tensor-parallel-size": "2"},
        {"--max-model-len": "131072", "--tensor-parallel-size": "4"},
    ]


def test_cmdline_alone_a_flag_the_image_version_lacks() -> None:
    code, report = _cmdline(
        "docker run --gpus all vllm/vllm-openai:v0.34.0 --model meta-llama/Llama-3.1-8B-Instruct --swap-space 4"
    )
    assert code == 2
    (f,) = [x for x in report["findings"] if x["rule"] == "launch-rejected"]
    assert "swap_space" in f["summary"] and "0.34.0" in f["summary"]


@pytest.mark.parametrize(
    "command",
    [
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 131072 --tensor-parallel-size 2",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 200000",
        "docker run --gpus all vllm/vllm-openai:v0.17.1 --model meta-llama/Llama-3.1-8B-Instruct --swap-space 4",
        # an unknown model: nothing to check the length or TP against
        "vllm serve my-org/private-model --max-model-len 1000000 --tensor-parallel-size 3",
    ],
)
def test_cmdline_near_misses_are_ok(command: str) -> None:
    code, report = _cmdline(command)
    assert code == 0 and all(x["rule"] != "launch-rejected" for x in report["findings"])


def test_rule_on_facts_mml_only() -> None:
    f = finding(
        RULE,
        facts(
            launch_max_model_len=65536,
            model_max_model_len=40960,
            max_model_len=65536,
            long_max_model_len_allowed=False,
            tp=1,
        ),
    )
    assert f is not None and [x.flags for x in f.fixes] == [{"--max-model-len": "40960"}]


@pytest.mark.parametrize(
    ("bundle", "fires"),
    [("k1-preflight-launch-rejected", True), ("k1-preflight-launch-accepted-near-miss", False)],
)
def test_bundles(bundle: str, fires: bool) -> None:
    code, report = diagnose_json(DATA / "bundles" / bundle)
    assert any(x["rule"] == "launch-rejected" for x in report["findings"]) is fires
    assert (code != 0) is fires


def test_a_length_the_engine_ran_with_is_not_rejected() -> None:
    # near miss: the log shows vLLM sized the KV cache for 65,536 tokens, so it accepted the
    # length whatever the model maximum in hand says (another revision, the catalogue's)
    ran = facts(
        launch_max_model_len=65536,
        model_max_model_len=40960,
        max_model_len=65536,
        long_max_model_len_allowed=False,
        tp=1,
        log_kv_concurrency_len=65536,
    )
    assert finding(RULE, ran) is None
    # a shorter length in that line is no evidence for this one
    assert finding(RULE, {**ran, "log_kv_concurrency_len": 32768}) is not None


def test_bundle_whose_config_was_not_read_and_that_ran(tmp_path: Path) -> None:
    # the catalogue says Qwen/Qwen3-4B supports 40,960 tokens; this engine ran with 262,144
    # (its config.json, here left out, says so): the log's KV line is the evidence it ran
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(DATA / "bundles" / "c2-long-context-prefill-oom-gh200", bundle)
    (bundle / "config.json").unlink()
    _code, report = diagnose_json(bundle)
    assert all(x["rule"] != "launch-rejected" for x in report["findings"])
