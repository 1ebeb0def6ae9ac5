"""``Policy.train(token_loss=fn)``: a loss that is a sum of per-token terms trains through the
fused lm_head (issue 40, point 2) -- the gradient formed while each chunk's logits are computed,
3 matmuls for the vocabulary projection where log-probs handed to a ``loss_fn`` cost 4 -- with
the numbers of the ``loss_fn`` path for the same sum. (Against the unsharded model at every
layout: ``tests/test_policy.py``'s ``*_tokens`` cases.) A real world of one rank here; a
refusal on one of two real ranks at the end."""

import pytest
import torch

B, S = 6, 24
LENGTHS = [24, 5, 9, 17, 3, 12]


def _policy():
    import plancc

    return plancc.Policy(
        "plans/qwen3.yaml",
        "tiny-qwen3",
        device="cpu",
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        max_grad_norm=None,  # clipping would hide a scaled gradient
    )


def _batch():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {
        "input_ids": torch.randint(0, 200, (B, S), generator=gen) * mask,
        "attention_mask": mask,
        "token_mask": torch.nn.functional.pad(mask[:, 1:], (1, 0)).bool(),
        "old_logprobs": -torch.rand(B, S, generator=gen) * 3,
        "ref_logprobs": -torch.rand(B, S, generator=gen) * 3,
        "advantages": torch.randn(B, generator=gen),
    }


def grpo_per_token(lp, tok, norm, eps=0.2, beta=0.05):
    mask = tok["token_mask"].float()
    ratio = torch.exp(lp - tok["old_logprobs"])
    surrogate = torch.minimum(ratio * tok["advantages"], ratio.clamp(1 - eps, 1 + eps) * tok["advantages"])
    delta = tok["ref_logprobs"] - lp
    kl = torch.exp(delta) - delta - 1
    return ((beta * kl - surrogate) * mask).sum() / norm.tokens, {"kl_sum": (kl.detach() * mask).sum()}


def grpo_per_microbatch(lp, mb, norm):
    """The same sum over ``[rows, s]``: the per-row advantages broadcast over positions."""
    return grpo_per_token(lp, {**mb, "advantages": mb["advantages"][:, None].expand_as(lp)}, norm)


