"""Round 3, nothing lost: an output never written over an input or another output, an export
that removes nothing it did not write, a learning rate that cannot produce non-finite weights,
refused before any process starts (one diagnostic, exit 2, every file as it was)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 9 + i))}) + "\n" for i in range(4)))
    return path


def refused(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    assert "[path-overlap]" in err and "fix:" in err and "Traceback" not in err
    assert "plancc apply:" not in out and "plancc logprobs:" not in out  # no worker started
    return err


def test_metrics_or_out_naming_the_data_or_the_plan_is_refused_and_the_file_kept(cli, tmp_path, data):
    before = data.read_bytes()
    plan = tmp_path / "plan.yaml"
    plan.write_text(QWEN3.read_text())
    err = refused(cli, "apply", plan, "--data", data, "--metrics", data)
    assert f"--metrics {data} names the same file as --data" in err
    refused(cli, "apply", plan, "--data", data, "--metrics", plan)
    refused(cli, "logprobs", plan, "--data", data, "--out", data)
    refused(cli, "apply", plan, "--data", data, "--tensorboard", plan)
    assert data.read_bytes() == before and plan.read_text() == QWEN3.read_text()


def test_another_spelling_a_symbolic_link_or_a_hard_link_of_an_input_is_refused(cli, tmp_path, data):
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)
    hard = tmp_path / "hard.jsonl"
    os.link(data, hard)
    spelled = tmp_path / "sub" / ".." / data.name
    (tmp_path / "sub").mkdir()
    for out in (link, hard, spelled):
        refused(cli, "logprobs", QWEN3, "--data", data, "--out", out)


def test_two_outputs_on_one_path_are_refused(cli, tmp_path, data):
    out = tmp_path / "metrics.jsonl"
    refused(cli, "apply", QWEN3, "--data", data, "--metrics", out, "--tensorboard", out)
    refused(cli, "apply", QWEN3, "--data", data, "--save", tmp_path / "x", "--export-hf", tmp_path / "x")


def test_an_export_holding_or_inside_the_runs_checkpoints_data_or_model_is_refused(cli, tmp_path, data):
    P = tmp_path / "P"
    (P / "ck").mkdir(parents=True)
    (P / "config.json").write_text("{}")  # an earlier export
    before = digest(tmp_path)
    err = refused(cli, "apply", QWEN3, "--resume", P / "ck", "--save", P / "ck", "--export-hf", P)
    assert "is a folder that holds" in err
    refused(cli, "apply", QWEN3, "--save", P / "ck", "--export-hf", P)
    refused(cli, "apply", QWEN3, "--data", data, "--export-hf", tmp_path)  # the data inside
    refused(cli, "apply", QWEN3, "--save", tmp_path / "ck", "--export-hf", tmp_path / "ck" / "hf")  # inside
    assert digest(tmp_path) == before


def test_a_run_may_resume_from_and_save_into_its_own_checkpoint_folder():
    from plancc.paths import RunPath, overlaps

    paths = [RunPath(flag="--resume", path="ck/step-000002", output=False), RunPath(flag="--save", path="ck", output=True)]
    assert overlaps(paths, allowed=[("--save", "--resume")]) == []
    assert overlaps(paths) == []  # a checkpoint folder is no enclosing export: resuming inside it is reading


def test_plot_never_draws_over_its_metrics_file(cli, tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    before = metrics.read_bytes()
    code, _, err = cli("plot", metrics, "-o", metrics)
    assert code == 2 and "[path-overlap]" in err and metrics.read_bytes() == before


@pytest.mark.parametrize("lr", ["inf", "nan", "-1e-3", "-inf"])
def test_a_learning_rate_that_is_not_finite_or_is_negative_is_a_usage_error_before_launch(cli, tmp_path, lr):
    code, out, err = cli("apply", QWEN3, "--lr", lr, "--save", tmp_path / "ck")
    assert code == 2 and "--lr" in err and "[usage]" in err and "fix:" in err
    assert "plancc apply:" not in out and not (tmp_path / "ck").exists()


def test_weights_that_are_not_finite_are_never_saved_or_exported(tmp_path):
    from plancc.errors import PlanError
    from plancc.runtime.hf_weights import refuse_non_finite_weights

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    refuse_non_finite_weights(model, what="saving")  # finite: nothing to say
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    with pytest.raises(PlanError) as caught:
        refuse_non_finite_weights(model, what="saving step 1")
    (problem,) = caught.value.diagnostics
    assert problem.rule == "non-finite" and "1.weight" in problem.message and "saving step 1" in problem.message


# --------------------------------------------------------------------------- the export itself
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_export_keeps_every_file_it_did_not_write_and_removes_only_its_own_stale_ones(tmp_path):
    """An earlier sharded export by plancc (its files listed), a user's notes and a stray index
    from elsewhere: the new export removes the earlier export's extra shards, moves the stray
    weight files aside (kept), and leaves the notes alone."""
    from transformers import AutoModelForCausalLM

    export = tmp_path / "E"
    export.mkdir()
    # an earlier sharded export by plancc, its files listed; a user's notes; a stray index
    earlier = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json"]
    for name in earlier:
        (export / name).write_text("{}" if name.endswith(".json") else "old shard")
    (export / ".plancc-export.json").write_text(json.dumps({"files": earlier}))
    (export / "NOTES.md").write_text("my notes\n")
    (export / "pytorch_model.bin.index.json").write_text("{}")
    code, _, err = forked_cli("apply", QWEN3, "--steps", 1, "--export-hf", export, "--nproc-per-node", 2)
    assert code == 0, err
    manifest = json.loads((export / ".plancc-export.json").read_text())
    assert "model.safetensors" in manifest["files"] and "config.json" in manifest["files"]
    assert (export / "NOTES.md").read_text() == "my notes\n"
    for stale in earlier[1:]:  # plancc's own, not written again: removed
        assert not (export / stale).exists(), stale
    (aside,) = export.glob(".plancc-superseded-*")
    assert (aside / "pytorch_model.bin.index.json").read_text() == "{}"  # not plancc's: moved, kept
    assert sorted(p.name for p in export.glob("*.safetensors")) == ["model.safetensors"]
    assert AutoModelForCausalLM.from_pretrained(export).config.vocab_size == 256


# --------------------------------------------------------------------------- uneven dp slices
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lines,batch", [(9, 2), (1, 4)], ids=["9-lines", "1-line"])
def test_logprobs_of_a_row_count_dp_does_not_divide_gives_every_line_in_order(tmp_path, lines, batch):
    """At dp=2, 9 lines in batches of 2 give rank 0 three forward passes and rank 1 two; one line
    gives rank 1 none: every rank still runs as many (FSDP gathers in each), and the output has
    one line per input line, in order, each the unsharded model's log-probs (--verify)."""
    data = tmp_path / "rows.jsonl"
    seqs = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(lines)]
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    out = tmp_path / "lp.jsonl"
    code, stdout, err = forked_cli("logprobs", QWEN3, "--model", "tiny-qwen3", "--nproc-per-node", 2, "--data", data,
                                "--out", out, "--batch-size", batch, "--verify")
    assert code == 0, err
    assert "verify: max |logprob diff|" in stdout and "OK" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["logprobs"]) for r in rows] == [len(s) for s in seqs]


