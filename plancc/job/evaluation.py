"""A training run's eval (``--eval-data``, or ``--eval-split`` of a hub-layout ``--data``
folder): the mean next-token NLL over every held-out row, each row once, in file order, at
``--eval-every`` steps and at the end.

The same tokens counted as training counts them (a row's masks, never position 0), each dp rank
scoring its share of each batch through ``Policy.logprobs`` (no gradient, dropout off); the sum
of NLL and the token count are summed over every rank and divided once, so the number is the
unsharded model's loss over all eval tokens whatever the layout (tp, cp and pp ranks that hold
the same rows add the same sums to both: the ratio is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..engine.policy import Policy
from .data import TokenDataset, rows_batch


def eval_batches(data: TokenDataset, *, batch_size: int, seq_len: int | None) -> Iterator[dict[str, torch.Tensor]]:
    """Every eval row once, ``batch_size`` a batch, with ``token_mask`` (what the loss counts);
    the last batch filled up to ``batch_size`` with rows that count nothing (every dp rank gets
    rows, and no row is counted twice)."""
    rows = len(data.sequences)
    for start in range(0, rows, batch_size):
        picked = list(range(start, min(start + batch_size, rows)))
        real = len(picked)
        picked += [picked[-1]] * (batch_size - real)
        batch = rows_batch(data, picked, seq_len=seq_len)
        if "token_mask" not in batch:
            batch["token_mask"] = batch["attention_mask"].clone()
            batch["token_mask"][:, 0] = 0
        batch["token_mask"][real:] = 0
        yield batch


def evaluate(policy: Policy, data: TokenDataset, *, batch_size: int, seq_len: int | None) -> dict[str, float]:
    """``{"eval_loss": mean NLL over the counted tokens, "eval_tokens": their number}``, on every
    rank alike. Collective."""
    device = policy.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in eval_batches(data, batch_size=batch_size, seq_len=seq_len):
        mine = policy.balanced_slices(batch["attention_mask"].sum(1))
        rows = {name: batch[name][mine].to(device) for name in ("input_ids", "attention_mask")}
        counted = batch["token_mask"][mine].to(device)
        logprobs = policy.logprobs(rows)
        assert isinstance(logprobs, torch.Tensor)
        totals[0] -= (logprobs.double() * counted).sum()
        totals[1] += counted.sum()
    # each rank holding a dp share adds it once per copy (tp, cp, pp ranks of the same rows): the
    # copies scale both sums alike, so the ratio is every token's mean NLL
    copies = torch.ones(1, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    dist.all_reduce(copies)
    dp = policy.dp_size
    tokens = totals[1].item() * dp / copies.item()
    return {"eval_loss": totals[0].item() / max(1.0, totals[1].item()), "eval_tokens": round(tokens)}
