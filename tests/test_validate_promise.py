"""validate's promise: a plan it passes trains exactly, a plan it refuses could not have, and the
refusal stands at the rule to blame with every problem in one report.

The mutations are bench/plan_mutations.py's: each rule of every shipped plan changed, one at a
time, to each style its modules take (and removed, and its ``optional`` flipped; the TP rules at
--tp 2 and at --tp 2 --sp, the SP overlay's rules with --sp). Their ground truth -- one step of
the mutated plan at tp=2 against the unsharded model, with plancc's checks switched off -- is
recorded in docs/measurements/plan_mutations.json by the bench (it depends on the plan alone,
never on the checks); a sample is re-run here live."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import plancc

from .conftest import PLANS, ROOT

_spec = importlib.util.spec_from_file_location("plan_mutations", ROOT / "bench" / "plan_mutations.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["plan_mutations"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

QWEN3 = (PLANS / "qwen3.yaml").read_text()


def _sample() -> list:
    """qwen3's mutations whole (the issue's 38 among them), every 4th of the other plans'."""
    picked = []
    for plan in bench.TINY:
        found = list(bench.mutations(plan))
        picked += found if plan == "qwen3" else found[::4]
    return picked


SAMPLE = _sample()


def test_validate_agrees_with_the_recorded_ground_truth_on_every_sampled_mutation(tmp_path):
    truths = json.loads(bench.CACHE.read_text())
    wrong = []
    for i, m in enumerate(SAMPLE):
        folder = tmp_path / str(i)
        folder.mkdir()
        verdict = bench.validate_verdict(m, bench.write_mutated(m, folder))
        signature = verdict["signature"]
        exact = False if signature.startswith(("unreadable", "unbound")) else truths[signature]["exact"]
        if verdict["refused"] == exact:  # refused yet exact, or passed yet not exact
            wrong.append((m.key, "false error" if exact else "false ok", verdict["errors"]))
    assert len(SAMPLE) > 500 and wrong == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recorded_ground_truth_holds_when_run_again(tmp_path):
    """Two mutations' ground truth re-run (one 2-rank launch): the cache is what a run finds."""
    keys = {
        "qwen3|tensor_parallel|model.layers.*.mlp.up_proj|style:rowwise|tp",
        "qwen3|tensor_parallel|lm_head|style:colwise_rep|tp",
        "qwen3|sequence_parallel|model.norm|removed|sp",
    }
    picked = [m for m in SAMPLE if m.key in keys]
    batch = []
    for i, m in enumerate(picked):
        (tmp_path / str(i)).mkdir()
        batch.append((m, bench.write_mutated(m, tmp_path / str(i))))
    found = bench.ground_truths(batch)
    truths = json.loads(bench.CACHE.read_text())
    for (m, path), truth in zip(batch, found):
        assert truth["exact"] == truths[bench.validate_verdict(m, path)["signature"]]["exact"], m.key
    assert [t["exact"] for t in found] == [False, True, False]  # the SP rule left out trains wrong silently


def _validate(cli, path, *args):
    code, out, err = cli("validate", path, *args)
    return code, out, err, [line for line in err.splitlines() if ": error:" in line]


def _line(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if fragment in line)


def test_a_rowwise_up_proj_is_refused_by_plain_validate_at_its_own_rule(cli, write_plan):
    """The issue's first edit: validate (no --model, no --tp) said ok and the launch crashed."""
    text = QWEN3.replace("mlp.up_proj: colwise", "mlp.up_proj: rowwise")
    path = write_plan(text)
    code, _, err, errors = _validate(cli, path)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"{path}:{_line(text, 'mlp.up_proj: rowwise')}:3: error:") and "[mixed-shards]" in err
    assert "down_proj" in errors[0] and "fix: make 'model.layers.*.mlp.up_proj: colwise'" in err


def test_the_culprit_is_the_rule_whose_change_alone_fixes_it(cli, write_plan):
    """o_proj: colwise once blamed q_proj (line 6, "make q_proj colwise_rep"): o_proj is the mistake."""
    text = QWEN3.replace("self_attn.o_proj: rowwise\n", "self_attn.o_proj: colwise\n")
    code, _, err, errors = _validate(cli, write_plan(text), "--model", "tiny-qwen3", "--tp", "2")
    assert code == 1 and len(errors) == 1 and "[layout-pairing]" in errors[0]
    assert f":{_line(text, 'self_attn.o_proj: colwise')}:3: error:" in errors[0]
    assert "fix: make 'model.layers.*.self_attn.o_proj: rowwise'" in err
    # a rule missing altogether is named as the rule to add
    text = QWEN3.replace("  model.layers.*.self_attn.v_proj: colwise\n", "")
    code, _, err, errors = _validate(cli, write_plan(text), "--model", "tiny-qwen3", "--tp", "2")
    assert "fix: add 'model.layers.*.self_attn.v_proj: colwise'" in err


