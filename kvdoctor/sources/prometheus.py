"""Fleet mode source: a Prometheus server's HTTP API → one Timeline of Snapshots per pod.

``kvdoctor diagnose --prometheus URL [--since 15m] [--selector '{namespace="ml"}']`` reads what
the fleet's Prometheus already scraped, over the window ``[now − since, now]``:

- **vLLM**: every ``vllm:*`` series matching the selector (and ``vllm_*``: the same series where
  a pipeline turned the colon into an underscore, as OpenTelemetry collectors and some remote
  writers do; read as ``vllm:*``, and left out for a pod that has the ``vllm:`` series too), as
  one range query
  (``/api/v1/query_range``, step :func:`step_for`), grouped by pod and laid back out, one
  instant at a time, as the ``/metrics`` page vLLM served then, parsed by the same
  :func:`kvdoctor.sources.metrics.parse_metrics` a live scrape uses. So the rules see the same
  facts as ``diagnose --metrics URL`` and compute rates (``vllm:num_preemptions_total``) and
  quantiles (``vllm:request_prompt_tokens`` buckets) over the window the same way.
- **GPUs**, when present: DCGM exporter series joined to the pod by the pod labels
  dcgm-exporter's Kubernetes mapping gives them (``exported_namespace``/``exported_pod`` where
  Prometheus kept the exporter pod's own ``namespace``/``pod``, i.e. no ``honorLabels``; else
  ``namespace``/``pod``) — ``DCGM_FI_DEV_FB_USED``/``_FREE``/``_RESERVED`` MiB and
  ``DCGM_FI_DEV_GPU_UTIL`` percent, or its DCGM 4.6 name ``DCGM_FI_DEV_GPU_UTIL_RATIO``, still
  percent, else ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (a 0..1 ratio, in the default counters of
  exporter 4.x where GPU_UTIL is not) (:data:`DCGM_METRICS`); the GPU's UUID from the ``UUID``
  label (``uuid`` with the exporter's old-namespace option) — else a kvdoctor sidecar's own
  ``kvdoctor_gpu_memory_*`` / ``kvdoctor_gpu_utilization_ratio`` (with their ``uuid``).
- A pod is ``namespace/pod`` when those labels exist (Kubernetes discovery), else ``instance``.

Errors are :class:`~kvdoctor.facts.SourceError` with one line (``GET …/api/v1/query_range:
connection refused``, ``HTTP 400: bad selector``); a response is bounded (:data:`MAX_BODY_BYTES`).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.facts import Gpu, Snapshot, SourceError, SourceStatus
from kvdoctor.units import number_in_range

MiB = 2**20
#: the most one API response may hold, bytes (decoded).
MAX_BODY_BYTES = 64 * 2**20
#: labels Prometheus adds to every series (not vLLM's own): dropped when rebuilding a page.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "service", "endpoint", "node"})

#: DCGM exporter metric → (Gpu field, factor to base units). dcgm-exporter names each series
#: after the DCGM field in its counters CSV (NVIDIA/dcgm-exporter etc/default-counters.csv, up to
#: 4.5.3-4.8.2: ``DCGM_FI_DEV_FB_FREE``/``_USED``/``_RESERVED`` "in MiB", ``DCGM_FI_DEV_GPU_UTIL``
#: "in %"). DCGM 4.6 (NVIDIA/DCGM dcgmlib/dcgm_fields.h, "renamed per DCGM Field Naming
#: Standard") renamed field 203 ``DCGM_FI_DEV_GPU_UTIL`` → ``DCGM_FI_DEV_GPU_UTIL_RATIO`` but
#: kept its value an integer percent (DcgmCacheManager.cpp stores NVML's ``utilization.gpu``,
#: 0..100), and kept the frame-buffer fields' names and MB unit: so both utilisation names scale
#: by 0.01 and no byte-valued FB field exists to read.
DCGM_METRICS: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_FB_USED": ("used", MiB),
    "DCGM_FI_DEV_FB_FREE": ("free", MiB),
    "DCGM_FI_DEV_FB_RESERVED": ("reserved", MiB),
    "DCGM_FI_DEV_FB_TOTAL": ("total", MiB),
    "DCGM_FI_DEV_GPU_UTIL": ("util", 0.01),
    "DCGM_FI_DEV_GPU_UTIL_RATIO": ("util", 0.01),
    # Exporter 4.x default counters (4.5.3-4.8.2 etc/default-counters.csv): "Ratio of time the
    # graphics engine is active", 0..1; read only where neither GPU_UTIL name is there.
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("engine_active", 1.0),
}
#: a vLLM series name as Prometheus may hold it: ``vllm:…`` as vLLM exports it, or ``vllm_…``
_VLLM_NAME = re.compile(r"^vllm[:_](.+)$")
_KVDOCTOR_GPU = (
    "kvdoctor_gpu_memory_total_bytes",
    "kvdoctor_gpu_memory_bytes",
    "kvdoctor_gpu_utilization_ratio",
)
_HIST_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def parse_duration(text: str) -> float:
    """``"15m"`` / ``"90s"`` / ``"2h"`` / ``"1d"`` / ``"300"`` → seconds. Raises ValueError."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?", (text or "").strip())
    if not m:
        raise ValueError(f"bad duration {text!r} (expected e.g. 15m, 90s, 2h)")
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]
    return float(m.group(1)) * unit


