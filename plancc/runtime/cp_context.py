"""Context parallelism: load-balanced sequence shards and an attention that runs anywhere.

Layout. Causal attention makes a contiguous split unbalanced (the last rank attends to
everything before it). The sequence is cut into ``2*cp`` equal chunks and rank ``r`` holds
chunks ``r`` and ``2*cp - 1 - r`` (the head-tail layout of Megatron, the reference
``_get_tokens_on_this_cp_rank`` and torch's head-tail load balancer): every rank then does
the same causal work. Packed documents are laid out the same way one document at a time.

Attention. Each rank keeps its query shard, all-gathers keys and values over the cp group
(GQA keeps them small: the Llama 3 paper's approach, and they stay at their own head count),
and attends block by block (``runtime.block_attention``): each local query chunk sees its
segment's keys before it unmasked and its own diagonal causally, merged by log-sum-exp, so no
``[S/cp, S]`` mask exists and memory grows linearly with the length. On CUDA the same blocks
are one flex-attention call a layer, whatever the number of documents (``runtime.flex_blocks``;
``PLANCC_CP_ATTENTION=blocks`` or ``flex`` chooses either anywhere). Segments are the row's
documents (packed rows, restarting positions) and its padding. It is registered as a
transformers attention implementation ("plancc_cp") and uses only all-gather and
reduce-scatter, so it runs on gloo/CPU as well as nccl/CUDA, with masks and packing, where
torch's experimental ``context_parallel`` does neither. Rows whose mask has holes (a real
token after padding after a real token) and attention dropout keep the dense reference: the
``[S/cp, S]`` mask from global positions (``PLANCC_CP_ATTENTION=dense`` chooses it always).
"""

from __future__ import annotations

import bisect
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..sequence_mixing import is_cp_attention
from .block_attention import Block, Span, block_attention, span_blocks
from .document_attention import (
    attend_per_document,
    attention_with_sinks,
    causal_window,
    enabled_by_default,
    sliding_window,
)
from .flex_blocks import FlexLayout, flex_block_attention, flex_layout, uses_flex
from .hooks import call_arguments

# Marks an attention module whose layer picks its own keys (``runtime.cp_key_selection``): the
# CP attention attends under the mask or the indices that layer passes, not its own blocks.
SELECTS_KEYS = "_plancc_selects_keys"


# --------------------------------------------------------------------------- layout
def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions rank ``cp_rank`` holds, in order: chunks r and 2*cp-1-r (on the host:
    callers move them next to the tensors they index)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not a rank of a cp group of size {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of 2*cp={2 * cp_size}; "
            f"pad it by {pad_amount(seq_len, cp_size)} (see plancc.cp.pad_to_multiple)"
        )
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device="cpu")
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device="cpu")])


def pad_amount(seq_len: int, cp_size: int) -> int:
    return (-seq_len) % (2 * cp_size)


def pad_to_multiple(x: torch.Tensor, cp_size: int, dim: int = 1, value: float = 0) -> tuple[torch.Tensor, int]:
    """Right-pad ``dim`` to a multiple of 2*cp; returns (padded, how many were added)."""
    pad = pad_amount(x.shape[dim], cp_size)
    if pad == 0:
        return x, 0
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim), pad


def shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced slice of ``x`` along ``dim`` (two views, concatenated)."""
    if cp_size == 1:
        return x
    n = x.shape[dim]
    load_balanced_indices(n, cp_size, cp_rank)  # validates
    chunk = n // (2 * cp_size)
    head = x.narrow(dim, cp_rank * chunk, chunk)
    tail = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)
    return torch.cat([head, tail], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard`` given every rank's shard in rank order; no process group."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunk = shards[0].shape[dim] // 2
    heads = [s.narrow(dim, 0, chunk) for s in shards]  # chunks 0 .. cp-1, in rank order
    tails = [s.narrow(dim, chunk, chunk) for s in reversed(shards)]  # chunks cp .. 2cp-1
    return torch.cat(heads + tails, dim=dim)


def _doc_lengths(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)  # one read
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]


def load_balanced_indices_packed(cu_seqlens: torch.Tensor | list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Packed documents: the head-tail layout applied to each document (each a multiple of 2*cp)."""
    out, start = [], 0
    for length in _doc_lengths(cu_seqlens):
        out.append(start + load_balanced_indices(length, cp_size, cp_rank))
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device="cpu")