def test_a_global_batch_dp_does_not_divide_is_refused_before_launch_not_trained_in_part(cli):
    """At dp=2, --batch-size 3 gave each rank one row: the third row of every step was never
    trained, and the run said nothing."""
    code, out, err = cli("apply", QWEN3, "--batch-size", 3, "--nproc-per-node", 2)
    assert code == 2 and "--batch-size 3 does not split over dp=2" in err and "use a multiple of 2: 2 or 4" in err
    assert "plancc apply:" not in out


@pytest.mark.parametrize("args,said", [
    (("--seed", 2**70), "--seed 1180591620717411303424 is not a 64-bit seed"),
    (("--timeout", 10**12), "is beyond the longest wait plancc sets"),
    (("--seq-len", 4096), "--seq-len 4096 is beyond the model's max_position_embeddings (512)"),
])
def test_a_flag_out_of_range_is_a_usage_error_before_launch(cli, args, said):
    code, out, err = cli("apply", QWEN3, *args)
    assert code == 2 and said in err and "[usage]" in err and "fix:" in err and "plancc apply:" not in out


@pytest.mark.parametrize("temperature", ["inf", "nan"])
def test_a_temperature_that_is_not_finite_is_a_usage_error_before_launch(cli, data, temperature):
    """inf passed the flag's range check and gave uniform log-probs with exit 0; nan the range
    check itself refuses (click's usage error)."""
    code, out, err = cli("logprobs", QWEN3, "--data", data, "--temperature", temperature)
    assert code == 2 and "temperature" in err.lower() and "plancc logprobs:" not in out
    if temperature == "inf":
        assert "is not a sampling temperature" in err


def test_tensorboard_naming_a_file_is_refused_before_launch(cli, tmp_path):
    afile = tmp_path / "events"
    afile.write_text("mine\n")
    code, out, err = cli("apply", QWEN3, "--tensorboard", afile)
    assert code == 1 and "--tensorboard names a file" in err and "[output]" in err and afile.read_text() == "mine\n"


@pytest.mark.parametrize("out,said,code", [
    ("plot.txt", "cannot draw a '.txt' file", 2),
    ("missing/plot.png", "which does not exist", 2),
    ("/dev/full", "cannot draw a file without an extension", 2),
])
def test_plot_refuses_an_output_it_cannot_write(cli, tmp_path, out, said, code):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2)))
    target = out if out.startswith("/") else tmp_path / out
    got, _, err = cli("plot", metrics, "-o", target)
    assert got == code and said in err and "Traceback" not in err


def test_plot_reports_a_failed_write_as_one_line(cli, tmp_path):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": float("nan") if s == 2 else 1.0}) + "\n" for s in (1, 2, 3)))
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "plot.png").mkdir()  # a folder where the file should go: the write fails
    code, _, err = cli("plot", metrics, "-o", folder / "plot.png")
    assert code == 1 and "cannot write the plot" in err and "Traceback" not in err
