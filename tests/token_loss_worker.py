"""Rank-side code of tests/test_token_loss.py (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo, sized


def fails_on_rank_1(plan, model_name):
    """tp2: a token loss that raises on rank 1 only; the error each rank sees, whether the
    weights stayed as they were, and whether the next step trains."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.batches import BatchError

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=sized(tp=2))
    batch = {"input_ids": torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])

    def poisoned(lp, tok, norm):
        if dist.get_rank() == 1:
            raise RuntimeError("poisoned")
        return -lp.sum() / norm.tokens

    before = [t.clone() for t in policy._shards()]
    out = {"error": ""}
    try:
        policy.train(batch, token_loss=poisoned, micro_batch_size=2)
    except BatchError as exc:
        out["error"] = str(exc)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(policy._shards(), before, strict=True))
    metrics = policy.train(batch, token_loss=lambda lp, tok, norm: -lp.sum() / norm.tokens)
    out["trains_after"] = bool(torch.isfinite(torch.tensor(metrics["loss"])))
    dist.destroy_process_group()
    return out
