"""Packed documents attend one document at a time: no ``[T, T]`` mask over the packed row.

A packed row holds several documents one after the other; each must attend causally to itself
only. transformers finds them from the restarting position ids and builds the block-diagonal
``[T, T]`` mask (at 32k tokens a 1 GiB bool tensor, and SDPA with an explicit mask leaves the
fused kernels for one that materializes ``[heads, T, T]`` scores). Here the attention runs on
each document's slice of queries, keys and values with ``is_causal`` (the fused kernels: flash /
memory-efficient on CUDA, flash on CPU), so nothing of size ``T x T`` exists: memory is that of
the longest document's attention, and every document attends exactly as it would alone --
the dense mask's numbers, without its work (``tests/test_document_attention.py``). A layer
with a sliding window gets a per-document ``[L, L]`` mask instead; a layer with learned sinks
(gpt-oss, an eager model) goes through the block attention (``runtime.block_attention``:
one causal block per document, windows in tiles, the sinks in the log-sum-exp).

It is a transformers attention implementation (``plancc_docs``; ``plancc_docs_eager`` for a
model whose own implementation is eager, with transformers' additive mask) that is the model's
own attention unless the model's document context holds the packed row's boundaries: ``set_documents`` sets them before
a forward (``token_logprobs`` and the fused token loss do), from a host list, so no device read
is needed to cut the row. They hold for that forward of the model and the recomputations of its
backward (activation checkpointing runs a layer's attention again after the forward returned);
the model's next forward drops them unless they were set for it.

Under context parallelism the cp attention has the same per-document path
(``runtime.cp_context``); ``document_attention`` is for cp = 1. ``PLANCC_DOCUMENT_MASK=dense`` keeps
transformers' dense mask (the reference).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ..sequence_mixing import is_cp_attention
from .block_attention import Block, Span, block_attention, span_blocks
from .flex_blocks import FlexLayout, flex_block_attention, flex_layout, uses_flex

IMPLEMENTATION = "plancc_docs"
EAGER_IMPLEMENTATION = "plancc_docs_eager"  # the same, for models whose own attention is eager

# Per-document calls see a new query length with nearly every document. On CUDA, torch >= 2.9
# prefers cuDNN attention, which builds (and caches) an execution plan per new shape: ~60 ms
# each on an H200, which made the per-document path 0.54x the dense one at first sight of a
# batch's lengths (docs/gpu.md). Flash and memory-efficient attention take any length without a
# plan; the math kernel stays as the last resort for shapes neither takes.
_ANY_LENGTH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class DocumentContext:
    """The packed row's document boundaries (``cu_seqlens`` on the host: the first position of
    each document, then the row's length), or None for rows the model's own mask describes."""

    bounds: list[int] | None = None
    # the one-call kernel's layouts of these bounds, per (rows, window, sinks) (CUDA)
    flex: dict[tuple[int, int, bool], FlexLayout] = field(default_factory=dict)
    armed: bool = False  # set for the next forward of the model (then kept for its recomputation)
    eager: bool = False  # the model's own attention is its eager one (sinks), not SDPA


def enabled_by_default() -> bool:
    return os.environ.get("PLANCC_DOCUMENT_MASK", "documents") != "dense"


def enable_document_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is SDPA to ``plancc_docs`` (SDPA until a packed row's
    documents are set), or eager without soft-capping (gpt-oss's sinks) to ``plancc_docs_eager``
    (its eager attention until then). Returns whether it did: a model on another implementation
    (flash, eager with soft-capped logits: the blocks have no soft-cap) keeps it, and
    ``PLANCC_DOCUMENT_MASK=dense`` turns it off."""
    config: Any = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    eager = implementation == "eager" and not getattr(config, "attn_logit_softcapping", None)
    if not enabled_by_default() or (implementation != "sdpa" and not eager):
        return False
    register()
    hf_model: Any = model
    hf_model.set_attn_implementation(EAGER_IMPLEMENTATION if eager else IMPLEMENTATION)
    ctx = DocumentContext(eager=eager)
    for module in model.modules():
        if is_cp_attention(module):
            module.__dict__["_plancc_documents"] = ctx  # a plain attribute, as the cp context
    model.__dict__["_plancc_documents"] = ctx
    model.register_forward_pre_hook(_ForwardUses(ctx))
    return True


class _ForwardUses:
    """The model's forward pre-hook: the documents ``set_documents`` set are this forward's; a
    forward nobody set documents for (the model called directly) attends by its own mask, never
    by the boundaries of an earlier packed row. (A recomputation during backward does not run
    the model's forward: it keeps the documents of the forward it repeats.)"""

    def __init__(self, ctx: DocumentContext) -> None:
        self.ctx = ctx

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.ctx.armed:
            self.ctx.armed = False
        else:
            self.ctx.bounds = None


def documents_of(module: torch.nn.Module) -> DocumentContext | None:
    ctx = module.__dict__.get("_plancc_documents")
    return ctx if isinstance(ctx, DocumentContext) else None


def set_documents(model: torch.nn.Module, bounds: Sequence[int] | torch.Tensor | None) -> bool:
    """The next forward's packed documents (None: the rows' own mask). Returns whether the model
    attends per document (then pass an all-ones ``attention_mask``: transformers builds no mask)."""
    ctx = documents_of(model)
    if ctx is None:
        return False
    if isinstance(bounds, torch.Tensor):
        bounds = bounds.tolist()  # a caller without the host copy: one read
    new = None if bounds is None else [int(b) for b in bounds]
    if new != ctx.bounds:
        ctx.flex = {}
    ctx.bounds = new
    ctx.armed = True
    return ctx.bounds is not None


