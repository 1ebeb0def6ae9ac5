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

import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..models import LOGIT_TRANSFORMS, transforms_logits
from .cp_context import CPContext, all_gather, context_of, load_balanced_indices, load_balanced_indices_packed
from .document_attention import set_documents
from .fused_logprobs import fused_logprobs
from .mesh import MeshLike, device_mesh_of
from .unpacked_rows import unpacked_rows
from .vocab_stats import ChunkStats, combine_over_ranks, default_chunk


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk: int,
        ignore_index: int,
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
        # logsumexp over ranks from the per-rank ones: 2 collectives of O(tokens) values
        lse, picked, _ = combine_over_ranks(ChunkStats.of_logsumexp(lse, picked), group)
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start, ctx.chunk, ctx.ignore_index = vocab_start, chunk, ignore_index
        valid = flat_t != ignore_index
        return torch.where(valid, picked - lse, torch.zeros_like(lse)).reshape(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        v_local = logits.shape[-1]
        rows = logits.reshape(-1, v_local)
        flat_t = targets.reshape(-1)
        g = grad_out.reshape(-1).float() * (flat_t != ctx.ignore_index)  # ignored targets: no gradient
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
        return grad.reshape(logits.shape), None, None, None, None, None


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
    ignore_index: int = -100,
) -> torch.Tensor:
    """log p(target) from this rank's vocab shard of the logits; fp32, identical on every rank.
    ``ignore_index`` targets give 0 and no gradient; any other target outside the vocabulary
    is an error. Pass contiguous logits (a ``[:, :-1]`` slice of a batch is copied whole):
    to drop the last position, give it the ``ignore_index`` target instead.

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
    chunk = chunk_size or default_chunk(rows, logits.shape[-1], logits.device)
    _check_targets(targets, logits.shape[-1], group, ignore_index)
    return _VocabParallelLogprob.apply(logits, targets, group, vocab_start, chunk, ignore_index)


def _check_targets(targets: torch.Tensor, v_local: int, group: dist.ProcessGroup | None, ignore_index: int) -> None:
    """A target outside the vocabulary would silently give -logsumexp: refuse it (under TP
    only negative ones: the upper bound is the sum of the shards)."""
    bad = (targets != ignore_index) & (targets < 0)
    if group is None or dist.get_world_size(group) == 1:
        bad |= targets >= v_local
    if bool(bad.any()):
        raise ValueError(
            f"target {int(targets[bad].flatten()[0])} is outside the vocabulary and is not ignore_index={ignore_index}"
        )


def _dtensor_layout(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(local vocab shard, tp group or None, vocab_start) of DTensor logits."""
    if any(isinstance(p, Shard) and p.dim not in (-1, logits.ndim - 1) for p in logits.placements):
        raise ValueError(f"logits must be sharded on the vocab dim only, got {logits.placements}")
    if not any(isinstance(p, Shard) for p in logits.placements):
        return logits.to_local(), None, 0
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    return logits.to_local(), logits.device_mesh.get_group(), offset[-1]