def selector_matchers(selector: str | None) -> str:
    """``'{namespace="ml"}'`` → ``'namespace="ml"'`` (the inside, to add to other matchers);
    "" for none. Raises ValueError for text that is not one ``{…}`` block."""
    s = (selector or "").strip()
    if not s:
        return ""
    if not (s.startswith("{") and s.endswith("}")) or "}" in s[1:-1]:
        raise ValueError(f'--selector must be one {{label="value", …}} block, got {s[:60]!r}')
    return s[1:-1].strip().rstrip(",")


def step_for(since_s: float) -> float:
    """Query step, seconds: about 200 points over the window (15m → 5 s), never under 1 s.
    A step shorter than the scrape interval repeats samples, which leaves rates unchanged."""
    return max(1.0, math.ceil(since_s / 200.0))


@dataclass
class PodData:
    """What Prometheus holds for one pod: ``key`` ("ns/pod" or the instance), its Snapshots
    oldest first, and how its GPU facts were found ("dcgm", "kvdoctor" or None)."""

    key: str
    snapshots: list[Snapshot] = field(default_factory=list)
    gpu_source: str | None = None


class PrometheusClient:
    """The few HTTP API calls fleet mode needs (httpx; ``timeout_s`` per request)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        from kvdoctor.sources.metrics import _redact_url

        self.base = url.rstrip("/")
        if "://" not in self.base:
            self.base = "http://" + self.base
        self.shown = _redact_url(self.base)
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, str]) -> Any:
        import json

        import httpx

        label = f"GET {self.shown}{path}"
        try:
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=self.timeout_s)) as c:
                with c.stream("GET", self.base + path, params=params) as resp:
                    chunks, size = [], 0
                    for chunk in resp.iter_bytes():
                        size += len(chunk)
                        if size > MAX_BODY_BYTES:
                            raise SourceError(f"{label}: answer larger than {MAX_BODY_BYTES // MiB} MiB")
                        chunks.append(chunk)
                    status = resp.status_code
        except httpx.TimeoutException:
            raise SourceError(f"{label}: timed out after {self.timeout_s:g} s") from None
        except httpx.ConnectError as e:
            why = "connection refused" if "refused" in str(e).lower() else "cannot connect"
            raise SourceError(f"{label}: {why}") from None
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise SourceError(f"{label}: {type(e).__name__}") from None
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            raise SourceError(f"{label}: HTTP {status}, not a Prometheus API answer") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            err = str(body.get("error", "")) if isinstance(body, dict) else ""
            raise SourceError(f"{label}: HTTP {status}: {err.splitlines()[0][:200] if err else 'error'}")
        return body.get("data")

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        """``/api/v1/label/LABEL/values?match[]=…`` over ``[start, end]``: the label's values
        on the series ``match`` selects, sorted ("" left out)."""
        data = self._get(
            f"/api/v1/label/{label}/values",
            {"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}"},
        )
        return sorted(str(v) for v in data or [] if v) if isinstance(data, list) else []

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """``/api/v1/query_range`` → the matrix ``[{"metric": {labels}, "values": [[t, "v"], …]}]``."""
        data = self._get(
            "/api/v1/query_range",
            {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
        )
        return list(data.get("result") or []) if isinstance(data, dict) else []


def _pod_key(labels: dict[str, str]) -> str:
    if labels.get("pod"):
        return f"{labels.get('namespace', '')}/{labels['pod']}".lstrip("/")
    return labels.get("instance", "") or labels.get("job", "") or "unknown"


def _dcgm_pod_key(labels: dict[str, str]) -> str:
    """The pod a DCGM series is about: the exported pod labels when Prometheus renamed them
    (the scrape's own pod/namespace are the exporter's), else :func:`_pod_key`."""
    if labels.get("exported_pod"):
        return f"{labels.get('exported_namespace', '')}/{labels['exported_pod']}".lstrip("/")
    return _pod_key(labels)


def _fmt_labels(labels: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    inner = ",".join(
        f'{k}="{esc(v)}"' for k, v in sorted(labels.items()) if k != "__name__" and k not in TARGET_LABELS
    )
    return "{" + inner + "}" if inner else ""


def render_page(samples: list[tuple[str, dict[str, str], float]]) -> str:
    """Prometheus text for ``(name, labels, value)`` samples (target labels dropped), with a
    ``# TYPE`` line per family: histograms where ``_bucket`` samples exist (so
    ``vllm:iteration_tokens_total`` is one), counters for other ``_total`` names, else gauges."""
    hist = {n[: -len("_bucket")] for n, _, _ in samples if n.endswith("_bucket")}
    families: dict[str, list[str]] = defaultdict(list)
    types: dict[str, str] = {}
    for name, labels, value in samples:
        fam = _histogram_family(name)
        base = fam if fam in hist else name
        kind = "histogram" if base in hist else ("counter" if name.endswith("_total") else "gauge")
        types.setdefault(base, kind)
        families[base].append(f"{name}{_fmt_labels(labels)} {value!r}")
    lines: list[str] = []
    for base, rows in families.items():
        lines.append(f"# TYPE {base} {types[base]}")
        lines.extend(rows)
    return "\n".join(lines) + "\n"


def _histogram_family(name: str) -> str | None:
    """``vllm:iteration_tokens_total_bucket`` → ``vllm:iteration_tokens_total``; None for a
    sample that is not part of a histogram."""
    m = _HIST_SUFFIX.search(name)
    return name[: m.start()] if m else None


#: pods whose vLLM series one range query asks for: bounds one answer (:data:`MAX_BODY_BYTES`)
#: and the raw samples held before they are parsed into snapshots (500 pods: 10 queries).
POD_BATCH = 50


def fetch_fleet(
    url: str,
    *,
    since_s: float = 900.0,
    selector: str | None = None,
    timeout_s: float = 10.0,
    now: float | None = None,
) -> list[PodData]:
    """Every pod of :func:`iter_fleet`, in key order (all held at once: :func:`iter_fleet`
    gives them a batch at a time)."""
    pods = iter_fleet(url, since_s=since_s, selector=selector, timeout_s=timeout_s, now=now)
    return sorted(pods, key=lambda p: p.key)


def iter_fleet(
    url: str,
    *,
    since_s: float = 900.0,
    selector: str | None = None,
    timeout_s: float = 10.0,
    now: float | None = None,
) -> Iterator[PodData]:
    """Every pod with vLLM series in ``[now − since_s, now]`` (matching ``selector``), each with
    one Snapshot per query step (vLLM metrics parsed as a scrape, GPUs from DCGM or a kvdoctor
    sidecar), key order within a batch. Raises SourceError (when iterated) when Prometheus
    cannot be queried or the selector is invalid; a pod whose series cannot be parsed gets an
    "error" SourceStatus.

    Only the vLLM series kvdoctor reads are asked for (:func:`~kvdoctor.sources.metrics.
    read_sample_names`, as ``vllm:`` or ``vllm_`` names), :data:`POD_BATCH` pods a range query
    (the pods from ``/api/v1/label/pod/values``; one query for all where that API fails); a
    batch's raw samples are dropped once its pods are parsed, and a caller that lets each pod go
    once used holds one batch at a time."""
    try:
        inner = selector_matchers(selector)
    except ValueError as e:
        raise SourceError(str(e)) from None
    client = PrometheusClient(url, timeout_s=timeout_s)
    end = time.time() if now is None else now
    start = end - since_s
    step = step_for(since_s)
    extra = f",{inner}" if inner else ""
    names = _vllm_names_re()
    gpus = _gpu_series(client, extra, start, end, step)
    for batch in _pod_batches(client, f'{{__name__=~"{names}"{extra}}}', start, end):
        vllm = client.query_range(f'{{__name__=~"{names}"{extra}{batch}}}', start, end, step)
        pods = _pods_from(vllm, gpus, client.shown)
        del vllm
        for pod in pods:
            gpus.pop(pod.key, None)
        yield from pods


def _vllm_names_re() -> str:
    """``vllm[:_](?:cache_config_info|…)``: the vLLM sample names parse_metrics reads."""
    from kvdoctor.sources.metrics import read_sample_names

    return "vllm[:_](?:" + "|".join(re.escape(n[len("vllm:") :]) for n in read_sample_names()) + ")"


def _regex_of(values: list[str]) -> str:
    """A PromQL regex string literal's inside matching exactly ``values``."""
    alt = "|".join(re.escape(v) for v in values)
    return alt.replace("\\", "\\\\").replace('"', '\\"')


