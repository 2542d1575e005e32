"""nvidia-smi table / --query-gpu CSV / --query-compute-apps CSV / -q -x XML → Gpu facts.

Tables b01/b05/b20/b21/b26/seed-int8 are the real cases' nvidia-smi.txt (525/570/535/550/580
layouts); the rest are written to the drivers' documented formats.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor.facts import Gpu, GpuProcess, SourceError
from kvdoctor.sources.nvidia_smi import (
    attach_processes,
    decode_clock_event_reasons,
    latest_gpus,
    normalize_bus_id,
    parse_compute_apps_csv,
    parse_nvidia_smi_file,
    parse_nvidia_smi_table,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
    parse_query_gpu_csv,
)
from kvdoctor.units import MiB

DATA = Path(__file__).resolve().parent.parent / "data" / "nvidia_smi"


def read(name: str) -> str:
    return (DATA / name).read_text()


def one(name: str) -> list[Gpu]:
    moments = parse_nvidia_smi_table(read(name), origin=name)
    assert len(moments) == 1
    return moments[0]


# --------------------------------------------------------------------------- table, real cases


def test_b01_525_table_eight_a100_40g() -> None:
    gpus = one("b01.txt")
    assert [g.index for g in gpus] == list(range(8))
    g0 = gpus[0]
    assert g0.name == "NVIDIA A100-SXM..."
    assert g0.bus_id == "00000000:07:00.0"
    assert g0.memory_used_bytes == 40051 * MiB
    assert g0.memory_total_bytes == 40960 * MiB
    assert g0.memory_free_bytes == (40960 - 40051) * MiB
    assert g0.utilization_gpu == 0.0
    assert g0.temperature_c == 36.0
    assert (g0.power_w, g0.power_limit_w) == (92.0, 400.0)
    assert g0.mig_enabled is False
    assert g0.ecc_uncorrectable == 0
    assert g0.processes == [GpuProcess(pid=31577, name="/usr/bin/python3", used_bytes=40044 * MiB, type="C")]
    assert all(g.memory_used_bytes == 3 * MiB and g.processes == [] for g in gpus[1:])
    assert gpus[7].bus_id == "00000000:CB:00.0"
    assert gpus[7].power_w == 59.0
    assert all(g.node is None for g in gpus)
    # the date line above the table, read as UTC
    assert g0.timestamp == 1693041278.0  # 2023-08-26 09:14:38 UTC


def test_b05_570_table_foreign_process() -> None:
    (g,) = one("b05.txt")
    assert g.name == "NVIDIA RTX 6000 Ada Gener..."
    assert g.memory_used_bytes == 15796 * MiB
    assert g.memory_total_bytes == 49140 * MiB
    assert g.utilization_gpu == pytest.approx(0.97)
    assert (g.power_w, g.power_limit_w) == (271.0, 300.0)
    assert g.mig_enabled is None  # "N/A"
    assert g.ecc_uncorrectable is None  # "Off"
    assert g.temperature_c == 63.0
    (p,) = g.processes
    assert (p.pid, p.name, p.used_bytes, p.type) == (48213, "/opt/conda/bin/python3.10", 15790 * MiB, "C")


def test_b20_535_table_h800() -> None:
    gpus = one("b20.txt")
    assert len(gpus) == 8
    g0 = gpus[0]
    assert (g0.memory_used_bytes, g0.memory_total_bytes) == (75327 * MiB, 81559 * MiB)
    assert g0.utilization_gpu == pytest.approx(0.21)
    assert g0.processes[0].pid == 3317042 and g0.processes[0].used_bytes == 75310 * MiB
    assert gpus[5].bus_id == "00000000:AB:00.0"


def test_b21_550_table() -> None:
    (g,) = one("b21.txt")
    assert g.name == "NVIDIA A100 80GB PCIe"
    assert (g.memory_used_bytes, g.memory_total_bytes) == (73393 * MiB, 81920 * MiB)
    assert g.processes[0].pid == 2751 and g.processes[0].used_bytes == 73380 * MiB


def test_b26_580_table_worker_names() -> None:
    gpus = one("b26.txt")
    assert [g.name for g in gpus] == ["NVIDIA GeForce RTX 5060 Ti"] * 2
    assert [g.memory_used_bytes for g in gpus] == [12843 * MiB, 12837 * MiB]
    assert [(p.pid, p.name, p.used_bytes) for g in gpus for p in g.processes] == [
        (48211, "VLLM::Worker_TP0", 12830 * MiB),
        (48212, "VLLM::Worker_TP1", 12824 * MiB),
    ]


def test_seed_580_no_running_processes() -> None:
    gpus = one("seed-int8.txt")
    assert [g.bus_id for g in gpus] == ["00000000:07:00.0", "00000000:0F:00.0"]
    assert all(g.processes == [] and g.memory_used_bytes == MiB for g in gpus)


# --------------------------------------------------------------------------- table, other layouts


def test_pre_450_table_without_mig_row_or_gi_ci() -> None:
    g0, g1 = one("v440-no-mig.txt")
    assert g0.name == "Tesla V100-SXM2..."
    assert g0.bus_id == "00000000:00:1E.0"  # 4-digit domain normalised
    assert g0.memory_used_bytes == 15208 * MiB
    assert g0.utilization_gpu == pytest.approx(0.34)
    assert g0.mig_enabled is None
    assert g1.ecc_uncorrectable == 2
    assert (g1.power_w, g1.power_limit_w) == (None, None)  # "N/A /  N/A"
    assert g1.utilization_gpu == 0.0
    assert [(p.pid, p.name, p.type, p.used_bytes) for p in g0.processes] == [
        (12345, "python -m vllm.entrypoints.api_server", "C", 15196 * MiB),
        (12399, "/usr/lib/xorg/Xorg", "C+G", 10 * MiB),
    ]


def test_535_mig_table_with_mig_devices_and_na_fields() -> None:
    g0, g1 = one("v535-mig.txt")
    assert g0.mig_enabled is True and g1.mig_enabled is False
    assert g0.utilization_gpu is None  # "N/A" under MIG
    assert g0.ecc_uncorrectable is None  # "On"
    assert g0.memory_used_bytes == 87 * MiB  # MIG devices table rows are not GPUs
    assert [(p.pid, p.name, p.used_bytes) for p in g0.processes] == [
        (7401, "python3", None),
        (7402, "/usr/local/bin/python3 -m vllm.entrypoints", None),
    ]
    # the N/A-pid row (other PID namespace) is skipped; a truncated name is kept as printed
    assert [(p.pid, p.name, p.used_bytes) for p in g1.processes] == [
        (9001, "...al/lib/python3.10/dist-packages/ray", 38898 * MiB)
    ]


def test_same_bus_ids_again_are_later_moments() -> None:
    first = read("b26.txt")
    later = first.replace("12843MiB /", "16001MiB /").replace("Sat Sep  5 10:43:40", "Sat Sep  5 10:44:40")
    moments = parse_nvidia_smi_table(first + "\n" + later)
    assert len(moments) == 2
    assert [g.memory_used_bytes for g in moments[0]] == [12843 * MiB, 12837 * MiB]
    assert [g.memory_used_bytes for g in moments[1]] == [16001 * MiB, 12837 * MiB]
    assert (moments[0][0].timestamp, moments[1][0].timestamp) == (1788605020.0, 1788605080.0)
    assert all(g.node is None for m in moments for g in m)
    latest = latest_gpus(moments)
    assert [g.memory_used_bytes for g in latest] == [16001 * MiB, 12837 * MiB]


def test_new_bus_ids_are_another_node() -> None:
    a, b = read("b20.txt"), read("b21.txt")  # 8 x H800 node, 1 x A100 node
    a2 = a.replace("75327MiB /", "75400MiB /")
    moments = parse_nvidia_smi_table("\n".join([a, b, a2]))
    assert [len(m) for m in moments] == [9, 8]
    assert {g.node for g in moments[0]} == {"node1", "node2"}
    assert {g.node for g in moments[1]} == {"node1"}
    latest = latest_gpus(moments)
    assert len(latest) == 9
    assert [g.node for g in latest] == ["node1"] * 8 + ["node2"]
    assert latest[0].memory_used_bytes == 75400 * MiB  # node1's later moment
    assert latest[8].memory_used_bytes == 73393 * MiB  # node2's only moment


def test_tables_pasted_without_header_lines() -> None:
    body = "\n".join(ln for ln in read("b26.txt").splitlines() if "NVIDIA-SMI" not in ln)
    moments = parse_nvidia_smi_table(body + "\n" + body)
    assert [len(m) for m in moments] == [2, 2]
    assert moments[1][1].processes[0].pid == 48212


def test_latest_gpus_empty() -> None:
    assert latest_gpus([]) == []


# --------------------------------------------------------------------------- --query-gpu CSV


def test_query_gpu_time_series_with_units() -> None:
    moments = parse_query_gpu_csv(read("query-gpu-loop.csv"), origin="nvidia-smi.csv")
    assert [len(m) for m in moments] == [2, 2]
    g0, g1 = moments[0]
    assert g0.timestamp == pytest.approx(1721816120.123)  # 2024-07-24 10:15:20.123 UTC
    assert g0.uuid == "GPU-0a1b2c3d-0000-1111-2222-333344445555"
    assert g0.bus_id == "00000000:18:00.0"
    assert (g0.memory_used_bytes, g0.memory_total_bytes) == (75327 * MiB, 81559 * MiB)
    assert g0.utilization_gpu == pytest.approx(0.21)
    assert g0.utilization_memory == pytest.approx(0.09)
    assert (g0.temperature_c, g0.power_w, g0.power_limit_w) == (41.0, 187.32, 700.0)
    assert g0.mig_enabled is False and g0.ecc_uncorrectable == 0
    assert g0.clock_event_reasons == []
    assert g1.clock_event_reasons == ["gpu_idle"]
    h0, h1 = moments[1]
    assert h0.timestamp == pytest.approx(1721816125.130)
    assert h0.clock_event_reasons == ["sw_power_cap", "sw_thermal_slowdown"]  # 0x24
    assert h0.memory_used_bytes == 75329 * MiB
    assert (h1.utilization_gpu, h1.power_w, h1.mig_enabled, h1.ecc_uncorrectable) == (None, None, None, None)
    assert h1.clock_event_reasons == []
    assert [g.memory_used_bytes for g in latest_gpus(moments)] == [75329 * MiB, 2 * MiB]


def test_query_gpu_nounits_ignores_unused_columns() -> None:
    ((g,),) = parse_query_gpu_csv(read("query-gpu-nounits.csv"))
    assert (g.index, g.name) == (0, "NVIDIA A100 80GB PCIe")
    assert (g.memory_used_bytes, g.memory_total_bytes) == (73393 * MiB, 81920 * MiB)
    assert g.utilization_gpu == 0.0 and g.timestamp is None


def test_query_gpu_noheader_needs_fields() -> None:
    text = "0, 40051 MiB, 40960 MiB\n1, 3 MiB, 40960 MiB\n"
    with pytest.raises(SourceError, match="no header row"):
        parse_query_gpu_csv(text, origin="x.csv")
    (m,) = parse_query_gpu_csv(text, fields=["index", "memory.used", "memory.total"])
    assert [g.memory_used_bytes for g in m] == [40051 * MiB, 3 * MiB]


def test_query_gpu_loop_without_timestamp_splits_on_repeat() -> None:
    text = "uuid, memory.used [MiB]\nGPU-a, 1\nGPU-b, 2\nGPU-a, 3\nGPU-b, 4\n"
    moments = parse_query_gpu_csv(text)
    assert [[(g.index, g.memory_used_bytes) for g in m] for m in moments] == [
        [(0, MiB), (1, 2 * MiB)],
        [(0, 3 * MiB), (1, 4 * MiB)],
    ]


def test_query_gpu_per_reason_columns() -> None:
    text = (
        "index, clocks_event_reasons.hw_slowdown, clocks_throttle_reasons.sw_thermal_slowdown\n"
        "0, Active, Not Active\n1, Not Active, Active\n"
    )
    (m,) = parse_query_gpu_csv(text)
    assert [g.clock_event_reasons for g in m] == [["hw_slowdown"], ["sw_thermal_slowdown"]]


def test_query_gpu_truncated_last_row_is_dropped() -> None:
    text = read("query-gpu-loop.csv")
    cut = text[: text.rindex("\n", 0, len(text) - 1) + 40]
    moments = parse_query_gpu_csv(cut)
    assert [len(m) for m in moments] == [2, 1]


@pytest.mark.parametrize(
    "text, message, line",
    [
        ("foo, bar\n1, 2\n", "unknown header", 1),
        ("index, memory.used [MiB]\n0, lots\n", "column 'memory.used'", 2),
        ("index, memory.used [MiB]\n0, 1, 2\n", "3 values for 2 columns", 2),
        ("index, timestamp\n0, yesterday\n", "not a timestamp", 2),
        ("index, memory.used [MiB]\n", "header but no GPU rows", 1),
    ],
)
def test_query_gpu_bad_input(text: str, message: str, line: int) -> None:
    with pytest.raises(SourceError, match=message) as ei:
        parse_query_gpu_csv(text, origin="nvidia-smi.csv")
    assert ei.value.origin == "nvidia-smi.csv" and ei.value.line == line
    assert "\n" not in str(ei.value)


# --------------------------------------------------------------------------- compute apps


def test_compute_apps_b26_and_attach_to_table_by_pid() -> None:
    procs = parse_compute_apps_csv(read("b26-compute-apps.csv"), origin="compute-apps.csv")
    assert [(p.pid, p.name, p.used_bytes, p.gpu_uuid) for p in procs] == [
        (48211, "VLLM::Worker_TP0", 12830 * MiB, "GPU-6c1d9b52-7e0a-2f41-93c8-1ab5e07d4f21"),
        (48212, "VLLM::Worker_TP1", 12824 * MiB, "GPU-b2e84f17-51c3-0d9a-6e72-f83a9c15d0b6"),
    ]
    gpus = one("b26.txt")  # the table has no uuids: learnt from the pids it lists
    attach_processes(gpus, procs)
    assert [g.uuid for g in gpus] == [p.gpu_uuid for p in procs]
    assert [len(g.processes) for g in gpus] == [1, 1]  # merged, not duplicated
    assert gpus[0].processes[0].gpu_uuid == "GPU-6c1d9b52-7e0a-2f41-93c8-1ab5e07d4f21"


def test_compute_apps_attach_by_uuid() -> None:
    (moment, _) = parse_query_gpu_csv(read("query-gpu-loop.csv"))
    procs = [
        GpuProcess(
            pid=7, name="python", used_bytes=5 * MiB, gpu_uuid="GPU-0a1b2c3d-0000-1111-2222-333344446666"
        ),
        GpuProcess(pid=8, gpu_uuid="GPU-unknown"),
    ]
    attach_processes(moment, procs)
    assert moment[0].processes == [] and [p.pid for p in moment[1].processes] == [7]


def test_compute_apps_by_bus_id_with_na_values() -> None:
    procs = parse_compute_apps_csv(read("compute-apps-busid.csv"))
    assert [(p.pid, p.used_bytes, p.gpu_bus_id, p.gpu_uuid) for p in procs] == [
        (3317042, 75310 * MiB, "00000000:18:00.0", None),
        (4242, None, "00000000:2A:00.0", None),
    ]
    gpus = one("b20.txt")
    attach_processes(gpus, procs)
    # pid 3317042 already listed by the table on GPU 0: merged; 4242 is new on GPU 1
    assert [p.pid for p in gpus[0].processes] == [3317042]
    assert gpus[0].processes[0].used_bytes == 75310 * MiB
    assert [p.pid for p in gpus[1].processes] == [4242]


def test_compute_apps_header_only_is_no_processes() -> None:
    assert parse_compute_apps_csv("gpu_uuid, pid, process_name, used_gpu_memory [MiB]\n") == []


@pytest.mark.parametrize(
    "text, message, line",
    [
        ("index, name\n0, x\n", "unknown header", 1),
        ("gpu_uuid, pid, used_memory [MiB]\nGPU-a, abc, 1 MiB\n", "pid is not a number", 2),
        ("gpu_uuid, pid, used_memory [MiB]\nGPU-a, 1, many\n", "used memory", 2),
        ("gpu_uuid, pid\nGPU-a\n", "1 values for 2 columns", 2),
    ],
)
def test_compute_apps_bad_input(text: str, message: str, line: int) -> None:
    with pytest.raises(SourceError, match=message) as ei:
        parse_compute_apps_csv(text, origin="compute-apps.csv")
    assert (ei.value.origin, ei.value.line) == ("compute-apps.csv", line)


# --------------------------------------------------------------------------- -q -x XML


def test_xml_v12_schema() -> None:
    g0, g1 = parse_nvidia_smi_xml(read("q-x-v12.xml"), origin="nvidia-smi.xml")
    assert (g0.index, g0.name, g0.uuid) == (0, "NVIDIA H800", "GPU-0a1b2c3d-0000-1111-2222-333344445555")
    assert g0.bus_id == "00000000:18:00.0"
    assert (g0.memory_used_bytes, g0.memory_total_bytes) == (75327 * MiB, 81559 * MiB)
    assert (g0.utilization_gpu, g0.utilization_memory) == (pytest.approx(0.21), pytest.approx(0.09))
    assert (g0.temperature_c, g0.power_w, g0.power_limit_w) == (41.0, 187.32, 700.0)
    assert g0.mig_enabled is False
    assert g0.clock_event_reasons == ["sw_power_cap", "sw_thermal_slowdown"]
    assert g0.ecc_uncorrectable == 3  # volatile sram secded 1 + dram 2, not aggregate
    assert g0.processes == [
        GpuProcess(
            pid=3317042,
            name="python",
            used_bytes=75310 * MiB,
            type="C",
            gpu_uuid="GPU-0a1b2c3d-0000-1111-2222-333344445555",
            gpu_bus_id="00000000:18:00.0",
        )
    ]
    assert g1.index == 1 and g1.mig_enabled is True
    assert g1.utilization_gpu is None and g1.ecc_uncorrectable is None
    assert g1.power_w == 70.11  # instant_power_draw when power_draw is N/A
    assert g1.clock_event_reasons == ["gpu_idle"]
    assert g1.processes == []


def test_xml_v11_throttle_reasons_and_double_bit_ecc() -> None:
    (g,) = parse_nvidia_smi_xml(read("q-x-v11-old.xml"))
    assert g.name == "Tesla V100-SXM2-16GB" and g.mig_enabled is None
    assert g.clock_event_reasons == ["hw_slowdown", "hw_thermal_slowdown"]
    assert g.ecc_uncorrectable == 3
    assert (g.power_w, g.power_limit_w) == (58.12, 300.0)
    assert g.processes[0].pid == 12345 and g.processes[0].used_bytes == 15196 * MiB


def test_xml_truncated_gives_line() -> None:
    text = read("q-x-v12.xml")
    cut = "\n".join(text.splitlines()[:60])
    with pytest.raises(SourceError, match="malformed XML") as ei:
        parse_nvidia_smi_xml(cut, origin="nvidia-smi.xml")
    assert ei.value.origin == "nvidia-smi.xml" and ei.value.line is not None and ei.value.line >= 60


def test_xml_wrong_root_and_no_gpus() -> None:
    with pytest.raises(SourceError, match="not <nvidia_smi_log>"):
        parse_nvidia_smi_xml("<html><body/></html>")
    with pytest.raises(SourceError, match="no <gpu>"):
        parse_nvidia_smi_xml("<nvidia_smi_log><attached_gpus>0</attached_gpus></nvidia_smi_log>")


# --------------------------------------------------------------------------- sniffing and garbage


@pytest.mark.parametrize(
    "name, n_gpus",
    [("b01.txt", 8), ("query-gpu-nounits.csv", 1), ("q-x-v12.xml", 2), ("v535-mig.txt", 2)],
)
def test_file_sniffs_shape(name: str, n_gpus: int) -> None:
    moments = parse_nvidia_smi_file(DATA / name)
    assert len(moments[-1]) == n_gpus


def test_file_refuses_compute_apps_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="query-compute-apps"):
        parse_nvidia_smi_file(DATA / "b26-compute-apps.csv")
    with pytest.raises(SourceError, match="cannot read") as ei:
        parse_nvidia_smi_file(tmp_path / "nope.txt")
    assert ei.value.origin == str(tmp_path / "nope.txt")


def test_file_binary(tmp_path: Path) -> None:
    p = tmp_path / "nvidia-smi.txt"
    p.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(SourceError, match="binary") as ei:
        parse_nvidia_smi_file(p)
    assert ei.value.origin == str(p)


@pytest.mark.parametrize(
    "parser",
    [
        parse_nvidia_smi_table,
        parse_query_gpu_csv,
        parse_compute_apps_csv,
        parse_nvidia_smi_xml,
        parse_nvidia_smi_text,
    ],
)
@pytest.mark.parametrize("text", ["", "   \n\n", "\x7fELF\x02\x01\x01\x00\x00\x00" + "\x00\x03" * 200])
def test_every_parser_rejects_empty_and_binary(parser, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SourceError) as ei:
        parser(text, origin="in.txt")
    msg = str(ei.value)
    assert msg.startswith("in.txt") and "\n" not in msg
    assert ("empty" in msg) or ("binary" in msg)


@pytest.mark.parametrize(
    "text, message",
    [
        ("No devices were found\n", "No devices were found"),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n",
            "NVIDIA-SMI has failed",
        ),
        ("hello world\nthis is not a table\n", "not nvidia-smi output"),
    ],
)
def test_text_failures(text: str, message: str) -> None:
    with pytest.raises(SourceError, match=message) as ei:
        parse_nvidia_smi_text(text, origin="nvidia-smi.txt")
    assert ei.value.line == 1


def test_table_without_gpu_rows() -> None:
    with pytest.raises(SourceError, match="no GPU rows") as ei:
        parse_nvidia_smi_table("+-----+\n| Processes: |\n+-----+\n", origin="t.txt")
    assert ei.value.line == 1


def test_truncated_table_keeps_what_it_has() -> None:
    lines = read("b01.txt").splitlines()
    cut = "\n".join(lines[:12] + [lines[12][:20]])  # GPU 1's first row, cut mid-line
    (gpus,) = parse_nvidia_smi_table(cut)
    assert [g.index for g in gpus] == [0]
    assert gpus[0].memory_used_bytes == 40051 * MiB
    # cut after GPU 1's first row: GPU 1 is known, its memory is not
    (gpus,) = parse_nvidia_smi_table("\n".join(lines[:13]))
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[1].bus_id == "00000000:0B:00.0" and gpus[1].memory_used_bytes is None


def test_helpers() -> None:
    assert normalize_bus_id("0000:0b:00.0") == "00000000:0B:00.0"
    assert normalize_bus_id("N/A") is None and normalize_bus_id(None) is None
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1 | 0x8 | 0x80) == [
        "gpu_idle",
        "hw_slowdown",
        "hw_power_brake_slowdown",
    ]
