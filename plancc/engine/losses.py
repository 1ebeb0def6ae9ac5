"""Losses for ``Policy.train`` that plancc itself runs (``plancc apply`` and its ``--verify``)."""

from __future__ import annotations

import torch

from .batches import default_token_mask
from .policy import Norm


def next_token_loss(lp: torch.Tensor, mb: dict[str, torch.Tensor], norm: Norm) -> tuple[torch.Tensor, dict]:
    """The SFT / pre-training loss: the mean next-token NLL over the global batch's tokens (this
    microbatch's share of it: divided by the global count, ``norm.tokens``)."""
    mask = default_token_mask(mb["attention_mask"]).to(lp.dtype)
    return -(lp * mask).sum() / norm.tokens, {}


def token_nll(lp: torch.Tensor, tokens: dict[str, torch.Tensor], norm: Norm) -> tuple[torch.Tensor, dict]:
    """``next_token_loss`` as a sum of per-token terms, for ``train(token_loss=)``: the same
    loss and gradient through the 3-matmul lm_head. A token without a log-prob comes with every
    field 0, so its ``attention_mask`` there is ``default_token_mask``'s 0."""
    return -(lp * tokens["attention_mask"].to(lp.dtype)).sum() / norm.tokens, {}
