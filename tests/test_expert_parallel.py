"""Expert parallelism (--ep): each layer's experts spread over ep data-parallel ranks (times
tp), tokens moved by all-to-all, the experts' FSDP unit over the dp/ep ranks left.

Sharded == unsharded on real gloo process groups, with the bars of test_numerics (fp32:
logits and every gradient 1e-5 relative, loss 1e-5 absolute, losses after AdamW steps 1e-4
relative): router and expert gradients included, at ep=2 alone, ep=2 x tp=2, ep over all
four ranks, and ep=2 with FSDP sharding the experts over the two ranks ep leaves. And a
checkpoint saved with ep resumes at a layout without it, step for step.
"""

import json

import pytest

from .conftest import PLANS, forked_cli
from .distributed import launch
from .numerics_worker import verify_ep_cases
from .test_numerics import assert_matches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(nproc, cases):
    cases = [(str(PLANS / plan), preset, dp, tp, ep) for plan, preset, dp, tp, ep in cases]
    return cases, launch(verify_ep_cases, nproc, cases)


def test_ep_2_on_two_ranks_matches_unsharded():
    cases, results = _run(2, [("qwen3_moe.yaml", "tiny-qwen3-moe", 2, 1, 2)])
    for rank, reports in results.items():
        assert_matches(reports[0], f"rank {rank} {cases[0]}")


@pytest.mark.extended  # the default run: ep=2 (above) and ep x tp in bench/hf_sweep.py --ep's 40 MoE plans
def test_ep_with_tp_and_with_expert_fsdp_on_four_ranks_matches_unsharded():
    cases, results = _run(4, [
        ("qwen3_moe.yaml", "tiny-qwen3-moe", 2, 2, 2),  # ep=2 x tp=2: 4 experts, one per rank
        ("deepseek_v3.yaml", "tiny-deepseek-v3", 2, 2, 2),  # MLA heads split, shared experts over tp
        ("mixtral.yaml", "tiny-mixtral", 4, 1, 4),  # every rank a token exchange partner
        ("gpt_oss.yaml", "tiny-gpt-oss", 4, 1, 2),  # experts FSDP-sharded over the 2 ranks ep leaves
    ])
    for rank, reports in results.items():
        for i, case in enumerate(cases):
            assert_matches(reports[i], f"rank {rank} {case}")


def test_a_checkpoint_saved_with_ep_resumes_without_it_step_for_step(tmp_path):
    common = [PLANS / "qwen3_moe.yaml", "--model", "tiny-qwen3-moe", "--nproc-per-node", "2", "--device", "cpu",
              "--schedule-steps", "3"]
    # 3 steps at ep=2, a checkpoint every 2: step-000002 and step-000003
    code, out, err = forked_cli("apply", *common, "--ep", "2", "--steps", "3", "--save", tmp_path / "ck",
                             "--save-every", "2", "--metrics", tmp_path / "ep.jsonl")
    assert code == 0, err
    # from step 2 at tp=2 (experts over tp only): DCP reshards the experts' weights and moments
    code, out, err = forked_cli("apply", *common, "--tp", "2", "--steps", "3", "--resume", tmp_path / "ck" / "step-000002",
                             "--metrics", tmp_path / "tp.jsonl")
    assert code == 0, err
    assert "saved at dp=2 cp=1 tp=1 ep=2" in out + err
    ep_steps = [json.loads(line) for line in (tmp_path / "ep.jsonl").read_text().splitlines()]
    (tp_step,) = [json.loads(line) for line in (tmp_path / "tp.jsonl").read_text().splitlines()]
    assert tp_step["step"] == ep_steps[-1]["step"] == 3
    assert tp_step["loss"] == pytest.approx(ep_steps[-1]["loss"], rel=1e-5)
    assert tp_step["grad_norm"] == pytest.approx(ep_steps[-1]["grad_norm"], rel=1e-4)
