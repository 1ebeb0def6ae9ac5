"""The training loss of a parallelized causal LM, from vocab-parallel logits.

The logits are never built where the model's logits are ``lm_head(hidden)``: the loss comes
from the hidden states and the (vocab-sharded) lm_head weight (``fused_nll_loss``); other
models' logits stay vocab-sharded and are never gathered (``F.cross_entropy`` would need
them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cp_context import load_balanced_indices
from .fused_logprobs import fused_nll_loss
from .mesh import MeshLike, dp_cp_mesh
from .vocab_parallel_logprobs import (
    IGNORE_INDEX,
    fusable,
    lm_head_bypassed,
    through_output,
    vocab_layout,
    vocab_parallel_logprobs,
)


def masked_next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross entropy over the positions whose target is not padding."""
    targets = input_ids[:, 1:].clone()
    if mask is not None:
        targets[mask[:, 1:] == 0] = -100
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def sharded_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, mesh: MeshLike) -> torch.Tensor:
    """The loss to backpropagate for one dp slice: the masked next-token mean.

    Fused where the model allows (``fusable``): the decoder runs with its lm_head bypassed
    and ``fused_nll_loss`` applies the lm_head weight (vocab-sharded under TP) chunk by
    chunk, forming the gradients as it goes, so no logits exist. Otherwise the exact
    vocab-parallel log-probs of the logits the model returns. With cp each rank holds a
    load-balanced shard of the positions: targets are shifted on the whole sequence, then
    sharded, and the rank's sum is scaled by cp / (valid targets of the slice); FSDP's
    average over the dp_cp ranks then yields exactly the gradient of the slice's mean loss.
    """
    cp = mesh["cp"].size()
    targets = torch.roll(ids, -1, dims=1)
    valid = mask.clone()
    valid[:, :-1] = mask[:, 1:]  # a position counts when the token it predicts is real
    valid[:, -1] = 0  # the last position predicts nothing
    targets = targets.masked_fill(valid == 0, IGNORE_INDEX)
    if cp > 1:
        index = load_balanced_indices(ids.shape[1], cp, mesh["cp"].get_local_rank()).to(ids.device)
        targets = targets.index_select(1, index)
    weights = (targets != IGNORE_INDEX).float() * (cp / valid.sum().clamp(min=1))
    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    if fusable(model):
        with lm_head_bypassed(model) as seen:
            output = model(**inputs)
        loss, _ = fused_nll_loss(seen["hidden"], seen["weight"], targets, weights, ignore_index=IGNORE_INDEX)
        return through_output(loss, output)
    local, group, start = vocab_layout(model(**inputs).logits, model, mesh)
    logprobs = vocab_parallel_logprobs(local, targets, group=group, vocab_start=start, ignore_index=IGNORE_INDEX)
    return -(logprobs * weights).sum()


def reported_loss(loss: torch.Tensor, mesh: MeshLike) -> float:
    """The mean loss over the global batch, from every rank's share of it."""
    value = loss.detach().clone()
    dist.all_reduce(value, group=dp_cp_group(mesh))
    return value.item() / (mesh["dp"].size() * mesh["cp"].size())


def dp_cp_group(mesh: MeshLike) -> dist.ProcessGroup:
    return dp_cp_mesh(mesh).get_group()


def batch_slice(mesh: MeshLike, global_batch: int) -> slice:
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = global_batch // dp
    return slice(rank * per, (rank + 1) * per)


def causal_lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, *, mesh: MeshLike, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The next-token cross entropy of a model parallelized by ``plancc.parallelize``, for an
    own training loop: this rank passes its data-parallel slice of the batch (full-length
    sequences, also under context parallelism) and back-propagates the result.

    The loss is the mean over the slice's predicted tokens (padding excluded), computed from
    vocab-parallel logits without gathering them (``model(..., labels=...).loss`` fails on
    the DTensor logits of the shipped plans: "mixed torch.Tensor and DTensor"); FSDP's
    gradient average over the dp ranks then gives the gradient of the global mean when the
    slices hold equal numbers of tokens.
    """
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    return sharded_loss(model, input_ids, mask, mesh)
