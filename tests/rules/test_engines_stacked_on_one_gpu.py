"""engines-stacked-on-one-gpu (issue 24 kind 4): stacking on one GPU while another is idle is the
root cause; colocated-engines-overcommit is its consequence (``explains``), shown as caused_by."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvdoctor.cli import cli

BUNDLES = Path(__file__).parent.parent / "data" / "bundles"


def _findings(name: str) -> list[dict]:
    out = CliRunner().invoke(cli, ["diagnose", "--bundle", str(BUNDLES / name), "--format", "json"])
    return json.loads(out.stdout)["findings"]


def test_stacking_is_the_cause_and_overcommit_its_consequence() -> None:
    fs = _findings("p2-stacked-engines-overcommit-gpu1-idle")
    stacked = [f for f in fs if f["rule"] == "engines-stacked-on-one-gpu"]
    over = [f for f in fs if f["rule"] == "colocated-engines-overcommit"]
    assert stacked and over
    assert stacked[0]["suggested_flags"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert "gmu 0.98" in stacked[0]["summary"] and "fallback" in stacked[0]["summary"]
    assert stacked[0].get("caused_by") is None
    assert all(f["caused_by"] == "engines-stacked-on-one-gpu" for f in over)


def test_near_miss_no_idle_gpu_leaves_the_overcommit_as_root() -> None:
    fs = _findings("p2-stacked-near-miss-overcommit-gpu1-busy")
    assert not [f for f in fs if f["rule"] == "engines-stacked-on-one-gpu"]
    over = [f for f in fs if f["rule"] == "colocated-engines-overcommit"]
    assert over and all(f.get("caused_by") is None for f in over)
