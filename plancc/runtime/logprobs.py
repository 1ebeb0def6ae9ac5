"""Exact token log-probs from vocab-parallel logits, in bounded memory.

With TP the lm_head's logits are sharded over the vocabulary: rank r holds columns
``[vocab_start, vocab_start + V_local)``. log p(t) = x_t - logsumexp(x) needs a max, a sum of
exponentials and the target's logit from whichever rank holds it: three numbers per token,
so the collectives carry O(tokens), never O(tokens x vocab).

Memory: the forward pass walks the logits in row chunks (a fused logsumexp per chunk, read
in place for fp32 logits) and keeps only the per-token logsumexp (fp32) for backward;
backward recomputes softmax chunk by chunk straight into the gradient. Peak extra memory is
one fp32 chunk, whatever the logits' size or dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .cp import all_gather, context_of, load_balanced_indices, load_balanced_indices_packed

# Rows per chunk, chosen so one fp32 chunk is about this many bytes. On CPU a chunk that
# stays in cache between the passes is fastest. On GPU each chunk costs a handful of kernel
# launches, so chunks are larger: a sixteenth of the fp32 logits, between the two bounds.
CPU_CHUNK_BYTES = 4 * 2**20
GPU_CHUNK_BYTES = (4 * 2**20, 256 * 2**20)


def _default_chunk(rows: int, v_local: int, device: torch.device) -> int:
    row_bytes = 4 * max(1, v_local)
    if device.type == "cpu":
        target = CPU_CHUNK_BYTES
    else:
        low, high = GPU_CHUNK_BYTES
        target = min(high, max(low, rows * row_bytes // 16))
    return max(1, target // row_bytes)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk: int,
    ) -> torch.Tensor:
        v_local = logits.shape[-1]
        rows = logits.reshape(-1, v_local)
        flat_t = targets.reshape(-1)
        n = rows.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            # fp32 logits are read in place; other dtypes through one fp32 chunk
            x = rows[lo:hi].float()
            local_t = flat_t[lo:hi] - vocab_start
            here = (local_t >= 0) & (local_t < v_local)
            hit = x.gather(1, local_t.clamp(0, v_local - 1).unsqueeze(1)).squeeze(1)
            picked[lo:hi] = torch.where(here, hit, torch.zeros_like(hit))
            lse[lo:hi] = torch.logsumexp(x, dim=1)  # one fused pass over the chunk
            del x, hit  # free this chunk before the next one is allocated
        if group is not None and dist.get_world_size(group) > 1:
            # logsumexp over ranks from the per-rank ones: 2 collectives of O(tokens) values
            m = lse.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            stacked = torch.stack([(lse - m).exp_(), picked])
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
            lse = m + stacked[0].log()
            picked = stacked[1]
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start, ctx.chunk = vocab_start, chunk
        return (picked - lse).reshape(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        v_local = logits.shape[-1]
        rows = logits.reshape(-1, v_local)
        flat_t = targets.reshape(-1)
        g = grad_out.reshape(-1).float()
        grad = torch.empty_like(rows)
        in_place = grad.dtype == torch.float32  # compute straight into the gradient
        for lo in range(0, rows.shape[0], ctx.chunk):
            hi = min(rows.shape[0], lo + ctx.chunk)
            # d logp(t) / d x_j = 1[j == t] - softmax_j, times the incoming gradient
            if in_place:
                p = torch.sub(rows[lo:hi], lse[lo:hi].unsqueeze(1), out=grad[lo:hi])
            else:  # one fp32 chunk: the converted copy is worked on in place
                p = rows[lo:hi].float().sub_(lse[lo:hi].unsqueeze(1))
            p.exp_().mul_(-g[lo:hi].unsqueeze(1))
            local_t = flat_t[lo:hi] - ctx.vocab_start
            here = (local_t >= 0) & (local_t < v_local)
            idx = local_t.clamp(0, v_local - 1).unsqueeze(1)
            p.scatter_add_(1, idx, torch.where(here, g[lo:hi], torch.zeros_like(g[lo:hi])).unsqueeze(1))
            if not in_place:
                grad[lo:hi] = p
            del p  # free this chunk before the next one is allocated
        return grad.reshape(logits.shape), None, None, None, None


def _shard_start(logits_local: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """This rank's first vocab column, from every rank's shard width (uneven splits too)."""
    if group is None or dist.get_world_size(group) == 1:
        return 0
    widths: list[int] = [0] * dist.get_world_size(group)
    dist.all_gather_object(widths, int(logits_local.shape[-1]), group=group)
    return sum(widths[: dist.get_rank(group)])


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(target) from this rank's vocab shard of the logits; fp32, identical on every rank.

    ``logits``: ``[..., V_local]``, a plain tensor (with ``group``; ``vocab_start`` is derived
    from the shard widths when omitted) or a DTensor sharded on its last dim (group and start
    come from its mesh). ``targets``: token ids with the same leading shape (already shifted).
    """
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        if mesh.ndim != 1:
            raise ValueError("vocab_parallel_logprobs expects logits on a 1-D (tp) mesh")
        _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
        group = mesh.get_group()
        vocab_start = offset[-1] if vocab_start is None else vocab_start
        logits = logits.to_local()
    if vocab_start is None:
        vocab_start = _shard_start(logits, group)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)} without the vocab dim"
        )
    rows = logits.numel() // max(1, logits.shape[-1])
    chunk = chunk_size or _default_chunk(rows, logits.shape[-1], logits.device)
    return _VocabParallelLogprob.apply(logits, targets, group, vocab_start, chunk)