def _pod_batches(client: PrometheusClient, match: str, start: float, end: float) -> list[str]:
    """Extra matchers (``,pod=~"a|b"``) that split the series of ``match`` into batches of at
    most :data:`POD_BATCH` pods (series without a pod label: by instance); ``[""]`` (one batch)
    when the label-values API is not answered or names none."""
    try:
        pods = client.label_values("pod", match, start, end)
        bare = client.label_values("instance", match[:-1] + ',pod=""}', start, end)
    except SourceError:
        return [""]
    if not pods and not bare:  # nothing, or an API that ignores match[]: one query finds out
        return [""]
    out = [f',pod=~"{_regex_of(pods[i : i + POD_BATCH])}"' for i in range(0, len(pods), POD_BATCH)]
    out += [
        f',pod="",instance=~"{_regex_of(bare[i : i + POD_BATCH])}"' for i in range(0, len(bare), POD_BATCH)
    ]
    return out


def _pods_from(
    vllm: list[dict[str, Any]],
    gpus: dict[str, tuple[dict[float, list[Gpu]], str | None]],
    shown: str,
) -> list[PodData]:
    """PodData (with snapshots) of one range answer's vLLM series."""
    from kvdoctor.sources.metrics import parse_metrics

    # per pod: (name, labels, [[t, "value"], …]) of each series
    per_pod: dict[str, list[tuple[str, dict[str, str], list[Any]]]] = defaultdict(list)
    colon_pods = {_pod_key(dict(s.get("metric") or {})) for s in vllm if _is_colon(s)}
    for series in vllm:
        labels = dict(series.get("metric") or {})
        m = _VLLM_NAME.match(labels.get("__name__", ""))
        if m is None or m.group(1).endswith("_created"):
            continue
        key = _pod_key(labels)
        if not _is_colon(series) and key in colon_pods:
            continue  # the pod's vllm: series are there: these are a copy
        per_pod[key].append(("vllm:" + m.group(1), labels, list(series.get("values") or [])))
    out: list[PodData] = []
    for key in sorted(per_pod):
        pod = PodData(key)
        origin = f"prometheus {shown} pod {key}"
        pod_gpus, pod.gpu_source = gpus.get(key, ({}, None))
        for t, page in sorted(_pages(per_pod.pop(key)).items()):
            snap = Snapshot(timestamp=t)
            try:
                snap.metrics = parse_metrics(page, origin=origin, timestamp=t)
                snap.sources.append(SourceStatus("metrics", origin, "ok", f"vLLM series at {_iso(t)}"))
            except SourceError as e:
                snap.sources.append(SourceStatus("metrics", origin, "error", str(e).splitlines()[0]))
            snap.gpus = pod_gpus.get(t, [])
            if snap.gpus:
                snap.sources.append(
                    SourceStatus(
                        "nvml",
                        f"prometheus {pod.gpu_source} series, pod {key}",
                        "ok",
                        f"{len(snap.gpus)} GPU(s)",
                    )
                )
            pod.snapshots.append(snap)
        out.append(pod)
    return out


