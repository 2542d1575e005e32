"""Report: JSON shape (spec/report.md), exit codes, markdown and rich text renderings."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone

from rich.console import Console

from kvdoctor.facts import Engine, EngineConfig, Gpu, GpuProcess, Snapshot, SourceStatus
from kvdoctor.findings import Evidence, Finding, Fix, Skipped, worst_health
from kvdoctor.report import build_report, exit_code, fix_lines, render_json, render_markdown, render_text

MML = "max-model-len-exceeds-kv-capacity"


def snapshot(statuses: tuple[str, ...] = ("ok", "ok", "missing")) -> Snapshot:
    gpu = Gpu(
        index=0,
        uuid="GPU-1",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=81920 * 2**20,
        memory_used_bytes=73393 * 2**20,
        utilization_gpu=0.0,
        processes=[GpuProcess(pid=4242, name="python3", used_bytes=73390 * 2**20)],
    )
    cfg = EngineConfig(
        model="meta-llama/Llama-2-7b-hf", gpu_memory_utilization=0.9, max_model_len=4096, max_num_seqs=256
    )
    kinds = ("log", "nvidia-smi", "metrics")
    return Snapshot(
        gpus=[gpu],
        engines=[Engine(id="llama", config=cfg, pid=4242, gpus=[0])],
        sources=[
            SourceStatus(kind=k, origin=f"bundle/{k}", status=s, detail="" if s == "ok" else "not in bundle")  # type: ignore[arg-type]
            for k, s in zip(kinds, statuses, strict=True)
        ],
    )


def finding(sev: str = "critical", rule: str = MML, **kw: object) -> Finding:
    base: dict[str, object] = dict(
        rule=rule,
        severity=sev,
        family="K",
        title="The KV cache holds fewer tokens than --max-model-len",
        summary="The KV cache holds 3,664 tokens but --max-model-len is 4,096 [sic].",
        evidence=[Evidence("KV cache capacity", "3,664 tokens", "vllm.log line 31")],
        suggested_flags={"--max-model-len": "3664", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        gpus=[0],
        engine="llama",
    )
    base.update(kw)
    if "fixes" not in kw:  # one alternative: the suggested flags (and environment)
        flags: dict[str, str] = base["suggested_flags"]  # type: ignore[assignment]
        base["fixes"] = (
            [
                Fix(
                    flags={k: v for k, v in flags.items() if k.startswith("-")},
                    env={k: v for k, v in flags.items() if not k.startswith("-")},
                    why="the fix",
                )
            ]
            if flags
            else []
        )
    return Finding(**base)  # type: ignore[arg-type]


NOW = datetime(2026, 11, 29, 18, 0, 0, tzinfo=timezone.utc)


def test_json_shape_matches_spec() -> None:
    kv = {
        "llama": {"num_gpu_blocks": 229, "block_size": 16, "capacity_tokens": 3664, "usage": 0.0, "extra": 1}
    }
    info = finding("info", rule="idle-preallocation", family="U", suggested_flags={})
    rep = build_report(
        snapshot(), [info, finding()], [Skipped("preemption-storm", ["metrics"], "llama")], kv, now=NOW
    )
    text = render_json(rep)
    assert "\n" not in text
    doc = json.loads(text)
    assert list(doc) == [
        "schema",
        "generated_at",
        "health",
        "sources",
        "gpus",
        "engines",
        "findings",
        "skipped",
        "errors",
        "config",
        "exit_code",  # added field (report/1 allows additions)
    ]
    assert doc["exit_code"] == 2
    assert doc["schema"] == "kvdoctor.report/2" and doc["generated_at"] == "2026-11-29T18:00:00Z"
    assert doc["health"] == "critical"
    assert doc["sources"][2] == {
        "kind": "metrics",
        "origin": "bundle/metrics",
        "status": "missing",
        "detail": "not in bundle",
        "cut": "",  # added within report/2: what the time budget left unread
    }
    assert doc["gpus"] == [
        {
            "index": 0,
            "uuid": "GPU-1",
            "name": "NVIDIA A100-SXM4-80GB",
            "memory_total_bytes": 85899345920,
            "memory_used_bytes": 76958138368,
            "utilization_gpu": 0.0,
            "processes": [{"pid": 4242, "name": "python3", "used_bytes": 76954992640}],
        }
    ]
    (eng,) = doc["engines"]
    assert (eng["id"], eng["pid"], eng["model"], eng["gpus"]) == (
        "llama",
        4242,
        "meta-llama/Llama-2-7b-hf",
        [0],
    )
    for key, value in {
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "kv_cache_dtype": "auto",
    }.items():
        assert eng["config"][key] == value
    assert eng["kv"] == {"num_gpu_blocks": 229, "block_size": 16, "capacity_tokens": 3664, "usage": 0.0}
    assert [f["rule"] for f in doc["findings"]] == [MML, "idle-preallocation"]  # worst first
    f = doc["findings"][0]
    assert {
        "rule",
        "severity",
        "family",
        "title",
        "summary",
        "evidence",
        "suggested_flags",
        "gpus",
        "engine",
    } <= set(f)
    assert f["evidence"] == [
        {"fact": "KV cache capacity", "value": "3,664 tokens", "source": "vllm.log line 31"}
    ]
    assert f["suggested_flags"]["--max-model-len"] == "3664" and f["docs"] == f"kvdoctor explain {MML}"
    assert doc["skipped"] == [{"rule": "preemption-storm", "missing": ["metrics"], "engine": "llama"}]


def test_json_unknown_kv_and_nan_are_null() -> None:
    snap = snapshot()
    snap.gpus[0].utilization_gpu = float("nan")
    doc = json.loads(render_json(build_report(snap, [], [], None, now=0)))
    assert doc["gpus"][0]["utilization_gpu"] is None
    assert doc["engines"][0]["kv"] == {
        "num_gpu_blocks": None,
        "block_size": None,
        "capacity_tokens": None,
        "usage": None,
    }
    assert doc["generated_at"] == "1970-01-01T00:00:00Z" and doc["health"] == "ok"


def test_exit_codes() -> None:
    snap = snapshot()
    assert exit_code(build_report(snap, [], [])) == 0
    assert exit_code(build_report(snap, [finding("info")], [])) == 0
    assert exit_code(build_report(snap, [finding("info"), finding("warning", rule="b")], [])) == 1
    assert exit_code(build_report(snap, [finding("warning", rule="b"), finding("critical")], [])) == 2
    assert exit_code(build_report(snapshot(("error", "missing", "missing")), [], [])) == 3
    assert exit_code(build_report(Snapshot(), [], [])) == 3


def test_worst_health() -> None:
    assert worst_health([]) == "ok"
    assert worst_health([finding("info"), finding("warning")]) == "warning"


def test_fix_lines_are_copy_pasteable_one_line_per_alternative() -> None:
    f = finding(
        fixes=[
            Fix(
                flags={
                    "--max-model-len": "3664",
                    "--enforce-eager": "",
                    "--limit-mm-per-prompt": '{"image": 1}',
                },
                env={"CUDA_VISIBLE_DEVICES": "2,3"},
                why="a",
            ),
            Fix(commands=("kill 48211 48212",), why="b"),
        ]
    )
    assert fix_lines(f) == [
        "CUDA_VISIBLE_DEVICES=2,3 --max-model-len 3664 --enforce-eager --limit-mm-per-prompt '{\"image\": 1}'",
        "kill 48211 48212",
    ]
    # a report/1 finding without fixes shows its suggested flags as one line
    old = finding(fixes=[], suggested_flags={"--max-model-len": "3664"})
    assert fix_lines(old) == ["--max-model-len 3664"]


def test_markdown_has_fix_first_and_collapsed_evidence() -> None:
    md = render_markdown(
        build_report(snapshot(), [finding()], [Skipped("preemption-storm", ["metrics"])], now=NOW)
    )
    assert md.startswith("## kvdoctor: CRITICAL")
    assert md.index("--max-model-len 3664") < md.index("The KV cache holds 3,664 tokens")
    assert (
        "<details><summary>Evidence</summary>" in md
        and "| KV cache capacity | 3,664 tokens | vllm.log line 31 |" in md
    )
    assert "| metrics | bundle/metrics | missing | not in bundle |" in md
    assert "Skipped rules (missing inputs): no /metrics: preemption-storm" in md
    assert f"`kvdoctor explain {MML}`" in md


def render(rep: object, width: int = 100) -> str:
    buf = io.StringIO()
    render_text(rep, Console(file=buf, width=width, force_terminal=False, color_system=None))  # type: ignore[arg-type]
    return buf.getvalue()


def test_text_header_sources_fix_before_summary_and_skipped() -> None:
    rep = build_report(
        snapshot(("ok", "error", "missing")),
        [
            finding(
                "warning", rule="preemption-storm", family="L", suggested_flags={"--max-num-seqs": "128"}
            ),
            finding(),
        ],
        [Skipped("idle-preallocation", ["gpus"], "llama")],
        now=NOW,
    )
    out = render(rep)
    lines = out.splitlines()
    assert lines[0] == "kvdoctor: CRITICAL — 2 findings (1 critical, 1 warning)"
    assert "✓ log bundle/log: ok" in lines[1]
    assert "✗ nvidia-smi bundle/nvidia-smi: error — not in bundle" in lines[2]
    assert out.index("CRITICAL The KV cache") < out.index("WARNING")  # worst first
    fix = "Fix: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --max-model-len 3664"
    assert out.index(fix) < out.index("The KV cache holds 3,664")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert "[sic]" in out  # rich markup in text is printed, not interpreted
    assert f"kvdoctor explain {MML}" in out and "vllm.log line 31" in out
    assert "Skipped rules (missing inputs): no nvidia-smi/NVML: idle-preallocation" in out
    assert "\x1b[" not in out  # no colour when not a terminal


def test_text_without_findings_or_sources() -> None:
    out = render(build_report(Snapshot(), [], []))
    # Nothing read is UNKNOWN (exit 3), never "OK".
    assert out.startswith("kvdoctor: UNKNOWN — no source could be read") and "no source was read" in out


def test_skipped_grouped_by_missing_input() -> None:
    skipped = [Skipped("a", ["gpus"], "x"), Skipped("b", ["metrics"], "y"), Skipped("c", ["gpus"], "y")]
    md = render_markdown(build_report(snapshot(), [], skipped))
    assert "Skipped rules (missing inputs): no nvidia-smi/NVML: a[x], c[y]; no /metrics: b[y]" in md


def test_the_report_copies_every_field_of_a_finding_and_redacts_its_texts() -> None:
    import dataclasses

    from kvdoctor import report as report_mod

    secret = "--api-key sk-abcdefghijklmnopqrstuvwxyz0123"
    f = finding(
        summary=f"launched with {secret}",
        evidence=[Evidence("cmdline", f"vllm serve m {secret}", f"ps {secret}")],
        docs="kvdoctor explain x",
        caused_by="root-rule",
    )
    # every field set to a value other than its default: a field the copy forgot would show
    for fld in dataclasses.fields(Finding):
        assert getattr(f, fld.name) != (
            fld.default_factory() if callable(fld.default_factory) else fld.default
        )
    for _ in range(2):  # the second time from the kept redactions
        shown = build_report(snapshot(), [f], [], now=NOW).findings[0]
        want = dataclasses.replace(
            f,
            summary=report_mod.redact_text(f.summary),
            evidence=[
                dataclasses.replace(
                    e, value=report_mod.redact_text(e.value), source=report_mod.redact_text(e.source)
                )
                for e in f.evidence
            ],
        )
        assert shown == want
        assert "sk-abc" not in json.dumps(shown.to_dict())
        assert shown.suggested_flags is not f.suggested_flags and shown.gpus is not f.gpus
        assert shown.evidence[0] is not f.evidence[0]
    assert f.summary.endswith(secret)  # the input is left as it was


def test_owned_findings_are_redacted_in_place_into_the_same_report() -> None:
    import copy
    import dataclasses

    secret = "--api-key sk-abcdefghijklmnopqrstuvwxyz0123"
    f = finding(
        summary=f"launched with {secret}",
        evidence=[Evidence("cmdline", f"vllm serve m {secret}", f"ps {secret}"), Evidence("a", "b", "c")],
        docs="kvdoctor explain x",
        caused_by="root-rule",
    )
    g = finding("info", rule="other")
    snap = snapshot()
    want = render_json(build_report(snap, [f, g], [], now=NOW))
    mine = [copy.deepcopy(f), copy.deepcopy(g)]
    rep = build_report(snap, mine, [], now=NOW, owned=True)
    assert render_json(rep) == want and "sk-abc" not in want
    assert {id(x) for x in rep.findings} == {id(x) for x in mine}  # no copies made
    assert [dataclasses.asdict(x) for x in mine] == [dataclasses.asdict(x) for x in rep.findings]


def test_kept_redactions_are_bounded() -> None:
    from kvdoctor import report as report_mod

    for i in range(report_mod._REDACTED_MAX + 10):
        assert report_mod._redacted(f"text {i} --api-key sk-{i:030d}") == f"text {i} --api-key ***"
    assert len(report_mod._REDACTED) <= report_mod._REDACTED_MAX
