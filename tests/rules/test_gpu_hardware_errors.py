"""gpu-hardware-errors: the reset is offered as the exact command for the failing GPU's index,
with what it needs; none for a GPU that fell off the bus or an unknown index; none for
application XIDs."""

from __future__ import annotations

from kvdoctor.rules.gpu_hardware_errors import RULE

from kvdoctor import rulekit
from kvdoctor.findings import Finding
from tests.rules._words import facts
from tests.test_words_and_fixes import _problems


def _finding(**values: object) -> Finding | None:
    ev = rulekit.evaluate([RULE], [rulekit.RuleContext("e", facts(**values), {"gpus", "log"})])
    assert not ev.errors, [str(e) for e in ev.errors]
    for f in ev.findings:
        assert _problems(f) == []
    return ev.findings[0] if ev.findings else None


def test_a_reset_required_xid_gets_the_exact_reset_command() -> None:
    f = _finding(
        xid_hw_count=1,
        xid_desc="Xid 154 on GPU 3 (00000000:9A:00.0), dmesg line 4: GPU recovery action changed"
        " from 0x0 (None) to 0x1 (GPU Reset Required)",
        hw_error_gpus=[3],
        hw_error_bus_ids=["00000000:9A:00.0"],
    )
    assert f is not None and f.severity == "critical"
    assert [x.commands for x in f.fixes] == [("nvidia-smi -r -i 3",)]
    assert "every process on that GPU stopped" in f.summary and "root" in f.fixes[0].why


def test_uncorrectable_ecc_on_two_gpus_resets_each() -> None:
    f = _finding(
        ecc_gpus=[1, 0], ecc_desc="GPU 0: 2, GPU 1: 1 uncorrectable ECC errors", hw_error_gpus=[1, 0]
    )
    assert f is not None
    assert f.fixes[0].commands == ("nvidia-smi -r -i 0", "nvidia-smi -r -i 1")


def test_a_gpu_that_fell_off_the_bus_gets_no_reset_command() -> None:
    f = _finding(
        xid_hw_count=1,
        xid_desc="Xid 79 on GPU 0 (00000000:07:00.0), dmesg line 5: GPU has fallen off the bus",
        hw_error_gpus=[0],
    )
    assert f is not None and f.fixes == []
    assert "nvidia-smi -r" not in f.summary and "reboot" in f.summary


def test_an_unknown_index_or_application_xids_get_no_command() -> None:
    f = _finding(xid_hw_count=1, xid_desc="Xid 48 (double-bit ECC)", hw_error_gpus=None)
    assert f is not None and f.fixes == []
    f = _finding(xid_app_count=1, xid_app_desc="Xid 43 on GPU 0 (pid 381)", xid_app_gpus=[0])
    assert f is not None and f.severity == "info" and f.fixes == []
