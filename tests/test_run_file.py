"""One file that reproduces a run: ``plancc apply --config run.yaml`` takes every flag of apply
as a key (flags on the command line override it), is checked with the plans' ``file:line:col``
diagnostics, and every checkpoint holds the settings its run ran with, so ``--config
SAVE/step-N/run.yaml --resume SAVE`` continues that run."""

import inspect
import json
import shutil
from pathlib import Path

import pytest

from .conftest import PLANS, forked_cli


def test_the_schema_names_every_flag_of_apply():
    from plancc.cli import apply
    from plancc.job.run_file import run_schema

    options = set(inspect.signature(apply).parameters) - {"plan_path", "fmt", "ctx", "config"}
    keys = set(run_schema()["properties"]) - {"plancc_run", "plan"}
    assert keys == options, "a flag of apply without a key (or a key without a flag): regenerate schemas/run.schema.json"


# How apply's and logprobs' flags reach RunConfig where a flag is not a field of the same name:
# folded into one field, or the launcher's alone (torch's elastic launcher), or set by the
# launcher itself. A flag or a field outside these, without its partner, fails the test below.
FOLDED = {
    "layout": {"dp", "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "sp"},
    "data_fields": {"text_field", "messages_field", "prompt_field", "completion_field"},
    "lora": {"lora_r", "lora_alpha", "lora_targets"},
    "loggers": {"logger"},
    "timeout_s": {"timeout"},
    "json_output": {"fmt"},
    "plan": {"plan_path"},
}
LAUNCHER_FLAGS = {"nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id",
                  "max_restarts", "config"}
SET_BY_THE_LAUNCHER = {"mode", "inputs", "run_file", "log_dir"}


def test_every_field_of_the_run_config_is_a_flag_and_every_flag_a_field():
    """A new setting is one RunConfig field plus its option: a field no command's flag sets, or a
    flag that reaches no field, is caught here (as --max-grad-norm was: a field without a flag)."""
    from plancc.cli import apply, logprobs
    from plancc.job.config import RunConfig

    flags = (set(inspect.signature(apply).parameters) | set(inspect.signature(logprobs).parameters)) - {"ctx"}
    fields = RunConfig.flag_names()
    folded = {flag: field for field, group in FOLDED.items() for flag in group}
    reached = {folded.get(flag, flag) for flag in flags - LAUNCHER_FLAGS}
    assert reached - fields == set(), "flags that reach no RunConfig field"
    assert fields - reached - SET_BY_THE_LAUNCHER == set(), "RunConfig fields that no flag sets"


def test_both_run_schemas_are_what_apply_s_flags_make():
    """One definition: the packaged schema and the editors' copy are generated from apply's options
    (types and bounds); `python -m plancc.cli.run_schema` rewrites them."""
    from plancc.cli.run_schema import SCHEMA_FILES, schema_text

    from .conftest import ROOT

    for name in SCHEMA_FILES:
        assert (ROOT / name).read_text() == schema_text(), f"{name}: run `python -m plancc.cli.run_schema`"


@pytest.mark.parametrize("key,value,bound", [
    ("steps", -5, ">= 0"), ("keep", -1, ">= 0"), ("save_every", 0, ">= 1"), ("log_every", 0, ">= 1"),
    ("timeout", 1, ">= 10"), ("master_port", 0, ">= 1"), ("batch_size", 0, ">= 1"),
    ("micro_batch_size", 0, ">= 1"), ("seq_len", 1, ">= 2"), ("master_port", 70000, "<= 65535"),
])
def test_a_run_file_is_held_to_the_flags_bounds_before_launch(cli, tmp_path, key, value, bound):
    run = tmp_path / "run.yaml"
    run.write_text(f"plancc_run: 1\nplan: {PLANS / 'qwen3.yaml'}\n{key}: {value}\n")
    code, out, err = cli("apply", "--config", run)
    assert code == 1 and "plancc apply:" not in out  # no worker started
    assert f"{run}:3:{len(key) + 3}: error: {key} is {value}; allowed: {bound}" in err and "[run-file]" in err


def test_a_bad_run_file_is_told_at_its_lines_before_anything_starts(cli, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(f"plancc_run: 1\nplan: {PLANS / 'qwen3.yaml'}\nstep: 4\ntp: two\n")
    code, out, err = cli("apply", "--config", run)
    assert code == 1 and "plancc apply:" not in out
    assert f"{run}:3:1: error: unknown key 'step'" in err and "did you mean 'steps'?" in err
    assert f"{run}:4:5: error: tp is 'two'; allowed: integer [run-file]" in err
    code, out, err = cli("validate", run)
    assert code == 1 and "[run-file]" in err


def test_validate_checks_a_run_files_plan_at_its_model_and_layout(cli, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(f"plancc_run: 1\nplan: {PLANS / 'qwen3.yaml'}\nmodel: qwen3-0.6b\ntp: 3\n")
    code, out, err = cli("validate", run)
    assert code == 1 and "tp=3 does not divide" in err  # the file's layout, the file's model


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoints_run_file_resumes_the_run_it_was_saved_by(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file's relative paths, from where the command runs
    (tmp_path / "run.yaml").write_text(
        f"plancc_run: 1\nplan: {PLANS / 'qwen3.yaml'}\nsteps: 9\nlr: 0.002\ntp: 2\nnproc_per_node: 2\n"
        "save: ck\nsave_every: 2\nmetrics: straight.jsonl\n"
    )
    code, out, err = forked_cli("apply", "--config", "run.yaml", "--steps", 4)  # the flag wins over the file
    assert code == 0, err
    straight = [json.loads(line) for line in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert [row["step"] for row in straight] == [1, 2, 3, 4]
    saved = (tmp_path / "ck" / "step-000002" / "run.yaml").read_text()
    assert "steps: 4" in saved and "lr: 0.002" in saved and "tp: 2" in saved
    shutil.rmtree(tmp_path / "ck" / "step-000004")  # stopped after step 2
    (tmp_path / "ck" / "latest").unlink()
    code, out, err = forked_cli("apply", "--config", "ck/step-000002/run.yaml", "--resume", "ck",
                                "--metrics", "resumed.jsonl")
    assert code == 0, err
    assert "resumed from step 2" in out and "note:" not in out  # the same settings: nothing changed
    resumed = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight[2:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[2:]], abs=1e-6)


def test_the_readmes_run_file_is_a_valid_run_file(tmp_path, monkeypatch):
    """The run file "Your model, your data" shows (every flag of issue 76 in it) passes the
    run file's own checks: a key renamed or a value out of bounds fails here, not for a reader."""
    from plancc.job.run_file import read_run_file

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    block = text.split("```yaml\n# sft.yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "sft.yaml").write_text(block)
    monkeypatch.chdir(root)  # its plan is plans/qwen3.yaml
    settings = read_run_file(tmp_path / "sft.yaml")
    for key in ("epochs", "eval_data", "eval_every", "lr_schedule", "warmup_steps", "min_lr", "weight_decay", "keep",
                "logger", "dp_replicate", "cpu_offload"):
        assert key in settings, key
