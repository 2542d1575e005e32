"""DCGM exporter GPU series in fleet mode: the names and units dcgm-exporter really exports
(etc/default-counters.csv: FB in MiB, GPU_UTIL in %; DCGM 4.6 renamed GPU_UTIL to
GPU_UTIL_RATIO and kept the percent value)."""

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
