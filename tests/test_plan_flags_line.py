"""plan's `Flags:` line holds every flag the plan assumed (issue 24 kind 10): pasting it after
`vllm serve MODEL` (here: back into `kvdoctor plan MODEL`) reproduces the plan."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli

MODEL = "meta-llama/Llama-3.1-70B-Instruct"  # the built-in catalogue
KEYS = ("num_gpu_blocks", "kv_cache_tokens", "max_concurrency", "fits", "sizing_mode", "block_size")


def _plan(args: list[str], fmt: str) -> str:
    result = CliRunner().invoke(cli, ["plan", MODEL, "--no-grid", "--format", fmt, *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def _flags_line(args: list[str]) -> list[str]:
    (line,) = [x for x in _plan(args, "text").splitlines() if x.startswith("Flags: ")]
    return shlex.split(line.removeprefix("Flags: "))


def _pairs(flags: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, tok in enumerate(flags):
        if tok.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else ""
            out[tok] = "" if nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize(
    ("where", "args"),
    [
        (["--gpu", "H100"], ["-tp", "4", "--kv-cache-dtype", "fp8", "--max-model-len", "65536"]),
        (
            ["--gpu", "H100", "--vllm-version", "0.34"],
            ["-tp", "8", "--block-size", "16", "--max-num-batched-tokens", "4096"],
        ),
        (
            ["--gpu", "A100-80GB", "--vllm-version", "0.33"],
            ["-tp", "4", "-pp", "2", "--gpu-memory-utilization", "0.9"],
        ),
        (["--gpu", "H100"], ["-tp", "4", "--no-enable-extensible-kv-cache", "--enforce-eager"]),
    ],
)
def test_pasting_the_flags_line_reproduces_the_plan(where: list[str], args: list[str]) -> None:
    flags = _flags_line([*where, *args])
    for assumed in ("--tensor-parallel-size", "--kv-cache-dtype", "--max-model-len"):
        assert assumed in flags
    for given in (a for a in args if a.startswith("--")):
        assert given in flags  # nothing the user gave is dropped
    first = json.loads(_plan([*where, *args], "json"))
    again = json.loads(_plan([*where, *flags], "json"))
    assert {k: again.get(k) for k in KEYS} == {k: first.get(k) for k in KEYS}
    # a fixed point: pasting it again gives the same flags and values
    assert _pairs(_flags_line([*where, *flags])) == _pairs(flags)
