"""plancc.ray.PolicyGroup on a local Ray cluster (2 actors, CPU): a Policy as Ray actors, the
process group set up among them, a global batch fanned out by dp rank -- and the results equal
the torchrun path bitwise."""

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_policy_group_of_ray_actors_equals_the_torchrun_path_bitwise():
    import torch

    from plancc.models import load_config
    from plancc.ray import PolicyGroup

    from .distributed import launch
    from .policy_worker import LR, ROWS_PER_RANK, global_batch, grpo, torchrun_reference_for_ray

    want = launch(torchrun_reference_for_ray, 2, "plans/qwen3.yaml", "tiny-qwen3", {"dp": 2})
    batch = global_batch(ROWS_PER_RANK * 2, load_config("tiny-qwen3").vocab_size, seed=13)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        group = PolicyGroup(2, "plans/qwen3.yaml", "tiny-qwen3", dp=2,
                            optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": LR}})
        before = group.logprobs(batch)
        metrics = group.train(batch, grpo, micro_batch_size=3)
        after = group.logprobs(batch)
        group.shutdown()
    finally:
        ray.shutdown()
    expected_before = torch.cat([want[r]["logprobs"] for r in sorted(want, key=lambda r: want[r]["start"])])
    expected_after = torch.cat([want[r]["after"] for r in sorted(want, key=lambda r: want[r]["start"])])
    assert torch.equal(before, expected_before)
    assert torch.equal(after, expected_after)
    assert {k: v for k, v in metrics.items() if k != "seconds"} == want[0]["metrics"]
    assert not torch.equal(before, after)  # the step moved the policy
