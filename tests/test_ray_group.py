"""plancc.ray.PolicyGroup on a local Ray cluster (2 actors, CPU): a Policy as Ray actors, the
process group set up among them, a global batch fanned out by dp rank -- and the results equal
the torchrun path bitwise."""

from pathlib import Path

import pytest

from plancc import Layout

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the file (starting one takes seconds); each test's group ends its
    own actors."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def group_of_two(cluster):
    """``take(fresh=)``: a group of two actors on the tiny Qwen3 at dp=2 (PACK, the SGD step of the
    torchrun reference). Each actor's start imports torch, transformers and plancc, so the file's
    tests share one: ``fresh=True`` gives a group no test has used yet, ``fresh=False`` the live one
    (a new one where a test ended it). Every group is shut down after the file."""
    from plancc.ray import PolicyGroup

    from .policy_worker import LR

    made, used = [], set()

    def take(*, fresh: bool):
        if not made or not made[-1].workers or (fresh and id(made[-1]) in used):
            made.append(PolicyGroup(2, "plans/qwen3.yaml", "tiny-qwen3", layout=Layout(dp=2), strategy="PACK", timeout_s=600,
                                    optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": LR}}))
        used.add(id(made[-1]))
        return made[-1]

    yield take
    for group in made:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_public_policy_method_is_the_groups_with_no_list_to_keep():
    """Each public ``Policy`` method is the group's (run on every actor; rank 0's result), or one it
    runs in its own way or cannot carry, named with the reason (``NOT_FORWARDED``)."""
    from plancc import Policy
    from plancc.engine.ray_group import NOT_FORWARDED
    from plancc.ray import PolicyGroup

    public = {n for n, m in vars(Policy).items() if not n.startswith("_") and callable(m)}
    assert public - NOT_FORWARDED <= set(vars(PolicyGroup)), public - NOT_FORWARDED - set(vars(PolicyGroup))
    assert {"save", "load", "export_hf", "offload", "onload", "weights_manifest"} <= set(vars(PolicyGroup))
    assert "weights" not in vars(PolicyGroup) and "slice_of" not in vars(PolicyGroup)
    assert PolicyGroup.export_hf.__doc__.startswith("``Policy.export_hf`` on every actor")


def test_a_policy_group_of_ray_actors_equals_the_torchrun_path_bitwise(group_of_two):
    import torch

    from plancc.models import load_config

    from .distributed import launch
    from .policy_worker import ROWS_PER_RANK, global_batch, grpo, torchrun_reference_for_ray

    want = launch(torchrun_reference_for_ray, 2, "plans/qwen3.yaml", "tiny-qwen3", {"dp": 2})
    batch = global_batch(ROWS_PER_RANK * 2, load_config("tiny-qwen3").vocab_size, seed=13)
    group = group_of_two(fresh=True)
    before = group.logprobs(batch)
    metrics = group.train(batch, grpo, micro_batch_size=3)
    after = group.logprobs(batch)
    expected_before = torch.cat([want[r]["logprobs"] for r in sorted(want, key=lambda r: want[r]["start"])])
    expected_after = torch.cat([want[r]["after"] for r in sorted(want, key=lambda r: want[r]["start"])])
    assert torch.equal(before, expected_before)
    assert torch.equal(after, expected_after)
    assert {k: v for k, v in metrics.items() if k != "seconds"} == want[0]["metrics"]
    assert not torch.equal(before, after)  # the step moved the policy


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_actors_are_placed_together_and_a_dead_actor_is_one_error_that_ends_the_group(group_of_two):
    """The group's actors hold one placement group (a bundle each); an actor whose process dies
    mid-train fails the driver's call at once with one PolicyGroupError naming its rank -- not
    after the process group's timeout -- the other actor is ended and the reservation freed."""
    import time

    from ray.util.placement_group import placement_group_table

    from plancc.models import load_config
    from plancc.ray import PolicyGroupError

    from .policy_worker import ROWS_PER_RANK, dies_on_rank_1, global_batch

    batch = global_batch(ROWS_PER_RANK * 2, load_config("tiny-qwen3").vocab_size, seed=13)
    group = group_of_two(fresh=False)  # a step or none: what follows is the same
    try:
        table = placement_group_table(group.placement)
        assert table["state"] == "CREATED" and table["strategy"] == "PACK" and len(table["bundles"]) == 2
        assert group.logprobs(batch).shape == batch["input_ids"].shape  # one answer per dp slice
        workers, placement = list(group.workers), group.placement
        started = time.monotonic()
        with pytest.raises(PolicyGroupError, match="rank 1's actor died") as caught:
            group.train(batch, dies_on_rank_1)
        assert time.monotonic() - started < 120, "the dead actor was seen at once, not after a timeout"
        assert "other actors were ended" in str(caught.value)
        with pytest.raises(ray.exceptions.RayActorError):  # rank 0's actor, left waiting in a collective: ended
            ray.get(workers[0].call.remote("weights_manifest"), timeout=60)
        assert placement_group_table(placement)["state"] == "REMOVED"
    finally:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # the resharded refit itself: tests/test_reshard.py; the group: the bitwise test above
def test_a_resharded_refit_through_the_group_gives_the_engine_the_policys_logprobs(tmp_path, cluster):
    """Every actor joins the weight channel (as its global rank) and sends the engine at tp=2 only
    the shards it holds; the engine's model then gives the group's log-probs."""
    import json

    from plancc.models import load_config
    from plancc.ray import PolicyGroup

    from .distributed import free_port, launch_beside
    from .reshard_worker import MODEL, PLAN, _batch, receiver_rank

    port = free_port()
    manifest = tmp_path / "manifest.json"
    group = PolicyGroup(2, PLAN, MODEL, layout=Layout(dp=2))
    try:
        manifest.write_text(json.dumps({**group.weights_manifest(), "policy_ranks": 2}))
        engine = launch_beside(receiver_rank, 2, port, str(manifest))
        group.open_channel("127.0.0.1", port, world_size=4, backend="gloo", reshard=True)
        sent = group.send_weights(reshard=True)
        group.close_channel()
        want = group.logprobs(_batch(load_config(MODEL).vocab_size))
        receivers = engine.result(timeout=300)
    finally:
        group.shutdown()
    assert sent > 0
    for rank, got in receivers.items():
        assert 0 < got["received"] <= 1.05 * got["shard"], (rank, got)
        assert (got["logprobs"] - want).abs().max() <= 1e-5, rank