def _pages(series: list[tuple[str, dict[str, str], list[Any]]]) -> dict[float, str]:
    """Timestamp → the /metrics page of one pod's series then (what :func:`render_page` writes
    for that instant's samples), each series' labels formatted once for all its samples."""
    hist = {n[: -len("_bucket")] for n, _, _ in series if n.endswith("_bucket")}
    rows = []
    for name, labels, values in series:
        fam = _histogram_family(name)
        base = fam if fam in hist else name
        kind = "histogram" if base in hist else ("counter" if name.endswith("_total") else "gauge")
        rows.append(((base, name), base, kind, f"{name}{_fmt_labels(labels)} ", values))
    rows.sort(key=lambda r: r[0])  # a histogram's buckets, count and sum under one # TYPE line
    lines: dict[float, list[str]] = defaultdict(list)
    last: dict[float, str] = {}
    for _, base, kind, prefix, values in rows:
        for t, v in values:
            try:
                t = float(t)
                float(v)
            except (TypeError, ValueError):
                continue
            page = lines[t]
            if last.get(t) != base:
                page.append(f"# TYPE {base} {kind}")
                last[t] = base
            page.append(prefix + str(v))
    return {t: "\n".join(page) + "\n" for t, page in lines.items()}


def _is_colon(series: dict[str, Any]) -> bool:
    return str((series.get("metric") or {}).get("__name__", "")).startswith("vllm:")


