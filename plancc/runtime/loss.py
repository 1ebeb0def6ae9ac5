"""The training loss of a parallelized causal LM, from vocab-parallel logits.

The full ``[B, S, V]`` logits are never gathered (``F.cross_entropy`` would need them): the
loss is built from ``plancc.logprobs``' exact per-token log-probs of this rank's vocab shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .cp import load_balanced_indices
from .logprobs import vocab_layout, vocab_parallel_logprobs
from .mesh import dp_cp_mesh


def masked_next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross entropy over the positions whose target is not padding."""
    targets = input_ids[:, 1:].clone()
    if mask is not None:
        targets[mask[:, 1:] == 0] = -100
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def sharded_loss(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, the model's logits as it returned them) for one dp slice.

    The loss is the masked next-token mean, computed from vocab-parallel logits where the
    plan leaves them sharded (``plancc.logprobs``): the full ``[B, S, V]`` logits are never
    gathered, as ``F.cross_entropy`` would need. With cp each rank holds a load-balanced
    shard of the positions: targets are shifted on the whole sequence, then sharded, and the
    rank's sum is scaled by cp / (valid targets of the slice); FSDP's average over the dp_cp
    ranks then yields exactly the gradient of the slice's mean loss.
    """
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    local, group, start = vocab_layout(logits, model, mesh)
    cp = mesh["cp"].size()
    targets = torch.roll(ids, -1, dims=1)
    valid = mask.clone()
    valid[:, :-1] = mask[:, 1:]  # a position counts when the token it predicts is real
    valid[:, -1] = 0  # the last position predicts nothing
    if cp > 1:
        index = load_balanced_indices(ids.shape[1], cp, mesh["cp"].get_local_rank()).to(ids.device)
        targets, local_valid = targets.index_select(1, index), valid.index_select(1, index)
    else:
        local_valid = valid
    logprobs = vocab_parallel_logprobs(local, targets, group=group, vocab_start=start)
    total = -(logprobs * local_valid.to(logprobs.dtype)).sum()
    return total * cp / valid.sum().clamp(min=1), logits


def reported_loss(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    """The mean loss over the global batch, from every rank's share of it."""
    value = loss.detach().clone()
    dist.all_reduce(value, group=dp_cp_group(mesh))
    return value.item() / (mesh["dp"].size() * mesh["cp"].size())


def dp_cp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return dp_cp_mesh(mesh).get_group()


def batch_slice(mesh: DeviceMesh, global_batch: int) -> slice:
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = global_batch // dp
    return slice(rank * per, (rank + 1) * per)


def causal_lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, *, mesh: DeviceMesh, attention_mask: torch.Tensor | None = None
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
    loss, _ = sharded_loss(model, input_ids, mask, mesh)
    return loss
