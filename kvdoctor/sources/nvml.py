"""Live GPUs through NVML (``import pynvml``, package nvidia-ml-py) → :class:`~kvdoctor.facts.Gpu`.

The live twin of ``sources.nvidia_smi``: the same facts in the same units (bytes, fractions 0..1,
°C, W). NVML is initialised once and kept initialised between reads (``nvmlInit`` costs tens of
milliseconds; the sampler reads at 1 Hz). Like nvitop's ``api``, every per-field NVML error
(``NVMLError_NotSupported``, ``NVMLError_NoPermission``, ``NVMLError_FunctionNotFound``, …) makes
that one field None (or the process list empty) and never stops the read.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvdoctor.facts import Gpu, GpuProcess, SourceError, SourceUnavailable
from kvdoctor.sources.nvidia_smi import decode_clock_event_reasons, normalize_bus_id

__all__ = ["NvmlReader", "close", "read_gpus"]


#: NVML's "value not available" for unsigned long long fields (``usedGpuMemory`` under WDDM/MIG).
_NOT_AVAILABLE_ULL = 2**64 - 1


def _text(v: object) -> str | None:
    """NVML strings are ``str`` in current nvidia-ml-py and ``bytes`` in old releases."""
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


#: The NVML functions a read calls, looked up once per read (a pynvml without one: that field None).
_FUNCTIONS = (
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlSystemGetProcessName",
)

#: NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION, NVML_ERROR_FUNCTION_NOT_FOUND: what the
#: device, the driver or this user lacks, for the whole session (a GPU without MIG or ECC says so
#: on every read); no sign of a bad handle.
_LACKS = (3, 4, 13)
_LACKS_NAMES = ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound")

#: seconds between reads of the fields only an administrator changes (enforced power limit,
#: MIG mode): :class:`NvmlReader`
SLOW_FIELDS_S = 10.0
#: seconds between reads of a GPU's running-process lists while its used memory holds still:
#: :class:`NvmlReader`. The lists are the costly NVML query (milliseconds, under the driver's
#: lock, beside the engine's own CUDA calls); a served vLLM GPU's memory is steady.
PROCESS_LIST_S = 30.0
#: a change of a GPU's used memory (bytes) since its process lists were read that reads them
#: again at once (a process started, ended or grew): 64 MiB, under one CUDA context (~300 MiB).
PROCESS_LIST_MEMORY_CHANGE = 64 * 2**20


def _lacks(err: BaseException) -> bool:
    return getattr(err, "value", None) in _LACKS or type(err).__name__ in _LACKS_NAMES


class NvmlReader:
    """Reads every GPU NVML sees; keeps NVML initialised until :meth:`close`.

    ``nvml`` is the pynvml module (injected by tests); by default ``import pynvml`` at
    :meth:`open` time. Thread-safe: reads are serialised by a lock.

    Kept for the NVML session (dropped by :meth:`close`): each index's device handle
    (``nvmlDeviceGetHandleByIndex``, valid until ``nvmlShutdown``) and its name, UUID and bus
    id. The fields only an administrator changes, ``power_limit_w`` (``nvmlDevice
    GetEnforcedPowerLimit``, ``nvidia-smi -pl``) and ``mig_enabled`` (``nvmlDeviceGetMigMode``,
    ``nvidia-smi -mig``, which needs a GPU reset anyway), are read every ``slow_s`` seconds
    (default :data:`SLOW_FIELDS_S`, 10; ``clock`` is monotonic seconds): they may be that much
    stale. Any NVML error on a device other than "not supported", "no permission" or "function
    not found" (what the device, driver or user lacks, every read alike) drops
    its handle and those fields: the next read asks for them again.

    The running-process lists (``nvmlDeviceGetComputeRunningProcesses`` and ``…Graphics…``, the
    costly query) are read every ``processes_s`` seconds (default :data:`PROCESS_LIST_S`, 30),
    and at once when the GPU's used memory moved by ``process_memory_change`` bytes or more
    (default :data:`PROCESS_LIST_MEMORY_CHANGE`) since they were read, or its memory is unknown;
    between those reads a read gives copies of the last lists (so a process's ``used_bytes`` is
    at most that much and that long stale). ``processes_s=0`` reads them every read. Every
    other field is read on every read.
    """

    #: every read's Gpu, GpuProcess and list objects are new and given to no one else (the
    #: sampler's NvmlSource stamps them in place rather than copying them)
    fresh_objects = True

    def __init__(
        self,
        nvml: ModuleType | None = None,
        *,
        slow_s: float = SLOW_FIELDS_S,
        processes_s: float = PROCESS_LIST_S,
        process_memory_change: int = PROCESS_LIST_MEMORY_CHANGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml: Any = nvml
        self._initialised = False
        self._lock = threading.Lock()
        self.slow_s = slow_s
        self.processes_s = processes_s
        self.process_memory_change = process_memory_change
        # index → (monotonic time the process lists were read, used bytes then, the processes)
        self._procs: dict[int, tuple[float, int | None, list[GpuProcess]]] = {}
        self._clock = clock
        # What one NVML session does not change, read once per device index: name, UUID, bus
        # id, the device handle (four of a device's ~15 calls a read; ctypes calls cost µs each,
        # every second).
        self._static: dict[int, tuple[str | None, str | None, str | None]] = {}
        self._handles: dict[int, Any] = {}
        # index → (monotonic time read, power_limit_w, mig_enabled)
        self._slow: dict[int, tuple[float, float | None, bool | None]] = {}
        # an NVML call of the device being read failed (not "not supported")
        self._failed = False
        # Process names of the previous read, by pid: a pid seen in two reads a cycle apart is
        # the same process (a reused pid would first have to leave NVML's list), so psutil is
        # asked once per GPU process, not once per read.
        self._names: dict[int, str] = {}
        self._names_now: dict[int, str] = {}
        self._fns: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """``nvmlInit()`` once. Raises SourceError "NVML unavailable: <pynvml's message>" (e.g.
        "NVML unavailable: NVML Shared Library Not Found" on a host without the driver)."""
        if self._initialised:
            return
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
            self._nvml.nvmlInit()
            self._static, self._names, self._handles, self._slow = {}, {}, {}, {}
            self._procs = {}
        except ImportError as e:
            raise SourceUnavailable(f"NVML unavailable: cannot import pynvml ({e})") from None
        except Exception as e:  # pynvml.NVMLError_* (library not found, driver not loaded, …)
            if type(e).__name__ == "NVMLError_LibraryNotFound":
                # no driver on this host: not a failure to retry every second
                raise SourceUnavailable(f"NVML unavailable: {e} (no NVIDIA driver on this host)") from None
            raise SourceError(f"NVML unavailable: {e}") from None
        self._initialised = True

    def close(self) -> None:
        """``nvmlShutdown()`` if initialised. Never raises."""
        with self._lock:
            if self._initialised:
                self._initialised = False
                self._handles, self._slow, self._procs = {}, {}, {}
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001 - shutting down; nothing to report
                    pass

    # ------------------------------------------------------------------ reading

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call one NVML function (looked up for this read: None when this pynvml lacks it);
        any NVML error → None, and one other than "not supported", "no permission" or "function
        not found" marks the device's read as failed. (One frame a call: ~70 calls a read of 8 GPUs, every second.)"""
        if fn is None:
            return None
        try:
            return fn(*args, **kwargs)
        except (self._nvml.NVMLError, AttributeError, TypeError, ValueError) as e:
            if not _lacks(e):
                self._failed = True
            return None

    def read(self) -> list[Gpu]:
        """One reading of every GPU, in NVML index order.

        Per device (NVML call → field): ``nvmlDeviceGetName`` → name; ``nvmlDeviceGetUUID`` →
        uuid; ``nvmlDeviceGetPciInfo().busId`` → bus_id ("00000000:07:00.0");
        ``nvmlDeviceGetMemoryInfo`` (v2 struct where available, else v1) → memory_total_bytes /
        memory_used_bytes (bytes); ``nvmlDeviceGetUtilizationRates`` → utilization_gpu /
        utilization_memory (% → fraction); ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`` →
        temperature_c; ``nvmlDeviceGetPowerUsage`` / ``GetEnforcedPowerLimit`` (mW → W) →
        power_w / power_limit_w; ``nvmlDeviceGetMigMode`` → mig_enabled;
        ``nvmlDeviceGetCurrentClocksEventReasons`` (else ``…ThrottleReasons``) → decoded
        clock_event_reasons; ``nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)`` →
        ecc_uncorrectable; ``nvmlDeviceGetComputeRunningProcesses`` + ``…GraphicsRunning…`` →
        processes (usedGpuMemory bytes, None when NVML says not available; names from psutil).
        Name, UUID and bus id are read once per NVML session, power_limit_w and mig_enabled
        every ``slow_s`` seconds (the class doc).

        Raises SourceError when NVML cannot be initialised or the device count cannot be read;
        per-device and per-field errors only blank those fields.
        """
        with self._lock:
            self.open()
            nv = self._nvml
            try:
                count = int(nv.nvmlDeviceGetCount())
            except Exception as e:
                raise SourceError(f"NVML: cannot count devices: {e}", origin="NVML") from None
            # looked up once a read, not once a call (a test or a reload may swap them between reads)
            self._fns = {name: getattr(nv, name, None) for name in _FUNCTIONS}
            self._names_now = {}
            now = self._clock()
            try:
                return [self._read_device(i, now) for i in range(count)]
            finally:
                self._names = self._names_now

    def _read_device(self, index: int, now: float) -> Gpu:
        nv = self._nvml
        f = self._fns
        call = self._call
        gpu = Gpu(index=index)
        self._failed = False
        handle = self._handles.get(index)
        if handle is None:
            handle = call(f["nvmlDeviceGetHandleByIndex"], index)
            if handle is None:
                return gpu
        static = self._static.get(index)
        if static is None:
            name = _text(call(f["nvmlDeviceGetName"], handle))
            uuid = _text(call(f["nvmlDeviceGetUUID"], handle))
            pci = call(f["nvmlDeviceGetPciInfo"], handle)
            bus_id = normalize_bus_id(_text(getattr(pci, "busId", None))) if pci is not None else None
            static = (name, uuid, bus_id)
            if None not in static:  # a field that failed is asked again next read
                self._static[index] = static
        gpu.name, gpu.uuid, gpu.bus_id = static
        mem = None
        if hasattr(nv, "nvmlMemory_v2"):
            mem = call(f["nvmlDeviceGetMemoryInfo"], handle, version=nv.nvmlMemory_v2)
        if mem is None:
            mem = call(f["nvmlDeviceGetMemoryInfo"], handle)
        if mem is not None:
            gpu.memory_total_bytes = int(mem.total)
            gpu.memory_used_bytes = int(mem.used)
        util = call(f["nvmlDeviceGetUtilizationRates"], handle)
        if util is not None:
            gpu.utilization_gpu = util.gpu / 100.0
            gpu.utilization_memory = util.memory / 100.0
        temp = call(f["nvmlDeviceGetTemperature"], handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        gpu.temperature_c = None if temp is None else float(temp)
        mw = call(f["nvmlDeviceGetPowerUsage"], handle)
        gpu.power_w = None if mw is None else mw / 1000.0
        slow = self._slow.get(index)
        if slow is None or now - slow[0] >= self.slow_s:
            slow = self._read_slow(handle, now)
        gpu.power_limit_w, gpu.mig_enabled = slow[1], slow[2]
        reasons = call(f["nvmlDeviceGetCurrentClocksEventReasons"], handle)
        if reasons is None:
            reasons = call(f["nvmlDeviceGetCurrentClocksThrottleReasons"], handle)
        if reasons is not None:
            gpu.clock_event_reasons = decode_clock_event_reasons(int(reasons))
        ecc = call(
            f["nvmlDeviceGetTotalEccErrors"],
            handle,
            getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nv, "NVML_VOLATILE_ECC", 0),
        )
        gpu.ecc_uncorrectable = None if ecc is None else int(ecc)
        gpu.processes = self._processes_now(index, handle, gpu, now)
        if self._failed:  # the handle may be stale (GPU lost, reset): asked again next read
            self._handles.pop(index, None)
            self._slow.pop(index, None)
            self._procs.pop(index, None)
        else:
            self._handles[index] = handle
            self._slow[index] = slow
        return gpu

    def _read_slow(self, handle: Any, now: float) -> tuple[float, float | None, bool | None]:
        """(now, power_limit_w, mig_enabled): ``nvmlDeviceGetEnforcedPowerLimit`` (else
        ``…PowerManagementLimit``, mW → W) and ``nvmlDeviceGetMigMode``."""
        f = self._fns
        lim = self._call(f["nvmlDeviceGetEnforcedPowerLimit"], handle)
        if lim is None:
            lim = self._call(f["nvmlDeviceGetPowerManagementLimit"], handle)
        mig = self._call(f["nvmlDeviceGetMigMode"], handle)
        enabled = None
        if mig is not None:
            enabled = int(mig[0]) == int(getattr(self._nvml, "NVML_DEVICE_MIG_ENABLE", 1))
        return (now, None if lim is None else lim / 1000.0, enabled)

    def _processes_now(self, index: int, handle: Any, gpu: Gpu, now: float) -> list[GpuProcess]:
        """The GPU's processes: read from NVML when due (the class doc), else copies of the last
        read's (their names kept for the next read, as a read that saw them would)."""
        used = gpu.memory_used_bytes
        last = self._procs.get(index)
        if (
            last is not None
            and used is not None
            and last[1] is not None
            and now - last[0] < self.processes_s
            and abs(used - last[1]) < self.process_memory_change
        ):
            for p in last[2]:
                self._names_now[p.pid] = p.name
            return [dataclasses.replace(p) for p in last[2]]
        procs = self._processes(handle, gpu)
        self._procs[index] = (now, used, procs)
        return [dataclasses.replace(p) for p in procs]

    def _processes(self, handle: Any, gpu: Gpu) -> list[GpuProcess]:
        """Compute ("C") and graphics ("G") processes; one in both lists is "C+G"."""
        by_pid: dict[int, GpuProcess] = {}
        for fn, typ in (
            ("nvmlDeviceGetComputeRunningProcesses", "C"),
            ("nvmlDeviceGetGraphicsRunningProcesses", "G"),
        ):
            for p in self._call(self._fns[fn], handle) or []:
                pid = int(p.pid)
                used = getattr(p, "usedGpuMemory", None)
                used = None if used is None or used >= _NOT_AVAILABLE_ULL else int(used)
                known = by_pid.get(pid)
                if known is not None:
                    known.type = "C+G" if known.type != typ else typ
                    if known.used_bytes is None:
                        known.used_bytes = used
                    continue
                by_pid[pid] = GpuProcess(
                    pid=pid,
                    name=self._process_name(pid),
                    used_bytes=used,
                    type=typ,
                    gpu_uuid=gpu.uuid,
                    gpu_bus_id=gpu.bus_id,
                )
        return list(by_pid.values())

    def _process_name(self, pid: int) -> str:
        """What nvidia-smi shows: argv[0] (``VLLM::Worker_TP0`` after setproctitle,
        ``/usr/bin/python3``), via psutil; else psutil's name; else NVML's
        ``nvmlSystemGetProcessName``; "" when the process is invisible (other PID namespace).
        The previous read's name when that read saw the pid too."""
        name = self._names.get(pid)
        if name is None:
            name = self._names_now.get(pid)
        if name is None:
            name = self._lookup_name(pid)
        self._names_now[pid] = name
        return name

    def _lookup_name(self, pid: int) -> str:
        try:
            import psutil

            proc = psutil.Process(pid)
            try:
                argv = proc.cmdline()
            except psutil.Error:
                argv = []
            if argv and argv[0]:
                return argv[0]
            return proc.name()
        except Exception:  # noqa: BLE001 - psutil.NoSuchProcess/AccessDenied/ZombieProcess
            pass
        failed = self._failed  # a pid NVML cannot name says nothing about the device's handle
        name = _text(self._call(self._fns.get("nvmlSystemGetProcessName"), pid)) or ""
        self._failed = failed
        return name


_default: NvmlReader | None = None
_default_lock = threading.Lock()


def read_gpus() -> list[Gpu]:
    """Every GPU NVML sees, now, through a module-level :class:`NvmlReader` kept initialised
    between calls (see :meth:`NvmlReader.read` for the NVML call behind each field).

    Raises SourceError "NVML unavailable: NVML Shared Library Not Found" where there is no
    driver (and "NVML unavailable: <reason>" for other init failures)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NvmlReader()
        reader = _default
    return reader.read()


def close() -> None:
    """Shut down the module-level reader's NVML session, if any. Never raises."""
    global _default
    with _default_lock:
        reader, _default = _default, None
    if reader is not None:
        reader.close()
