"""Live collection: the one sampler that reads live sources into a Timeline.

``diagnose`` samples a short window (rates need two scrapes); ``watch`` and ``sidecar`` keep the
same loop running. Each source has its own timeout and failure handling: NVML absent, a dead
/metrics endpoint or an unreadable log becomes a SourceStatus, and the other sources go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdoctor.facts import EngineConfig, HostProcess, Snapshot, SourceError, SourceStatus, Timeline, VllmLog

if TYPE_CHECKING:
    from kvdoctor.sources.nvml import NvmlReader
    from kvdoctor.sources.vllm_log import LogFollower


@dataclass
class LiveOptions:
    """What to read live. ``metrics_urls`` empty → discovered from vLLM processes' ports."""

    metrics_urls: list[str] = field(default_factory=list)
    log_path: Path | None = None
    window_s: float = 5.0
    interval_s: float = 1.0
    timeout_s: float = 2.0
    use_nvml: bool = True
    use_processes: bool = True


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class Sampler:
    """Polls live sources; ``sample()`` returns one Snapshot, never raises for a source failure.

    NVML through ``kvdoctor.sources.nvml``, host processes through psutil
    (``kvdoctor.sources.processes``), ``/metrics`` through httpx, the log file followed as it grows.
    """

    def __init__(self, opts: LiveOptions) -> None:
        self.opts = opts
        self._nvml: NvmlReader | None = None
        self._nvml_error: str | None = None
        self._follower: LogFollower | None = None
        self._log: VllmLog | None = None
        self._log_error: str | None = None
        self._urls: list[str] = list(opts.metrics_urls)
        self._discovered = False
        # One HTTP client for every scrape: building one costs ~40 ms (its TLS context), more
        # than the rest of a sidecar cycle.
        self._http: Any = None

    def _gpus(self, snap: Snapshot) -> None:
        if not self.opts.use_nvml:
            return
        if self._nvml_error is not None:
            snap.sources.append(SourceStatus("nvml", "NVML", "error", self._nvml_error))
            return
        try:
            from kvdoctor.sources.nvml import NvmlReader

            if self._nvml is None:
                self._nvml = NvmlReader()
            snap.gpus = self._nvml.read()
            snap.sources.append(SourceStatus("nvml", "NVML", "ok", f"{len(snap.gpus)} GPU(s)"))
        except SourceError as e:
            # A missing driver does not come back within a diagnose run: remember it.
            self._nvml_error = _one_line(e)
            snap.sources.append(SourceStatus("nvml", "NVML", "error", self._nvml_error))
        except Exception as e:  # never let NVML take the other sources down
            snap.sources.append(
                SourceStatus("nvml", "NVML", "error", f"NVML: {type(e).__name__}: {_one_line(e)}")
            )

    def _processes(self, snap: Snapshot) -> list[HostProcess]:
        if not self.opts.use_processes:
            return []
        try:
            from kvdoctor.sources.processes import list_processes

            procs = list_processes()
            snap.processes = procs
            snap.process_table_known = True
            if procs:
                snap.sources.append(
                    SourceStatus("processes", "psutil", "ok", f"{len(procs)} vLLM process(es)")
                )
            else:
                snap.sources.append(
                    SourceStatus("processes", "psutil", "missing", "no vLLM server or engine process running")
                )
            return procs
        except Exception as e:
            snap.sources.append(SourceStatus("processes", "psutil", "error", f"psutil: {_one_line(e)}"))
            return []

    def _discover(self, procs: list[HostProcess]) -> None:
        if self._discovered or self._urls:
            self._discovered = True
            return
        from kvdoctor.sources.processes import metrics_url_for

        for p in procs:
            if p.vllm_role == "api_server":
                url = metrics_url_for(p)
                if url and url not in self._urls:
                    self._urls.append(url)
        self._discovered = True

    def _metrics(self, snap: Snapshot) -> None:
        from kvdoctor.sources.metrics import parse_metrics, scrape

        if not self._urls:
            snap.sources.append(
                SourceStatus(
                    "metrics", "/metrics", "missing", "no vLLM server found to scrape (give --metrics URL)"
                )
            )
            return
        if self._http is None:
            import httpx

            self._http = httpx.Client(timeout=httpx.Timeout(self.opts.timeout_s, connect=self.opts.timeout_s))
        for url in self._urls:
            try:
                text, ts = scrape(url, timeout=self.opts.timeout_s, client=self._http)
                ms = parse_metrics(text, origin=url, timestamp=ts)
                snap.metrics.extend(ms)
                snap.sources.append(SourceStatus("metrics", url, "ok", f"{len(ms)} engine(s)"))
            except SourceError as e:
                snap.sources.append(SourceStatus("metrics", url, "error", _one_line(e)))

    def _log_source(self, snap: Snapshot) -> None:
        path = self.opts.log_path
        if path is None:
            return
        if self._log_error is None and self._follower is None:
            try:
                from kvdoctor.sources.vllm_log import LogFollower, check_log_file

                check_log_file(path)
                self._follower = LogFollower(path)
            except (SourceError, OSError) as e:
                self._log_error = _one_line(e)
        if self._follower is not None:
            try:
                # The follower parses only what was appended, with the run/phase context kept.
                self._follower.poll()
                self._log = self._follower.log
            except (SourceError, OSError) as e:
                self._log_error = _one_line(e)
        if self._log_error is not None:
            snap.sources.append(SourceStatus("log", str(path), "error", self._log_error))
        elif self._log is not None:
            snap.log = self._log
            from kvdoctor.sources.bundle import describe_log

            snap.sources.append(SourceStatus("log", str(path), "ok", describe_log(self._log)))

    def sample(self) -> Snapshot:
        """Read every live source once."""
        snap = Snapshot(timestamp=time.time())
        self._gpus(snap)
        procs = self._processes(snap)
        self._discover(procs)
        self._metrics(snap)
        self._log_source(snap)
        return snap

    def configs(self, snap: Snapshot) -> list[EngineConfig]:
        """Engine configs from the live API servers' command lines (redacted)."""
        from kvdoctor.sources.cmdline import parse_argv

        out = []
        for p in snap.processes:
            if p.vllm_role == "api_server" and p.cmdline:
                try:
                    out.append(parse_argv(p.cmdline, origin=f"pid {p.pid}"))
                except SourceError:
                    continue
        return out

    def close(self) -> None:
        """Release NVML (nvmlShutdown) and the HTTP client; never raises."""
        if self._http is not None:
            try:
                self._http.close()
            except Exception:
                pass
        if self._nvml is not None:
            try:
                self._nvml.close()
            except Exception:
                pass


def collect_live(
    opts: LiveOptions, *, sleep: Callable[[float], None] = time.sleep
) -> tuple[Timeline, list[EngineConfig]]:
    """Sample for ``opts.window_s`` seconds at ``opts.interval_s`` (at least one sample; two when a
    /metrics endpoint answers, so counter rates exist). Returns the timeline and engine configs."""
    sampler = Sampler(opts)
    timeline = Timeline()
    try:
        start = time.monotonic()
        while True:
            snap = sampler.sample()
            timeline.append(snap)
            elapsed = time.monotonic() - start
            have_metrics = bool(snap.metrics)
            if elapsed >= opts.window_s or (not have_metrics and len(timeline.snapshots) >= 1):
                break
            sleep(opts.interval_s)
        latest = timeline.latest or Snapshot()
        configs = sampler.configs(latest)
        latest.configs = configs
    finally:
        sampler.close()
    return timeline, configs
