"""Losses for ``Policy.train`` that plancc itself runs (``plancc apply`` and its ``--verify``)."""

from __future__ import annotations

import torch

from .policy import BatchTotals


def token_nll(lp: torch.Tensor, tokens: dict[str, torch.Tensor], norm: BatchTotals) -> tuple[torch.Tensor, dict]:
    """The SFT / pre-training loss, the mean next-token NLL over the global batch's tokens (this
    group of tokens' share of it: divided by the global count, ``norm.tokens``), as a sum of
    per-token terms for ``train(token_loss=)``: the 3-matmul lm_head. A token without a log-prob
    comes with every field 0, so its ``attention_mask`` there is ``default_token_mask``'s 0. A
    batch with a ``token_mask`` (prompt masking: the tokens the loss counts) weighs by it, as
    ``norm.tokens`` counts it."""
    counted = tokens.get("token_mask", tokens["attention_mask"])
    return -(lp * counted.to(lp.dtype)).sum() / norm.tokens, {}
