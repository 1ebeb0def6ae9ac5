"""The run users configure (issue 76): --data read shuffled epoch by epoch, the order the same
after a resume; warmup, --lr-schedule and --min-lr; weight decay on the matrices alone, the
same in --verify's unsharded model."""

from __future__ import annotations

import json
from pathlib import Path
import math

import pytest
import torch

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


# --- data order ------------------------------------------------------------------------------


def test_every_epoch_reads_every_row_once_in_an_order_drawn_from_the_seed():
    from plancc.job.data_order import RowOrder

    order = RowOrder(rows=10, seed=3)
    epochs = [[order.row(e * 10 + i) for i in range(10)] for e in range(3)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # anew each epoch
    assert epochs[0] != list(range(10))
    assert [RowOrder(rows=10, seed=3).row(i) for i in range(30)] == sum(epochs, [])  # a function of (seed, position)
    assert [RowOrder(rows=10, seed=4).row(i) for i in range(10)] != epochs[0]
    # a step's batch is positions step*B ... of that stream: it crosses an epoch's end whole
    assert order.batch(3, 4) == [epochs[1][2], epochs[1][3], epochs[1][4], epochs[1][5]]
    assert order.batch(2, 4) == [*epochs[0][8:], *epochs[1][:2]]


def test_no_shuffle_reads_the_file_in_order_cycling():
    from plancc.job.data_order import RowOrder

    assert RowOrder(rows=3, shuffle=False).batch(1, 4) == [1, 2, 0, 1]


@pytest.mark.parametrize("epochs,rows,batch,steps", [(1, 10, 4, 3), (2, 10, 4, 5), (0.5, 10, 4, 2), (3, 8, 4, 6)])
def test_epochs_are_whole_steps_that_cover_the_passes(epochs, rows, batch, steps):
    from plancc.job.data_order import steps_for_epochs

    assert steps_for_epochs(epochs, rows=rows, batch_size=batch) == steps


def test_epochs_and_steps_together_or_without_data_are_usage_errors(cli, tmp_path):
    code, _, err = cli("apply", QWEN3, "--epochs", 2)
    assert code == 2 and "--epochs 2 without --data" in err
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    code, _, err = cli("apply", QWEN3, "--data", data, "--epochs", 2, "--steps", 3)
    assert code == 2 and "--epochs 2 with --steps" in err


# --- learning rate ---------------------------------------------------------------------------


def test_each_schedule_warms_up_then_ends_at_min_lr():
    from plancc.job.lr_schedule import lr_factor

    def course(schedule: str) -> list[float]:
        return [lr_factor(s, schedule=schedule, warmup=2, total=12, min_ratio=0.05) for s in range(13)]

    for schedule in ("constant", "linear", "cosine", "wsd"):
        rates = course(schedule)
        assert rates[:2] == pytest.approx([1 / 3, 2 / 3]) and rates[2] == 1.0
        assert rates[-1] == pytest.approx(1.0 if schedule == "constant" else 0.05)
        assert all(a >= b for a, b in zip(rates[2:], rates[3:], strict=False))  # never up after warmup
    assert course("linear")[7] == pytest.approx(1 - 0.95 * 0.5)
    assert course("cosine")[7] == pytest.approx(0.05 + 0.95 * 0.5)
    # wsd: stable for 80% of the 10 steps after warmup, then linear to the minimum
    assert course("wsd")[2:10] == [1.0] * 8 and course("wsd")[11] == pytest.approx(1 - 0.95 * 0.5)


# --- weight decay ----------------------------------------------------------------------------


def test_weight_decay_reaches_matrices_not_norms_biases_or_embeddings():
    from transformers import AutoModelForCausalLM

    from plancc.engine.param_groups import decay_split, trained_parameters
    from plancc.models import load_config

    config = load_config("tiny-qwen2")  # biases on q/k/v, an untied head
    model = AutoModelForCausalLM.from_config(config)
    decay, rest = trained_parameters(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    excluded = {names[id(p)] for p in rest["params"]}
    assert (decay["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
    assert "model.embed_tokens.weight" in excluded and "lm_head.weight" in decayed
    assert all(n.endswith((".bias", "norm.weight")) or n == "model.embed_tokens.weight" for n in excluded)
    assert all(p.ndim == 2 for p in decay["params"]) and "model.layers.0.self_attn.q_proj.weight" in decayed
    assert decayed | excluded == set(names.values())
    split = decay_split(model)
    assert (split.decayed, split.excluded) == (len(decayed), len(excluded))
    assert trained_parameters(model, None) == list(model.parameters())  # None: the optimizer's own default


# --- through apply ---------------------------------------------------------------------------


def losses(stdout: str) -> list[float]:
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def rates(stdout: str) -> list[float]:
    return [float(line.split(" lr ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shuffled_run_of_epochs_resumed_is_the_uninterrupted_run(tmp_path):
    """Two epochs of 6 rows, 4 a step (3 steps), shuffled, a linear decay and weight decay at dp2: resumed
    from step 1 at tp2, steps 2 and 3 read the rows and rates the uninterrupted run did."""
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": [(7 * i + j) % 200 for j in range(5 + i)]}) + "\n" for i in range(6))
    )
    flags = (
        "--data",
        data,
        "--epochs",
        2,
        "--lr-schedule",
        "linear",
        "--warmup-steps",
        0,
        "--min-lr",
        "1e-4",
        "--weight-decay",
        0.1,
        "--seed",
        5,
    )
    code, straight, err = forked_cli("apply", QWEN3, *flags, "--save", tmp_path / "ck", "--save-every", 1)
    assert code == 0, err
    assert "an epoch is 6 rows (1.5 steps), 3 steps are --epochs 2" in straight
    assert "shuffled by --seed 5, anew each epoch" in straight
    assert (
        "then linear to 0.0001 at step 3" in straight
        and "weight decay 0.1 on" in straight
        and "norm, bias and embedding tensors" in straight
    )
    assert rates(straight) == pytest.approx([1e-3, 7e-4, 4e-4], rel=1e-2)  # to 1e-4 at step 3, after the last
    code, resumed, err = forked_cli("apply", QWEN3, *flags, "--tp", 2, "--resume", tmp_path / "ck" / "step-000001")
    assert code == 0, err
    assert "note:" not in resumed  # the same rows, schedule and decay
    assert losses(resumed) == pytest.approx(losses(straight)[1:], rel=1e-5)
    assert rates(resumed) == pytest.approx(rates(straight)[1:], rel=1e-3)
    # another seed reads other rows: the resume says so
    code, other, err = forked_cli("apply", QWEN3, *flags[:-1], 6, "--resume", tmp_path / "ck" / "step-000001")
    assert code == 0, err
    assert "--seed 5 -> 6" in other and "train on other batches" in other


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_holds_with_weight_decay_the_unsharded_model_decays_the_same_tensors():
    """And with --max-grad-norm: a clip far below the gradients' norm scales every gradient of the
    sharded run and of the unsharded reference alike (a clip the reference did not apply would
    fail the gradient comparison by the clip's factor)."""
    code, out, err = forked_cli(
        "apply", QWEN3, "--tp", 2, "--verify", "--steps", 2, "--weight-decay", 0.5, "--lr", "1e-2",
        "--max-grad-norm", 0.01,
    )
    assert code == 0, err + out
    assert "verify: OK" in out
    (after,) = [float(line.split("|diff|")[1]) for line in out.splitlines() if "loss after step 2" in line]
    assert math.isfinite(after) and after < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_metrics_after_a_resume_continue_the_file_one_line_a_step(tmp_path):
    """The run went on to step 3 past its checkpoint of step 1 and was killed mid-line: the
    resume from step 1 drops steps 2-3 and the cut line, then writes its own steps 2-3."""
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    code, _, err = forked_cli("apply", QWEN3, "--steps", 3, "--save", ck, "--save-every", 1, "--metrics", metrics)
    assert code == 0, err
    with open(metrics, "a") as f:
        f.write('{"step": 4, "lo')  # killed while writing
    code, _, err = forked_cli("apply", QWEN3, "--steps", 3, "--resume", ck / "step-000001", "--metrics", metrics)
    assert code == 0, err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_keep_the_newest_three_unless_told_and_say_so_on_the_first_save(tmp_path):
    code, out, err = forked_cli("apply", QWEN3, "--steps", 4, "--save", tmp_path / "ck", "--save-every", 1)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-000002", "step-000003", "step-000004"]
    (said,) = [line for line in out.splitlines() if line.startswith("checkpoints:")]
    assert said == f"checkpoints: the newest 3 in {tmp_path / 'ck'} stay (--keep N; --keep 0 keeps every one)"
    code, out, err = forked_cli("apply", QWEN3, "--steps", 4, "--save", tmp_path / "all", "--save-every", 1,
                                "--keep", 0)
    assert code == 0, err
    assert len(list((tmp_path / "all").glob("step-*"))) == 4 and "every one stays" in out


# --- eval ------------------------------------------------------------------------------------

EVAL_ROWS = [
    {"input_ids": [5, 9, 14, 2, 77, 31, 8]},
    {"input_ids": [40, 41, 42, 43], "loss_mask": [0, 0, 1, 1]},  # a prompt of two tokens, not counted
    {"input_ids": [100, 3, 60, 61, 62, 63, 64, 65, 66]},
]


def unsharded_eval_loss(folder, rows) -> tuple[float, int]:
    """Transformers' model from the exported folder: the mean NLL of the counted next tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logprobs = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
            token_lp = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            counted = torch.tensor(row.get("loss_mask", [1] * len(row["input_ids"]))[1:], dtype=torch.float32)
            nll -= float((token_lp * counted).sum())
            count += int(counted.sum())
    return nll / count, count


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [("--tp", 2, "--sp"), ("--pp", 2)], ids=["tp2-sp", "pp2"])
def test_eval_loss_is_the_unsharded_models_loss_on_the_held_out_rows(tmp_path, layout):
    """Two steps, eval after each: the last eval loss equals transformers' loss of the exported
    weights on the same rows (three rows at a batch of 2: the second batch filled with a row that
    counts nothing), and its token count is the rows' counted tokens."""
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in EVAL_ROWS))
    metrics = tmp_path / "m.jsonl"
    code, out, err = forked_cli("apply", QWEN3, *layout, "--steps", 2, "--batch-size", 2, "--eval-data", held_out,
                                "--eval-every", 1, "--metrics", metrics, "--export-hf", tmp_path / "hf")
    assert code == 0, err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [("eval_loss" in row) for row in rows] == [True, True]
    expected, count = unsharded_eval_loss(tmp_path / "hf", EVAL_ROWS)
    assert rows[-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert rows[-1]["eval_tokens"] == count == 6 + 2 + 8
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"]  # after each step, not once
    assert f"eval    2/2  loss {rows[-1]['eval_loss']:.6f}  over 16 tokens" in out
    assert "eval: " in out and "3 rows, every 1 steps and at the end" in out


def test_eval_flags_that_name_no_rows_are_refused_before_launch(cli, tmp_path):
    code, _, err = cli("apply", QWEN3, "--eval-every", 2)
    assert code == 2 and "--eval-every 2 without --eval-data or --eval-split" in err
    code, _, err = cli("apply", QWEN3, "--eval-split", "test")
    assert code == 2 and "--eval-split test without --data" in err


def test_eval_split_reads_the_held_out_split_of_a_hub_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    from plancc.job.data import DataError, read_jsonl

    for split, rows in (("train", [[1, 2, 3], [4, 5]]), ("test", [[7, 8, 9]])):
        path = tmp_path / "hub" / "data" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list([{"input_ids": r} for r in rows]).to_parquet(str(path))
    held_out = read_jsonl(tmp_path / "hub", vocab_size=256, min_tokens=2, split="test")
    assert [tuple(r) for r in held_out.sequences] == [(7, 8, 9)] and "(test split)" in held_out.path
    with pytest.raises(DataError, match="holds the splits test, train, not validation"):
        read_jsonl(tmp_path / "hub", vocab_size=256, split="validation")


# --- LoRA checkpoints and exports ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_run_checkpoints_and_exports_the_adapters_alone(tmp_path, cli):
    from torch.distributed.checkpoint import FileSystemReader

    lora = ("--lora-r", 4, "--lora-targets", "model.layers.*.self_attn.q_proj,model.layers.*.self_attn.v_proj")
    code, out, err = forked_cli("apply", QWEN3, *lora, "--steps", 2, "--save", tmp_path / "ck",
                                "--export-hf", tmp_path / "adapters", "--export-adapters")
    assert code == 0, err
    held = {k for k in FileSystemReader(str(tmp_path / "ck" / "step-000002")).read_metadata().state_dict_metadata
            if k.startswith("model.")}
    assert held and all("lora_" in k for k in held)  # no base tensor: the base is --model's
    written = sorted(p.name for p in (tmp_path / "adapters").iterdir() if not p.name.startswith("."))
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    assert "exported the LoRA adapters (a PEFT folder)" in out
    code, out, err = forked_cli("apply", QWEN3, *lora, "--steps", 3, "--resume", tmp_path / "ck")
    assert code == 0 and "resumed from step 2" in out, err
    code, out, err = forked_cli("apply", QWEN3, *lora, "--steps", 3, "--resume", tmp_path / "ck", "--seed", 1)
    assert code == 1 and "trained on the base 'random init (seed 0)'" in err
    code, _, err = cli("apply", QWEN3, "--export-hf", tmp_path / "x", "--export-adapters")
    assert code == 2 and "--export-adapters without LoRA" in err


# --- memory ----------------------------------------------------------------------------------


def memory_cgroup(tmp_name: str, limit: int):
    """A memory cgroup below this process's own, limited to ``limit`` bytes (v1 or v2), or None
    where one cannot be made here (not root, no writable cgroup file system)."""
    from plancc.runtime.rank_memory import _cgroup_file

    own = Path(_cgroup_file("x")).parent
    child = own / tmp_name
    try:
        child.mkdir()
        limit_file = child / ("memory.limit_in_bytes" if (child / "memory.limit_in_bytes").exists() else "memory.max")
        limit_file.write_text(str(limit))
    except OSError:
        return None
    return child


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_the_oom_killer_ends_is_reported_as_out_of_memory_with_its_peak():
    """A real OOM kill: the run in a memory cgroup of 3 GiB, rank 1 allocating until the kernel
    ends it. The launcher says so, with the peak the rank reached -- not 'Signal 9' and a
    --timeout hint."""
    import os
    import subprocess
    import sys

    group = memory_cgroup(f"plancc-oom-{os.getpid()}", 3 << 30)
    if group is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        done = subprocess.run([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "2"],
                              env={**os.environ, "PLANCC_FAULT": "train:hog@1#1"}, preexec_fn=enter,
                              capture_output=True, text=True, timeout=500)
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)
    assert done.returncode == 1, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "[memory]" in x]
    assert "rank 1 was killed by the kernel's OOM killer: out of host memory (its peak: " in line, line
    peak = float(line.split("its peak: ")[1].split(" GiB")[0])
    assert 1.0 < peak <= 3.0, line
    assert "--timeout" not in done.stderr


# --- loggers ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wandb_and_mlflow_get_the_metrics_files_numbers_offline(tmp_path, monkeypatch):
    """--logger wandb,mlflow beside --metrics: both trackers (offline: W&B's run file, MLflow's
    file store) hold every step's loss as the metrics file has it, under TensorBoard's names;
    an unknown tracker is refused before launch."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    metrics = tmp_path / "metrics.jsonl"
    code, out, err = forked_cli("apply", QWEN3, "--steps", 3, "--metrics", metrics, "--logger", "wandb,mlflow")
    assert code == 0 and "--logger" not in err, err
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 3
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = run_file.read_bytes()  # its history records hold each value as JSON text
    assert b"train/loss" in recorded and all(json.dumps(loss).encode() in recorded for loss in losses)
    (by_step,) = (tmp_path / "mlruns").glob("*/*/metrics/train/loss")
    assert [(int(step), float(value)) for _, value, step in (line.split() for line in by_step.read_text().splitlines())] \
        == list(enumerate(losses, start=1))
    code, _, err = forked_cli("apply", QWEN3, "--steps", 1, "--logger", "neptune")
    assert code == 2 and "--logger 'neptune' is no tracker" in err and "one of wandb, mlflow" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packing_and_the_token_budget_read_the_rows_in_their_shuffled_order(tmp_path):
    """A shuffled run with --pack and --max-tokens trains exactly as a run in file order on the
    file written in that shuffled order: the packer and the token budget see the order the
    seed drew, not the file's."""
    from plancc.job.data_order import RowOrder

    rows = [{"input_ids": [(11 * i + j) % 200 for j in range(3 + 2 * i)]} for i in range(8)]
    data, drawn = tmp_path / "rows.jsonl", tmp_path / "drawn.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = RowOrder(rows=8, seed=3)
    drawn.write_text("".join(json.dumps(rows[order.row(i)]) + "\n" for i in range(8)))  # one epoch, as drawn
    assert [order.row(i) for i in range(8)] != list(range(8))
    flags = ("--batch-size", 4, "--steps", 2, "--pack", "--max-tokens", 24, "--seed", 3)
    code, shuffled, err = forked_cli("apply", QWEN3, "--data", data, *flags)
    assert code == 0, err
    code, in_order, err = forked_cli("apply", QWEN3, "--data", drawn, "--no-shuffle", *flags)
    assert code == 0, err
    assert losses(shuffled) == pytest.approx(losses(in_order), rel=1e-6) and len(losses(shuffled)) == 2
    code, file_order, err = forked_cli("apply", QWEN3, "--data", data, "--no-shuffle", *flags)
    assert code == 0, err
    assert losses(file_order) != pytest.approx(losses(shuffled), rel=1e-6)  # the order is what differs
