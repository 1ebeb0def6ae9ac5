"""Log-probs, entropy and the training loss straight from hidden states: the lm_head fused
into the evaluator, so the ``[N, V]`` logits (``[N, V/tp]`` under TP) never exist.

For a chunk of tokens at a time: the local matmul ``h_c @ W_local.T`` in fp32 (exact fp32
accumulation whatever the input dtype), then per token the max, the sum of exponentials and
the target's logit over the local vocabulary. Under TP these three numbers per token are
combined over the tp group with two small all-reduces after the loop, so the collectives
carry O(tokens), never O(tokens x vocab).

Two backward strategies, because a gradient that depends on the caller's ``grad_output``
cannot be formed before it exists:

- ``fused_logprobs``: any downstream function (RL ratios, clipping, KL). Backward recomputes
  the logits and forms the gradients of hidden and weight: 4 matmuls in all. On CPU, when
  there are at least twice as many local vocabulary columns as tokens, forward and backward walk blocks of
  vocabulary columns over all tokens instead of chunks of tokens (``default_columns``): the
  forward then keeps a running max per token, as the tp merge does across ranks.
- ``fused_nll_loss``: a loss that is a weighted sum of the log-probs (the SFT/pre-training
  loss, weights = mask / count). The weights are known in forward, so the gradients are
  formed right there, chunk by chunk, while the logits are hot: 3 matmuls, as many as the
  naive ``log_softmax(h @ W.T)`` forward and backward, and backward only scales them.

Sampler-filtered log-probs (``top_k`` / ``top_p``) need the whole vocabulary of a token to
rank it, so that mode gathers each chunk's logits over tp (one chunk, never all of them).

On CUDA (with Triton) the per-chunk statistics and the logits' gradient are single-pass
kernels (``fused_kernels``); elsewhere, and for the filtered mode, the PyTorch chunk math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import fused_kernels
from .fused_walk import (
    _all_reduce_sum,
    _as_fp32,
    _Backward,
    _chunk_logits,
    _chunk_stats,
    _ChunkLogits,
    _Chunks,
    _filtered_chunk,
    _finish_grad,
    _fp32_weight,
    _grad_by_columns,
    _grad_by_tokens,
    _grad_matmuls,
    _kernel_grad,
    _stats_by_columns,
    _stats_by_tokens,
    _Vocab,
    _widths,
    default_columns,
)
from .mesh import MeshLike
from .vocab_stats import combine_over_ranks, default_chunk


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab: _Vocab,
        chunks: _Chunks,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, chunk = hidden.shape[0], chunks.forward
        widths = _widths(weight.shape[0], vocab.group)
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if entropy else lp.new_empty(0)
        # Statistics of the plain path are combined once for all chunks (2 collectives in
        # all); the filtered path combines per chunk inside _filtered_chunk.
        if vocab.filtered:
            logits = _ChunkLogits(weight, chunk)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                x = _chunk_logits(hidden[lo:hi], logits, vocab)
                lp[lo:hi], lse[lo:hi], e, keep = _filtered_chunk(x, targets[lo:hi], vocab, widths, entropy)
                if e is not None:
                    ent[lo:hi] = e
                del x, keep
        else:
            if chunks.columns is not None:
                stats = _stats_by_columns(hidden, _as_fp32(weight), targets, vocab, chunks.columns, entropy)
            else:
                stats = _stats_by_tokens(hidden, weight, targets, vocab, chunk, entropy)
            full_lse, full_picked, full_ent = combine_over_ranks(stats, vocab.group)
            lse.copy_(full_lse)
            lp.copy_(torch.where(targets != vocab.ignore_index, full_picked - full_lse, torch.zeros_like(full_lse)))
            if entropy and full_ent is not None:
                ent.copy_(torch.where(targets != vocab.ignore_index, full_ent, torch.zeros_like(full_ent)))
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.vocab, ctx.chunks, ctx.entropy, ctx.widths = vocab, chunks, entropy, widths
        ctx.mark_non_differentiable(lse)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        vocab: _Vocab = ctx.vocab
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        g_ent = g_ent.float() if (ctx.entropy and g_ent is not None) else None
        chunks: _Chunks = ctx.chunks
        e_all = ent if ctx.entropy else None
        grad_w: torch.Tensor | None
        if chunks.columns is not None:  # set only for the unfiltered PyTorch path (_prepare)
            walk = _Backward(hidden, _as_fp32(weight), targets, lse, e_all, g_lp, g_ent, vocab)
            grad_h, grad_w = _grad_by_columns(walk, chunks.columns)
        else:
            fast = fused_kernels.active(hidden.device) and not vocab.filtered
            walk = _Backward(hidden, weight, targets, lse, e_all, g_lp, g_ent, vocab)
            grad_h, grad_w = _grad_by_tokens(walk, chunks.grad, fast, ctx.widths, ctx.needs_input_grad[1])
        # every tp rank holds a partial sum over its columns; the hidden states are replicated
        if not vocab.partial_hidden_grad:
            _all_reduce_sum(grad_h, vocab.group)
        weight_grad = grad_w.to(weight.dtype) if grad_w is not None and ctx.needs_input_grad[1] else None
        return grad_h.to(hidden.dtype), weight_grad, None, None, None, None


TokenLossFn = Callable[[torch.Tensor, slice], torch.Tensor]


def _chunk_loss(
    loss_fn: TokenLossFn, lp: torch.Tensor, index: slice, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the chunk's loss, d loss / d log-probs when gradients are wanted): ``loss_fn`` run on
    the chunk's log-probs with autograd on, so any per-token expression gives its own gradient."""
    grad = None
    with torch.enable_grad():
        leaf = lp.detach().requires_grad_(need_grad)
        loss = loss_fn(leaf, index)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (the summed loss of the chunk's tokens), got {got}")
        if need_grad and loss.requires_grad:
            _refuse_other_gradients(loss, leaf)
            (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if need_grad and grad is None:  # a loss that does not depend on these log-probs
        grad = torch.zeros_like(lp)
    return loss.detach().float(), None if grad is None else grad.float()


def _refuse_other_gradients(loss: torch.Tensor, leaf: torch.Tensor) -> None:
    """Refuse a ``loss_fn`` result that depends on a tensor requiring grad besides the chunk's
    log-probs (a value head's output, a learned coefficient, old log-probs left attached): its
    gradient would be dropped without a word, because only hidden and weight get gradients.

    Walks the loss's autograd graph to the first leaf that accumulates a gradient and is not
    the log-probs. Everything ``loss_fn`` built from the log-probs and constants is a handful of
    nodes; a graph from outside ends at such a leaf (a parameter) within a few steps."""
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        other = getattr(node, "variable", None)  # AccumulateGrad: a leaf that requires grad
        if other is not None and other is not leaf:
            raise ValueError(
                f"loss_fn uses a tensor that requires grad besides the log-probs (shape {tuple(other.shape)}): "
                "fused_token_loss forms gradients for hidden and weight only, so that tensor's gradient "
                "would be lost. Detach it if it is a constant (old log-probs, advantages, a mask), or call "
                "fused_logprobs and apply the loss yourself when it should train as well"
            )
        stack.extend(fn for fn, _ in node.next_functions)


class _FusedTokenLoss(torch.autograd.Function):
    """``sum over chunks of loss_fn(logprobs of the chunk)`` with the gradients formed in forward:
    each token's term depends on its own log-prob only, so d loss / d logprob is known as soon as
    the chunk's log-probs are (``fused_token_loss``)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: TokenLossFn,
        vocab: _Vocab,
        chunks: _Chunks,
        need_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, chunk = hidden.shape[0], chunks.grad if need_grad else chunks.forward
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        # a frozen weight (LoRA's lm_head) gets no gradient: the third vocabulary matmul skipped
        weight_grad = need_grad and weight.requires_grad
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        fast = fused_kernels.active(hidden.device)
        w32 = _fp32_weight(weight, fast) if need_grad else None
        logits = _ChunkLogits(weight, chunk, w32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            h = hidden[lo:hi]
            st, x = _chunk_stats(h, logits, targets[lo:hi], vocab, False)
            lse, picked, _ = combine_over_ranks(st, vocab.group)  # per chunk: the gradient needs it now
            valid = targets[lo:hi] != vocab.ignore_index
            lp[lo:hi] = torch.where(valid, picked - lse, torch.zeros_like(lse))
            loss, g = _chunk_loss(loss_fn, lp[lo:hi], slice(lo, hi), need_grad)
            total += loss
            if grad_h is not None and g is not None:
                if fast:  # masks ignore_index targets itself, as _local_grad_logits does
                    gx = _kernel_grad(x, targets[lo:hi], lse, None, g, None, vocab, weight.dtype)
                else:  # x holds exp(x - m) now: the softmax over the whole vocabulary is one scale away
                    p = x.mul_((st.m - lse).exp_().unsqueeze(1))
                    gx = _finish_grad(p, targets[lo:hi], g * valid, vocab)
                _grad_matmuls(gx, weight, w32, h, grad_h[lo:hi], grad_w)
                del gx
            del x  # every name of this chunk's storage: the next chunk must not coexist with it
        if grad_h is not None and not vocab.partial_hidden_grad:
            _all_reduce_sum(grad_h, vocab.group)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.spent = False
        ctx.mark_non_differentiable(lp)
        return total, lp

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor, _g_lp: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.spent:
            raise RuntimeError(
                "a second backward through fused_token_loss (retain_graph): its gradients were formed in "
                "forward and the first backward took them"
            )
        ctx.spent = True
        grad_h, *rest = ctx.saved_tensors
        grad_w = rest[0] if rest else None  # none for a frozen weight
        # scaled in place, whatever g_loss is: asking whether it is 1 would be a device read
        # (a GPU's queue stalled once per microbatch); one pass over them costs less
        grad_h.mul_(g_loss)
        if grad_w is not None:
            grad_w.mul_(g_loss)
            grad_w = grad_w.to(ctx.dtypes[1])
        return grad_h.to(ctx.dtypes[0]), grad_w, None, None, None, None, None


_TARGETS_CHECKED: ContextVar[bool] = ContextVar("plancc_targets_checked", default=False)


@contextmanager
def targets_checked() -> Iterator[None]:
    """Inside, the evaluator does not check that every target is in the vocabulary: the caller
    checked the token ids already (``Policy`` does, once per step, on every rank), and the check
    is a device read per call, which stalls a GPU's queue once per microbatch."""
    token = _TARGETS_CHECKED.set(True)
    try:
        yield
    finally:
        _TARGETS_CHECKED.reset(token)


def _vocab_of(
    weight: torch.Tensor, group: dist.ProcessGroup | None, vocab_start: int | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int, int]:
    """(local rows, tp group or None, first row, global rows) of an lm_head weight: a plain
    tensor (with ``group`` for a vocab shard) or a DTensor sharded on dim 0."""
    if isinstance(weight, DTensor):
        placements = weight.placements
        if any(isinstance(p, Shard) and p.dim != 0 for p in placements) or not all(
            isinstance(p, (Shard, Replicate)) for p in placements
        ):
            raise ValueError(f"the lm_head weight must be sharded on the vocab dim (0) only, got {placements}")
        size = weight.shape[0]
        if not any(isinstance(p, Shard) for p in placements):
            return weight.to_local(), None, 0, size
        if weight.device_mesh.ndim != 1:
            raise ValueError("a vocab-sharded lm_head weight must live on a 1-D (tp) mesh")
        with unset_fake_temporarily():  # the mesh's coordinates are host data, also in the dry run's fake world
            _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
        return weight.to_local(), weight.device_mesh.get_group(), offset[0], size
    local_rows = weight.shape[0]
    if group is None or dist.get_world_size(group) == 1:
        return weight, None, 0, local_rows
    widths = _widths(local_rows, group)
    start = sum(widths[: dist.get_rank(group)]) if vocab_start is None else vocab_start
    return weight, group, start, sum(widths)


def _prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    mesh: MeshLike | None,
    vocab_start: int | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    ignore_index: int,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Vocab, _Chunks]:
    """Flat hidden states, local weight, flat targets, the vocabulary, and how to chunk the
    logits: an explicit ``chunk_size`` is tokens per chunk everywhere; by default unfiltered
    ``fused_logprobs`` on CPU may walk vocabulary columns instead, forward and backward
    (``default_columns``)."""
    if group is None and mesh is not None:
        group = mesh["tp"].get_group()
    local_w, group, start, size = _vocab_of(weight, group, vocab_start)
    partial = False
    if isinstance(hidden, DTensor):
        if not all(isinstance(p, Replicate) for p in hidden.placements):
            raise ValueError(f"hidden states must be replicated over tp, got {hidden.placements}")
        partial = group is not None and hidden.device_mesh.ndim == 1 and hidden.device_mesh.get_group() == group
        hidden = hidden.to_local(grad_placements=[Partial()] if partial else None)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets {tuple(targets.shape)} do not match hidden states {tuple(hidden.shape)} without the hidden dim"
        )
    if hidden.shape[-1] != local_w.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the lm_head weight {tuple(local_w.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    flat_t = targets.reshape(-1)
    bad = (flat_t != ignore_index) & ((flat_t < 0) | (flat_t >= size))
    if not _TARGETS_CHECKED.get() and bool(bad.any()):  # a device read: skipped where checked before
        raise ValueError(
            f"target {int(flat_t[bad][0])} is outside the vocabulary [0, {size}) and is not ignore_index={ignore_index}"
        )
    vocab = _Vocab(
        group=group,
        start=start,
        size=size,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        ignore_index=ignore_index,
        partial_hidden_grad=partial,
    )
    n, v_local = targets.numel(), local_w.shape[0]
    if chunk_size is not None:
        chunks = _Chunks(chunk_size, chunk_size)
    else:
        columns = None if vocab.filtered else default_columns(n, v_local, hidden.device)
        chunks = _Chunks(
            default_chunk(n, v_local, hidden.device), default_chunk(n, v_local, hidden.device, grad=True), columns
        )
    return hidden.reshape(-1, hidden.shape[-1]), local_w, flat_t, vocab, chunks


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: MeshLike | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    ignore_index: int = -100,
    entropy: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target) under ``softmax(hidden @ weight.T / temperature)`` without building the
    logits: fp32 ``[...]`` for ``hidden [..., H]`` and ``targets [...]``, identical on every
    tp rank. With ``entropy=True``: ``(logprobs, entropy)`` of each token's distribution.

    ``weight``: the lm_head weight ``[V, H]``, or this rank's vocab rows of it -- a DTensor
    sharded on dim 0 (its mesh gives the group and offset), or a plain shard with its tp group:
    ``mesh`` (a ``ParallelMesh``, whose ``tp`` axis it is) or ``group``, the keyword of plancc
    0.1 (``vocab_start`` is derived from the shard sizes when omitted). ``hidden``: the same
    tokens on every tp rank (a replicated DTensor is accepted).
    ``top_k`` / ``top_p``: the distribution as a sampler saw it (temperature, then top-k, then
    top-p; filtered-out targets get -inf). ``ignore_index`` targets give 0 (log-prob and
    entropy) and no gradient;
    any other target outside the vocabulary is an error.
    Differentiable in ``hidden`` and ``weight`` (log-probs and entropy).
    """
    h, w, t, vocab, chunks = _prepare(
        hidden,
        weight,
        targets,
        group=group,
        mesh=mesh,
        vocab_start=vocab_start,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
    )
    lp, ent = _FusedLogprobs.apply(h, w, t, vocab, chunks, entropy)
    if entropy:
        return lp.reshape(targets.shape), ent.reshape(targets.shape)
    return lp.reshape(targets.shape)


def fused_nll_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: MeshLike | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-sum(weights * logprobs), logprobs)``: a training loss from hidden states and the
    lm_head weight (same layouts as ``fused_logprobs``), with its gradients formed during
    forward while each chunk's logits are in hand. The log-probs come back detached."""
    if weights.shape != targets.shape:
        raise ValueError(f"weights {tuple(weights.shape)} do not match targets {tuple(targets.shape)}")
    flat = weights.reshape(-1).float()

    def nll(lp: torch.Tensor, index: slice) -> torch.Tensor:
        return -(flat[index] * lp).sum()

    return fused_token_loss(
        hidden,
        weight,
        targets,
        nll,
        group=group,
        mesh=mesh,
        vocab_start=vocab_start,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
    )


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: TokenLossFn,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: MeshLike | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logprobs)`` for a loss that is a sum of per-token terms, each a function of its
    own token's log-prob -- a PPO / GRPO clipped objective, a KL penalty against reference
    log-probs, a weighted NLL -- with the gradients formed in forward: 3 matmuls, where
    ``fused_logprobs`` followed by the same loss needs 4 (its backward must recompute the
    softmax it could not keep).

    ``loss_fn(logprobs, index)`` gets the fp32 log-probs of the flat token positions ``index``
    (a slice of ``targets.reshape(-1)``; ``ignore_index`` targets give 0 and no gradient) and
    returns the summed loss of those tokens as a scalar tensor; index your per-token constants
    (old log-probs, advantages, mask / count) with it. It is called once per chunk, so a term
    that mixes tokens (a sequence-level ratio, a mean over what it is given) would be wrong:
    use ``fused_logprobs`` for those. Gradients flow to ``hidden`` and ``weight`` only: what
    ``loss_fn`` closes over must be constant, and a closed-over tensor that requires grad is
    refused with a ValueError (its gradient would be lost). Layouts as in ``fused_logprobs``; the log-probs come
    back detached, identical on every tp rank. ``temperature``: the log-probs are the sampler's
    (the logits divided by it), as ``fused_logprobs`` gives them."""
    h, w, t, vocab, chunks = _prepare(
        hidden,
        weight,
        targets,
        group=group,
        mesh=mesh,
        vocab_start=vocab_start,
        temperature=temperature,
        top_k=None,
        top_p=None,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
    )
    need_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    loss, lp = _FusedTokenLoss.apply(h, w, t, loss_fn, vocab, chunks, need_grad)
    return loss, lp.reshape(targets.shape)