def test_rules_that_each_fix_it_alone_are_all_named(write_plan):
    """gate_proj colwise_rep (whole) beside a colwise up_proj, read by a rowwise_rep down_proj: the
    one change that fixes it alone is up_proj's; where several would, each is named."""
    from plancc.checks import layout_flow

    text = QWEN3.replace("mlp.gate_proj: colwise", "mlp.gate_proj: colwise_rep").replace(
        "mlp.down_proj: rowwise\n", "mlp.down_proj: rowwise_rep\n"
    )
    (found,) = [d for d in plancc.check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2) if d.is_error]
    assert found.rule == "mixed-shards" and found.line == _line(text, "mlp.up_proj: colwise")
    assert found.fix == "make 'model.layers.*.mlp.up_proj: colwise_rep'"
    # two equally small fixes: both named
    fixes = [("model.layers.*.mlp.up_proj", "colwise_rep"), ("model.layers.*.mlp.gate_proj", "colwise")]
    said = layout_flow.fix_text(lambda glob: True, fixes)
    assert said == (
        "make 'model.layers.*.mlp.up_proj: colwise_rep' or make 'model.layers.*.mlp.gate_proj: colwise' "
        "(each alone fixes it)"
    )


def test_every_problem_of_a_plan_is_in_one_report_each_at_its_line(cli, write_plan):
    """A style typo once hid the glob typo, which hid the model's problems: three rounds."""
    text = (
        QWEN3.replace("mlp.up_proj: colwise", "mlp.up_proj: colwsie")
        .replace("mlp.gate_proj: colwise", "mlp.gate_projj: colwise")
        .replace("self_attn.o_proj: rowwise\n", "self_attn.o_proj: colwise\n")
    )
    code, _, err, errors = _validate(cli, write_plan(text), "--model", "tiny-qwen3", "--tp", "16")
    assert code == 1
    found = {(line.split(":")[1], line.rpartition("[")[2].rstrip("]")) for line in errors}
    assert found == {
        (str(_line(text, "mlp.up_proj: colwsie")), "unknown-style"),
        (str(_line(text, "mlp.gate_projj")), "glob-no-match"),
        (str(_line(text, "self_attn.o_proj: colwise")), "layout-pairing"),
        (str(_line(text, "self_attn.q_proj: colwise")), "attention-heads-divisible"),
        (str(_line(text, "self_attn.k_proj: colwise")), "kv-heads-divisible"),
    }
    # what follows from the two typos alone (down_proj reading gate/up left whole) is not reported
    assert "[mixed-shards]" not in err and f":{_line(text, 'mlp.down_proj')}:" not in err


def test_a_legal_but_slower_pair_is_a_warning_naming_the_cheaper_plan(write_plan):
    llama = (PLANS / "llama.yaml").read_text()
    text = llama
    for proj in ("q_proj", "k_proj", "v_proj"):
        text = text.replace(f"self_attn.{proj}: colwise", f"self_attn.{proj}: colwise_rep")
    text = text.replace("self_attn.o_proj: rowwise\n", "self_attn.o_proj: rowwise_rep\n")
    found = plancc.check_plan(plancc.load_plan(write_plan(text)), "tiny-llama", tp=2)
    assert not [d for d in found if d.is_error]
    (warning,) = [d for d in found if d.rule == "redundant-gather"]
    assert warning.line == _line(text, "self_attn.o_proj: rowwise_rep")
    assert "'model.layers.*.self_attn.q_proj: colwise'" in warning.fix and "o_proj: rowwise'" in warning.fix


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_launch_that_fails_at_run_time_prints_the_diagnostic_alone(tmp_path):
    """Past the checks (the bench's unchecked launch), a layout failure in the ranks is one
    diagnostic: no [rankN]:E lines of fake-tensor tracebacks before it."""
    text = QWEN3.replace("self_attn.o_proj: rowwise\n", "self_attn.o_proj: colwise\n")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_mutations.py"), "--unchecked", "apply", str(path),
         "--model", "tiny-qwen3", "--nproc-per-node", "2", "--tp", "2", "--steps", "1", "--verify",
         "--timeout", "60"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "[run-time-layout]" in done.stderr and "o_proj" in done.stderr
    assert "[rank" not in done.stderr and "fake_tensor" not in done.stderr and "Traceback" not in done.stderr
