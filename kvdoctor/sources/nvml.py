"""Live GPUs through NVML (``import pynvml``, package nvidia-ml-py) → :class:`~kvdoctor.facts.Gpu`.

The live twin of ``sources.nvidia_smi``: the same facts in the same units (bytes, fractions 0..1,
°C, W). NVML is initialised once and kept initialised between reads (``nvmlInit`` costs tens of
milliseconds; the sampler reads at 1 Hz). Like nvitop's ``api``, every per-field NVML error
(``NVMLError_NotSupported``, ``NVMLError_NoPermission``, ``NVMLError_FunctionNotFound``, …) makes
that one field None (or the process list empty) and never stops the read.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

from kvdoctor.facts import Gpu, GpuProcess, SourceError
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


class NvmlReader:
    """Reads every GPU NVML sees; keeps NVML initialised until :meth:`close`.

    ``nvml`` is the pynvml module (injected by tests); by default ``import pynvml`` at
    :meth:`open` time. Thread-safe: reads are serialised by a lock.
    """

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml: Any = nvml
        self._initialised = False
        self._lock = threading.Lock()
        # What one NVML session does not change, read once per device index: name, UUID, bus id
        # (three of a device's ~15 calls a read; ctypes calls cost µs each, every second).
        self._static: dict[int, tuple[str | None, str | None, str | None]] = {}
        # Process names of the previous read, by pid: a pid seen in two reads a cycle apart is
        # the same process (a reused pid would first have to leave NVML's list), so psutil is
        # asked once per GPU process, not once per read.
        self._names: dict[int, str] = {}
        self._names_now: dict[int, str] = {}

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
            self._static, self._names = {}, {}
        except ImportError as e:
            raise SourceError(f"NVML unavailable: cannot import pynvml ({e})") from None
        except Exception as e:  # pynvml.NVMLError_* (library not found, driver not loaded, …)
            raise SourceError(f"NVML unavailable: {e}") from None
        self._initialised = True

    def close(self) -> None:
        """``nvmlShutdown()`` if initialised. Never raises."""
        with self._lock:
            if self._initialised:
                self._initialised = False
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001 - shutting down; nothing to report
                    pass

    # ------------------------------------------------------------------ reading

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call one NVML function by name; any NVML error (or a function this pynvml lacks) →
        None. (One frame a call: ~90 calls a read of 8 GPUs, every second.)"""
        fn = getattr(self._nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args, **kwargs)
        except (self._nvml.NVMLError, AttributeError, TypeError, ValueError):
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
            self._names_now = {}
            try:
                return [self._read_device(i) for i in range(count)]
            finally:
                self._names = self._names_now

    def _read_device(self, index: int) -> Gpu:
        nv = self._nvml
        gpu = Gpu(index=index)
        handle = self._call("nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return gpu
        static = self._static.get(index)
        if static is None:
            name = _text(self._call("nvmlDeviceGetName", handle))
            uuid = _text(self._call("nvmlDeviceGetUUID", handle))
            pci = self._call("nvmlDeviceGetPciInfo", handle)
            bus_id = normalize_bus_id(_text(getattr(pci, "busId", None))) if pci is not None else None
            static = (name, uuid, bus_id)
            if None not in static:  # a field that failed is asked again next read
                self._static[index] = static
        gpu.name, gpu.uuid, gpu.bus_id = static
        mem = None
        if hasattr(nv, "nvmlMemory_v2"):
            mem = self._call("nvmlDeviceGetMemoryInfo", handle, version=nv.nvmlMemory_v2)
        if mem is None:
            mem = self._call("nvmlDeviceGetMemoryInfo", handle)
        if mem is not None:
            gpu.memory_total_bytes = int(mem.total)
            gpu.memory_used_bytes = int(mem.used)
        util = self._call("nvmlDeviceGetUtilizationRates", handle)
        if util is not None:
            gpu.utilization_gpu = util.gpu / 100.0
            gpu.utilization_memory = util.memory / 100.0
        temp = self._call("nvmlDeviceGetTemperature", handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        gpu.temperature_c = None if temp is None else float(temp)
        mw = self._call("nvmlDeviceGetPowerUsage", handle)
        gpu.power_w = None if mw is None else mw / 1000.0
        lim = self._call("nvmlDeviceGetEnforcedPowerLimit", handle)
        if lim is None:
            lim = self._call("nvmlDeviceGetPowerManagementLimit", handle)
        gpu.power_limit_w = None if lim is None else lim / 1000.0
        mig = self._call("nvmlDeviceGetMigMode", handle)
        if mig is not None:
            gpu.mig_enabled = int(mig[0]) == int(getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1))
        reasons = self._call("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if reasons is None:
            reasons = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        if reasons is not None:
            gpu.clock_event_reasons = decode_clock_event_reasons(int(reasons))
        ecc = self._call(
            "nvmlDeviceGetTotalEccErrors",
            handle,
            getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nv, "NVML_VOLATILE_ECC", 0),
        )
        gpu.ecc_uncorrectable = None if ecc is None else int(ecc)
        gpu.processes = self._processes(handle, gpu)
        return gpu

    def _processes(self, handle: Any, gpu: Gpu) -> list[GpuProcess]:
        """Compute ("C") and graphics ("G") processes; one in both lists is "C+G"."""
        by_pid: dict[int, GpuProcess] = {}
        for fn, typ in (
            ("nvmlDeviceGetComputeRunningProcesses", "C"),
            ("nvmlDeviceGetGraphicsRunningProcesses", "G"),
        ):
            for p in self._call(fn, handle) or []:
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
        return _text(self._call("nvmlSystemGetProcessName", pid)) or ""


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
