"""HSDP (torchtitan's dp_replicate x dp_shard): replicas of the FSDP-sharded model among the
data-parallel ranks. What it must be: the same training as the unsharded model on the whole
batch (``--verify`` at dp_replicate 2 x dp_shard 2), FSDP's gathers and reduce-scatters inside a
replica and one all-reduce of the gradient shards between replicas (nothing else), checkpoints
any layout resumes, and a layout suggest can cost and print."""

from __future__ import annotations

import pytest

import plancc
from plancc.layout import LayoutError
from plancc.models import load_config
from plancc.tools.dryrun import layer_traffic

from .conftest import PLANS, forked_cli
from .test_training_run import losses

QWEN3 = PLANS / "qwen3.yaml"


def test_a_layout_splits_dp_into_replicas_of_a_sharded_model():
    layout = plancc.Layout(dp=4, dp_replicate=2, tp=2)
    assert (layout.dp, layout.dp_shard, layout.fsdp_size, layout.world_size) == (4, 2, 2, 8)
    assert layout.describe() == "dp_replicate=2 dp_shard=2 cp=1 tp=2"
    assert plancc.Layout(**layout.to_json()) == layout
    assert "dp_replicate" not in plancc.Layout(dp=4).to_json()  # older readers read a plain layout as before
    assert plancc.Layout.infer(world_size=8, tp=2, dp_replicate=2) == layout


@pytest.mark.parametrize(
    "sizes,says",
    [
        ({"dp": 4, "dp_replicate": 3}, "dp_replicate=3 does not divide dp=4"),
        ({"dp": 4, "dp_replicate": 2, "ep": 2}, "HSDP with expert parallelism is not supported"),
    ],
)
def test_replicas_that_do_not_fit_are_refused_by_the_layout(sizes, says):
    with pytest.raises(LayoutError, match=says):
        plancc.Layout(**sizes)


def test_a_replica_gathers_and_reduce_scatters_inside_and_all_reduces_between_replicas():
    """One decoder layer's collectives (the dry run's fake world): plain FSDP over 4 ranks
    all-gathers and reduce-scatters on all of them; HSDP 2 x 2 does the same inside a replica
    and adds exactly one all-reduce, between the replicas, in backward."""
    plan, config = plancc.load_plan(QWEN3), load_config("tiny-qwen3")

    def by_axis(layout):
        traffic = layer_traffic(plan, config, layout, seq_len=16).layer
        return sorted((c.phase, c.axis, c.kind, c.count) for c in traffic.collectives)

    assert by_axis(plancc.Layout(dp=4)) == [
        ("backward", "dp_cp", "all_gather", 1),
        ("backward", "dp_cp", "reduce_scatter", 1),
        ("forward", "dp_cp", "all_gather", 1),
    ]
    assert by_axis(plancc.Layout(dp=4, dp_replicate=2)) == [
        ("backward", "dp_replicate", "all_reduce", 1),
        ("backward", "dp_shard_cp", "all_gather", 1),
        ("backward", "dp_shard_cp", "reduce_scatter", 1),
        ("forward", "dp_shard_cp", "all_gather", 1),
    ]


