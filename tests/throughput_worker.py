"""Rank-side code of tests/test_throughput.py (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo, sized


def balanced_and_contiguous_steps(plan, model_name):
    """One ``train`` step of a long-tailed global batch at dp2 from the same weights twice: each
    rank holding ``slice_of``'s rows, then ``balanced_slices``' rows. Returns the loss of each,
    the largest parameter difference after the two steps, and each way's tokens per rank."""
    import torch

    import plancc
    from plancc.engine.batches import default_token_mask

    init_gloo()
    policy = plancc.Policy(plan, model_name, optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}}, layout=sized(dp=2))
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([40, 4, 6, 38, 5, 36, 3, 7])  # the long rows first on rank 0: 119 tokens against 21
    ids = torch.randint(0, policy.config.vocab_size, (8, 40), generator=gen)
    mask = (torch.arange(40)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids * mask, "attention_mask": mask}

    def nll(lp, mb, norm):
        return -(lp * default_token_mask(mb["attention_mask"]).float()).sum() / norm.tokens, {}

    initial = [t.clone() for t in policy._shards()]
    out = {}
    after = {}
    for way, rows in (("contiguous", policy.slice_of(8)), ("balanced", policy.balanced_slices(mask.sum(1)))):
        with torch.no_grad():
            for param, value in zip(policy._shards(), initial, strict=True):
                param.copy_(value)
        mine = {k: v[rows] for k, v in batch.items()}
        out[f"{way}_loss"] = policy.train(mine, nll)["loss"]
        out[f"{way}_tokens"] = int(mine["attention_mask"].sum())
        after[way] = [t.clone() for t in policy._shards()]
    out["max_parameter_diff"] = max(
        (a - b).abs().max().item() for a, b in zip(after["contiguous"], after["balanced"], strict=True)
    )
    torch.distributed.destroy_process_group()
    return out
