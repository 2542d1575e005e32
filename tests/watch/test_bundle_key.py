"""The ``b`` key writes the bundle ``kvdoctor bundle`` writes from the same inputs: the log is
copied (bounded, redacted), not re-rendered from the events kvdoctor parsed."""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.inputs import InputOptions, open_feed
from kvdoctor.watch.app import WatchApp

from .conftest import wait_for

BUNDLE = Path(__file__).parents[1] / "data" / "bundles" / "r04-dp2-engines-preempting"
SECRET = "sk-live-5f3c9a1e7b2d"


def _member(tar_path: Path, name: str) -> bytes:
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            if m.name.split("/", 1)[-1] == name:
                f = tar.extractfile(m)
                assert f is not None
                return f.read()
    raise AssertionError(f"{name} not in {tar_path}")


def test_b_bundle_log_is_the_same_as_kvdoctor_bundle(pipeline, tmp_path):
    # The bundle's log plus lines no parser keeps, and a secret on the launch line.
    log = tmp_path / "vllm.log"
    text = (BUNDLE / "vllm.log").read_text()
    extra = "".join(f"INFO 05-01 10:00:{i % 60:02d} [misc.py:1] housekeeping line {i}\n" for i in range(200))
    log.write_text(f"INFO args: vllm serve m --api-key {SECRET}\n" + text + extra)
    n_lines = len(log.read_text().splitlines())

    ref = tmp_path / "ref.tar.gz"
    res = CliRunner().invoke(cli, ["bundle", "-o", str(ref), "--bundle", str(BUNDLE), "--log", str(log)])
    assert res.exit_code == 0, res.output

    out = tmp_path / "out"
    out.mkdir()
    opts = InputOptions(bundle=BUNDLE, log=log)

    async def go():
        app = WatchApp(open_feed(opts), pipeline, host="test-host", out_dir=out, opts=opts)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.view is not None and app.controller.ended)
            await pilot.press("b")
            await wait_for(pilot, lambda: any("bundle written" in n.message for n in app._notifications))

    asyncio.run(go())
    [written] = list(out.glob("kvdoctor-bundle-*.tar.gz"))
    mine, theirs = _member(written, "vllm.log"), _member(ref, "vllm.log")
    assert mine == theirs
    assert SECRET.encode() not in mine and len(mine.decode().splitlines()) == n_lines
    # The rest of the bundle too: the same files from the same inputs.
    with tarfile.open(written) as a, tarfile.open(ref) as b:
        names = {m.name.split("/", 1)[-1] for m in a.getmembers() if m.isfile()}
        assert names == {m.name.split("/", 1)[-1] for m in b.getmembers() if m.isfile()}
