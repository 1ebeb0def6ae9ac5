"""The rollout tier (``pytest -m rollout``): a real vLLM, in its own environment
(``scripts/vllm_env.sh``; ``PLANCC_VLLM_PYTHON`` names its interpreter, default ``.venv-vllm``),
fed by plancc policies at several layouts through vLLM's weight-transfer protocol."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .distributed import launch

pytestmark = [pytest.mark.rollout, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vllm_python():
    python = os.environ.get("PLANCC_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"no vLLM environment at {python}: bash scripts/vllm_env.sh (or set PLANCC_VLLM_PYTHON)")
    return python


def test_every_vllm_worker_gets_its_shard_and_vllms_log_probs_are_the_policys(vllm_python):
    """vLLM at tensor parallel 2, fed from dp=2, tp=2 + SP, cp=2, pp=2 and LoRA-merged policies (two ranks
    each, one after the other into the same vLLM): each
    worker receives exactly its own slice of every weight (the fused qkv and gate/up included:
    bytes on the wire <= 1.05x the shard vLLM lays out), the policy's log-probs of vLLM's samples
    equal vLLM's within 1e-4 in fp32, a step of training makes them differ, and the next refit
    brings them back -- at the version the refit named."""
    from .rollout_worker import refit_sample_train_refit

    layouts = [
        ("dp2", {"dp": 2}),
        ("tp2-sp", {"tp": 2, "sequence_parallel": True}),
        ("cp2", {"cp": 2}),
        ("pp2", {"pp": 2}),
        ("lora-merged-dp2", {"dp": 2, "lora": 8}),
    ]
    results = launch(refit_sample_train_refit, 2, vllm_python, layouts, 2, timeout_s=600)
    for name, got in results[0].items():
        assert got["fresh"]["rollout_logprob_max_abs_diff"] <= 1e-4, (name, got["fresh"])
        assert got["again"]["rollout_logprob_max_abs_diff"] <= 1e-4, (name, got["again"])
        assert got["stale"]["rollout_logprob_max_abs_diff"] > 1e-2, (name, got["stale"])  # the check can fail
        assert got["fresh"]["rollout_tokens"] == 2 * 3 * 8
        assert got["serving"] == {"serving": f"{name}-1", "broken": None, "vllm": f"{name}-1"}
        for worker in got["workers"]:
            assert worker["version"] == f"{name}-1"
            assert worker["bytes"] <= 1.05 * worker["shard_bytes"], (name, worker)
        whole = sum(got["refits"][1]["bytes_per_worker"])
        assert whole <= 1.05 * sum(w["shard_bytes"] for w in got["workers"])
    for name in results[0]:  # every rank got the same samples, numbers and refit reports
        for key in ("fresh", "stale", "again", "refits"):
            assert results[0][name][key] == results[1][name][key], (name, key)


def test_an_expert_parallel_tied_moe_policy_sends_each_vllm_worker_its_slice_of_every_expert(vllm_python):
    """Qwen3-MoE with its head tied to its embedding (as Qwen3-0.6B, Llama 3.2 1B, Gemma), at
    ep=2 and at pp=2, into vLLM at tensor parallel 2, whose fused MoE splits every expert's intermediate
    size: each worker receives its slice of each expert and the tied weight once (bytes <= 1.05x
    its shard), and the policy's log-probs of vLLM's samples equal vLLM's within 1e-4 in fp32,
    before and after a step of training.

    Two vLLM 0.32 reload gaps on the CPU are closed by plancc_vllm.engine: the experts served
    unpacked (``forget_cpu_moe_kernels``; 2e-2 off without it) and the tied head's packed GEMM
    left on the dummy weights (``reprocess``; 0.36 off)."""
    from .rollout_worker import refit_sample_train_refit

    # and the same model in pipeline stages: its tied head's copy on the last stage, experts in
    # each stage; vLLM gets the weight once, as from ep2
    layouts = [("ep2", {"dp": 2, "ep": 2, "model": "qwen3-moe-tied"}), ("pp2", {"pp": 2, "model": "qwen3-moe-tied"})]
    results = launch(refit_sample_train_refit, 2, vllm_python, layouts, 2, timeout_s=600)
    for name, _ in layouts:
        got = results[0][name]
        assert got["fresh"]["rollout_logprob_max_abs_diff"] <= 1e-4, (name, got["fresh"])
        assert got["again"]["rollout_logprob_max_abs_diff"] <= 1e-4, (name, got["again"])
        assert got["stale"]["rollout_logprob_max_abs_diff"] > 1e-2, (name, got["stale"])
        for worker in got["workers"]:
            assert worker["bytes"] <= 1.05 * worker["shard_bytes"], (name, worker)
        assert results[1][name]["fresh"] == got["fresh"], name


def test_a_vllm_killed_mid_update_is_named_on_every_rank_and_a_new_one_takes_the_next_refit(vllm_python):
    from .rollout_worker import killed_mid_update_then_a_new_vllm

    results = launch(killed_mid_update_then_a_new_vllm, 2, vllm_python, timeout_s=600)
    for rank, got in results.items():
        assert got["raised"] is not None and "vLLM" in got["raised"], (rank, got)
        assert got["seconds"] < 60, (rank, got["seconds"])
        assert got["agreement"]["rollout_logprob_max_abs_diff"] <= 1e-4, (rank, got["agreement"])
    assert results[0]["leftover"] == []  # nothing of the killed vLLM left running


def test_grpo_on_vllms_samples_raises_its_reward_with_the_agreement_logged_every_step(tmp_path, vllm_python):
    """``examples/grpo.py --rollout vllm``: the example's task on a real vLLM's samples (refit
    every step), its reward rising as with plancc's sampler (the same margin over 16 steps), and
    every step's refit time, bytes per vLLM worker and agreement in the metrics."""
    import json
    import subprocess
    import sys

    metrics = tmp_path / "grpo.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "examples/grpo.py",
            "--rollout",
            "vllm",
            "--vllm-python",
            vllm_python,
            "--steps",
            "16",
            "--metrics",
            str(metrics),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 17))
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    assert last >= first + 0.2, (first, last)
    for row in rows:
        assert row["rollout_logprob_max_abs_diff"] <= 1e-4, row
        assert row["refit_s"] > 0 and row["bytes_per_vllm_worker"] > 0, row


