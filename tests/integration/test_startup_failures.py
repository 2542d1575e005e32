"""Two real startup failures, diagnosed from the log vLLM printed.

- ``--num-gpu-blocks-override 2`` at ``--max-model-len 256``: 2 blocks of 128 tokens, one of them
  the null block, hold 128 tokens; vLLM refuses with "To serve at least one request with the
  model's max seq len (256) …" and logs its estimated maximum model length.
- ``--num-gpu-blocks-override 1``: only the null block; "No available memory for the cache blocks".

The suggested value is read from vLLM's own message by this test, never hard-coded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration import vllm_env
from tests.integration.conftest import kvdoctor_json, pin
from tests.integration.server import FAILURE_TIMEOUT_S, STARTUP_FAILED, VllmServer, start_server

FAILURES = {
    "kv-too-small": ["--max-model-len", "256", "--num-gpu-blocks-override", "2"],
    "no-kv-blocks": ["--max-model-len", "256", "--num-gpu-blocks-override", "1"],
}


@pytest.fixture(scope="module")
def failed(vllm: vllm_env.VllmEnv, workdir: Path) -> dict[str, tuple[VllmServer, int]]:
    """Both failing startups, run side by side; name → (server, exit code)."""
    servers = {name: start_server(vllm, workdir, args, name=name) for name, args in FAILURES.items()}
    out: dict[str, tuple[VllmServer, int]] = {}
    try:
        for name, srv in servers.items():
            out[name] = (srv, srv.wait_exit(FAILURE_TIMEOUT_S))
    finally:
        for srv in servers.values():
            srv.stop()
    for name, (srv, _) in out.items():
        pin(f"startup-failures/{name}.log", srv.log)
    return out


def test_kv_smaller_than_max_model_len_gives_vllms_estimate(
    failed: dict[str, tuple[VllmServer, int]],
) -> None:
    srv, rc = failed["kv-too-small"]
    text = srv.log.read_text(errors="replace")
    # vLLM itself refused to start (its own last line), whatever ended the process afterwards.
    assert STARTUP_FAILED in text and rc != 0
    assert "To serve at least one request with the model's max seq len (256)" in text
    estimate = re.search(r"estimated maximum model length is (\d+)", text)
    doc = kvdoctor_json("diagnose", "--log", str(srv.log))
    found = {f["rule"]: f for f in doc["findings"]}
    assert "max-model-len-exceeds-kv-capacity" in found, sorted(found)
    assert "kv-budget-exhausted" not in found
    f = found["max-model-len-exceeds-kv-capacity"]
    assert f["severity"] == "critical" and doc["exit_code"] == 2
    suggested = int(
        next(x["flags"]["--max-model-len"] for x in f["fixes"] if "--max-model-len" in x["flags"])
    )
    if estimate:
        assert suggested == int(estimate.group(1))
    # Valid: shorter than what failed, and a whole number of 128-token blocks fits it.
    assert 0 < suggested < 256


def test_no_kv_blocks_gives_kv_budget_exhausted(failed: dict[str, tuple[VllmServer, int]]) -> None:
    srv, rc = failed["no-kv-blocks"]
    text = srv.log.read_text(errors="replace")
    # vLLM itself refused to start (its own last line), whatever ended the process afterwards.
    assert STARTUP_FAILED in text and rc != 0
    assert "No available memory for the cache blocks" in text
    doc = kvdoctor_json("diagnose", "--log", str(srv.log))
    found = {f["rule"]: f for f in doc["findings"]}
    assert "kv-budget-exhausted" in found, sorted(found)
    assert found["kv-budget-exhausted"]["severity"] == "critical" and doc["exit_code"] == 2
