"""`plancc apply` end to end: launched by torch's elastic launcher, trained, checkpointed,
resumed at another layout, verified against the unsharded model; HF weights load exactly."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import PLANS, forked_cli
from .distributed import launch
from .runner_worker import logits_from_hf_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def plancc_cli(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "plancc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def losses(stdout):
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def test_apply_with_no_flags_trains_a_tiny_qwen3_data_parallel_on_two_processes():
    code, out, err = plancc_cli("apply", PLANS / "qwen3.yaml")
    assert code == 0, err
    assert "dp=2 cp=1 tp=1" in out and "tiny-qwen3" in out  # torchrun's default: data parallelism
    assert len(losses(out)) == 5 and "summary:" in out


# tiny-llama-tied at dp2 x tp2: tests/test_numerics.py (the same comparison, without the CLI)
@pytest.mark.extended  # --verify at 4 ranks through the CLI: the cp=2 x tp=2 test below
@pytest.mark.parametrize("model", ["tiny-llama"])
def test_verify_llama_dp2_tp2_sp_reports_differences(model):
    code, out, err = plancc_cli("apply", PLANS / "llama.yaml", "--model", model, "--nproc-per-node", 4,
                                "--tp", 2, "--sp", "--verify", "--steps", 2)
    assert code == 0, err + out
    assert "verify: OK" in out and "logits  max |diff|" in out and "grads   max relative diff" in out


def test_the_workers_import_the_installed_plancc_whatever_the_working_directory_holds(tmp_path):
    """Run from the folder above a clone (a `plancc/` folder there): the workers, started as
    `python -m plancc.job.runner`, imported that folder ("FileNotFoundError .../plancc/schemas")."""
    (tmp_path / "plancc").mkdir()
    (tmp_path / "plancc" / "__init__.py").write_text("")
    script = shutil.which("plancc", path=str(Path(sys.executable).parent))  # the console script, as a user runs it
    done = subprocess.run([script, "apply", str(PLANS / "qwen3.yaml"), "--steps", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert len(losses(done.stdout)) == 1


def test_apply_through_an_explicit_c10d_rendezvous_endpoint():
    """The multi-node path (--nnodes/--rdzv-endpoint/--rdzv-id), here with one node."""
    from .distributed import free_port

    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--nnodes", 1, "--rdzv-endpoint",
                                f"127.0.0.1:{free_port()}", "--rdzv-id", "plancc-test", "--steps", 1)
    assert code == 0, err
    assert "world 2" in out and len(losses(out)) == 1


def test_broken_plan_fails_validation_before_any_process_starts(tmp_path):
    broken = tmp_path / "no-o-proj.yaml"
    broken.write_text((PLANS / "qwen3.yaml").read_text().replace("  model.layers.*.self_attn.o_proj: rowwise\n", ""))
    code, out, err = forked_cli("apply", broken, "--nproc-per-node", 2, "--tp", 2)
    assert code == 1
    assert "[layout-pairing]" in err and "plancc apply:" not in out  # no worker ever printed


@pytest.fixture(scope="module")
def six_steps_at_tp2(tmp_path_factory):
    """One run of 6 steps at tp=2 that checkpoints every 3 steps and exports the model: (its
    stdout, the checkpoint folder, the exported folder). One launch serves the tests below."""
    root = tmp_path_factory.mktemp("six-steps")
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 6, "--tp", 2, "--save", root / "ck",
                                "--save-every", 3, "--keep", 2, "--export-hf", root / "out",
                                "--metrics", root / "straight.jsonl")
    assert code == 0, err
    return out, root / "ck", root / "out"


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_same_command_plus_resume_is_the_uninterrupted_run_step_for_step(six_steps_at_tp2, tmp_path):
    """--steps is the run's total (HF Trainer's max_steps): the run stopped after step 3 and
    started again with the same command plus --resume trains steps 4-6 at the learning rates
    and with the losses of the run that was never stopped."""
    _, ck, _ = six_steps_at_tp2
    straight = _metrics(ck.parent / "straight.jsonl")
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 6, "--tp", 2, "--resume", ck / "step-000003",
                                "--metrics", tmp_path / "resumed.jsonl")
    assert code == 0, err
    assert "resumed from step 3" in out and "training to step 6" in out and "note:" not in out
    resumed = _metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight[3:]]  # every step's rate, exactly
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[3:]], abs=1e-6)


def test_save_at_tp2_resume_at_dp2_continues_the_loss_curve(six_steps_at_tp2):
    straight, ck, _ = six_steps_at_tp2
    assert (ck / "latest").read_text().strip() == "step-000006"
    # back to the checkpoint of step 3 (without 'latest', resume takes the newest complete step)
    shutil.rmtree(ck / "step-000006")
    (ck / "latest").unlink()
    code, resumed, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 6, "--tp", 1, "--resume", ck)
    assert code == 0, err
    assert "resumed from step 3 (saved at dp=1 cp=1 tp=2)" in resumed and "dp=2 cp=1 tp=1" in resumed
    assert losses(resumed) == pytest.approx(losses(straight)[3:], rel=1e-5)


def test_a_resumed_run_takes_its_learning_rate_from_lr_at_the_schedules_restored_position(six_steps_at_tp2):
    """The checkpoint keeps the schedule's position (Policy.save); the base rate is this run's
    --lr: step 4 of a resume at twice the rate has twice the rate the straight run had there."""
    from plancc.job.lr_schedule import lr_factor

    _, ck, _ = six_steps_at_tp2
    code, resumed, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 6, "--tp", 1, "--lr", "2e-3",
                                    "--resume", ck / "step-000003")
    assert code == 0, err
    rates = [float(line.split(" lr ")[1].split()[0]) for line in resumed.splitlines() if line.startswith("step ")]
    assert rates == pytest.approx([2e-3 * lr_factor(s, schedule="cosine", warmup=1, total=6, min_ratio=0.1) for s in (3, 4, 5)], rel=1e-2)
    # a resume that changes what fixes the rate says so, in one line
    (note,) = [line for line in resumed.splitlines() if line.startswith("note:")]
    assert "--lr 0.001 -> 0.002" in note


def test_resuming_another_architecture_is_a_clear_error(tiny_checkpoint):
    code, _, err = forked_cli("apply", PLANS / "qwen3.yaml", "--model", "tiny-qwen2", "--steps", 1,
                              "--resume", tiny_checkpoint[0])
    assert code != 0
    assert "checkpoint is of Qwen3ForCausalLM" in err


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_loading_a_save_pretrained_folder_matches_from_pretrained(tmp_path, dp, tp):
    from transformers import AutoModelForCausalLM

    from plancc.models import build_model, load_config

    torch.manual_seed(3)
    build_model(load_config("tiny-qwen3-tied"), device="cpu").save_pretrained(tmp_path / "hf")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = expected(input_ids=ids).logits
    results = launch(logits_from_hf_folder, dp * tp, str(PLANS / "qwen3.yaml"), str(tmp_path / "hf"), dp, tp, ids)
    for rank, got in results.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_export_hf_is_loadable_by_transformers(six_steps_at_tp2):
    from transformers import AutoModelForCausalLM

    _, _, out = six_steps_at_tp2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_apply_with_context_parallel_verifies():
    """Through the CLI at cp=2 x tp=2 (cp alone, every plan: tests/test_cp.py, without a launch each)."""
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--nproc-per-node", 4, "--cp", 2, "--tp", 2,
                                "--verify", "--steps", 2)
    assert code == 0, err + out
    assert "verify: OK" in out and "cp=2" in out


def test_logprobs_cli_verifies_with_tp_and_cp(tmp_path):
    data = tmp_path / "data.jsonl"
    gen = torch.Generator().manual_seed(0)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(0, 256, (int(n),), generator=gen).tolist()}) + "\n"
                            for n in torch.randint(3, 40, (6,), generator=gen)))
    # cp without packing: tests/test_cp.py compares it to the unsharded model directly
    for args, to_file in ((["--tp", 2, "--entropy"], True), (["--cp", 2, "--pack"], False)):
        out_args = ["--out", tmp_path / "out.jsonl"] if to_file else []  # without --out: JSONL on stdout
        code, out, err = forked_cli("logprobs", PLANS / "qwen3.yaml", "--data", data, *args, "--verify", *out_args)
        assert code == 0, err + out
        log = out if to_file else err
        assert "verify: max |logprob diff|" in log and "OK" in log
        written = (tmp_path / "out.jsonl").read_text() if to_file else out
        lines = [json.loads(x) for x in written.splitlines()]
        inputs = [json.loads(x) for x in data.read_text().splitlines()]
        assert [len(x["logprobs"]) for x in lines] == [len(x["input_ids"]) for x in inputs]
        assert all(x["logprobs"][0] == 0.0 and all(v < 0 for v in x["logprobs"][1:]) for x in lines)
        if "--entropy" in args:  # beside each log-prob: the entropy of the distribution it came from
            assert all(len(x["entropy"]) == len(x["logprobs"]) and x["entropy"][0] == 0.0 for x in lines)
            assert all(0 < v <= math.log(256) + 1e-5 for x in lines for v in x["entropy"][1:])
        else:
            assert all("entropy" not in x for x in lines)


def test_bf16_mixed_precision_tracks_the_fp32_run(fp32_run):
    """FSDP mixed precision (bf16 compute, fp32 master weights and gradient reduction)."""
    code, out, err = fp32_run
    assert code == 0, err
    fp32 = [h["loss"] for h in json.loads(out)["history"]]
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 3, "--tp", 2, "--param-dtype", "bfloat16",
                                "--format", "json")
    assert code == 0, err
    bf16 = [h["loss"] for h in json.loads(out)["history"]]
    assert bf16 == pytest.approx(fp32, abs=5e-3)
    assert bf16 != fp32  # it really ran in bf16 (both at full precision)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_apply_trains_the_same_steps_whether_the_batch_is_one_pass_microbatches_or_packed(tmp_path):
    """The loss is the global batch's token mean however the batch is cut, so the loss curve of
    sequences of different lengths is the same in one pass and in packed microbatches by a token
    budget (every way of cutting, at every layout: tests/test_policy.py, without a launch each)."""
    data = tmp_path / "mixed.jsonl"
    lengths = [5, 31, 12, 20, 8, 27, 16, 3]
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 250 for j in range(n)]}) + "\n"
                            for i, n in enumerate(lengths)))
    curves = {}
    for name, flags in {"one": [], "packed": ["--max-tokens", 40, "--pack"]}.items():
        code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--data", data, "--steps", 2, "--batch-size", 4,
                                    *flags)
        assert code == 0, err
        curves[name] = losses(out)
    assert len(curves["one"]) == 2
    assert all(abs(a - b) <= 2e-6 for a, b in zip(curves["packed"], curves["one"], strict=True)), curves


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_token_budget_smaller_than_a_row_is_a_diagnostic_not_a_traceback(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(2, 2 + n))}) + "\n" for n in (5, 9, 7, 12)))
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--data", data, "--steps", 1, "--batch-size", 4,
                                "--max-tokens", 4)
    assert code == 1, (out, err)
    assert "[data]" in err and "more than max_tokens=4" in err and "fix:" in err, err
    assert "sequence 4 of the data has 12 tokens" in err, err  # said before launch: no step ran
    assert "Traceback" not in err and "step " not in out
