"""Live NVML reader against a fake pynvml module (and the real one, which finds no driver here)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from kvdoctor.facts import Gpu, SourceError, SourceUnavailable
from kvdoctor.sources import nvml
from kvdoctor.sources.nvml import NvmlReader, read_gpus
from kvdoctor.units import GiB, MiB

NO_SUCH_PID = 2**22 + 12345  # above Linux's pid_max default: never a live process


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's spelling
    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_NoPermission(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Insufficient Permissions"


class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "Function Not Found"


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "NVML Shared Library Not Found"


def obj(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def make_fake(devices: list[dict[str, Any]], *, init_error: Exception | None = None) -> types.ModuleType:
    """A pynvml stand-in: each device is a dict of NVML function name → value or exception."""
    m = types.ModuleType("pynvml")
    calls: dict[str, int] = {"init": 0, "shutdown": 0}
    m.calls = calls  # type: ignore[attr-defined]
    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    m.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    m.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1  # type: ignore[attr-defined]
    m.NVML_VOLATILE_ECC = 0  # type: ignore[attr-defined]

    def init() -> None:
        calls["init"] += 1
        if init_error is not None:
            raise init_error

    def shutdown() -> None:
        calls["shutdown"] += 1

    def handle(i: int) -> dict[str, Any]:
        dev = devices[i]
        if "handle" in dev:
            raise dev["handle"]
        return dev

    def getter(name: str) -> Any:
        def fn(h: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            key = name
            if name == "nvmlDeviceGetMemoryInfo" and kwargs.get("version"):
                key = "nvmlDeviceGetMemoryInfo_v2"
            if name == "nvmlDeviceGetTemperature":
                assert args == (0,)
            if name == "nvmlDeviceGetTotalEccErrors":
                assert args == (1, 0)  # uncorrected, volatile
            val = h.get(key, NVMLError_NotSupported())
            if isinstance(val, Exception):
                raise val
            return val

        return fn

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    # every function a read calls but the handle (above) and the process name (below)
    for name in set(nvml._FUNCTIONS) - {"nvmlDeviceGetHandleByIndex", "nvmlSystemGetProcessName"}:
        setattr(m, name, getter(name))
    m.nvmlSystemGetProcessName = lambda pid: b"/opt/other/bin/trainer"  # type: ignore[attr-defined]
    return m


H100 = {
    "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
    "nvmlDeviceGetUUID": "GPU-11111111-2222-3333-4444-555555555555",
    "nvmlDeviceGetPciInfo": obj(busId="00000000:18:00.0"),
    "nvmlDeviceGetMemoryInfo_v2": obj(
        total=81559 * MiB, used=75327 * MiB, free=5902 * MiB, reserved=330 * MiB
    ),
    "nvmlDeviceGetMemoryInfo": obj(total=81559 * MiB, used=75657 * MiB, free=5902 * MiB),
    "nvmlDeviceGetUtilizationRates": obj(gpu=21, memory=9),
    "nvmlDeviceGetTemperature": 41,
    "nvmlDeviceGetPowerUsage": 187_320,  # mW
    "nvmlDeviceGetEnforcedPowerLimit": 700_000,
    "nvmlDeviceGetMigMode": [0, 0],
    "nvmlDeviceGetCurrentClocksEventReasons": 0x1 | 0x20,
    "nvmlDeviceGetTotalEccErrors": 0,
    "nvmlDeviceGetComputeRunningProcesses": [
        obj(pid=os.getpid(), usedGpuMemory=70 * GiB),
        obj(pid=NO_SUCH_PID, usedGpuMemory=2**64 - 1),  # NVML_VALUE_NOT_AVAILABLE
    ],
    "nvmlDeviceGetGraphicsRunningProcesses": [obj(pid=os.getpid(), usedGpuMemory=None)],
}

A100_MIG = {
    "nvmlDeviceGetName": b"NVIDIA A100-SXM4-40GB",  # old nvidia-ml-py returns bytes
    "nvmlDeviceGetUUID": b"GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
    "nvmlDeviceGetPciInfo": obj(busId=b"00000000:00:04.0"),
    "nvmlDeviceGetMemoryInfo_v2": NVMLError_FunctionNotFound(),  # old driver: v1 fallback
    "nvmlDeviceGetMemoryInfo": obj(total=40960 * MiB, used=87 * MiB, free=40873 * MiB),
    "nvmlDeviceGetUtilizationRates": NVMLError_NotSupported(),
    "nvmlDeviceGetTemperature": 33,
    "nvmlDeviceGetPowerUsage": 45_000,
    "nvmlDeviceGetEnforcedPowerLimit": NVMLError_NotSupported(),
    "nvmlDeviceGetPowerManagementLimit": 400_000,
    "nvmlDeviceGetMigMode": [1, 1],
    "nvmlDeviceGetCurrentClocksEventReasons": NVMLError_FunctionNotFound(),
    "nvmlDeviceGetCurrentClocksThrottleReasons": 0x8 | 0x40,
    "nvmlDeviceGetTotalEccErrors": NVMLError_NoPermission(),
    "nvmlDeviceGetComputeRunningProcesses": NVMLError_NoPermission(),
    "nvmlDeviceGetGraphicsRunningProcesses": NVMLError_NoPermission(),
}

LOCKED = {"handle": NVMLError_NoPermission()}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    mod = make_fake([H100, A100_MIG, LOCKED])
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.setattr(nvml, "_default", None)
    yield mod
    nvml.close()


def test_reads_every_field(fake: types.ModuleType) -> None:
    g0, g1, g2 = read_gpus()
    assert (g0.index, g0.name, g0.uuid, g0.bus_id) == (
        0,
        "NVIDIA H100 80GB HBM3",
        "GPU-11111111-2222-3333-4444-555555555555",
        "00000000:18:00.0",
    )
    # v2 memory info preferred (used excludes reserved, as nvidia-smi shows it)
    assert (g0.memory_total_bytes, g0.memory_used_bytes) == (81559 * MiB, 75327 * MiB)
    assert (g0.utilization_gpu, g0.utilization_memory) == (0.21, 0.09)
    assert (g0.temperature_c, g0.power_w, g0.power_limit_w) == (41.0, 187.32, 700.0)
    assert g0.mig_enabled is False and g0.ecc_uncorrectable == 0
    assert g0.clock_event_reasons == ["gpu_idle", "sw_thermal_slowdown"]
    me, ghost = g0.processes
    assert (me.pid, me.type, me.used_bytes) == (os.getpid(), "C+G", 70 * GiB)
    assert me.name == psutil.Process().cmdline()[0]
    assert (me.gpu_uuid, me.gpu_bus_id) == (g0.uuid, g0.bus_id)
    # not visible to psutil: NVML's name; NVML_VALUE_NOT_AVAILABLE memory: None
    assert (ghost.pid, ghost.name, ghost.used_bytes, ghost.type) == (
        NO_SUCH_PID,
        "/opt/other/bin/trainer",
        None,
        "C",
    )


def test_mig_device_errors_blank_fields(fake: types.ModuleType) -> None:
    _, g1, _ = read_gpus()
    assert (g1.name, g1.uuid, g1.bus_id) == (
        "NVIDIA A100-SXM4-40GB",
        "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        "00000000:00:04.0",
    )
    assert (g1.memory_total_bytes, g1.memory_used_bytes) == (40960 * MiB, 87 * MiB)  # v1 fallback
    assert g1.utilization_gpu is None and g1.utilization_memory is None  # NotSupported
    assert g1.mig_enabled is True
    assert g1.power_limit_w == 400.0  # management limit when the enforced one is unsupported
    assert g1.clock_event_reasons == ["hw_slowdown", "hw_thermal_slowdown"]  # throttle fallback
    assert g1.ecc_uncorrectable is None  # NoPermission
    assert g1.processes == []  # NoPermission on both process lists


def test_device_without_handle_is_all_unknown(fake: types.ModuleType) -> None:
    *_, g2 = read_gpus()
    assert g2 == Gpu(index=2)


def test_init_once_and_close(fake: types.ModuleType) -> None:
    read_gpus()
    read_gpus()
    assert fake.calls["init"] == 1  # type: ignore[attr-defined]
    nvml.close()
    assert fake.calls["shutdown"] == 1  # type: ignore[attr-defined]
    read_gpus()
    assert fake.calls["init"] == 2  # type: ignore[attr-defined]


def test_init_failure_from_fake() -> None:
    reader = NvmlReader(make_fake([], init_error=NVMLError_LibraryNotFound()))
    with pytest.raises(SourceError) as ei:
        reader.read()
    # no driver library: unavailable on this host, said in words (issue 27)
    assert str(ei.value) == "NVML unavailable: NVML Shared Library Not Found (no NVIDIA driver on this host)"
    assert isinstance(ei.value, SourceUnavailable)
    reader.close()  # nothing initialised: no shutdown, no error


def test_real_pynvml_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    except pynvml.NVMLError:
        pytest.skip("a driver library is present here")
    else:
        pynvml.nvmlShutdown()
        pytest.skip("a GPU driver is present here")
    monkeypatch.setattr(nvml, "_default", None)
    with pytest.raises(SourceError) as ei:
        read_gpus()
    # no driver library: unavailable on this host, said in words (issue 27)
    assert str(ei.value) == "NVML unavailable: NVML Shared Library Not Found (no NVIDIA driver on this host)"
    assert isinstance(ei.value, SourceUnavailable)
    nvml.close()


def test_device_count_failure() -> None:
    fake = make_fake([])

    def broken() -> int:
        raise NVMLError_NoPermission()

    fake.nvmlDeviceGetCount = broken  # type: ignore[attr-defined]
    with pytest.raises(SourceError, match="NVML: cannot count devices: Insufficient Permissions"):
        NvmlReader(fake).read()


def _counting(mod: types.ModuleType, name: str, counts: dict[str, int]) -> None:
    real = getattr(mod, name)

    def wrapper(*a: object, **k: object) -> object:
        counts[name] = counts.get(name, 0) + 1
        return real(*a, **k)

    setattr(mod, name, wrapper)


def test_identity_is_read_once_per_nvml_session_and_live_fields_every_read() -> None:
    mod = make_fake([H100, A100_MIG])
    counts: dict[str, int] = {}
    for name in ("nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMemoryInfo"):
        _counting(mod, name, counts)
    reader = NvmlReader(mod)
    first = reader.read()
    assert [g.memory_used_bytes for g in reader.read()] == [g.memory_used_bytes for g in first]
    assert [(g.name, g.uuid, g.bus_id) for g in reader.read()] == [(g.name, g.uuid, g.bus_id) for g in first]
    assert counts["nvmlDeviceGetName"] == counts["nvmlDeviceGetUUID"] == counts["nvmlDeviceGetPciInfo"] == 2
    assert counts["nvmlDeviceGetMemoryInfo"] >= 6  # used memory: every read
    reader.close()
    reader.read()  # a new NVML session: identity read afresh
    assert counts["nvmlDeviceGetName"] == 4


def test_identity_field_that_failed_is_asked_again() -> None:
    mod = make_fake([H100])
    real = mod.nvmlDeviceGetUUID
    fails = [True]

    def flaky(h: object) -> object:
        if fails[0]:
            raise mod.NVMLError("Unknown Error")
        return real(h)

    mod.nvmlDeviceGetUUID = flaky
    reader = NvmlReader(mod)
    assert reader.read()[0].uuid is None
    fails[0] = False
    assert reader.read()[0].uuid == "GPU-11111111-2222-3333-4444-555555555555"


def test_process_name_asked_once_while_the_pid_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = make_fake([H100])
    reader = NvmlReader(mod, processes_s=0)  # the process lists read every read
    asked: list[int] = []
    real = NvmlReader._lookup_name

    def lookup(self: NvmlReader, pid: int) -> str:
        asked.append(pid)
        return real(self, pid)

    monkeypatch.setattr(NvmlReader, "_lookup_name", lookup)
    names = [p.name for p in reader.read()[0].processes]
    for _ in range(3):
        assert [p.name for p in reader.read()[0].processes] == names
    assert sorted(asked) == sorted({os.getpid(), NO_SUCH_PID})  # once each, over four reads
    # a pid that leaves NVML's list is forgotten: when it comes back it is asked again
    real_procs = mod.nvmlDeviceGetComputeRunningProcesses
    real_gfx = mod.nvmlDeviceGetGraphicsRunningProcesses
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    assert reader.read()[0].processes == []
    mod.nvmlDeviceGetComputeRunningProcesses = real_procs
    mod.nvmlDeviceGetGraphicsRunningProcesses = real_gfx
    reader.read()
    assert len(asked) == 4


def test_process_lists_read_every_processes_s_and_at_once_when_memory_moves() -> None:
    """The costly query (running processes) waits processes_s while used memory holds still;
    a memory change of process_memory_change or more reads it at once; the near miss (just under
    the change) does not."""
    dev = dict(H100)
    mod = make_fake([dev])
    counts: dict[str, int] = {}
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo"):
        _counting(mod, name, counts)
    now = [0.0]
    reader = NvmlReader(mod, processes_s=30.0, process_memory_change=64 * MiB, clock=lambda: now[0])
    first = reader.read()[0].processes
    for t in range(1, 30):  # 29 more reads a second apart, memory steady
        now[0] = float(t)
        again = reader.read()[0].processes
        assert again == first and again is not first and again[0] is not first[0]  # fresh copies
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 1 and counts["nvmlDeviceGetMemoryInfo"] == 30
    now[0] = 30.0
    reader.read()
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 2  # processes_s passed
    used = dev["nvmlDeviceGetMemoryInfo_v2"].used
    now[0] = 31.0
    dev["nvmlDeviceGetMemoryInfo_v2"] = obj(total=81559 * MiB, used=used + 63 * MiB, free=0, reserved=0)
    reader.read()
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 2  # near miss: under the change
    now[0] = 32.0
    dev["nvmlDeviceGetMemoryInfo_v2"] = obj(total=81559 * MiB, used=used + 64 * MiB, free=0, reserved=0)
    mod.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    real_c = mod.nvmlDeviceGetComputeRunningProcesses
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: (real_c(h), [])[1]  # the process ended
    assert reader.read()[0].processes == []  # read at once, not 30 s later
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 3


def test_process_lists_read_again_when_memory_is_unknown_or_after_an_error() -> None:
    dev = dict(H100)
    mod = make_fake([dev])
    counts: dict[str, int] = {}
    _counting(mod, "nvmlDeviceGetComputeRunningProcesses", counts)
    reader = NvmlReader(mod, clock=lambda: 0.0)
    reader.read()
    dev["nvmlDeviceGetMemoryInfo_v2"] = NVMLError_NotSupported()
    dev["nvmlDeviceGetMemoryInfo"] = NVMLError_NotSupported()
    reader.read()
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 2  # no memory to compare: asked
    dev["nvmlDeviceGetTemperature"] = mod.NVMLError("GPU is lost")
    reader.read()
    reader.read()
    assert counts["nvmlDeviceGetComputeRunningProcesses"] == 4


# --------------------------------------------------------------------------- handles and slow fields kept


def test_handle_kept_for_the_session_and_asked_again_after_an_error() -> None:
    devices = [dict(H100), dict(A100_MIG)]
    mod = make_fake(devices)
    counts: dict[str, int] = {}
    _counting(mod, "nvmlDeviceGetHandleByIndex", counts)
    reader = NvmlReader(mod)
    for _ in range(4):
        reader.read()
    # once per index: "not supported" and "no permission" (every read of the A100) keep it
    assert counts["nvmlDeviceGetHandleByIndex"] == 2
    devices[0]["nvmlDeviceGetTemperature"] = NVMLError("GPU is lost")
    assert reader.read()[0].temperature_c is None
    assert counts["nvmlDeviceGetHandleByIndex"] == 2
    devices[0]["nvmlDeviceGetTemperature"] = 41
    assert reader.read()[0].temperature_c == 41.0
    assert counts["nvmlDeviceGetHandleByIndex"] == 3  # the failed index asked again
    reader.read()
    assert counts["nvmlDeviceGetHandleByIndex"] == 3
    reader.close()
    reader.read()  # a new NVML session: handles asked afresh
    assert counts["nvmlDeviceGetHandleByIndex"] == 5


def test_power_limit_and_mig_mode_read_every_slow_s_and_at_once_after_an_error() -> None:
    dev = dict(H100)
    mod = make_fake([dev])
    counts: dict[str, int] = {}
    for name in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetMigMode", "nvmlDeviceGetPowerUsage"):
        _counting(mod, name, counts)
    now = [0.0]
    reader = NvmlReader(mod, slow_s=10.0, clock=lambda: now[0])
    assert reader.read()[0].power_limit_w == 700.0
    dev["nvmlDeviceGetEnforcedPowerLimit"] = 350_000  # nvidia-smi -pl 350
    for _ in range(9):
        now[0] += 1.0
        gpu = reader.read()[0]
    assert gpu.power_limit_w == 700.0 and gpu.mig_enabled is False  # up to slow_s stale
    assert counts["nvmlDeviceGetEnforcedPowerLimit"] == counts["nvmlDeviceGetMigMode"] == 1
    assert counts["nvmlDeviceGetPowerUsage"] == 10  # the live fields: every read
    now[0] += 1.0
    assert reader.read()[0].power_limit_w == 350.0
    assert counts["nvmlDeviceGetEnforcedPowerLimit"] == 2
    dev["nvmlDeviceGetEnforcedPowerLimit"] = 300_000
    dev["nvmlDeviceGetUtilizationRates"] = NVMLError("Unknown Error")
    now[0] += 1.0
    assert reader.read()[0].power_limit_w == 350.0  # read before the failing call
    dev["nvmlDeviceGetUtilizationRates"] = obj(gpu=21, memory=9)
    now[0] += 1.0
    assert reader.read()[0].power_limit_w == 300.0  # after an error: read again at once
    assert counts["nvmlDeviceGetEnforcedPowerLimit"] == 3


def test_kept_handles_and_slow_fields_read_what_a_fresh_read_reads() -> None:
    """Differential: a reader keeping handles and slow fields and one asking for everything on
    every read (a new reader each time) give equal GPUs over reads whose live fields change,
    with a device whose fields are not supported and one that errors once."""
    devices = [dict(H100), dict(A100_MIG), {**H100, "nvmlDeviceGetTotalEccErrors": NVMLError_NotSupported()}]
    mod = make_fake(devices)
    kept = NvmlReader(mod)
    for step in range(8):
        devices[0]["nvmlDeviceGetUtilizationRates"] = obj(gpu=step * 10, memory=step)
        devices[1]["nvmlDeviceGetPowerUsage"] = 100_000 + step
        devices[2]["nvmlDeviceGetTemperature"] = NVMLError("Unknown Error") if step == 3 else 50 + step
        a = kept.read()
        b = NvmlReader(mod).read()
        assert a == b


def test_the_sampler_stamps_a_readers_own_objects_as_it_would_copies() -> None:
    """Differential: NvmlSource over an NvmlReader (its fresh objects stamped, interned and
    shared in place) gives what it gives over the same reader with the copies made (a reader
    not known to make fresh objects); unchanged process lists and reasons are the previous
    reading's objects, changed ones new, and earlier readings are never modified."""
    from kvdoctor.sampler import NvmlSource

    class Copied(NvmlReader):
        fresh_objects = False

    devices = [dict(H100), dict(A100_MIG)]
    mod = make_fake(devices)
    in_place = NvmlSource(factory=lambda: NvmlReader(mod))
    copied = NvmlSource(factory=lambda: Copied(mod))
    seen: list[list[Gpu]] = []
    for step in range(4):
        devices[0]["nvmlDeviceGetUtilizationRates"] = obj(gpu=10 * step, memory=step)
        if step == 2:
            devices[0]["nvmlDeviceGetComputeRunningProcesses"] = [
                obj(pid=os.getpid(), usedGpuMemory=71 * GiB)
            ]  # and the GPU's used memory with it (what reads the process lists again)
            devices[0]["nvmlDeviceGetMemoryInfo_v2"] = obj(
                total=81559 * MiB, used=75327 * MiB + GiB, free=4878 * MiB, reserved=330 * MiB
            )
        a, b = in_place.read().values["gpus"], copied.read().values["gpus"]
        for ga, gb in zip(a, b, strict=True):
            assert ga.timestamp is not None and gb.timestamp is not None
            ga.timestamp = gb.timestamp = 0.0
        assert a == b
        seen.append(a)
    assert seen[1][0].processes is seen[0][0].processes  # unchanged: shared
    assert seen[2][0].processes is not seen[1][0].processes  # a process grew
    assert seen[1][0].processes[0].used_bytes == 70 * GiB  # the earlier reading unchanged
    assert seen[3][1].clock_event_reasons is seen[0][1].clock_event_reasons
