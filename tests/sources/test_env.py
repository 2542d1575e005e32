"""env.txt parsing (sources/env.py) against the cases' env.txt files and shell-style variants."""

from __future__ import annotations

import pytest

from kvdoctor.facts import SourceError
from kvdoctor.sources.env import parse_env_text, visible_devices, visible_devices_detail

# /work/shared/cases/b28-allocator-fragmentation-16g/env.txt
B28 = "CUDA_VISIBLE_DEVICES=0\nVLLM_USE_V1=1\nHF_HOME=/workspace/hf-cache\n"
# /work/shared/cases/real-cpu-preemptions/env.txt
REAL_CPU = "VLLM_CPU_KVCACHE_SPACE=1\nHF_HUB_OFFLINE=1\nTRANSFORMERS_OFFLINE=1\nVLLM_NO_USAGE_STATS=1\n"


def test_case_env_files() -> None:
    assert parse_env_text(B28) == {
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_USE_V1": "1",
        "HF_HOME": "/workspace/hf-cache",
    }
    env = parse_env_text(REAL_CPU)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and len(env) == 4
    assert visible_devices(parse_env_text(B28)) == [0]


def test_shell_forms_and_secrets() -> None:
    text = """
# comment
export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
declare -x VLLM_LOGGING_LEVEL='DEBUG'
HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345
VLLM_API_KEY = "s3cret"
MSG="two words" # trailing comment
BARE=value # comment
EMPTY=
HTTP_PROXY=http://u:pw@proxy:3128
VLLM_USE_V1=0
VLLM_USE_V1=1
"""
    env = parse_env_text(text)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert env["HF_TOKEN"] == "***"
    assert env["VLLM_API_KEY"] == "***"
    assert env["MSG"] == "two words"
    assert env["BARE"] == "value"
    assert env["EMPTY"] == ""
    assert env["HTTP_PROXY"] == "http://u:***@proxy:3128"
    assert env["VLLM_USE_V1"] == "1"  # later line wins


def test_env_output_with_multiline_value_skips_continuations() -> None:
    text = "A=1\nBASH_FUNC_f%%=() {  echo hi\n}\nB=2\n"
    assert parse_env_text(text) == {"A": "1", "B": "2"}


def test_empty_is_empty() -> None:
    assert parse_env_text("") == {}
    assert parse_env_text("# nothing\n\n") == {}


@pytest.mark.parametrize(
    "text,match,line",
    [
        ("A=1\nB=\x00\x01\x02\n", "binary", 2),
        ("\x7fELF\x02\x01", "binary", 1),
        ("this is not an env file\nnor this\n", "KEY=VALUE", 1),
        ("A=\ufffd\ufffd", "binary", 1),
    ],
)
def test_garbage(text: str, match: str, line: int) -> None:
    with pytest.raises(SourceError, match=match) as ei:
        parse_env_text(text, origin="env.txt")
    assert ei.value.line == line and ei.value.origin == "env.txt"


@pytest.mark.parametrize(
    "value,devices,note",
    [
        ("0", [0], ""),
        ("0,1, 3", [0, 1, 3], ""),
        ("", [], "no GPU"),
        ("1,-1,2", [1], "ignores"),
        ("GPU-8f4e2c1a-aaaa-bbbb-cccc-0123456789ab", None, "UUID"),
        ("MIG-GPU-8f4e2c1a/1/0", None, "UUID"),
    ],
)
def test_visible_devices(value: str, devices: list[int] | None, note: str) -> None:
    got, why = visible_devices_detail({"CUDA_VISIBLE_DEVICES": value})
    assert got == devices
    assert note in why
    assert visible_devices({"CUDA_VISIBLE_DEVICES": value}) == devices


def test_visible_devices_unset() -> None:
    assert visible_devices({}) is None
    assert visible_devices_detail({"OTHER": "1"}) == (None, "")