def _step(policy, batch, **kwargs):
    metrics = policy.train(batch, **kwargs)
    return metrics, [t.detach().clone() for t in policy._shards()]


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-lm-head", "logits-path"])
def test_a_token_loss_trains_as_the_loss_fn_of_the_same_sum(one_rank, monkeypatch, pack, fused):
    if not fused:  # a model whose logits are more than lm_head(hidden) takes the log-probs path
        monkeypatch.setenv("PLANCC_FUSED_LM_HEAD", "0")
    cut = {"max_tokens": 30, "pack": pack, "temperature": 0.7}
    want, want_weights = _step(_policy(), _batch(), loss_fn=grpo_per_microbatch, **cut)
    got, got_weights = _step(_policy(), _batch(), token_loss=grpo_per_token, **cut)
    assert got["microbatches"] == want["microbatches"] > 1
    for key in ("loss", "grad_norm", "kl_sum"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    for a, b in zip(got_weights, want_weights, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_token_loss_path_runs_one_vocabulary_matmul_fewer(one_rank):
    """4 matmuls of ``[tokens, hidden] x [hidden, vocab]`` become 3: the backward's recompute of
    the logits is gone, and nothing else changes (a FLOP count of the whole step)."""
    from torch.utils.flop_counter import FlopCounterMode

    policy = _policy()
    batch = {"input_ids": torch.randint(0, 200, (4, 32)), "attention_mask": torch.ones(4, 32, dtype=torch.long)}
    flops = {}
    for way, loss in (
        ("loss_fn", {"loss_fn": lambda lp, mb, n: -lp.sum() / n.tokens}),
        ("token_loss", {"token_loss": lambda lp, t, n: -lp.sum() / n.tokens}),
    ):
        with FlopCounterMode(display=False) as counter:
            policy.train(batch, **loss)
        flops[way] = counter.get_total_flops()
    one_matmul = 2 * 4 * 32 * policy.config.vocab_size * policy.config.hidden_size
    assert flops["loss_fn"] - flops["token_loss"] == one_matmul, flops


def test_train_takes_one_loss_and_no_entropy_for_a_token_loss(one_rank):
    policy, batch = _policy(), _batch()
    with pytest.raises(TypeError, match="one loss"):
        policy.train(batch)
    with pytest.raises(TypeError, match="one loss"):
        policy.train(batch, grpo_per_microbatch, token_loss=grpo_per_token)
    with pytest.raises(ValueError, match="entropy"):
        policy.train(batch, token_loss=grpo_per_token, entropy=True)


def test_a_token_loss_that_reads_a_missing_field_is_refused_naming_it(one_rank):
    from plancc.engine.batches import BatchError

    policy, batch = _policy(), _batch()
    before = [t.clone() for t in policy._shards()]
    del batch["ref_logprobs"]
    with pytest.raises(BatchError, match="ref_logprobs"):
        policy.train(batch, token_loss=grpo_per_token)
    assert all(torch.equal(a, b) for a, b in zip(policy._shards(), before, strict=True))  # no step


def test_every_field_comes_at_its_token_and_zero_where_there_is_no_log_prob():
    from plancc.engine.batches import Microbatch

    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "per_token": torch.tensor([[10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]]),
        "per_row": torch.tensor([1.5, 2.5]),
    }
    for pack in (False, True):
        mb = Microbatch.of(batch, [0, 1], multiple=1, pack=pack)
        where = mb.batch_positions()
        evaluated = torch.tensor([where.reshape(-1)[1].item(), -1, where.reshape(-1)[-1].item()])
        tokens = mb.per_token(evaluated)
        flat = where.reshape(-1)
        row_of_last = int(flat[-1]) // 4
        assert tokens["per_token"].tolist() == [
            batch["per_token"].reshape(-1)[int(flat[1])].item(),
            0.0,
            batch["per_token"].reshape(-1)[int(flat[-1])].item(),
        ]
        assert tokens["per_row"].tolist() == [1.5, 0.0, batch["per_row"][row_of_last].item()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_token_loss_that_fails_on_one_rank_is_refused_on_every_rank():
    """The evaluator runs a tp collective between chunks: a rank whose loss raised must still
    reach them all, and the step is refused on both ranks, naming the rank and the microbatch."""
    from .distributed import launch
    from .token_loss_worker import fails_on_rank_1

    results = launch(fails_on_rank_1, 2, "plans/qwen3.yaml", "tiny-qwen3")
    for rank, got in results.items():
        assert "rank 1" in got["error"] and "microbatch 0" in got["error"] and "poisoned" in got["error"], (rank, got)
        assert got["unchanged"] and got["trains_after"], (rank, got)


def test_a_frozen_lm_head_costs_no_weight_gradient(one_rank):
    """With LoRA the lm_head is frozen: the token-loss path forms no gradient for its weight
    (no matmul whose output is a ``[vocab, hidden]`` weight gradient), one vocabulary matmul of
    three saved."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import plancc

    class WeightGradients(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.seen = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
                self.seen += tuple(out.shape) == self.shape
            return out

    batch = {"input_ids": torch.randint(0, 200, (4, 32)), "attention_mask": torch.ones(4, 32, dtype=torch.long)}
    seen = {}
    for way, lora in (("full", None), ("lora", {"r": 4, "targets": ["model.layers.*.self_attn.q_proj"]})):
        policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", device="cpu", lora=lora, max_grad_norm=None)
        with WeightGradients((policy.config.vocab_size, policy.config.hidden_size)) as mode:
            policy.train(batch, token_loss=lambda lp, t, n: -lp.sum() / n.tokens)
        seen[way] = mode.seen
    assert seen["full"] > 0 and seen["lora"] == 0, seen  # full: one addmm per chunk of tokens
