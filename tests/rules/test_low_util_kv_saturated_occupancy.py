"""low-util-kv-saturated on 0.34 (issue 28 item 5, spec §2): token occupancy beside the block
usage; --block-size 16 only where the backend takes it and the token/block ratio is < 0.8."""

from __future__ import annotations

from typing import Any

from kvdoctor import rulekit
from rules.low_util_kv_saturated import RULE
from tests.rules._words import facts


def _eval(**changes: Any) -> Any:
    base = dict(
        gpu_util=0.2,
        kv_usage=0.95,
        kv_usage_max=0.95,
        waiting_max=40,
        kv_cache_dtype="fp8",
        block_size=64,
        kv_padding_tokens_per_request=31.5,
        typical_request_tokens=100,
        block_size_16_valid=True,
        vllm_v34=True,
        engine_gpus=[0],
    )
    v = facts(**{**base, **changes})
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", v, {"gpus", "metrics", "log"})])
    assert not ev.errors, [str(e) for e in ev.errors]
    return ev.findings[0] if ev.findings else None


def test_short_requests_in_64_token_blocks_get_block_size_16_and_the_token_occupancy() -> None:
    f = _eval()
    assert f is not None
    # ratio 100 / 131.5 = 0.76 < 0.8: 24 % of "KV 95 %" is padding, token occupancy ≈ 72 %
    assert "about 24% of that is padding" in f.summary and "token occupancy ≈ 72%" in f.summary
    assert {"--block-size": "16"} in [fx.flags for fx in f.fixes]
    assert any(e.fact == "token occupancy (estimate)" for e in f.evidence)


def test_no_block_size_16_on_a_backend_that_does_not_take_it_or_long_requests() -> None:
    for changes in (
        {"block_size_16_valid": False},  # FLASHMLA / CUTLASS_MLA / hybrid alignment
        {"block_size_16_valid": None},  # backend unknown
        {"typical_request_tokens": 2000},  # ratio 0.98
        {"block_size": 16, "kv_padding_tokens_per_request": 7.5},  # 0.33 default: already 16
    ):
        f = _eval(**changes)
        assert f is not None
        assert {"--block-size": "16"} not in [fx.flags for fx in f.fixes], changes
        assert "--block-size" not in f.summary, changes


def test_the_033_trigger_is_kept() -> None:
    assert _eval(kv_usage_max=0.85, kv_usage=0.85) is None
    assert _eval(waiting_max=0) is None


def _bundle_finding(name: str) -> dict:
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from kvdoctor.cli import cli

    bundle = Path(__file__).parent.parent / "data" / "bundles" / name
    out = CliRunner().invoke(cli, ["diagnose", "--bundle", str(bundle), "--format", "json"])
    (f,) = [f for f in json.loads(out.stdout)["findings"] if f["rule"] == "low-util-kv-saturated"]
    return f


def test_bundle_034_short_requests_get_block_size_16_long_ones_do_not() -> None:
    short = _bundle_finding("p2-v34-kv-saturated-short-requests-block64")
    assert {"--block-size": "16"} in [fx["flags"] for fx in short["fixes"]]
    assert "token occupancy ≈ 74%" in short["summary"]
    long = _bundle_finding("p2-v34-kv-saturated-long-requests-near-miss")
    assert {"--block-size": "16"} not in [fx["flags"] for fx in long["fixes"]]
    assert "padding" not in long["summary"]