def shard_packed(
    x: torch.Tensor, cu_seqlens: torch.Tensor | list[int], cp_size: int, cp_rank: int, dim: int = 1
) -> torch.Tensor:
    return x.index_select(dim, load_balanced_indices_packed(cu_seqlens, cp_size, cp_rank).to(x.device))


def unshard_packed(shards: list[torch.Tensor], cu_seqlens: torch.Tensor | list[int], dim: int = 1) -> torch.Tensor:
    cp_size = len(shards)
    total = int(cu_seqlens[-1])
    shape = list(shards[0].shape)
    shape[dim] = total
    out = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        out.index_copy_(dim, load_balanced_indices_packed(cu_seqlens, cp_size, r).to(s.device), s)
    return out


def pad_documents(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """cu_seqlens after padding every document to a multiple of 2*cp."""
    lengths = [n + pad_amount(n, cp_size) for n in _doc_lengths(cu_seqlens)]
    return torch.tensor([0] + lengths, device="cpu").cumsum(0)


# --------------------------------------------------------------------------- gather


class _AllGatherSequence(torch.autograd.Function):
    """Forward: every rank's load-balanced shard -> the full sequence in original order.
    Backward: each rank used the full sequence, so the gradient of a shard is the sum of all
    ranks' gradients at its positions: one reduce-scatter, no all-reduce."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int, cu_seqlens: torch.Tensor | list[int] | None
    ) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.world, ctx.cu = group, dim, world, cu_seqlens
        moved = x.movedim(dim, 0).contiguous()
        if cu_seqlens is not None:  # packed: gather, then place every document's chunks
            out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
            dist.all_gather_single(out, moved, group=group)
            return unshard_packed(list(out.chunk(world, dim=0)), cu_seqlens, dim=0).movedim(0, dim)
        # Head chunks arrive in rank order, which is their place in the sequence: gather them
        # straight into the output. Tail chunks arrive in reverse: gather, then flip once.
        c = moved.shape[0] // 2
        out = moved.new_empty((2 * world * c, *moved.shape[1:]))
        dist.all_gather_single(out[: world * c], moved[:c], group=group)
        tail_slots = list(out[world * c :].view(world, c, *moved.shape[1:]).unbind(0))[::-1]
        dist.all_gather(tail_slots, moved[c:], group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        world, dim = ctx.world, ctx.dim
        g = grad.movedim(dim, 0).contiguous()
        if ctx.cu is not None:
            parts = [shard_packed(g, ctx.cu, world, r, dim=0) for r in range(world)]
            pieces = torch.cat(parts, dim=0).contiguous()
            out = pieces.new_empty((pieces.shape[0] // world, *pieces.shape[1:]))
            dist.reduce_scatter_single(out, pieces, group=ctx.group)
            return out.movedim(0, dim), None, None, None
        half = g.shape[0] // 2
        c = half // world
        rest = g.shape[1:]
        out = g.new_empty((2 * c, *rest))
        # head chunks are already in rank order; tail chunks are flipped back into it
        dist.reduce_scatter_single(out[:c], g[:half], group=ctx.group)
        tails = g[half:].view(world, c, *rest).flip(0).reshape(half, *rest)
        dist.reduce_scatter_single(out[c:], tails, group=ctx.group)
        return out.movedim(0, dim), None, None, None


def all_gather(
    x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1, cu_seqlens: torch.Tensor | list[int] | None = None
) -> torch.Tensor:
    """The full sequence from every cp rank's shard (original order), autograd-aware.
    With ``cu_seqlens`` the shards are in the packed (per-document) layout. Works on any
    backend that has all-gather and reduce-scatter (gloo included)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGatherSequence.apply(x, group, dim, cu_seqlens)


# --------------------------------------------------------------------------- attention
@dataclass(frozen=True, kw_only=True, slots=True)
class CPBatch:
    """Where the current batch's tokens are, set by the input hook before every forward."""

    q_positions: torch.Tensor  # [B, S_local] global positions of local queries
    key_positions: torch.Tensor  # [B, S] global position of every key (0.. per doc)
    key_valid: torch.Tensor  # [B, S] bool, False for padding
    doc_ids: torch.Tensor  # [B, S] document of every position (packing)
    local_doc_ids: torch.Tensor  # [B, S_local]
    cu_seqlens: torch.Tensor | None = None  # packed layout, or None
    bounds: list[int] | None = None  # cu_seqlens on the host: the attention goes document by document
    # per group of rows alike, (first row, end row, first position of every segment): the block
    # attention's plan; None when the rows need the dense mask (holes in the padding)
    segments: list[tuple[int, int, list[int]]] | None = None


@dataclass(frozen=True, slots=True)
class CPState:
    """A ``CPContext``'s batch and what was built from it (``CPContext.state``)."""

    batch: CPBatch | None
    masks: dict[int, torch.Tensor]
    blocks: dict[int, list[Block]]
    padding: list[torch.Tensor | None]
    spans: list[tuple[int, int, Span]]
    flex: dict[tuple[int, bool], FlexLayout]
    unpadded_shape: tuple[int, int] | None


@dataclass(kw_only=True, slots=True)
class CPContext:
    """The cp group of a model and what its attention needs about the current batch."""

    group: dist.ProcessGroup
    size: int
    rank: int
    batch: CPBatch | None = None
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # per sliding window (0: none)
    blocks: dict[int, list[Block]] = field(default_factory=dict)  # the same, for the block attention
    # the query spans the blocks were cut from, per group of rows (first row, end row, span)
    spans: list[tuple[int, int, Span]] = field(default_factory=list)
    flex: dict[tuple[int, bool], FlexLayout] = field(default_factory=dict)  # per (window, sinks)
    # the local tokens' padding for the sequence mixers ([B, S/cp], None: no padding), once a batch
    padding: list[torch.Tensor | None] = field(default_factory=list)
    # packed rows attend document by document (PLANCC_DOCUMENT_MASK, read once, not per layer)
    per_document: bool = field(default_factory=enabled_by_default)
    # PLANCC_CP_ATTENTION, read once: "flex" (one flex-attention call a layer), "blocks" (a kernel
    # call per block or batch of blocks), "auto" (flex on CUDA, blocks on the CPU, where flex
    # attention has no backward: ``runtime.flex_blocks``) or "dense" (the [S/cp, S] mask for every
    # batch, the reference)
    kernel: str = field(default_factory=lambda: os.environ.get("PLANCC_CP_ATTENTION", "auto"))
    # (rows, length) of the unpadded batch ``unpadded`` laid out last (pipeline stages), or None
    unpadded_shape: tuple[int, int] | None = None

    @property
    def dense(self) -> bool:
        return self.kernel == "dense"

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        return self.batch.cu_seqlens if self.batch is not None else None

    def plan(self, window: int | None) -> list[Block] | None:
        """The block attention's blocks for this batch and window (None: the dense mask)."""
        b = self.batch
        assert b is not None, "the input hook sets the batch before attention runs"
        if b.segments is None:
            return None
        key = window or 0
        if not self.spans:
            total = b.key_positions.shape[1]
            bounds = b.bounds if b.bounds is not None else [0, total]
            self.spans = [
                (first, end, span)
                for first, end, starts in b.segments
                for span in query_spans(bounds, starts, self.size, self.rank)
            ]
        if key not in self.blocks:
            self.blocks[key] = [
                blk for first, end, span in self.spans for blk in span_blocks(span, (first, end), window)
            ]
        return self.blocks[key]

    def uses_flex(self, device: torch.device) -> bool:
        return uses_flex(device, self.kernel)

    def flex_layout(self, window: int | None, sink: bool, device: torch.device) -> FlexLayout | None:
        """The one-call layout of this batch for a window (None: the dense mask)."""
        blocks = self.plan(window)
        if blocks is None:
            return None
        key = (window or 0, sink)
        if key not in self.flex:
            b = self.batch
            assert b is not None, "plan() found the batch"
            shape = (b.q_positions.shape[0], b.q_positions.shape[1], b.key_positions.shape[1])
            self.flex[key] = flex_layout(self.spans, blocks, shape, window, sink, device)
        return self.flex[key]

    def unpadded(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """This rank's global positions ``[1, length/cp]`` of ``rows`` unpadded rows of ``length``
        tokens (a pipeline stage's microbatch: no documents, no padding), the batch laid out for
        the attention. Microbatches of one shape share one layout -- a schedule step's are alike,
        so a layer recomputed for its backward (activation checkpointing) after later
        microbatches' forwards finds the layout it ran with -- and nothing is read from a device."""
        index = load_balanced_indices(length, self.size, self.rank).to(device).unsqueeze(0)
        if self.unpadded_shape == (rows, length) and self.batch is not None:
            return index
        keys = torch.arange(length, device=device).unsqueeze(0).expand(rows, -1)
        queries = index.expand(rows, -1)
        batch = CPBatch(
            q_positions=queries,
            key_positions=keys,
            key_valid=torch.ones((rows, length), dtype=torch.bool, device=device),
            doc_ids=torch.zeros((rows, length), dtype=torch.long, device=device),
            local_doc_ids=torch.zeros_like(queries),
            segments=None if self.dense else [(0, rows, [0])],
        )
        self.restore(CPState(batch, {}, {}, [], [], {}, (rows, length)))
        return index

    def lay_out(
        self,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        cu: torch.Tensor | None = None,
        *,
        known: bool = False,
    ) -> torch.Tensor:
        """Lay out a batch of whole rows for the attention -- ``positions`` ``[B, S]`` (restarting
        at each document: packed rows), the padding ``mask``, a packed layout's ``cu_seqlens``
        -- and return this rank's positions' index ``[S/cp]`` (per document with ``cu``, else the
        rows' head-tail chunks). ``known``: the documents are given (``cu``) or there are none,
        so the block attention's plan reads nothing from the device."""
        # documents: a new one wherever positions do not continue (packing restarts them)
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        doc_ids = starts.long().cumsum(1)
        bounds = cu.tolist() if isinstance(cu, torch.Tensor) else None  # one read, for the layout and the attention
        if bounds is not None:
            index = load_balanced_indices_packed(bounds, self.size, self.rank).to(positions.device)
        else:
            index = load_balanced_indices(positions.shape[1], self.size, self.rank).to(positions.device)
        batch = CPBatch(
            q_positions=positions.index_select(1, index),
            key_positions=positions,
            key_valid=torch.ones_like(positions, dtype=torch.bool) if mask is None else mask.bool(),
            doc_ids=doc_ids,
            local_doc_ids=doc_ids.index_select(1, index),
            cu_seqlens=cu,
            bounds=bounds,
            segments=None if self.dense else row_segments(positions, mask, bounds, known=known),
        )
        self.restore(CPState(batch, {}, {}, [], [], {}, None))  # a new batch: nothing built from it yet
        return index

    def state(self) -> CPState:
        """What the attention reads about the current batch: a pipeline stage keeps its
        microbatch's, to put back before that microbatch's backward (``restore``) when other
        microbatches were laid out since (a schedule interleaves them)."""
        return CPState(self.batch, self.masks, self.blocks, self.padding, self.spans, self.flex, self.unpadded_shape)

    def restore(self, state: CPState) -> None:
        """``state`` as the current batch (a kept one, or a new one with nothing built yet)."""
        self.batch, self.masks, self.blocks, self.padding = state.batch, state.masks, state.blocks, state.padding
        self.spans, self.flex, self.unpadded_shape = state.spans, state.flex, state.unpadded_shape

    def local_padding(self) -> torch.Tensor | None:
        """This rank's tokens' padding mask ``[B, S/cp]`` (long), or None when no row is padded:
        one read of the device per batch, whatever the number of layers asking."""
        if not self.padding:
            b = self.batch
            assert b is not None, "the input hook sets the batch before the layers run"
            if bool(b.key_valid.all()):
                self.padding.append(None)
            else:
                total = b.key_valid.shape[1]
                index = (
                    load_balanced_indices(total, self.size, self.rank)
                    if b.bounds is None
                    else load_balanced_indices_packed(b.bounds, self.size, self.rank)
                )
                self.padding.append(b.key_valid.index_select(1, index.to(b.key_valid.device)).long())
        return self.padding[0]

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, S_local, S] bool: causal on global positions, same document, real keys."""
        key = window or 0
        if key not in self.masks:
            b = self.batch
            assert b is not None, "the input hook sets the batch before attention runs"
            q = b.q_positions.unsqueeze(-1)  # positions within the document
            k = b.key_positions.unsqueeze(1)
            allowed = (k <= q) & b.key_valid.unsqueeze(1)
            allowed &= b.local_doc_ids.unsqueeze(-1) == b.doc_ids.unsqueeze(1)
            if window:
                allowed &= (q - k) < window
            # a padded query may see nothing: let it see itself, its output is ignored
            allowed |= ~allowed.any(-1, keepdim=True) & (k == q)
            self.masks[key] = allowed.unsqueeze(1)
        return self.masks[key]


def attach_context(module: torch.nn.Module, ctx: CPContext) -> None:
    """Give a module the cp context of its model (read by the attention and the evaluator)."""
    module.__dict__["_plancc_cp"] = ctx  # a plain attribute: nn.Module registers only tensors and modules


def context_of(module: torch.nn.Module) -> CPContext | None:
    """The cp context of a module of a model parallelized with cp > 1, else None."""
    ctx = module.__dict__.get("_plancc_cp")
    return ctx if isinstance(ctx, CPContext) else None


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: [B, H, S_local, D] queries against all-gathered K/V.

    The layer's sliding window and learned sinks come as the interface's ``sliding_window`` and
    ``s_aux`` keywords (Mistral, Exaone 4 and gpt-oss pass them so; Gemma 3 also keeps its window
    on the module): each model's own eager/SDPA path reads them from its mask and its attention,
    so the CP attention must read them here or silently attend to keys the model would not."""
    ctx = context_of(module)
    assert ctx is not None, "the cp attention runs only on modules enable_context_parallel prepared"
    # the host copy of the boundaries where there is one: no device read per layer
    documents = ctx.batch.bounds if ctx.batch is not None and ctx.batch.bounds is not None else ctx.cu_seqlens
    key = all_gather(key, ctx.group, dim=2, cu_seqlens=documents)
    value = all_gather(value, ctx.group, dim=2, cu_seqlens=documents)
    dropout_p = dropout if module.training else 0.0
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    window = sliding_window(module, kwargs)
    own = _layer_mask(module, ctx, attention_mask, kwargs.get("indices"), window)
    blockwise = own is None and dropout_p == 0.0 and not ctx.dense
    layout = (
        ctx.flex_layout(window, sinks is not None, query.device) if blockwise and ctx.uses_flex(query.device) else None
    )
    if layout is not None:
        out = flex_block_attention(query, key, value, layout, scale=scaling, sinks=sinks, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    blocks = ctx.plan(window) if blockwise else None
    if blocks is not None:
        out = block_attention(query, key, value, blocks, scale=scaling, sinks=sinks, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # the dense reference: gather the few KV heads, repeat after
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if own is None and ctx.per_document and ctx.batch is not None and ctx.batch.bounds is not None:
        out = _per_document(ctx.batch, ctx.size, query, key, value, window, sinks, softcap, dropout_p, scaling)
        return out.transpose(1, 2).contiguous(), None
    mask = ctx.mask(window) if own is None else own
    if sinks is None and not softcap:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scaling)
    else:
        assert mask.dtype == torch.bool, "only a layer without sinks or a cap passes an additive mask (Doge)"
        out = attention_with_sinks(query, key, value, mask, sinks, dropout_p=dropout_p, scale=scaling, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def _layer_mask(
    module: torch.nn.Module,
    ctx: CPContext,
    attention_mask: torch.Tensor | None,
    indices: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor | None:
    """The mask a layer that picks its own keys attends under (``[B, 1|H, S/cp, S]``: bool, or
    Doge's additive one over the gathered keys), or None for every other layer (whatever mask
    reaches them is the model's mask function's, which the CP attention replaces)."""
    if not module.__dict__.get(SELECTS_KEYS):
        return None
    allowed = ctx.mask(window)
    if indices is not None:  # the indexer's picks: indices into the gathered sequence
        picked = torch.zeros((allowed.shape[0], *allowed.shape[2:]), dtype=torch.bool, device=allowed.device)
        allowed = allowed & picked.scatter_(-1, indices.long(), True).unsqueeze(1)
    if attention_mask is None:
        return allowed
    if attention_mask.dtype == torch.bool:
        return allowed & attention_mask
    return attention_mask  # additive: the layer folded the CP mask into it (Doge)


def query_spans(bounds: list[int], segments: list[int], cp: int, rank: int) -> list[Span]:
    """This rank's queries (head and tail chunk of every document of the layout) cut where a
    segment of the row begins: each span attends to its segment's keys up to itself."""
    spans = []
    local = 0
    for start, end in zip(bounds, bounds[1:], strict=False):
        chunk = (end - start) // (2 * cp)
        for first in (start + rank * chunk, start + (2 * cp - 1 - rank) * chunk):
            p = first
            while p < first + chunk:
                i = bisect.bisect_right(segments, p) - 1
                stop = min(first + chunk, segments[i + 1] if i + 1 < len(segments) else end)
                spans.append(Span(local=local + p - first, start=p, n=stop - p, segment=segments[i]))
                p = stop
            local += chunk
    return spans


def row_segments(
    positions: torch.Tensor, mask: torch.Tensor | None, bounds: list[int] | None, *, known: bool = False
) -> list[tuple[int, int, list[int]]] | None:
    """Where each row's segments begin (a document -- the layout's or restarting positions --
    or a run of padding), grouped into runs of rows alike; None when a row's mask has a hole
    (real, padding, real), which only the dense mask describes. One read of the device, none
    when the positions are ``known`` to restart only at ``bounds`` and there is no mask (and
    none in a dry run's fake world, which has no values: its rows are taken as unpadded)."""
    batch, seq = positions.shape
    if (known and mask is None) or _without_values(positions):
        return [(0, batch, sorted({0, *(bounds[:-1] if bounds else ())}))]
    change = torch.zeros((batch, seq + 1), dtype=torch.bool, device=positions.device)
    change[:, 1:seq] = positions[:, 1:] != positions[:, :-1] + 1
    if mask is not None:
        valid = mask.bool()
        change[:, 1:seq] |= valid[:, 1:] != valid[:, :-1]
        rises = (valid[:, 1:] & ~valid[:, :-1]).sum(1)
        change[:, seq] = (rises > 1) | ((rises == 1) & valid[:, 0])  # a hole: the last column says so
    starts: list[list[int]] = [[0] for _ in range(batch)]
    for row, col in change.nonzero().tolist():
        if col == seq:
            return None
        starts[row].append(col)
    groups: list[tuple[int, int, list[int]]] = []
    for row, own in enumerate(starts):
        merged = sorted(set(own) | set(bounds[:-1] if bounds else ()))
        if groups and groups[-1][2] == merged:
            groups[-1] = (groups[-1][0], row + 1, merged)
        else:
            groups.append((row, row + 1, merged))
    return groups


def _without_values(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or isinstance(t, FakeTensor)


def _per_document(
    batch: CPBatch,
    cp: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """Packed documents one at a time: document ``[s, e)`` of the row is ``[s/cp, e/cp)`` of
    this rank's queries (each document is sharded on its own) against keys ``[s, e)`` of the
    gathered row, under its own ``[L/cp, L]`` mask -- never the ``[S/cp, S]`` one of the row
    (``runtime.document_attention``)."""
    assert batch.bounds is not None, "packed rows have their boundaries"
    spans = [(s // cp, e // cp, s, e) for s, e in zip(batch.bounds, batch.bounds[1:], strict=False) if e > s]

    def mask_of(i: int) -> torch.Tensor:
        q0, q1, k0, k1 = spans[i]
        allowed = causal_window(batch.q_positions[:, q0:q1], batch.key_positions[:, k0:k1], window)
        allowed &= batch.key_valid[:, None, k0:k1]
        return allowed.unsqueeze(1)

    return attend_per_document(
        query, key, value, spans, mask_of, dropout_p=dropout_p, scale=scale, sinks=sinks, softcap=softcap
    )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the cp attention builds its own mask from global positions


def register_attention() -> str:
    AttentionInterface.register("plancc_cp", cp_attention_forward)
    AttentionMaskInterface.register("plancc_cp", _no_mask)
    return "plancc_cp"


class ShardSequenceInputs:
    """Forward pre-hook on the decoder: full-length inputs in, this rank's shard to the model.

    ``input_ids`` [B, S] (S a multiple of 2*cp, per document when packed) are replaced by
    the load-balanced shard; global ``position_ids`` (restarting per document) go with them,
    and the padding mask and document ids are kept whole for the attention. The model's
    outputs are per local token; ``plancc.cp.all_gather`` restores the order.
    """

    def __init__(self, model: torch.nn.Module, ctx: CPContext):
        self.signature = inspect.signature(model.forward)
        self.ctx = ctx

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[()], dict[str, Any]]:
        values = call_arguments(self.signature, args, kwargs)
        ids = values.get("input_ids")
        if ids is None:
            raise ValueError("context parallelism needs input_ids (inputs_embeds are not sharded)")
        ctx = self.ctx
        batch, seq = ids.shape
        cu = values.pop("cu_seqlens", None)
        if seq % (2 * ctx.size):
            raise ValueError(
                f"sequence length {seq} is not a multiple of 2*cp={2 * ctx.size}; "
                f"pad by {pad_amount(seq, ctx.size)} (plancc.cp.pad_to_multiple)"
            )
        positions = values.get("position_ids")
        # positions made here, or a packed row's (they restart at its documents): nothing to read
        known = positions is None or cu is not None
        if positions is None:
            positions = torch.arange(seq, device=ids.device).unsqueeze(0)
        positions = positions.expand(batch, -1)
        index = ctx.lay_out(positions, values.get("attention_mask"), cu, known=known)
        values["input_ids"] = ids.index_select(1, index)
        values["position_ids"] = positions.index_select(1, index)  # the batch's q_positions
        values["attention_mask"] = None  # the cp attention masks from global positions
        return (), values


def enable_context_parallel(model: torch.nn.Module, cp_mesh: DeviceMesh) -> CPContext:
    """Switch a model to the cp attention over ``cp_mesh`` and shard its inputs.

    transformers keeps the attention implementation on the config, which models built from
    one config object share: give a cp model a config of its own.
    """
    ctx = cp_attention_context(model, cp_mesh)
    # on the decoder, like the SP hook: model.model(...) called directly is sharded too
    decoder = getattr(model, "model", model)
    decoder.register_forward_pre_hook(ShardSequenceInputs(decoder, ctx), with_kwargs=True, prepend=True)
    return ctx


def cp_attention_context(model: torch.nn.Module, cp_mesh: DeviceMesh) -> CPContext:
    """The cp attention on every attention module of ``model`` over ``cp_mesh``, sharing one
    context; the inputs are left as they are (pipeline stages lay out their own microbatches:
    ``CPContext.unpadded``)."""
    ctx = CPContext(group=cp_mesh.get_group(), size=cp_mesh.size(), rank=cp_mesh.get_local_rank())
    hf_model: Any = model  # a transformers PreTrainedModel
    hf_model.set_attn_implementation(register_attention())
    for module in model.modules():
        if is_cp_attention(module):
            attach_context(module, ctx)
    attach_context(model, ctx)
    attach_context(getattr(model, "model", model), ctx)
    return ctx