def _fix_hist(samples: list[tuple[str, dict[str, str], float]]) -> list[tuple[str, dict[str, str], float]]:
    # Sort so that a histogram's buckets, count and sum stay together under one # TYPE line.
    return sorted(samples, key=lambda s: (_histogram_family(s[0]) or s[0], s[0]))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _gpu_series(
    client: PrometheusClient, extra: str, start: float, end: float, step: float
) -> dict[str, tuple[dict[float, list[Gpu]], str | None]]:
    """{pod key: ({timestamp: [Gpu]}, "dcgm" | "kvdoctor sidecar")} — DCGM first, else the
    sidecar's series. A missing family is no error (GPU facts are optional)."""
    names = "|".join(DCGM_METRICS)
    try:
        dcgm = client.query_range(f'{{__name__=~"{names}"{extra}}}', start, end, step)
    except SourceError:
        dcgm = []
    acc: dict[str, dict[float, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    source: dict[str, str] = {}
    for series in dcgm:
        labels = dict(series.get("metric") or {})
        fld, factor = DCGM_METRICS.get(labels.get("__name__", ""), ("", 0.0))
        if not fld or not labels.get("gpu", "").isdigit():
            continue
        key = _dcgm_pod_key(labels)
        source[key] = "DCGM exporter"
        uuid = labels.get("UUID") or labels.get("uuid")
        for t, v in series.get("values") or []:
            value = number_in_range(v, factor)
            if value is None:
                continue
            g = acc[key][float(t)].setdefault(
                int(labels["gpu"]), {"uuid": uuid, "name": labels.get("modelName")}
            )
            g[fld] = value
    if not acc:
        try:
            side = client.query_range(f'{{__name__=~"{"|".join(_KVDOCTOR_GPU)}"{extra}}}', start, end, step)
        except SourceError:
            side = []
        for series in side:
            labels = dict(series.get("metric") or {})
            name = labels.get("__name__", "")
            if not labels.get("gpu", "").isdigit():
                continue
            key = _pod_key(labels)
            source[key] = "kvdoctor sidecar"
            side_fld: str | None = {
                "kvdoctor_gpu_memory_total_bytes": "total",
                "kvdoctor_gpu_utilization_ratio": "util",
            }.get(name)
            if name == "kvdoctor_gpu_memory_bytes":
                side_fld = "free" if labels.get("part") == "free" else None
            if side_fld is None:
                continue
            for t, v in series.get("values") or []:
                value = number_in_range(v)
                if value is not None:
                    g = acc[key][float(t)].setdefault(int(labels["gpu"]), {})
                    g[side_fld] = value
                    if labels.get("uuid"):
                        g["uuid"] = labels["uuid"]
    out: dict[str, tuple[dict[float, list[Gpu]], str | None]] = {}
    for key, by_t in acc.items():
        per_t: dict[float, list[Gpu]] = {}
        for t, by_gpu in by_t.items():
            per_t[t] = [_gpu(i, f) for i, f in sorted(by_gpu.items())]
        out[key] = (per_t, source.get(key))
    return out


def _gpu(index: int, f: dict[str, Any]) -> Gpu:
    used, free, total = f.get("used"), f.get("free"), f.get("total")
    reserved = f.get("reserved") or 0.0
    if total is None and used is not None and free is not None:
        total = used + free + reserved  # DCGM's FB_TOTAL is not exported by default
    if used is None and total is not None and free is not None:
        used = total - free
    return Gpu(
        index=index,
        uuid=f.get("uuid"),
        name=f.get("name"),
        memory_total_bytes=int(total) if total is not None else None,
        memory_used_bytes=int(used) if used is not None else None,
        utilization_gpu=f.get("util", f.get("engine_active")),
    )