def test_with_cp_and_tp_the_replicas_leave_every_other_collective_as_it_was():
    """At dp 4 x cp 2 x tp 2 + SP (16 ranks, the fake world) HSDP's replicas shard over dp_shard x
    cp and add one all-reduce; the cp and tp collectives are plain FSDP's, call for call."""
    plan, config = plancc.load_plan(QWEN3), load_config("tiny-qwen3")

    def rows(layout):
        traffic = layer_traffic(plan, config, layout, seq_len=16).layer
        return sorted((c.phase, c.axis, c.kind, c.count) for c in traffic.collectives)

    sizes = {"dp": 4, "cp": 2, "tp": 2, "sequence_parallel": True}
    plain, hsdp = rows(plancc.Layout(**sizes)), rows(plancc.Layout(**sizes, dp_replicate=2))
    inner = {"cp", "tp"}
    assert [r for r in hsdp if r[1] in inner] == [r for r in plain if r[1] in inner]
    assert [r for r in hsdp if r[1] not in inner] == [
        ("backward", "dp_replicate", "all_reduce", 1),
        ("backward", "dp_shard_cp", "all_gather", 1),
        ("backward", "dp_shard_cp", "reduce_scatter", 1),
        ("forward", "dp_shard_cp", "all_gather", 1),
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_trains_as_the_unsharded_model_and_its_checkpoint_resumes_at_plain_fsdp(tmp_path):
    """dp_replicate 2 x dp_shard 2: --verify holds (logits, loss, gradients, two steps with the
    clip); its checkpoint, resumed at dp 2 without replicas, continues the run step for step."""
    code, out, err = forked_cli(
        "apply", QWEN3, "--nproc-per-node", 4, "--dp-replicate", 2, "--dp-shard", 2, "--verify", "--steps", 2
    )
    assert code == 0, err + out
    assert "(dp_replicate=2 dp_shard=2 cp=1 tp=1) against the unsharded model" in out and "verify: OK" in out
    flags = ("--steps", 3, "--seed", 3, "--batch-size", 4)
    code, straight, err = forked_cli(
        "apply", QWEN3, *flags, "--nproc-per-node", 4, "--dp-replicate", 2, "--save", tmp_path / "ck", "--save-every", 1
    )
    assert code == 0, err
    code, resumed, err = forked_cli("apply", QWEN3, *flags, "--resume", tmp_path / "ck" / "step-000001")
    assert code == 0, err
    assert "(saved at dp_replicate=2 dp=4 cp=1 tp=1)" in resumed
    assert losses(resumed) == pytest.approx(losses(straight)[1:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_hsdp_under_pipeline_stages_trains_as_the_unsharded_model():
    """pp2 x dp_replicate 2: each stage's FSDP mesh is its own replicas' (the extended tier: the
    default run has HSDP's verify above and pipeline stages' own)."""
    code, out, err = forked_cli(
        "apply", QWEN3, "--nproc-per-node", 4, "--pp", 2, "--dp-replicate", 2, "--verify", "--steps", 2
    )
    assert code == 0, err + out
    assert "(pp=2 dp_replicate=2 dp_shard=1 cp=1 tp=1) against the unsharded model" in out and "verify: OK" in out


@pytest.mark.parametrize(
    "flags,says",
    [
        (("--dp-replicate", 3), "dp_replicate=3 does not divide dp=4"),
        (("--dp-replicate", 2, "--dp-shard", 2, "--dp", 2), "--dp 2 is not --dp-replicate 2 x --dp-shard 2"),
    ],
)
def test_replicas_that_do_not_fit_the_ranks_are_a_usage_error_before_launch(cli, flags, says):
    code, _, err = cli("apply", QWEN3, "--nproc-per-node", 4, *flags)
    assert code == 2 and says in err and "[mesh-sizes]" in err


@pytest.mark.parametrize("command", ["validate", "explain"])
def test_validate_and_explain_refuse_a_dp_that_contradicts_replicas_times_shards(cli, command):
    code, _, err = cli(command, QWEN3, "--dp", 2, "--dp-replicate", 2, "--dp-shard", 2)
    assert code == 1 and "--dp 2 is not --dp-replicate 2 x --dp-shard 2" in err and "[mesh-sizes]" in err


def test_suggest_costs_hsdp_and_prints_its_replicas(cli):
    """Across two nodes plain FSDP's gathers cross the slow link every layer; HSDP keeps them in
    a node and sends one gradient all-reduce between nodes: the best layout is HSDP, and its
    command line says --dp-replicate."""
    code, out, err = cli(
        "suggest", QWEN3, "--model", "qwen3-8b", "--gpus", 16, "--gpus-per-node", 8, "--allow", "hsdp", "--top", 3
    )
    assert code == 0, err
    best = out.split("best: ")[1]
    assert best.startswith("dp_replicate=")
    replicas = int(best.split("dp_replicate=")[1].split()[0])
    assert f"--dp-replicate {replicas} " in best


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resharded_refit_from_hsdp_sends_each_shard_once_from_one_replica(tmp_path):
    """Weights out of an HSDP policy (dp_replicate 2 x dp_shard 2) into a rollout engine at tp2:
    each engine rank receives its shard alone, from the first replica (the second holds the same
    shards and sends nothing), and computes the policy's log-probs."""
    import torch

    from .distributed import free_port, launch, launch_beside
    from .reshard_worker import policy_side, receiver_rank

    port = free_port()
    manifest = tmp_path / "manifest.json"
    engine = launch_beside(receiver_rank, 2, port, str(manifest), 60, 1)
    policy = launch(policy_side, 4, port, str(manifest), {"dp_replicate": 2}, None, None, None, None, 1)
    receivers = engine.result(timeout=300)
    slices = {got["start"]: got["logprobs"] for got in policy.values()}
    want = torch.cat([slices[start] for start in sorted(slices)])
    for rank, got in receivers.items():
        assert 0 < got["received"] <= 1.05 * got["shard"], (rank, got["received"], got["shard"])
        assert (got["logprobs"] - want).abs().max() <= 1e-5, rank
    sent = {rank: got["sent"] for rank, got in policy.items()}
    assert all(sent[r] > 0 for r in (0, 1)) and all(sent[r] == 0 for r in (2, 3)), sent
