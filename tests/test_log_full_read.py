"""Logs are read fast (issue 27 item 9: request and access lines counted at C speed, the usual
stats and request lines read by one match, events made only for what a run's history keeps) —
and every bundle's diagnosis is the one a full read gives: each line through the parser's general
path, every event kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.pipeline import Pipeline
from kvdoctor.report import render_json
from kvdoctor.sources import vllm_log
from kvdoctor.sources.bundle import load_bundle
from tests.rule_contexts import bundle_dirs

BUNDLES = [d for d in bundle_dirs() if any(d.rglob("vllm.log*"))]


def _full_read(path: str | os.PathLike[str], **_: Any) -> Any:
    """The log parsed line by line through :meth:`_Parser.feed`, no history bounds."""
    parser = vllm_log._Parser(os.fspath(path))
    for line in vllm_log.iter_log_lines(path):
        parser.feed(line)
    parser.finish()
    parser.log.events.sort(key=lambda e: e.line)
    return parser.log


def _diagnosis(bundle: Path) -> dict[str, Any]:
    report = json.loads(render_json(Pipeline.load().evaluate(load_bundle(bundle).timeline, now=0)))
    return {k: report.get(k) for k in ("findings", "errors", "engines", "status")}


def test_there_are_bundles_with_logs() -> None:
    assert len(BUNDLES) > 100


@pytest.mark.parametrize("bundle", BUNDLES, ids=[d.name for d in BUNDLES])
def test_fast_read_gives_the_full_reads_diagnosis(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _diagnosis(bundle)
    monkeypatch.setattr(vllm_log, "parse_log_file", _full_read)
    full = _diagnosis(bundle)
    assert fast == full
