"""A training loss that is a sum of per-token terms, run through a whole parallelized model
with the lm_head fused into it: 3 matmuls for the vocabulary projection, where log-probs
handed to a loss cost 4 (``fused_logprobs``' backward must recompute what its forward could
not keep). What ``plancc.Policy.train(token_loss=...)`` runs.

The evaluator computes one token per model position ``q``: the log-prob of the token at
``q + 1``. ``evaluated_positions`` says, for each token this rank computes and in its order,
which position of the caller's batch that log-prob belongs to -- or -1 where the sequence
defines none (``per_position``'s rule: position 0, padding, the first token after left
padding, a packed document's first token) -- so the caller can hand its per-token constants
(old log-probs, advantages, masks) to the loss in the same order. Under context parallelism a
rank computes only its load-balanced share of the positions and its loss is that share: the
cp ranks' losses *add up* to the sequence's (no all-gather, no copies of the loss; see
``gradient_scale.token_loss_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cp_context import context_of
from .fused_logprobs import TokenLossFn, fused_token_loss
from .unpacked_rows import unpacked_rows
from .vocab_parallel_logprobs import (
    IGNORE_INDEX,
    lm_head_bypassed,
    local_positions,
    model_inputs,
    next_tokens,
    per_position,
    through_output,
)


def evaluated_positions(
    model: torch.nn.Module,
    where: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """``[tokens]`` long: for each token this rank's evaluator computes, in its order, the
    entry of ``where`` (``[rows, s]`` as the model takes the rows: the caller's own index of
    each model position, -1 where it has none) whose log-prob that token is, or -1 where the
    sequence defines no log-prob there."""
    ones = torch.ones((where.shape[0], where.shape[1] - 1), dtype=torch.float32, device=where.device)
    defined = (per_position(ones, attention_mask, cu_seqlens) > 0) & (where >= 0)
    owner = torch.where(defined, where, torch.full_like(where, -1))
    # token q predicts position q + 1; the last position predicts nothing
    predicted = torch.cat([owner[:, 1:], torch.full_like(owner[:, :1], -1)], dim=1)
    ctx = context_of(model)
    if ctx is not None:
        predicted = predicted.index_select(1, local_positions(ctx, where.shape[1], cu_seqlens, where.device))
    return predicted.reshape(-1)


def model_token_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    evaluated: torch.Tensor,
    loss_fn: TokenLossFn,
    *,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    temperature: float = 1.0,
    document_bounds: Sequence[int] | None = None,
) -> torch.Tensor:
    """The sum of ``loss_fn`` over this rank's tokens (``evaluated_positions``' order; those it
    marks -1 get log-prob 0 and no gradient), its gradient formed during the forward
    (``fused_token_loss``). The model must be ``logprobs.fusable``. Back-propagate the result:
    it reaches the hidden states, the lm_head weight and, through the model's own (empty)
    output, FSDP's hooks. ``document_bounds``: ``cu_seqlens`` on the host (``token_logprobs``)."""
    inputs = model_inputs(model, input_ids, attention_mask, cu_seqlens, document_bounds=document_bounds)
    targets = next_tokens(input_ids)
    ctx = context_of(model)
    if ctx is not None:
        if cu_seqlens is not None:
            inputs["cu_seqlens"] = cu_seqlens
        targets = targets.index_select(1, local_positions(ctx, targets.shape[1], cu_seqlens, targets.device))
    flat = targets.reshape(-1)
    if flat.shape != evaluated.shape:
        raise ValueError(f"{evaluated.numel()} evaluated positions for {flat.numel()} tokens of this rank")
    targets = torch.where(evaluated >= 0, flat, torch.full_like(flat, IGNORE_INDEX)).view(targets.shape)
    with lm_head_bypassed(model) as seen, unpacked_rows(model, inputs):
        output = model(**inputs)
    loss, _ = fused_token_loss(
        seen["hidden"], seen["weight"], targets, loss_fn, ignore_index=IGNORE_INDEX, temperature=temperature
    )
    return through_output(loss, output)
