"""Rule engine: loading (strict schema, file:line errors), evaluation, user config, speed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvdoctor import rules_engine
from kvdoctor.rules_engine import (
    FUNCTIONS,
    RuleContext,
    RuleFileError,
    evaluate,
    format_flag_value,
    load_rule_file,
    load_rules,
    register_function,
)
from kvdoctor.userconfig import UserConfigError, apply_user_config, load_user_config

DATA = Path(__file__).parent / "data" / "rules_engine"
RULES = DATA / "rules"
MML = "max-model-len-exceeds-kv-capacity"
KNOWN = {
    "kv_tokens",
    "num_gpu_blocks",
    "block_size",
    "max_model_len",
    "engine_failed_to_start",
    "kv_bytes",
    "cap_line",
    "gmu_needed",
    "fp8_ok",
    "engine_gpus",
    "preemptions_per_min",
    "kv_usage_max",
    "max_num_seqs",
    "kv_usage",
    "memory_used_fraction",
    "memory_used_bytes",
}


def b06_vars(**over: object) -> dict[str, object]:
    """Case b06: V0 log, 229 GPU blocks x 16 = 3664 tokens < max_model_len 4096."""
    v: dict[str, object] = dict(
        kv_tokens=None,
        num_gpu_blocks=229,
        block_size=16,
        max_model_len=4096,
        engine_failed_to_start=False,
        kv_bytes=229 * 16 * 524288,
        cap_line=31,
        gmu_needed=0.934,
        fp8_ok=True,
        engine_gpus=[0],
    )
    v.update(over)
    return v


def ctx(engine: str | None = "llama", inputs: set[str] | None = None, **over: object) -> RuleContext:
    return RuleContext(engine, b06_vars(**over), inputs if inputs is not None else {"config", "log"})


def mml_rule() -> rules_engine.Rule:
    return load_rule_file(RULES / f"{MML}.yaml", KNOWN)


def write_variant(tmp_path: Path, old: str, new: str, stem: str = MML, src: Path | None = None) -> Path:
    text = (src or RULES / f"{MML}.yaml").read_text()
    assert old in text, old
    p = tmp_path / f"{stem}.yaml"
    p.write_text(text.replace(old, new, 1))
    return p


def line_of(path: Path, needle: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


# --------------------------------------------------------------------------- loading


def test_load_fixture_rules_sorted_and_compiled() -> None:
    rules = load_rules([RULES], known_names=KNOWN)
    assert [r.id for r in rules] == ["idle-preallocation", MML, "preemption-storm"]
    r = rules[1]
    assert (r.family, r.severity, r.needs, r.needs_any) == ("K", "warning", ("config",), ("log", "metrics"))
    assert r.thresholds == {"margin_gib": 0.5}
    assert [n for n, _ in r.let] == ["cap_tokens", "fit_len"]
    assert [k for k, _ in r.fix] == ["--max-model-len", "--gpu-memory-utilization", "--kv-cache-dtype"]
    assert "kv_tokens" in r.let[0][1].names and "floor_to" in r.let[1][1].calls
    assert r.path.endswith(f"{MML}.yaml")


def test_load_without_catalogue_skips_name_check(tmp_path: Path) -> None:
    p = write_variant(
        tmp_path, 'when: "cap_tokens is not None', 'when: "whatever_name and cap_tokens is not None'
    )
    assert load_rule_file(p).id == MML  # no catalogue: unknown names are the context's business
    with pytest.raises(RuleFileError) as e:
        load_rule_file(p, KNOWN)
    assert str(e.value).endswith(
        f"{MML}.yaml:{line_of(p, 'whatever_name')}: unknown name 'whatever_name' in when"
    )


def test_unknown_name_message_has_file_line_and_suggestion(tmp_path: Path) -> None:
    p = write_variant(tmp_path, "kv_tokens if kv_tokens", "kv_tokns if kv_tokens")
    with pytest.raises(RuleFileError) as e:
        load_rule_file(p, KNOWN)
    err = e.value
    assert err.line == line_of(p, "kv_tokns") and err.path.endswith(f"{MML}.yaml")
    assert "unknown name 'kv_tokns' in let cap_tokens (did you mean 'kv_tokens'?)" in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("old", "new", "needle", "reason"),
    [
        ("family: K", "family: Q", "family: Q", "family 'Q' is not one of W|K|L|U|P"),
        ("severity: warning", "severity: fatal", "severity: fatal", "severity 'fatal' is not one of"),
        (
            "thresholds:",
            "treshold:\n  x: 1\nthresholds:",
            "treshold:",
            "unknown key 'treshold' in rule (did you mean 'thresholds'?)",
        ),
        (
            "id: max-model-len-exceeds-kv-capacity",
            "id: other-rule",
            "id: other-rule",
            "does not match the file name",
        ),
        ("id: max-model-len-exceeds-kv-capacity", "id: Not_A_Slug", "id: Not_A_Slug", "is not a slug"),
        (
            'when: "cap_tokens is not None and',
            'when: "cap_tokens is not None and and',
            "and and",
            "syntax error in when",
        ),
        (
            'when: "cap_tokens',
            'when: "cap_tokens.real or cap_tokens',
            "cap_tokens.real",
            "attribute access is not allowed in when",
        ),
        ('when: "cap_tokens', 'when: "open(1) or cap_tokens', "open(1)", "unknown function 'open' in when"),
        ('when: "cap_tokens', 'when: "(lambda: 1) or cap_tokens', "lambda", "lambda is not allowed"),
        (
            '"fit_len"',
            '"fit_len + undefined_x"',
            "undefined_x",
            "unknown name 'undefined_x' in fix --max-model-len",
        ),
        ("  --max-model-len:", "  max-model-len:", "  max-model-len:", "neither a vLLM flag"),
        (
            "{cap_tokens:,} tokens per rank",
            "{cap_tokens:, tokens",
            "{cap_tokens:, tokens",
            "unclosed '{' in summary",
        ),
        ('source: "launch flag', 'sauce: "launch flag', "sauce:", "unknown key 'sauce' in evidence item"),
        ("## How to confirm", "## How to check", "## What", "doc lacks the section '## How to confirm'"),
        ("  margin_gib: 0.5", "  margin_gib: [1]", "margin_gib", "threshold 'margin_gib' must be a number"),
        (
            '  - {when: "engine_failed_to_start", severity: critical}',
            '  - {when: "engine_failed_to_start", severity: fatal}',
            "severity: fatal",
            "severity 'fatal'",
        ),
        ("needs: [config]", "needs: config", "needs: config", "needs must be a list"),
        ("family: K", "family: K\nfamily: W", "family: W", "duplicate key 'family'"),
        ("title: The KV", "title: [The KV", "summary:", "YAML syntax error"),
    ],
)
def test_load_errors_name_their_line(tmp_path: Path, old: str, new: str, needle: str, reason: str) -> None:
    p = write_variant(tmp_path, old, new)
    with pytest.raises(RuleFileError) as e:
        load_rule_file(p, KNOWN)
    assert reason in str(e.value)
    if reason != "YAML syntax error":  # PyYAML reports the line where it noticed the problem
        assert e.value.line == line_of(p, needle), str(e.value)
    else:
        assert e.value.line is not None
    assert str(e.value).count("\n") == 0


def test_let_used_before_defined(tmp_path: Path) -> None:
    p = write_variant(tmp_path, "kv_tokens if kv_tokens is not None", "fit_len if kv_tokens is not None")
    with pytest.raises(RuleFileError, match="let 'fit_len' is used in let cap_tokens before it is defined"):
        load_rule_file(p, KNOWN)


def test_missing_required_key(tmp_path: Path) -> None:
    p = write_variant(tmp_path, 'when: "cap_tokens is not None and cap_tokens < max_model_len"\n', "")
    with pytest.raises(RuleFileError, match="missing required key 'when'"):
        load_rule_file(p)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty rule file"),
        (b"\x89PNG\r\n\x1a\n\x00\x00binary", "binary data"),
        (b"id: x\nfamily: \xff\xfe\n", "not UTF-8"),
        (b"- just\n- a list\n", "must be a mapping"),
        (b"id: [unclosed\n", "YAML syntax error"),
    ],
)
def test_garbage_files_give_one_line_errors(tmp_path: Path, content: bytes, reason: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_bytes(content)
    with pytest.raises(RuleFileError) as e:
        load_rules([tmp_path])
    assert reason in str(e.value) and "bad.yaml" in str(e.value) and "\n" not in str(e.value)


def test_random_bytes_never_raise_anything_but_rule_file_error(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    base = (RULES / f"{MML}.yaml").read_bytes()
    p = tmp_path / f"{MML}.yaml"
    for _ in range(200):
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):  # corrupt a few bytes, or truncate
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        p.write_bytes(bytes(data))
        try:
            load_rule_file(p, KNOWN)
        except RuleFileError as err:
            assert "\n" not in str(err)


def test_duplicate_ids_across_dirs(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    shutil.copy(RULES / f"{MML}.yaml", tmp_path / "a")
    with pytest.raises(RuleFileError, match="also defined in"):
        load_rules([RULES, tmp_path / "a"])


def test_missing_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuleFileError, match="rules directory does not exist"):
        load_rules([tmp_path / "nope"])
    monkeypatch.setattr(rules_engine, "default_rules_dir", lambda: tmp_path / "nope")
    assert load_rules() == []  # no shipped rules yet: zero rules, no error
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_rules([empty]) == []
    assert evaluate([], [ctx()]).findings == []


def test_default_rules_dir_is_repo_rules_in_dev_install() -> None:
    d = rules_engine.default_rules_dir()
    assert d.name == "rules"


def test_register_function_makes_it_callable(tmp_path: Path) -> None:
    p = write_variant(tmp_path, '"fit_len"', '"halve_for_test(fit_len)"')
    with pytest.raises(RuleFileError, match="unknown function 'halve_for_test'"):
        load_rule_file(p, KNOWN)
    register_function("halve_for_test", lambda x: x // 2)
    try:
        rule = load_rule_file(p, KNOWN)
        (f,) = evaluate([rule], [ctx()]).findings
        assert f.suggested_flags["--max-model-len"] == "1832"
    finally:
        del FUNCTIONS["halve_for_test"]
    with pytest.raises(ValueError):
        register_function("not a name", len)


# --------------------------------------------------------------------------- evaluation


def test_fires_on_b06_with_rendered_fields() -> None:
    ev = evaluate([mml_rule()], [ctx()])
    assert ev.skipped == [] and ev.errors == []
    (f,) = ev.findings
    assert f.rule == MML and f.severity == "warning" and f.family == "K" and f.engine == "llama"
    assert f.title == "The KV cache holds fewer tokens than --max-model-len"
    assert f.summary == (
        "The KV cache holds 3,664 tokens per rank but --max-model-len is 4,096; 1.79 GiB of KV."
    )
    assert [(e.fact, e.value, e.source) for e in f.evidence] == [
        ("KV cache capacity", "3,664 tokens", "vllm.log line 31"),
        ("max_model_len", "4096", "launch flag --max-model-len"),
    ]
    assert f.suggested_flags == {
        "--max-model-len": "3664",
        "--gpu-memory-utilization": "0.93",
        "--kv-cache-dtype": "fp8",
    }
    assert f.gpus == [0] and f.docs == f"kvdoctor explain {MML}"


def test_unpacks_as_findings_skipped() -> None:
    findings, skipped = evaluate([mml_rule()], [ctx()])
    assert len(findings) == 1 and skipped == []


def test_does_not_fire_when_capacity_suffices() -> None:
    assert evaluate([mml_rule()], [ctx(num_gpu_blocks=512)]).findings == []


def test_none_inputs_do_not_crash_and_are_recorded() -> None:
    # No capacity known at all: cap_tokens = None * 16 -> TypeError -> None; when -> False.
    ev = evaluate([mml_rule()], [ctx(num_gpu_blocks=None)])
    assert ev.findings == []
    assert any(e.where == "let cap_tokens" and "TypeError" in e.message for e in ev.errors)
    # max_model_len None: comparing int < None raises inside `when` -> not firing.
    ev = evaluate([mml_rule()], [ctx(max_model_len=None)])
    assert ev.findings == [] and any(e.where == "when" for e in ev.errors)


def test_failing_template_field_renders_na_and_optional_evidence_drops() -> None:
    ev = evaluate([mml_rule()], [ctx(kv_bytes=None, cap_line=None, gmu_needed=None, fp8_ok=False)])
    (f,) = ev.findings
    assert f.summary.endswith("; N/A GiB of KV.")
    assert [e.fact for e in f.evidence] == ["max_model_len"]  # cap_line is None -> item skipped
    assert f.suggested_flags == {"--max-model-len": "3664"}  # None fix values are dropped


def test_format_spec_error_is_na() -> None:
    ev = evaluate([mml_rule()], [ctx(kv_tokens="lots")])  # "lots" < 4096 -> TypeError in when
    assert ev.findings == []
    ev = evaluate([mml_rule()], [ctx(kv_bytes="x")])  # gib("x") -> TypeError -> N/A
    assert "N/A GiB" in ev.findings[0].summary


def test_severity_if_overrides_default() -> None:
    (f,) = evaluate([mml_rule()], [ctx(engine_failed_to_start=True)]).findings
    assert f.severity == "critical"


def test_missing_context_variable_reads_as_none(tmp_path: Path) -> None:
    variables = b06_vars()
    del variables["fp8_ok"]
    ev = evaluate([mml_rule()], [RuleContext("e", variables, {"config", "log"})])
    assert "--kv-cache-dtype" not in ev.findings[0].suggested_flags
    assert any(e.where == "names" and "fp8_ok" in e.message for e in ev.errors)


def test_needs_and_needs_any_skip_with_missing_inputs() -> None:
    rule = mml_rule()
    ev = evaluate([rule], [ctx(inputs={"log"})])
    assert ev.findings == [] and [(s.rule, s.missing, s.engine) for s in ev.skipped] == [
        (MML, ["config"], "llama")
    ]
    ev = evaluate([rule], [ctx(inputs={"config"})])
    assert ev.skipped[0].missing == ["log|metrics"]
    ev = evaluate([rule], [ctx(inputs=set())])
    assert ev.skipped[0].missing == ["config", "log|metrics"]
    assert evaluate([rule], [ctx(inputs={"config", "metrics"})]).findings


def test_per_engine_contexts_and_dedup() -> None:
    rule = mml_rule()
    ev = evaluate(
        [rule],
        [ctx("a"), ctx("b", num_gpu_blocks=4096), ctx("a", engine_failed_to_start=True), ctx(None)],
    )
    assert [(f.engine, f.severity) for f in ev.findings] == [("a", "critical"), (None, "warning")]


def test_thresholds_are_names_and_overridable(tmp_path: Path) -> None:
    rule = load_rule_file(RULES / "preemption-storm.yaml", KNOWN)
    c = RuleContext(
        "e", {"preemptions_per_min": 12.0, "kv_usage_max": 0.97, "max_num_seqs": 256}, {"metrics"}
    )
    (f,) = evaluate([rule], [c]).findings
    assert f.title == "12 preemptions per minute"
    assert f.summary == "Requests are preempted 12.0 times a minute with KV usage up to 97%."
    assert f.suggested_flags == {"--max-num-seqs": "128"}
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("thresholds:\n  preemption-storm:\n    per_min: 20\n")
    rules = apply_user_config([rule], load_user_config(cfg_file))
    assert rules[0].thresholds["per_min"] == 20 and rule.thresholds["per_min"] == 10
    assert evaluate(rules, [c]).findings == []


def test_bool_constant_expressions_and_gpus(tmp_path: Path) -> None:
    rule = load_rule_file(RULES / "idle-preallocation.yaml", KNOWN)
    c = RuleContext(
        None, {"kv_usage": 0.0, "memory_used_fraction": 0.9, "memory_used_bytes": 73393 * 2**20}, set()
    )
    (f,) = evaluate([rule], [c]).findings
    assert f.severity == "info" and f.gpus == [0] and f.suggested_flags == {}
    assert f.summary.startswith("71.67 GiB used")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (23648, "23648"),
        (0.63, "0.63"),
        (0.9, "0.9"),
        (0.934, "0.93"),
        (2.0, "2"),
        ("expandable_segments:True", "expandable_segments:True"),
        ([2, 3], "2,3"),
        (True, ""),
        (None, None),
        (False, None),
        (float("nan"), None),
    ],
)
def test_format_flag_value(value: object, text: str | None) -> None:
    assert format_flag_value(value) == text


# --------------------------------------------------------------------------- user config


def test_user_config_errors_have_lines(tmp_path: Path) -> None:
    rules = load_rules([RULES])
    p = tmp_path / "c.yaml"
    p.write_text("disabled: [idle-preallocation]\nthresholds:\n  preemption-strom:\n    per_min: 5\n")
    with pytest.raises(UserConfigError) as e:
        load_user_config(p, rules)
    assert str(e.value) == f"{p}:3: unknown rule id 'preemption-strom' (did you mean 'preemption-storm'?)"
    p.write_text("thresholds:\n  preemption-storm:\n    per_min: 5\n    per_hour: 1\n")
    with pytest.raises(UserConfigError, match=r":4: rule 'preemption-storm' has no threshold 'per_hour'"):
        load_user_config(p, rules)
    p.write_text("thresholds:\n  preemption-storm:\n    per_min: lots\n")
    with pytest.raises(
        UserConfigError, match=r":3: threshold 'per_min' of rule 'preemption-storm' must be a number"
    ):
        load_user_config(p, rules)
    p.write_text("disabled: [nope]\n")
    with pytest.raises(UserConfigError, match=r":1: unknown rule id 'nope'"):
        load_user_config(p, rules)
    p.write_text("rules: {}\n")
    with pytest.raises(UserConfigError, match=r":1: unknown key 'rules'"):
        load_user_config(p)
    p.write_bytes(b"\x00\x01")
    with pytest.raises(UserConfigError, match="binary"):
        load_user_config(p)
    with pytest.raises(UserConfigError, match="does not exist"):
        load_user_config(tmp_path / "missing.yaml")


def test_user_config_disable_and_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = load_rules([RULES])
    p = tmp_path / "c.yaml"
    p.write_text("disabled: [idle-preallocation]\n")
    monkeypatch.setenv("KVDOCTOR_CONFIG", str(p))
    cfg = load_user_config(None, rules)
    assert cfg.disabled == {"idle-preallocation"} and cfg.origin == str(p)
    assert [r.id for r in apply_user_config(rules, cfg)] == [MML, "preemption-storm"]
    monkeypatch.delenv("KVDOCTOR_CONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/kvdoctor/config.yaml
    assert load_user_config(None).origin is None
    home_cfg = tmp_path / ".config" / "kvdoctor" / "config.yaml"
    home_cfg.parent.mkdir(parents=True)
    home_cfg.write_text("")
    assert load_user_config(None).origin == str(home_cfg)


# --------------------------------------------------------------------------- speed


def test_thirty_copies_of_the_catalogue_rules_all_fire(tmp_path: Path) -> None:
    for src in RULES.glob("*.yaml"):
        for i in range(10):
            stem = f"{src.stem}-{i}"
            text = src.read_text().replace(f"id: {src.stem}", f"id: {stem}")
            (tmp_path / f"{stem}.yaml").write_text(text)
    rules = load_rules([tmp_path], known_names=KNOWN)
    assert len(rules) == 30
    variables = b06_vars(preemptions_per_min=30.0, kv_usage_max=0.99, max_num_seqs=256, kv_usage=0.0)
    variables.update(memory_used_fraction=0.95, memory_used_bytes=70 * 2**30)
    c = RuleContext("e", variables, {"config", "log", "metrics"})
    assert len(evaluate(rules, [c]).findings) == 30  # every rule fires (bench/parsers.py times it)


def test_comprehension_targets_are_not_free_names(tmp_path: Path) -> None:
    p = write_variant(tmp_path, 'gpus: "engine_gpus"', 'gpus: "[g for g in engine_gpus if g >= 0]"')
    rule = load_rule_file(p, KNOWN)
    assert rule.gpus is not None and rule.gpus.names == frozenset({"engine_gpus"})
    (f,) = evaluate([rule], [ctx(engine_gpus=[3, 1])]).findings
    assert f.gpus == [1, 3]