def vocab_layout(
    logits: torch.Tensor, model: torch.nn.Module, mesh: MeshLike | None
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
    whole = device_mesh_of(mesh)
    group = whole["tp"].get_group() if "tp" in (whole.mesh_dim_names or ()) else whole.get_group()
    return local, group, None


def _text_config(model: torch.nn.Module) -> Any:
    config: Any = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def fusable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are exactly ``lm_head(hidden)`` of a bias-free linear head,
    so log-probs can be taken from the hidden states without building the logits.
    ``PLANCC_FUSED_LM_HEAD=0`` turns the fused path off everywhere (the logits path, to
    compare with or for a model that transforms its logits in a way plancc does not know)."""
    if os.environ.get("PLANCC_FUSED_LM_HEAD", "1") == "0":
        return False
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    return not transforms_logits(_text_config(model))


@contextmanager
def lm_head_bypassed(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While active, the model's lm_head computes nothing: a forward fills the yielded dict
    with the lm_head's input (``hidden``, after the plan's input layout hooks: gathered
    from sequence shards under SP, a replicated DTensor under TP) and its weight as FSDP
    presents it during that forward (``weight``). The model returns empty logits."""
    head: Any = model.get_output_embeddings()  # type: ignore[operator]  # transformers' PreTrainedModel
    seen: dict[str, torch.Tensor] = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        seen["hidden"], seen["weight"] = hidden, head.weight
        return hidden[..., :0]  # what the output hooks and the model's own code see

    head.forward = forward  # an instance attribute: nn.Module.__call__ still runs the hooks
    try:
        with warnings.catch_warnings():
            # FSDP2 (torch 2.13) warns when a root module returns a view, as in-place ops on one
            # skip its backward hook; the empty placeholder above is never written to
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            yield seen
    finally:
        del head.forward


def through_output(value: torch.Tensor, output: Any) -> torch.Tensor:
    """``value``, computed from what ``lm_head_bypassed`` saw, made a function of the model's
    own (empty) logits too.

    FSDP2 runs a module's backward hooks from gradients that reach its forward outputs: the
    root's pre-backward hook is what queues the final callback that reduce-scatters every
    gradient into the sharded parameters the optimizer holds. The fused evaluator reads the
    hidden states and the lm_head weight beside the output, so without this nothing flows back
    through the root's output; where the root is the only FSDP unit (a plan without ``fsdp``
    units), the gradients then stayed on the gathered parameters and the optimizer stepped
    nothing. Adding the sum of the empty logits changes no value and no gradient."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor) or not logits.requires_grad:
        return value
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    assert local.numel() == 0, "the bypassed lm_head returns empty logits"
    return value + local.sum().to(value.dtype)


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


def _cp_size(cp: MeshLike) -> int:
    mesh = device_mesh_of(cp)
    return (mesh["cp"] if "cp" in (mesh.mesh_dim_names or ()) else mesh).size()


IGNORE_INDEX = -100


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The token each position predicts; the last position predicts nothing (ignored)."""
    targets = torch.roll(input_ids, shifts=-1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    return targets


def model_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    document_bounds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of one forward: packed rows (``cu_seqlens``) get position ids
    that restart at every document. A model that attends per document
    (``runtime.document_attention``) is told the documents (``document_bounds``: the host copy
    of ``cu_seqlens``, when the caller has one) and gets an all-ones mask, so transformers
    builds no ``[T, T]`` one from the position ids."""
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1:
            raise ValueError("packed sequences are one row: input_ids [1, T] with cu_seqlens")
        position_ids = packed_position_ids(cu_seqlens, input_ids.shape[1])
    documents = None if cu_seqlens is None else (document_bounds if document_bounds is not None else cu_seqlens)
    if set_documents(model, documents):
        attention_mask = torch.ones_like(input_ids)
    # use_cache=False: transformers only detects packed documents when there is no KV cache
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}


def local_positions(ctx: CPContext, seq: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The positions of a full-length sequence this cp rank computes, in the order it holds them
    (the load-balanced head-tail layout, per document when packed)."""
    if cu_seqlens is not None:
        return load_balanced_indices_packed(cu_seqlens, ctx.size, ctx.rank).to(device)
    return load_balanced_indices(seq, ctx.size, ctx.rank).to(device)


def _positions_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    *,
    mesh: MeshLike | None,
    temperature: float,
    chunk_size: int | None,
    entropy: bool,
    top_k: int | None,
    top_p: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of ``targets`` at every position the model computes, entropy or None).

    Fused: the decoder runs with its lm_head bypassed and the evaluator applies the lm_head
    weight chunk by chunk, so no logits exist. Models whose logits are more than
    ``lm_head(hidden)`` take the logits path (log-probs only)."""
    if fusable(model):
        with lm_head_bypassed(model) as seen, unpacked_rows(model, inputs):
            output = model(**inputs)
        result = fused_logprobs(
            seen["hidden"],
            seen["weight"],
            targets,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            ignore_index=IGNORE_INDEX,
            entropy=entropy,
            chunk_size=chunk_size,
        )
        if isinstance(result, tuple):
            return through_output(result[0], output), through_output(result[1], output)
        return through_output(result, output), None
    if entropy or top_k is not None or top_p is not None:
        raise ValueError(
            f"entropy, top_k and top_p need a model whose logits are lm_head(hidden); {type(model).__name__} "
            f"transforms them ({', '.join(LOGIT_TRANSFORMS)})"
        )
    with unpacked_rows(model, inputs):
        logits = model(**inputs).logits
    local, group, start = vocab_layout(logits, model, mesh)
    if temperature != 1.0:
        local = local / temperature
    lp = vocab_parallel_logprobs(
        local, targets, group=group, vocab_start=start, chunk_size=chunk_size, ignore_index=IGNORE_INDEX
    )
    return lp, None


@overload
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    mesh: MeshLike | None = None,
    position_ids: torch.Tensor | None = None,
    cp: MeshLike | None = None,
    temperature: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
    entropy: Literal[False] = False,
    top_k: int | None = None,
    top_p: float | None = None,
    document_bounds: Sequence[int] | None = None,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    mesh: MeshLike | None = None,
    position_ids: torch.Tensor | None = None,
    cp: MeshLike | None = None,
    temperature: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
    entropy: Literal[True],
    top_k: int | None = None,
    top_p: float | None = None,
    document_bounds: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    mesh: MeshLike | None = None,
    position_ids: torch.Tensor | None = None,
    cp: MeshLike | None = None,
    temperature: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
    entropy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    document_bounds: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(token_i | tokens_<i) for every position: ``[B, S]`` fp32; with ``entropy=True``
    also the entropy of the distribution each position's token was drawn from: a pair.

    Position 0 (and the first token of every packed document) is 0; padded positions
    (``attention_mask == 0``, left or right padding) are 0, and so is the first real token
    after left padding (nothing in the sequence predicts it). Works for an unsharded model and for one
    parallelized by ``plancc.parallelize`` (TP, SP, CP: a CP model is recognized; ``cp`` may
    name its mesh explicitly).
    Packed sequences: ``input_ids`` is one row ``[1, T]`` and ``cu_seqlens`` the document
    boundaries ``[0, l0, l0+l1, ..., T]``; attention never crosses a boundary.
    ``temperature``, ``top_k``, ``top_p``: the distribution as the sampler saw it
    (``plancc.logprobs.fused_logprobs``). The logits are never built unless the model
    transforms them after its lm_head (soft-capping, logit scales). ``document_bounds``:
    ``cu_seqlens`` as a host list, when the caller has it (saves reading it from the device).
    """
    cp_enabled = context_of(model) is not None
    if not cp_enabled and cp is not None and _cp_size(cp) > 1:
        raise ValueError(
            f"cp={_cp_size(cp)} was given but the model was not parallelized with it "
            "(plancc.parallelize with a mesh whose cp axis is > 1)"
        )
    options: dict[str, Any] = {
        "mesh": mesh,
        "temperature": temperature,
        "chunk_size": chunk_size,
        "entropy": entropy,
        "top_k": top_k,
        "top_p": top_p,
    }
    inputs = model_inputs(model, input_ids, attention_mask, cu_seqlens, position_ids, document_bounds)
    targets = next_tokens(input_ids)
    if cp_enabled:
        # a model parallelized with cp > 1 computes its sequence shard only: the cp path is
        # the only right one, whether or not the caller passed ``cp``
        lp, ent = _cp_positions_logprobs(model, inputs, targets, cu_seqlens, options)
    else:
        lp, ent = _positions_logprobs(model, inputs, targets, **options)
    lp = per_position(lp[:, :-1], attention_mask, cu_seqlens)
    if ent is None:
        return lp
    return lp, per_position(ent[:, :-1], attention_mask, cu_seqlens)


def _cp_positions_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    options: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_positions_logprobs`` for a model parallelized with cp > 1 (its cp group is the
    model's own). Every cp rank passes the same full-length batch; each evaluates its
    load-balanced shard of the positions (targets shifted globally, then sharded), and the
    shards are gathered back in order: the full ``[B, S]`` on every rank."""
    ctx = context_of(model)
    assert ctx is not None, "token_logprobs takes this path only for a model with a cp context"
    if cu_seqlens is not None:
        inputs = {**inputs, "cu_seqlens": cu_seqlens}
    local_targets = targets.index_select(1, local_positions(ctx, targets.shape[1], cu_seqlens, targets.device))
    lp, ent = _positions_logprobs(model, inputs, local_targets, **options)
    lp = all_gather(lp, ctx.group, dim=1, cu_seqlens=cu_seqlens)
    return lp, (all_gather(ent, ctx.group, dim=1, cu_seqlens=cu_seqlens) if ent is not None else None)