def attend_per_document(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    mask_of: Callable[[int], torch.Tensor | None],
    *,
    dropout_p: float,
    scale: float | None,
    sinks: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[B, H, Sq, D]`` attention where each ``(q_start, q_end, k_start, k_end)`` span of
    queries attends only to its span of keys: ``mask_of(i)`` the span's ``[B?, 1, q, k]`` bool
    mask, or None for plain causal attention (queries and keys the same positions). ``key`` and
    ``value`` may have fewer heads (GQA)."""
    with sdpa_kernel(_ANY_LENGTH) if query.is_cuda else nullcontext():
        return _attend_spans(
            query, key, value, spans, mask_of, dropout_p=dropout_p, scale=scale, sinks=sinks, softcap=softcap
        )


def _attend_spans(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    mask_of: Callable[[int], torch.Tensor | None],
    *,
    dropout_p: float,
    scale: float | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    parts = []
    for i, (q0, q1, k0, k1) in enumerate(spans):
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
        mask = mask_of(i)
        if sinks is not None or softcap:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            causal = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=q.device).tril()
            allowed = causal if mask is None else mask
            parts.append(
                attention_with_sinks(q, k, v, allowed, sinks, dropout_p=dropout_p, scale=scale, softcap=softcap)
            )
            continue
        parts.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p, scale=scale, enable_gqa=groups > 1
            )
        )
    return torch.cat(parts, dim=2)


def causal_window(positions_q: torch.Tensor, positions_k: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., q, k]`` bool: key at or before the query, within ``window`` when one is given."""
    q, k = positions_q.unsqueeze(-1), positions_k.unsqueeze(-2)
    allowed = k <= q
    if window:
        allowed &= (q - k) < window
    return allowed


def document_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: SDPA, or per document when the row's are set."""
    ctx = documents_of(module)
    if ctx is None or ctx.bounds is None:
        if ctx is not None and ctx.eager:  # the model's own eager attention (its sinks, its mask)
            own: Any = sys.modules[type(module).__module__].__dict__["eager_attention_forward"]
            result: tuple[torch.Tensor, None] = own(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
            return result
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    bounds = ctx.bounds
    if bounds[-1] != query.shape[2]:
        raise ValueError(f"the packed documents end at {bounds[-1]}, the row has {query.shape[2]} positions")
    window = sliding_window(module, kwargs)
    dropout_p = dropout if module.training else 0.0
    sinks = kwargs.get("s_aux")
    # on CUDA one flex-attention call for the row (``runtime.flex_blocks``); on the CPU (and for
    # sinks without flex) the block attention: a row's small documents batched into a few calls
    flex = uses_flex(query.device)
    if dropout_p == 0.0 and flex:
        key_of = (query.shape[0], window or 0, sinks is not None)
        if key_of not in ctx.flex:  # the layout once per packed row: the layers share it
            row_spans, blocks = _row_blocks(bounds, query.shape[0], window)
            shape = (query.shape[0], query.shape[2], query.shape[2])
            ctx.flex[key_of] = flex_layout(row_spans, blocks, shape, window, sinks is not None, query.device)
        out = flex_block_attention(query, key, value, ctx.flex[key_of], scale=scaling, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    if dropout_p == 0.0 and (sinks is not None or not query.is_cuda):
        _, blocks = _row_blocks(bounds, query.shape[0], window)
        out = block_attention(query, key, value, blocks, scale=scaling, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    spans = [(s, e, s, e) for s, e in zip(bounds, bounds[1:], strict=False) if e > s]

    def mask_of(i: int) -> torch.Tensor | None:
        if not window:
            return None
        s, e = spans[i][0], spans[i][1]
        positions = torch.arange(e - s, device=query.device)
        return causal_window(positions, positions, window)

    out = attend_per_document(
        query,
        key,
        value,
        spans,
        mask_of,
        dropout_p=dropout_p,
        scale=scaling,
        sinks=sinks,
    )
    return out.transpose(1, 2).contiguous(), None


def _row_blocks(bounds: list[int], rows: int, window: int | None) -> tuple[list[tuple[int, int, Span]], list[Block]]:
    """A packed row's documents as query spans of every row (each its own segment) and their blocks."""
    spans = [
        (0, rows, Span(local=s, start=s, n=e - s, segment=s)) for s, e in zip(bounds, bounds[1:], strict=False) if e > s
    ]
    return spans, [blk for first, end, span in spans for blk in span_blocks(span, (first, end), window)]


def sliding_window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The layer's window: as the attention interface is told it, else as the module keeps it,
    else as the model's own mask takes it from the config (Phi-MoE passes none and masks with
    ``config.sliding_window``; a model with ``layer_types`` windows its sliding layers only)."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    if hasattr(module, "sliding_window"):
        own = module.sliding_window
        return own if isinstance(own, int) else None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    kinds, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if window and kinds is not None and layer is not None and layer < len(kinds):
        return window if kinds[layer] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) is not False else None


def attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    dropout_p: float,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention under a bool ``mask`` whose softmax also sums one learned logit per head
    (gpt-oss's sinks: the sink takes probability mass and gives no value), with the logits
    soft-capped first where the model caps them (``cap * tanh(score / cap)``: Gemma 2) -- as the
    models' own eager attention does both. The reference the kernels have no form of."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = scores
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)
    # subtracting the row maximum, as the models do, keeps large sinks from overflowing
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = logits.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs.to(value.dtype), p=dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, value)


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(IMPLEMENTATION, document_attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # the rows' own mask otherwise
        AttentionInterface.register(EAGER_IMPLEMENTATION, document_attention_forward)
        AttentionMaskInterface.register(EAGER_IMPLEMENTATION, eager_mask)
        _REGISTERED = True
