"""Redaction (kvdoctor/redact.py): secrets in argv, free text, reprs and env never survive, and
the flags and variables kvdoctor needs do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.redact import MARK, is_secret_env_name, is_secret_name, redact_argv, redact_env, redact_text

HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"
SK = "sk-proj-AbCdEfGh0123456789xyz"


# --------------------------------------------------------------------------- argv


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--api-key", "abc"], ["--api-key", MARK]),
        (["--api-key=abc"], [f"--api-key={MARK}"]),
        (["--api_key", "abc"], ["--api_key", MARK]),
        (["--hf-token", "tok"], ["--hf-token", MARK]),
        (["--hf-token=tok"], [f"--hf-token={MARK}"]),
        (["--auth-token", "x"], ["--auth-token", MARK]),
        (["--client-secret", "x"], ["--client-secret", MARK]),
        (["--db-password=x"], [f"--db-password={MARK}"]),
        (["--secret-file-contents", "x"], ["--secret-file-contents", MARK]),
        (["--API-KEY", "x"], ["--API-KEY", MARK]),
        # a bare switch redacts nothing after it
        (["--hf-token", "--port", "8000"], ["--hf-token", "--port", "8000"]),
        (["--api-key"], ["--api-key"]),
        (["--api-key="], ["--api-key="]),
        (["-e", f"HF_TOKEN={HF}"], ["-e", f"HF_TOKEN={MARK}"]),
        (["--env", "OPENAI_API_KEY=abc"], ["--env", f"OPENAI_API_KEY={MARK}"]),
        (["-H", "Authorization: Bearer abc.def"], ["-H", f"Authorization: Bearer {MARK}"]),
        (["--download-dir", f"/x/{HF}/y"], ["--download-dir", f"/x/{MARK}/y"]),
        (["--endpoint", "https://user:pw@host:9/x"], ["--endpoint", f"https://user:{MARK}@host:9/x"]),
        ([SK], [MARK]),
        # recent vLLM: --api-key takes a list of keys
        (["--api-key", "k1", "k2", "--port", "1"], ["--api-key", MARK, MARK, "--port", "1"]),
        (["--hf-token", "t1", "model"], ["--hf-token", MARK, "model"]),
    ],
)
def test_redact_argv_secrets(argv: list[str], expected: list[str]) -> None:
    assert redact_argv(argv) == expected


def test_redact_argv_keeps_non_secrets() -> None:
    argv = [
        "vllm",
        "serve",
        "Qwen/Qwen3-32B",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--tokenizer",
        "org/tok",
        "--return-tokens-as-token-ids",
        "--ssl-keyfile",
        "/etc/ssl/key.pem",
        "--skip-tokenizer-init",
        "--port",
        "8000",
        "--served-model-name",
        "task-skinny",
        "-tp",
        "2",
        "--max-model-len=-1",
    ]
    assert redact_argv(argv) == argv


def test_api_key_list_in_text_stops_at_line_end() -> None:
    out = redact_text("serve --api-key k1 k2\nINFO next line stays")
    assert out == f"serve --api-key {MARK} {MARK}\nINFO next line stays"


def test_redact_argv_whole_command() -> None:
    argv = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--api-key",
        "hunter2",
        "--port",
        "1",
    ]
    out = redact_argv(argv)
    assert "hunter2" not in out and out[-4:] == ["--api-key", MARK, "--port", "1"]
    assert len(out) == len(argv)


# --------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    "text,secret",
    [
        ("vllm serve m --api-key abc123 --port 8000", "abc123"),
        ("vllm serve m --api-key=abc123", "abc123"),
        ("vllm serve m --api-key 'quoted secret'", "quoted secret"),
        ("Namespace(host=None, api_key='abc123', model='m')", "abc123"),
        ("Namespace(api_key=['k1', 'k2'], model='m')", "k1"),
        ("non-default args: {'model': 'm', 'api_key': 'abc123'}", "abc123"),
        ('{"hf_token": "abc123", "x": 1}', "abc123"),
        ("HF_TOKEN=abc123 vllm serve m", "abc123"),
        ('export HUGGING_FACE_HUB_TOKEN="abc 123"', "abc 123"),
        ("AWS_SECRET_ACCESS_KEY=abc123", "abc123"),
        ("WANDB_API_KEY=abc123", "abc123"),
        ("DB_PASSWORD=abc123", "abc123"),
        ("MY_SECRET=abc123", "abc123"),
        ("curl -H 'Authorization: Bearer abc123' http://x/v1/models", "abc123"),
        ("authorization: basic dXNlcjpwdw==", "dXNlcjpwdw=="),
        ("{'Authorization': 'Bearer abc123'}", "abc123"),
        ("proxy http://alice:abc123@proxy:3128 in use", "abc123"),
        (f"token is {HF} here", HF),
        (f"key {SK}", SK),
        ("ghp_AbCdEfGhIjKlMnOpQrStUvWx0123 pushed", "ghp_AbCdEfGhIjKlMnOpQrStUvWx0123"),
        ("AKIAABCDEFGHIJKLMNOP", "AKIAABCDEFGHIJKLMNOP"),
        ("api-key: abc123\nmodel: m\n", "abc123"),
        ("X-API-Key: abc123", "abc123"),
        ("args: ['--api-key', 'abc123', '--port', '8000']", "abc123"),
        ("url http://h/metrics?api_key=abc123&x=1", "abc123"),
        ("vllm serve m --api-key k0 abc123 --port 1", "abc123"),
    ],
)
def test_redact_text_secrets(text: str, secret: str) -> None:
    out = redact_text(text)
    assert secret not in out
    assert MARK in out


@pytest.mark.parametrize(
    "text",
    [
        "vllm serve m --kv-cache-dtype fp8 --max-num-seqs 256 --max-num-batched-tokens 8192",
        "Namespace(api_key=None, max_num_batched_tokens=None, tokenizer='org/tok', ssl_keyfile=None)",
        "non-default args: {'model_tag': 'm', 'max_model_len': 221000, 'kv_cache_dtype': 'fp8'}",
        "TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=0,1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "Maximum concurrency for 256 tokens per request: 8192.00x",
        "GPU KV cache size: 2,097,152 tokens",
        "(EngineCore pid=18489) INFO 11-29 18:04:37 [kv_cache_utils.py:2327] CPU KV cache size: 2 tokens",
        "max_num_batched_tokens: 8192\nblock_size: 16\n",
        "http://127.0.0.1:8000/metrics",
        "hf_config_path=/x/y and task-sk-1 model",
        "",
    ],
)
def test_redact_text_keeps_non_secrets(text: str) -> None:
    assert redact_text(text) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_redact_text_never_raises_and_is_idempotent(text: str) -> None:
    once = redact_text(text)
    assert isinstance(once, str)
    assert redact_text(once) == once


@settings(max_examples=100, deadline=None)
@given(st.from_regex(r"[A-Za-z0-9]{8,24}", fullmatch=True))
def test_api_key_value_never_survives(secret: str) -> None:
    assert secret not in redact_argv(["vllm", "serve", "m", "--api-key", secret])
    assert secret not in redact_text(f"vllm serve m --api-key {secret} --port 1")
    assert secret not in redact_text(f"Namespace(api_key='{secret}')")
    assert secret not in redact_env({"VLLM_API_KEY": secret}).values()


# --------------------------------------------------------------------------- env and names


def test_redact_env() -> None:
    env = {
        "HF_TOKEN": HF,
        "HUGGING_FACE_HUB_TOKEN": "x",
        "OPENAI_API_KEY": "x",
        "VLLM_API_KEY": "x",
        "AWS_SESSION_TOKEN": "x",
        "DB_PASSWORD": "x",
        "EMPTY_TOKEN": "",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "VLLM_USE_V1": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HTTPS_PROXY": "http://bob:pw@proxy:8080",
        "NOTE": f"uses {HF}",
    }
    out = redact_env(env)
    for k in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "OPENAI_API_KEY",
        "VLLM_API_KEY",
        "AWS_SESSION_TOKEN",
        "DB_PASSWORD",
    ):
        assert out[k] == MARK
    assert out["EMPTY_TOKEN"] == ""
    for k in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "VLLM_USE_V1", "TOKENIZERS_PARALLELISM"):
        assert out[k] == env[k]
    assert out["HTTPS_PROXY"] == f"http://bob:{MARK}@proxy:8080"
    assert HF not in out["NOTE"]
    assert list(out) == list(env)


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "GITHUB_TOKEN",
        "OPENAI_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "MY_SECRET",
        "DB_PASSWORD",
        "PGPASSWORD_X",
        "api_key",
    ],
)
def test_secret_env_names(name: str) -> None:
    assert is_secret_env_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "CUDA_VISIBLE_DEVICES",
        "TOKENIZERS_PARALLELISM",
        "VLLM_USE_V1",
        "HF_HOME",
        "KEYBOARD",
        "HF_TOKEN_PATH",
        "PATH",
    ],
)
def test_non_secret_env_names(name: str) -> None:
    assert not is_secret_env_name(name)


@pytest.mark.parametrize(
    "flag",
    [
        "--max-num-batched-tokens",
        "--tokenizer",
        "--ssl-keyfile",
        "--kv-cache-dtype",
        "--return-tokens-as-token-ids",
    ],
)
def test_non_secret_flag_names(flag: str) -> None:
    assert not is_secret_name(flag)
