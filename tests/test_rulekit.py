"""The rule engine (kvdoctor.rulekit): loading from --rules-dir and the entry-point group, the
README's example rule, per-rule error isolation, fix validation, thresholds and user config."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdoctor import rulekit
from kvdoctor.findings import Fix
from kvdoctor.rulekit import Hit, Rule, RuleContext, RuleFileError, evaluate, load_rules

README = Path(__file__).resolve().parent.parent / "README.md"

DOC = "## What\nw\n\n## Why\nw\n\n## How to confirm\nw\n\n## Fix\nw\n\n## Sources\nw\n"


def _readme_rule() -> str:
    text = README.read_text()
    section = text[text.index("## Writing a rule") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


@dataclasses.dataclass(frozen=True)
class _T:
    limit: float = 1.0


def _rule(check: Any, **kw: Any) -> Rule[Any]:
    base: dict[str, Any] = {
        "id": "test-rule",
        "family": "L",
        "severity": "warning",
        "title": "t",
        "doc": DOC,
        "thresholds": _T(),
        "check": check,
    }
    base.update(kw)
    return Rule(**base)


def _ctx(**v: Any) -> RuleContext:
    return RuleContext("e1", v, {"timeline", "log", "metrics", "gpus", "config"})


def test_the_readme_example_rule_loads_from_a_rules_dir_and_fires(tmp_path: Path) -> None:
    (tmp_path / "preemption_storm.py").write_text(_readme_rule())
    (rule,) = load_rules([tmp_path], plugins=False)
    assert rule.id == "preemption-storm" and rule.source.endswith("preemption_storm.py")
    out = evaluate([rule], [_ctx(preemptions_per_min=60.0, max_num_seqs_effective=64, max_num_seqs=None)])
    (f,) = out.findings
    assert f.fixes == [Fix(flags={"--max-num-seqs": "32"}, why="half the concurrent sequences")]
    assert "--max-num-seqs to 32" in f.summary and f.suggested_flags == {"--max-num-seqs": "32"}
    assert not out.errors
    quiet = evaluate([rule], [_ctx(preemptions_per_min=3.0, max_num_seqs_effective=64)])
    assert not quiet.findings and not quiet.errors


def test_a_rule_that_raises_is_a_visible_error_and_the_others_still_run() -> None:
    def boom(f: Any, t: Any) -> Hit | None:
        return Hit(summary=str(f["x"] * 2))

    ok = _rule(lambda f, t: Hit(summary="fine"), id="fine-rule")
    out = evaluate([_rule(boom), ok], [_ctx(x=None)])
    assert [f.rule for f in out.findings] == ["fine-rule"]
    (err,) = out.errors
    assert err.rule == "test-rule" and err.where == "check" and "TypeError" in err.message


def test_a_failed_rule_reaches_the_report_and_the_exit_code() -> None:
    from kvdoctor.pipeline import evaluate as pipeline_evaluate
    from kvdoctor.report import EXIT_UNKNOWN, exit_code, render_json
    from kvdoctor.sources.bundle import load_bundle

    case = Path(__file__).parent / "data" / "bundles" / "healthy-idle-gmu092"
    timeline = load_bundle(case).timeline

    def boom(f: Any, t: Any) -> Hit | None:
        raise ValueError("bad")

    report = pipeline_evaluate(timeline, rules=[_rule(boom)], now=0)
    assert report.errors and report.errors[0]["rule"] == "test-rule"
    assert '"errors":[{"rule":"test-rule"' in render_json(report)
    assert exit_code(report) == EXIT_UNKNOWN
    clean = pipeline_evaluate(timeline, rules=[_rule(lambda f, t: None)], now=0)
    assert not clean.errors and exit_code(clean) == 0


def test_an_invalid_fix_is_reported_as_the_rules_error() -> None:
    def bad(f: Any, t: Any) -> Hit:
        return Hit(
            summary="Set --gpu-memory-utilization 1.7.",
            fixes=[Fix(flags={"--gpu-memory-utilization": "1.7"}, why="x")],
        )

    out = evaluate([_rule(bad)], [_ctx(gmu=0.9)])
    assert out.errors and "outside (0, 1]" in out.errors[0].message


def test_thresholds_override_and_refuse_the_wrong_kind() -> None:
    rule = _rule(lambda f, t: None)
    assert rule.with_thresholds({"limit": 3}).thresholds.limit == 3
    with pytest.raises(TypeError):
        rule.with_thresholds({"limit": "high"})
    with pytest.raises(KeyError):
        rule.with_thresholds({"nope": 1})


def test_user_config_errors_name_the_line_and_aliases_are_refused(tmp_path: Path) -> None:
    from kvdoctor.pipeline import PipelineError
    from kvdoctor.pipeline import load_rules as pipeline_rules

    cfg = tmp_path / "c.yaml"
    cfg.write_text("thresholds:\n  kv-budget-exhausted:\n    max_gmu: high\n")
    with pytest.raises(PipelineError, match=r"c.yaml:3: threshold 'max_gmu'"):
        pipeline_rules(config_path=cfg)
    cfg.write_text('a: &a ["x","x","x"]\nb: &b [*a,*a,*a]\nthresholds: {}\n')
    with pytest.raises(PipelineError, match=r"c.yaml:2: YAML aliases"):
        pipeline_rules(config_path=cfg)
    cfg.write_text("disabled: [kv-budget-exhausted]\n")
    assert "kv-budget-exhausted" not in {r.id for r in pipeline_rules(config_path=cfg)}


@pytest.mark.parametrize(
    "body, reason",
    [
        ("x = (", "SyntaxError"),
        ("RULE = 1", "no RULE"),
        (
            "from kvdoctor.rulekit import Rule\nRULE = Rule(id='Bad Id', family='L', severity='info', title='t', doc='', thresholds=None, check=print)",
            "id must be",
        ),
    ],
)
def test_a_broken_rule_module_is_a_one_line_error(tmp_path: Path, body: str, reason: str) -> None:
    (tmp_path / "broken.py").write_text(body)
    with pytest.raises(RuleFileError, match=reason) as err:
        load_rules([tmp_path], plugins=False)
    assert "\n" not in str(err.value) and "broken.py" in str(err.value)


def test_explains_must_name_known_rules_without_cycles() -> None:
    a = _rule(lambda f, t: None, id="a-rule", explains=("b-rule",))
    b = _rule(lambda f, t: None, id="b-rule", explains=("a-rule",))
    with pytest.raises(RuleFileError, match="cycle"):
        rulekit.check_explains([a, b])
    with pytest.raises(RuleFileError, match="unknown"):
        rulekit.check_explains([_rule(lambda f, t: None, explains=("nope",))])


def test_rules_from_the_entry_point_group_join_the_catalogue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "extra_rules_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_rule.py").write_text(_readme_rule().replace("preemption-storm", "my-storm"))
    dist = tmp_path / "extra_rules_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-rules-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvdoctor.rules]\nmy-storm = extra_rules_pkg.my_rule\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ids = {r.id for r in load_rules()}
    assert "my-storm" in ids and "kv-budget-exhausted" in ids
    sys.modules.pop("extra_rules_pkg.my_rule", None)


def test_flag_values_are_written_as_vllm_reads_them() -> None:
    assert rulekit.flag_value(0.635) == "0.64" and rulekit.flag_value(2.0) == "2"
    assert rulekit.flag_value(23648) == "23648" and rulekit.flag_value(True) == ""
    assert rulekit.flag_value([2, 3]) == "2,3" and rulekit.flag_value(float("nan")) is None
    assert rulekit.flag_value(None) is None and rulekit.flag_value(False) is None


def test_the_fix_line_pastes() -> None:
    assert (
        Fix(flags={"--max-model-len": "8192", "--enforce-eager": ""}).line()
        == "--max-model-len 8192 --enforce-eager"
    )
    assert Fix(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).line() == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert Fix(commands=("kill 1 2",)).line() == "kill 1 2"


def test_no_code_is_evaluated_from_strings_in_the_package() -> None:
    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*(root / "kvdoctor").rglob("*.py"), *(root / "rules").rglob("*.py")]:
        text = path.read_text()
        if re.search(r"(?<![\w.])(eval|exec)\(|compile\([^)]*['\"]eval['\"]|simpleeval", text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == [], offenders


def test_every_report_format_says_which_thresholds_and_rules_the_user_config_changed(tmp_path: Path) -> None:
    import io
    import json

    from kvdoctor.pipeline import Pipeline
    from kvdoctor.report import make_console, render_json, render_markdown, render_text
    from kvdoctor.sources.bundle import load_bundle

    cfg = tmp_path / "site.yaml"
    cfg.write_text("thresholds:\n  kv-budget-exhausted: {max_gmu: 0.9}\n")
    timeline = load_bundle(Path(__file__).parent / "data" / "bundles" / "healthy-idle-gmu092").timeline
    report = Pipeline.load(config_path=cfg).evaluate(timeline, now=0)
    assert json.loads(render_json(report))["config"] == {
        "file": str(cfg),
        "thresholds": {"kv-budget-exhausted": {"max_gmu": 0.9}},
        "disabled": [],
    }
    assert "kv-budget-exhausted max_gmu=0.9" in render_markdown(report)
    out = io.StringIO()
    render_text(report, make_console(out))
    assert f"config {cfg}: kv-budget-exhausted max_gmu=0.9" in out.getvalue()
    plain = Pipeline.load(config_path=None).evaluate(timeline, now=0)
    assert "config " not in render_markdown(plain).lower().split("###")[0].replace("`kvdoctor.report/2`", "")
