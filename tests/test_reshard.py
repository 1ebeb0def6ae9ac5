"""Resharded refit: a rollout engine of its own at tp=2 gets from a policy at tp=2 only its own
shard of each weight, straight from the policy ranks that hold it (bytes received per receiver
rank <= 1.05 x its shard), and its sharded model then gives the policy's log-probs."""

import pytest

# B drawn at random, so the merged weights differ from the base before the step too
LORA = {"r": 4, "alpha": 8, "init_lora_weights": False, "targets": ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("ranks", "layout", "dtype", "lora", "refits", "model"),
    [
        pytest.param(2, {"tp": 2}, None, None, 1, "tiny-qwen3", marks=pytest.mark.extended),  # dp2 x tp2 covers tp
        pytest.param(2, {"dp": 2}, None, None, 1, "tiny-qwen3", marks=pytest.mark.extended),  # dp2 x tp2 covers dp
        pytest.param(4, {"dp": 2, "tp": 2}, None, None, 1, "tiny-qwen3", marks=pytest.mark.extended),  # bf16, LoRA
        (4, {"dp": 2, "tp": 2}, "bfloat16", None, 1, "tiny-qwen3"),
        (4, {"dp": 2, "tp": 2}, None, LORA, 2, "tiny-qwen3"),
        (4, {"pp": 2, "tp": 2}, None, LORA, 1, "tiny-qwen3-tied"),
        pytest.param(4, {"pp": 2, "dp": 2}, None, None, 1, "tiny-qwen3", marks=pytest.mark.extended),  # strided-free
    ],
    ids=["tp2", "dp2", "dp2xtp2", "dp2xtp2-bf16", "dp2xtp2-lora-merged-twice", "pp2xtp2-tied-lora", "pp2xdp2"],
)
def test_each_engine_rank_receives_only_its_shard_and_computes_the_policys_logprobs(
    tmp_path, ranks, layout, dtype, lora, refits, model
):
    """At tp2 both layouts line up (policy rank t sends rank t its shard); at dp2 the policy's
    FSDP rows cut across the engine's tp shards and each engine rank assembles its shard from
    both policy ranks' pieces; at dp2 x tp2 the column-sharded weights are FSDP's strided shards,
    each rank's a box of rows of its tp shard: every policy rank sends its own piece of them too,
    and no rank gathers a whole tensor -- a rank never holds more than the largest parameter plus
    the piece on its way. In bf16 (``send_weights(dtype=)``) the engine's shards
    arrive in bf16, half the bytes. A policy with LoRA adapters sends each adapted weight merged,
    piece by piece, to an engine that has no adapters: its log-probs are the adapted policy's.
    A second refit on the channel (after another step) reuses the first's transfer plan: no
    member reads the store, and the engine's log-probs are the policy's after that step.
    From pipeline stages each piece goes out from a rank of the stage that holds it: a tied
    model's embedding from the first stage once (its copy on the last stage is not sent), LoRA
    merged from the adapters of the stage that holds them."""
    import torch

    from .distributed import free_port, launch, launch_beside
    from .reshard_worker import policy_side, receiver_rank

    port = free_port()
    manifest = tmp_path / "manifest.json"
    engine = launch_beside(receiver_rank, 2, port, str(manifest), 60, refits)
    policy = launch(policy_side, ranks, port, str(manifest), layout, dtype, None, lora, None, refits, model)
    receivers = engine.result(timeout=300)
    slices = {got["start"]: got["logprobs"] for got in policy.values()}  # tp ranks of a slice: the same rows
    want = torch.cat([slices[start] for start in sorted(slices)])
    for rank, got in receivers.items():
        assert 0 < got["received"] <= 1.05 * got["shard"], (rank, got["received"], got["shard"])
        assert got["dtypes"] == [f"torch.{dtype or 'float32'}"], (rank, got["dtypes"])
        # bf16 weights move the log-probs by their rounding (~1e-2 here), fp32 ones not at all
        assert (got["logprobs"] - want).abs().max() <= (5e-2 if dtype else 1e-5), rank
        assert got["later_refits_store_reads"] == [0] * (refits - 1), (rank, got["later_refits_store_reads"])
    for rank, got in policy.items():
        assert got["later_refits_store_reads"] == [0] * (refits - 1), (rank, got["later_refits_store_reads"])
        assert got["peak"] <= 2 * got["largest"], (rank, got)
        assert got["strided_total"] == 0, (rank, got)  # no tensor gathered whole, strided ones included
    # the whole model crossed once: every policy rank sent its own part, and what the policy
    # sent is what the engine received, byte for byte
    sent = [p["sent"] for p in policy.values()]
    assert sum(sent) == sum(got["received"] for got in receivers.values()), sent
    if "pp" not in layout:  # stages differ in size; the ranks of one stage do not
        assert all(s > 0 for s in sent) and max(sent) <= 1.05 * min(sent), sent  # each its own piece, no more
    else:
        assert all(s > 0 for s in sent), sent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_policy_rank_failing_mid_resharded_refit_is_one_error_on_every_policy_rank_and_ends_the_engine(tmp_path):
    """Policy rank 1 raises at its first send: both policy ranks raise the same error naming rank 1
    and its transfer (not rank 0's broken connection that follows from it) and close their broken
    channel without waiting for the engine; the engine, left waiting for rank 1's piece, fails
    within its channel's timeout instead of hanging. The next refit, to a new engine, is exact."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .distributed import free_port, launch, launch_beside
    from .reshard_worker import policy_side, receiver_rank

    import torch

    port, then = free_port(), (free_port(), str(tmp_path / "then.json"))
    manifest = tmp_path / "manifest.json"
    engine = launch_beside(receiver_rank, 2, port, str(manifest), 5)
    next_engine = launch_beside(receiver_rank, 2, *then)
    policy = launch(policy_side, 2, port, str(manifest), {"dp": 2}, None, "send:raise@1", None, then)
    assert len({got["error"] for got in policy.values()}) == 1, policy  # the same error on every rank
    error = policy[0]
    assert error["type"] == "AgreedRefitError" and "rank 1, transfer " in error["error"], error
    assert "injected failure (send:raise@1)" in error["error"], error
    # the refit broke the channel on every policy rank: close() tears it down without waiting its
    # 60 s timeout for the engine's ranks (gone by then) to agree
    assert all(got["broken"] for got in policy.values()), policy
    with pytest.raises(ChildFailedError):  # an engine rank failed: its channel's timeout, not a hang
        engine.result(timeout=300)
    # the next refit after the failed one, on a new channel to a new engine, is exact
    want = torch.cat([got["logprobs"] for got in sorted(policy.values(), key=lambda got: got["start"])])
    for rank, got in next_engine.result(timeout=300).items():
        assert (got["logprobs"] - want).abs().max() <= 1e-5, rank


def test_a_refits_layouts_are_its_own_and_the_previous_refits_are_deleted():
    """Each resharded refit publishes its layouts under its own keys of the channel's store and
    deletes the previous refit's: no refit reads another's boxes (an engine that changed its
    layout between refits, or a refit that failed half-published)."""
    from datetime import timedelta

    import torch.distributed as dist

    from plancc.engine.channel import WeightChannel
    from plancc.engine.reshard import _publish, _read

    store = dist.HashStore()
    channel = WeightChannel(group=None, store=store, rank=0, world_size=1, device="cpu", timeout=timedelta(seconds=1))
    channel.refits = 1
    _publish(channel, {"w": {"box": [[0], [4]], "owner": True}})
    channel.refits = 2
    _publish(channel, {"w": {"box": [[0], [2]], "owner": True}})
    assert _read(channel, 0) == {"w": {"box": [[0], [2]], "owner": True}}
    assert not store.check(["boxes/1/0"]) and store.check(["boxes/2/0"])
