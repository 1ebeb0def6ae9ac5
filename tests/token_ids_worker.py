"""Rank-side code of tests/test_token_ids.py (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo, sized


def one_rank_with_an_id_outside_the_vocabulary(plan, model_name):
    """dp2: rank 1's rows hold a token id past the vocabulary. Returns each rank's error (every
    rank must raise, none may wait in a collective) and whether its weights stayed as they were."""
    import torch
    import torch.distributed as dist

    import plancc

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=sized(dp=2))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    if dist.get_rank() == 1:
        ids[1, 5] = policy.config.vocab_size + 7
    before = [t.clone() for t in policy._shards()]
    error = ""
    try:
        policy.train(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, lambda lp, mb, n: (-lp.sum() / n.tokens, {})
        )
    except plancc.BatchError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, policy._shards(), strict=True))
    dist.destroy_process_group()
    return {"error": error, "unchanged": unchanged}
