"""Every class of bad plan input is a diagnostic with a rule id and the right line; the CLI
exits 1 for plan problems and 2 for usage errors, and never prints a traceback."""

import json
import subprocess
import sys

import pytest

import plancc
from plancc import PlanError

GOOD = """\
plancc: 1
name: tiny
architectures: [Qwen3ForCausalLM]
tensor_parallel:
  model.layers.*.self_attn.q_proj: colwise
  model.layers.*.self_attn.o_proj: rowwise
"""


def rules_and_lines(path):
    with pytest.raises(PlanError) as info:
        plancc.load_plan(path)
    return [(d.rule, d.line) for d in info.value.diagnostics]


CASES = {
    "yaml-syntax": ("plancc: 1\nname: [unclosed\narchitectures: []\n", "yaml-syntax", 2),  # at the '[', not
    # where the parser gave up
    "unclosed-quote": ('plancc: 1\nname: "unclosed\narchitectures: []\n', "yaml-syntax", 2),
    "bad-indent": ("plancc: 1\nname: x\n  architectures: [A]\n", "yaml-syntax", 3),
    "empty": ("", "empty-plan", 1),
    "comment-only": ("# nothing here\n", "empty-plan", 1),
    "non-mapping-root": ("- colwise\n- rowwise\n", "wrong-type", 1),
    "duplicate-key": (GOOD + "  model.layers.*.self_attn.q_proj: rowwise\n", "duplicate-key", 7),
    "unknown-top-key": (GOOD + "tensor_paralel: {}\n", "unknown-key", 7),
    "unknown-style": (GOOD.replace("q_proj: colwise", "q_proj: colwsie"), "unknown-style", 5),
    "hf-style-not-supported": (GOOD.replace("q_proj: colwise", "q_proj: all_reduce"), "unsupported-style", 5),
    "wrong-type-architectures": (GOOD.replace("[Qwen3ForCausalLM]", "Qwen3ForCausalLM"), "wrong-type", 3),
    "missing-key": (GOOD.replace("name: tiny\n", ""), "missing-key", 1),
    "unsupported-version": (GOOD.replace("plancc: 1", "plancc: 2"), "unsupported-version", 1),
    "invalid-glob": (GOOD.replace("model.layers.*.self_attn.o_proj", "model..o_proj"), "invalid-glob", 6),
    "invalid-glob-space": (GOOD.replace("model.layers.*.self_attn.o_proj", "'model.layers.* o_proj'"),
                           "invalid-glob", 6),
    "unknown-key-in-style-mapping": (
        GOOD.replace("q_proj: colwise", "q_proj: {style: colwise, optinal: true}"), "unknown-key", 5),
    "bad-layout": (GOOD.replace("q_proj: colwise", "q_proj: {style: colwise, output_layouts: shard}"),
                   "invalid-layout", 5),
    "override-not-taken": (GOOD.replace("q_proj: colwise", "q_proj: {style: qk_norm, output_layouts: shard(1)}"),
                           "style-override", 5),
    "integer-key": (GOOD + "  3: colwise\n", "yaml-key-type", 7),
    "reshard-not-a-bool": (GOOD + "fsdp:\n  units: [model.layers.*]\n  reshard_after_forward: sometimes\n",
                           "wrong-type", 9),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_plan_reports_rule_and_line(case, write_plan):
    text, rule, line = CASES[case]
    found = rules_and_lines(write_plan(text))
    assert (rule, line) in found, found


def test_schema_errors_are_all_reported_at_once(write_plan):
    text = GOOD.replace("plancc: 1", "plancc: 7").replace("q_proj: colwise", "q_proj: colwize") + "extra: 1\n"
    found = {r for r, _ in rules_and_lines(write_plan(text))}
    assert {"unsupported-version", "unknown-style", "unknown-key"} <= found


def test_unknown_key_suggests_the_closest(write_plan):
    with pytest.raises(PlanError) as info:
        plancc.load_plan(write_plan(GOOD + "sequence_paralel: {}\n"))
    (diag,) = info.value.diagnostics
    assert "sequence_parallel" in diag.fix


def test_unknown_style_names_closest_styles(write_plan):
    with pytest.raises(PlanError) as info:
        plancc.load_plan(write_plan(GOOD.replace("o_proj: rowwise", "o_proj: rowwise_sq")))
    (diag,) = info.value.diagnostics
    assert "rowwise_seq" in diag.message and diag.column == 36


def test_missing_file_is_a_diagnostic():
    with pytest.raises(PlanError) as info:
        plancc.load_plan("plans/does-not-exist.yaml")
    assert info.value.diagnostics[0].rule == "file-not-found"


def test_non_utf8_bytes_point_at_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"plancc: 1\nname: caf\xe9\n")
    assert rules_and_lines(path) == [("yaml-syntax", 2)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_exits_1_with_file_line_col(case, write_plan, cli):
    text, rule, line = CASES[case]
    path = write_plan(text)
    code, out, err = cli("validate", path, "--model", "tiny-qwen3")
    assert code == 1
    assert f"{path}:{line}:" in err and f"[{rule}]" in err
    assert "fix:" in err
    assert "Traceback" not in out + err


def test_cli_json_format_has_the_same_diagnostics(write_plan, cli):
    path = write_plan(CASES["unknown-style"][0])
    code, out, _ = cli("validate", path, "--model", "tiny-qwen3", "--format", "json")
    assert code == 1
    # one report: the plan's other problem (k/v left whole before a rowwise o_proj) comes with it
    (diag,) = [d for d in json.loads(out)["diagnostics"] if d["line"] == 5]
    assert diag["rule"] == "unknown-style" and diag["path"] == str(path)
    assert set(diag) >= {"path", "line", "column", "rule", "message", "fix", "severity"}


def test_cli_usage_errors_exit_2(cli, write_plan):
    assert cli("validate", "no/such/plan.yaml")[0] == 2
    assert cli("validate", write_plan(GOOD), "--model", "no-such-model")[0] == 2
    assert cli("validate", write_plan(GOOD), "--tp", "zero")[0] == 2
    assert cli("validate")[0] == 2


def test_real_entry_point_prints_no_traceback(write_plan):
    path = write_plan(CASES["yaml-syntax"][0])
    proc = subprocess.run([sys.executable, "-m", "plancc.cli", "validate", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"{path}:2:7:" in proc.stderr  # at the unclosed "["