def _dtensor_layout(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(local vocab shard, tp group or None, vocab_start) of DTensor logits."""
    if any(isinstance(p, Shard) and p.dim not in (-1, logits.ndim - 1) for p in logits.placements):
        raise ValueError(f"logits must be sharded on the vocab dim only, got {logits.placements}")
    if not any(isinstance(p, Shard) for p in logits.placements):
        return logits.to_local(), None, 0
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    return logits.to_local(), logits.device_mesh.get_group(), offset[-1]


def vocab_layout(
    logits: torch.Tensor, model: torch.nn.Module, mesh: DeviceMesh | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int | None]:
    """(local logits, tp group or None, vocab_start) for a model's output logits.

    DTensor logits say how they are laid out. Plain logits are either the whole vocabulary
    (lm_head kept whole or gathered, e.g. HF's ``colwise_rep``) or this rank's vocab shard
    (``colwise`` with a local output): the width against the config's vocab size decides.
    Treating whole logits as a shard would all-reduce tp copies and shift every log-prob
    by log(tp).
    """
    if isinstance(logits, DTensor):
        return _dtensor_layout(logits)
    local = logits
    config: Any = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or local.shape[-1] >= vocab:
        return local, None, 0
    if mesh is None:
        raise ValueError(
            f"the logits hold {local.shape[-1]} of {vocab} vocabulary entries (a tp shard): "
            "pass mesh= so the shards can be combined"
        )
    group = mesh["tp"].get_group() if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()
    return local, group, None


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids that restart at every document of a packed row: [1, total]."""
    bounds = cu_seqlens[1:-1].long()
    doc_start = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    doc_start[bounds] = bounds
    doc_start = torch.cummax(doc_start, dim=0).values  # each position's document start
    return (torch.arange(total, device=cu_seqlens.device) - doc_start).unsqueeze(0)


def per_position(
    next_token_logprobs: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """``[B, S]`` fp32 from the log-probs of tokens 1..S-1: 0 wherever the sequence itself
    defines no log-prob -- position 0, padding, the first real token after left padding
    (the logits before it were computed from padding alone), the first token of each
    packed document."""
    batch, seq = next_token_logprobs.shape[0], next_token_logprobs.shape[1] + 1
    result = torch.zeros((batch, seq), dtype=torch.float32, device=next_token_logprobs.device)
    result[:, 1:] = next_token_logprobs
    if attention_mask is not None:
        real = attention_mask.bool()
        keep = real.clone()
        keep[:, 1:] &= real[:, :-1]
        result = result * keep.to(torch.float32)
    if cu_seqlens is not None:
        result[:, cu_seqlens[:-1].long()] = 0.0
    return result


def _cp_size(cp: DeviceMesh) -> int:
    return (cp["cp"] if "cp" in (getattr(cp, "mesh_dim_names", None) or ()) else cp).size()


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    mesh: DeviceMesh | None = None,
    position_ids: torch.Tensor | None = None,
    cp: DeviceMesh | None = None,
    temperature: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(token_i | tokens_<i) for every position: ``[B, S]`` fp32.

    Position 0 (and the first token of every packed document) is 0; padded positions
    (``attention_mask == 0``, left or right padding) are 0, and so is the first real token
    after left padding (nothing in the sequence predicts it). Works for an unsharded model and for one
    parallelized by ``plancc.parallelize`` (TP, SP, CP: a CP model is recognized; ``cp`` may
    name its mesh explicitly).
    Packed sequences: ``input_ids`` is one row ``[1, T]`` and ``cu_seqlens`` the document
    boundaries ``[0, l0, l0+l1, ..., T]``; attention never crosses a boundary.
    """
    cp_enabled = context_of(model) is not None
    if not cp_enabled and cp is not None and _cp_size(cp) > 1:
        raise ValueError(
            f"cp={_cp_size(cp)} was given but the model was not parallelized with it "
            "(plancc.parallelize with a mesh whose cp axis is > 1)"
        )
    if cp_enabled:
        # a model parallelized with cp > 1 hands back logits of its sequence shard only:
        # the cp path is the only right one, whether or not the caller passed ``cp``
        return _cp_token_logprobs(
            model,
            input_ids,
            mesh=mesh,
            attention_mask=attention_mask,
            position_ids=position_ids,
            temperature=temperature,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
        )
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1:
            raise ValueError("packed sequences are one row: input_ids [1, T] with cu_seqlens")
        position_ids = packed_position_ids(cu_seqlens, input_ids.shape[1])
    # use_cache=False: transformers only detects packed documents when there is no KV cache
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    local, group, start = vocab_layout(out.logits, model, mesh)
    shifted = local[:, :-1]
    if temperature != 1.0:
        shifted = shifted / temperature
    lp = vocab_parallel_logprobs(shifted, input_ids[:, 1:], group=group, vocab_start=start, chunk_size=chunk_size)
    return per_position(lp, attention_mask, cu_seqlens)


def _cp_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mesh: DeviceMesh | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    temperature: float,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """``token_logprobs`` for a model parallelized with cp > 1 (the cp group is the model's own).

    Every cp rank passes the same full-length batch;
    each computes its shard's log-probs (targets shifted globally, then sharded), and the
    shards are gathered back in order: the result is the full ``[B, S]`` on every rank.
    """
    ctx = context_of(model)
    assert ctx is not None, "token_logprobs takes this path only for a model with a cp context"
    if cu_seqlens is not None:
        position_ids = packed_position_ids(cu_seqlens, input_ids.shape[1])
    seq = input_ids.shape[1]
    targets = torch.roll(input_ids, shifts=-1, dims=1)  # token i predicts token i+1 (global shift)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **({"cu_seqlens": cu_seqlens} if cu_seqlens is not None else {}),
    )
    local, group, start = vocab_layout(out.logits, model, mesh)
    if temperature != 1.0:
        local = local / temperature
    if cu_seqlens is not None:
        index = load_balanced_indices_packed(cu_seqlens, ctx.size, ctx.rank)
    else:
        index = load_balanced_indices(seq, ctx.size, ctx.rank)
    local_targets = targets.index_select(1, index.to(targets.device))
    lp_local = vocab_parallel_logprobs(local, local_targets, group=group, vocab_start=start, chunk_size=chunk_size)
    lp = all_gather(lp_local, ctx.group, dim=1, cu_seqlens=cu_seqlens)
    return per_position(lp[:, :-1], attention_mask, cu_seqlens)
