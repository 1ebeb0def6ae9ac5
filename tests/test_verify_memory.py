"""--verify in about the memory of the run it checks (issue 76, point 7): the unsharded reference
runs the batch a row or a few at a time, keeps a 1/world share of AdamW's moments, and turns to
fp64 only when fp32 misses its fixed bar -- each of which must leave the numbers unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"


def test_the_fp64_look_puts_every_tensor_back_as_it_was():
    from plancc.job.verify_reference import in_fp64

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model.register_buffer("steps", torch.tensor([3]))  # not floating: untouched
    model(torch.randn(2, 4)).sum().backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    with in_fp64(model, {"0.weight"}):
        assert all(p.dtype == torch.float64 for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())  # set aside, not mixed in
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        assert model[0].weight.grad is not None and model[0].bias.grad is None  # the wanted alone
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name][0]) and torch.equal(p.grad, before[name][1])
    assert model.steps.dtype == torch.int64


def test_the_reference_runs_a_vocabulary_sized_batch_a_row_at_a_time():
    from plancc.job.verify_reference import reference_chunk_rows

    assert reference_chunk_rows(8, 16, 256) == 8  # a tiny vocabulary: the batch in one pass
    assert reference_chunk_rows(8, 64, 151936) == 1  # Qwen3's: 39 MB of logits a row
    assert reference_chunk_rows(8, 32768, 151936) == 1  # never fewer than a row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adamw_split_over_ranks_steps_as_one_adamw_does():
    """Each rank steps a slice of every tensor (weight decay on the matrix alone, as the policy's
    groups), the slices broadcast back: the weights are a plain AdamW's, also after the weights
    were turned fp64 and back in place (the optimizer's slices follow the new storage)."""
    from .distributed import launch
    from .verify_memory_worker import split_adamw_against_adamw

    for diffs in launch(split_adamw_against_adamw, 2, 4).values():
        assert max(diffs.values()) <= 1e-7, diffs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fp64_look_runs_when_fp32_misses_and_leaves_the_reference_training_on():
    """With the fixed gradient bar at 0, every gradient 'misses': the fp64 look measures the
    floor (fp32's own distance from exact) and the sharded model's, both small; the reference,
    turned fp64 and back in place, then trains on as the policy does (the losses after each step
    agree: a reference whose optimizer lost track of its weights is off by 1e-2)."""
    from .distributed import launch
    from .verify_memory_worker import fp64_look

    for report in launch(fp64_look, 2, str(QWEN3)).values():
        assert report["floor_measured"] and 0 < report["grad_floor"] < 1e-5
        assert 0 < report["grad_exact_rel"] < 1e-5
        assert report["params_compared"] > 0 and max(report["step_loss_abs"]) < 1e-5


def _peak_of(*args: object) -> tuple[int, str]:
    """(the largest resident memory of any process ``plancc`` starts, its output): a parent of its
    own, so no earlier child of this test process counts."""
    probe = (
        "import resource, subprocess, sys; "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "print(p.stdout + p.stderr, file=sys.stderr)"
    )
    cmd = [sys.executable, "-c", probe, sys.executable, "-m", "plancc.cli", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    code, kib = done.stdout.split()[-2:]
    assert code == "0", done.stderr
    return int(kib) * 1024, done.stderr


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_verify_needs_at_most_twice_the_training_runs_memory(tmp_path):
    """Qwen3's real vocabulary (152k) on a one-layer cut at tp2: the reference's whole weights and
    its logits are what once took 4x the run (11.2 GiB a rank against 2.8 GiB at --seq-len 64)."""
    folder = tmp_path / "qwen3-152k"
    folder.mkdir()
    config = json.loads((PLANS.parent / "plancc" / "presets" / "qwen3-0.6b.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)
    (folder / "config.json").write_text(json.dumps(config))
    run = ("apply", QWEN3, "--model", folder, "--tp", 2, "--seq-len", 64, "--batch-size", 8, "--steps", 1)
    trained, _ = _peak_of(*run)
    verified, err = _peak_of(*run, "--verify")
    assert "verify: OK" in err and "1 row of the global batch at a time" in err
    assert verified <= 2 * trained, (verified / 2**20, trained / 2**20)


def test_a_verify_that_does_not_fit_is_refused_before_launch_naming_its_reference():
    """The pre-launch bound counts the reference --verify trains beside the run: where the run
    fits and its check does not, the refusal says so and names the cheap fix (fewer layers)."""
    from plancc.job.config import RunConfig
    from plancc.job.memory import memory_problems, need
    from plancc.layout import Layout
    from plancc.models import build_meta_model, load_config

    model, config = build_meta_model("qwen3-0.6b"), load_config("qwen3-0.6b")
    params = sum(p.numel() for p in model.parameters())
    layout = Layout.infer(world_size=2, tp=2)
    run = RunConfig.of(plan="p.yaml", layout=layout, batch_size=8, seq_len=64)
    checked = RunConfig.of(plan="p.yaml", layout=layout, batch_size=8, seq_len=64, verify=True)
    plain, verified = (need(c, model, config, longest=None, from_folder=True) for c in (run, checked))
    assert plain.reference == 0 and verified.state == plain.state
    assert verified.reference >= params * (8 + 4)  # whole weights and gradients, half of AdamW's moments
    host = 2 * (plain.device + verified.reference // 2)  # two workers: the run fits, its check not
    (found,) = memory_problems(checked, model, config, local_ranks=2, longest=None, from_folder=True, device="cpu",
                               host=host)
    assert found.rule == "memory" and found.message.startswith("--verify needs at least")
    assert "num_hidden_layers" in (found.fix or "")
    assert memory_problems(run, model, config, local_ranks=2, longest=None, from_folder=True, device="cpu",
                           host=host) == []
