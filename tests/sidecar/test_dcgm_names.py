"""Fleet mode's series names: the DCGM exporter GPU series dcgm-exporter really exports
(etc/default-counters.csv: FB in MiB, GPU_UTIL in %; DCGM 4.6 renamed GPU_UTIL to
GPU_UTIL_RATIO and kept the percent value; 4.x labels), and vLLM's series as vllm: or vllm_."""

from __future__ import annotations

from typing import Any

from kvdoctor.sources.prometheus import _gpu_series

MiB = 2**20


class StubPrometheus:
    """Answers the DCGM query with the given series (the shape of /api/v1/query_range)."""

    def __init__(self, series: list[dict[str, Any]]) -> None:
        self.series = series
        self.queries: list[str] = []

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        self.queries.append(query)
        return self.series if "DCGM_FI" in query else []


def series(name: str, value: float) -> dict[str, Any]:
    labels = {"__name__": name, "gpu": "0", "UUID": "GPU-1", "namespace": "ml", "pod": "vllm-0"}
    return {"metric": labels, "values": [[100.0, str(value)]]}


def gpu_from(*s: dict[str, Any]) -> Any:
    out = _gpu_series(StubPrometheus(list(s)), "", 0.0, 200.0, 15.0)  # type: ignore[arg-type]
    (by_t, source) = out["ml/vllm-0"]
    assert source == "DCGM exporter"
    (g,) = by_t[100.0]
    return g


def test_default_counters_mib_and_percent() -> None:
    g = gpu_from(
        series("DCGM_FI_DEV_FB_USED", 70000),
        series("DCGM_FI_DEV_FB_FREE", 11000),
        series("DCGM_FI_DEV_FB_RESERVED", 559),
        series("DCGM_FI_DEV_GPU_UTIL", 87),
    )
    assert g.memory_used_bytes == 70000 * MiB
    assert g.memory_total_bytes == (70000 + 11000 + 559) * MiB
    assert abs(g.utilization_gpu - 0.87) < 1e-9


def test_dcgm_46_util_ratio_name_is_still_percent() -> None:
    g = gpu_from(series("DCGM_FI_DEV_GPU_UTIL_RATIO", 42), series("DCGM_FI_DEV_FB_USED", 1024))
    assert abs(g.utilization_gpu - 0.42) < 1e-9
    assert g.memory_used_bytes == 1024 * MiB


def test_query_asks_for_both_util_names() -> None:
    stub = StubPrometheus([])
    _gpu_series(stub, "", 0.0, 1.0, 1.0)  # type: ignore[arg-type]
    assert "DCGM_FI_DEV_GPU_UTIL_RATIO" in stub.queries[0] and "DCGM_FI_DEV_FB_USED" in stub.queries[0]


def test_nan_and_inf_readings_are_unknown_not_a_crash() -> None:
    # DCGM answers NaN for a field with no reading; the HTTP API writes it "NaN" (or "+Inf").
    for bad in ("NaN", "+Inf", "-Inf", "1e309"):
        s = series("DCGM_FI_DEV_FB_USED", 0.0)
        s["values"] = [[100.0, bad]]
        g = gpu_from(s, series("DCGM_FI_DEV_GPU_UTIL", 87))
        assert g.memory_used_bytes is None and abs(g.utilization_gpu - 0.87) < 1e-9


def test_exporter_4x_labels_exported_pod_lowercase_uuid_and_engine_active() -> None:
    """Scraped without honorLabels, the pod's labels are exported_*; the exporter's own
    namespace/pod must not be taken for the served pod. GR_ENGINE_ACTIVE (0..1, in exporter 4.x's
    default counters) stands in for utilisation only where GPU_UTIL is absent."""

    def s(name: str, value: float, **extra: str) -> dict[str, Any]:
        labels = {"__name__": name, "gpu": "0", "uuid": "GPU-9", "namespace": "gpu-operator",
                  "pod": "nvidia-dcgm-exporter-x7", "exported_namespace": "ml", "exported_pod": "vllm-0",
                  "hostname": "node-1", **extra}  # fmt: skip
        return {"metric": labels, "values": [[100.0, str(value)]]}

    out = _gpu_series(StubPrometheus([s("DCGM_FI_DEV_FB_USED", 1024), s("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.37)]), "", 0, 200, 15)  # type: ignore[arg-type]  # fmt: skip
    assert list(out) == ["ml/vllm-0"]
    (g,) = out["ml/vllm-0"][0][100.0]
    assert g.uuid == "GPU-9" and abs(g.utilization_gpu - 0.37) < 1e-9
    # near miss: with GPU_UTIL there, it is the utilisation (percent), not the engine-active ratio
    out = _gpu_series(StubPrometheus([s("DCGM_FI_DEV_GPU_UTIL", 90), s("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.37)]), "", 0, 200, 15)  # type: ignore[arg-type]  # fmt: skip
    (g,) = out["ml/vllm-0"][0][100.0]
    assert abs(g.utilization_gpu - 0.9) < 1e-9


def test_fleet_reads_vllm_underscore_names_and_prefers_colon_ones(monkeypatch: Any) -> None:
    """vllm_… series (a pipeline that rewrote the colon) are read as vllm:…; a pod that has both
    keeps its vllm: series only (the near miss: no doubled counters)."""
    from kvdoctor.sources import prometheus

    def page(pod: str, name: str, value: float) -> dict[str, Any]:
        labels = {"__name__": name, "namespace": "ml", "pod": pod, "model_name": "m", "engine": "0"}
        return {"metric": labels, "values": [[100.0, str(value)], [115.0, str(value)]]}

    served = [
        page("otel-0", "vllm_num_requests_running", 3),
        page("both-0", "vllm:num_requests_running", 5),
        page("both-0", "vllm_num_requests_running", 7),
    ]

    def query_range(self: Any, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        assert "DCGM" in query or "kvdoctor" in query or "vllm[:_]" in query
        return served if "vllm[:_]" in query else []

    monkeypatch.setattr(prometheus.PrometheusClient, "query_range", query_range)
    monkeypatch.setattr(prometheus.PrometheusClient, "label_values", lambda *a: [])  # one batch
    pods = {p.key: p for p in prometheus.fetch_fleet("http://prom:9090", since_s=60, now=120.0)}
    assert set(pods) == {"ml/otel-0", "ml/both-0"}
    running = {k: p.snapshots[-1].metrics[0].num_requests_running for k, p in pods.items()}
    assert running == {"ml/otel-0": 3, "ml/both-0": 5}