def test_a_vllm_serving_another_model_is_refused_before_any_weight_moves(tmp_path, vllm_python):
    """vLLM started from a folder of the user's (its config) whose vocabulary differs from the
    policy's: every rank raises, naming the first difference, and no refit was begun."""
    import json

    from .rollout_worker import another_model_is_refused, tiny_config

    config = tiny_config().to_dict()
    config.pop("transformers_version", None)
    config["vocab_size"] = 320
    (tmp_path / "config.json").write_text(json.dumps(config))
    results = launch(another_model_is_refused, 2, vllm_python, str(tmp_path), timeout_s=600)
    for rank, raised in results.items():
        assert raised is not None and "vocab_size" in raised and "320" in raised, (rank, raised)


def test_a_refit_lost_part_way_is_said_by_vllm_which_refuses_to_sample_until_the_next(vllm_python):
    """The policy fails after 7 of the weights went out (a lost rank): vLLM's workers, mid-refit,
    fail at once (the transfer group closed), vLLM says it serves version "a" with "b" failed
    part-way, refuses to sample a mix of the two, and the next refit serves "c" exactly."""
    from .rollout_worker import a_refit_lost_part_way

    got = launch(a_refit_lost_part_way, 1, vllm_python, timeout_s=600)[0]
    assert got["raised"] == "a policy rank was lost"
    assert got["seconds"] < 60, got["seconds"]
    assert got["serving"] == {"serving": "a", "broken": "b", "vllm": "a"}, got["serving"]
    assert "failed part-way" in got["sampled"], got["sampled"]
    assert got["after"]["serving"] == "c" and got["after"]["broken"] is None
    assert got["agreement"]["rollout_logprob_max_abs_diff"] <= 1e-4
