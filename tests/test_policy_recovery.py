"""A forward that raised (an out-of-memory, a caller's hook) leaves ``plancc.Policy`` usable: FSDP
leaves a unit whose forward never finished in its forward state, and ``reshard()`` skips such a
unit when it keeps its parameters gathered after forward (the plan's last layer, the root), so
its gathered parameters stood in for the shards and the next ``reference_logprobs`` failed on
the shapes (first seen on the GPU, 2026-11-26; docs/gpu.md). A fake world of 2 ranks at dp2:
the numbers are deterministic copies, enough to say the same weights give the same log-probs."""

import pytest
import torch


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _nll(lp, mb, norm):
    return -lp.sum() / norm.tokens, {}


@pytest.mark.parametrize("failing", ["logprobs", "train"])
def test_a_forward_that_raised_in_the_last_layer_leaves_the_policy_usable(fake_world, failing):
    import plancc

    policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", layout=plancc.Layout(dp=2), device="cpu", reference=True)
    batch = {"input_ids": torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    before = policy.logprobs(batch)
    last = policy.model.model.layers[-1].mlp  # the plan keeps the last layer gathered after forward

    def out_of_memory(*_args, **_kwargs):
        raise RuntimeError("out of memory (injected)")

    last.forward = out_of_memory
    with pytest.raises(RuntimeError, match="injected"):
        policy.logprobs(batch) if failing == "logprobs" else policy.train(batch, _nll)
    del last.forward  # the module's own forward again
    assert torch.equal(policy.reference_logprobs(batch), before)
    assert torch.equal(policy.logprobs(batch), before)
    assert torch.isfinite(torch.tensor(policy.train(batch, _nll)["loss"]))
