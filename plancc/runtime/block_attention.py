"""Attention as a few unmasked kernel calls merged by their log-sum-exp: no ``S x S`` mask.

Under context parallelism a rank's queries are two chunks of the sequence (head-tail layout)
and its keys are the whole gathered sequence. Causal attention of a query chunk starting at
``g`` inside a document starting at ``s`` is then two blocks: the keys ``[s, g)`` that every
query sees (no mask) and the keys ``[g, g + n)`` on the diagonal (the square causal mask the
kernels build themselves). Each block runs through a flash kernel that also returns the
row's log-sum-exp; the blocks' outputs are combined exactly as the kernels combine their own
tiles (``out = sum_b exp(lse_b - lse) * out_b``, ``lse = logsumexp_b lse_b``), and the
backward hands every block the merged output and log-sum-exp (the ring-attention identity),
so gradients are those of one softmax over all the keys.

What else a layer needs, without a dense mask:
- a sliding window of ``w``: queries go in tiles of ``T < w``; a tile's keys are its own
  diagonal (causal) and the ``T x (w - 1)`` band before it (a small additive mask, bounded
  by the window, never by the sequence);
- documents (packed rows, restarting position ids), left and right padding: segments of a
  row; a query attends only to keys of its segment, so padding never reaches a real token;
- learned sinks (gpt-oss): one more logit per head that takes probability mass and gives no
  value, added to the merged log-sum-exp (``out * exp(lse) / (exp(lse) + exp(sink))``);
- grouped-query attention: the CPU kernel takes fewer key heads as they are (no repeat);
- logit soft-capping (Gemma 2, VaultGemma: ``cap * tanh(score / cap)`` before the softmax): no
  fused kernel takes it, so those blocks run through a kernel written here in matrix products
  (``_softcap_forward``/``_softcap_backward``), cut first into tiles of at most
  ``MAX_TILE x KEY_TILE`` so that its scores, materialized per tile, stay bounded too.

Packed rows of many short documents make many small blocks; on the CPU those of one kind and
size class run as one kernel call, their queries and keys gathered into a padded batch
(``Batch``): 512 documents in 16k tokens at cp=2 take 15 calls a layer instead of 2048
(``bench/cp_long.py --packed``; a large block still runs alone, unpadded). On CUDA the blocks
are one flex-attention call a layer (``runtime.flex_blocks``), these kernels its fallback.

Kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the
flash kernel SDPA uses there); on CUDA ``aten._scaled_dot_product_efficient_attention`` and its
backward (any dtype; key heads are matched by folding the query groups into the query length
for the unmasked and band blocks, and by expanding the local diagonal block's keys). Memory is
linear in the sequence length: ``bench/cp_long.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

import torch

# Queries per window tile: the band mask is T x (w - 1) elements, so T caps its size.
MAX_TILE = 512
# Keys per tile of the soft-capped kernel, which materializes its tile's scores.
KEY_TILE = 2048


class Kind(Enum):
    FULL = "full"  # every query sees every key
    CAUSAL = "causal"  # a square block on the diagonal: query i sees keys 0..i
    BAND = "band"  # a sliding window's band: query at global q sees key k iff k > q - window


@dataclass(frozen=True, slots=True)
class Block:
    """Queries ``[q0, q1)`` (local indices) of rows ``[b0, b1)`` against keys ``[k0, k1)`` (indices
    of the gathered sequence). A band block's query ``q0`` sits at global position ``g0``."""

    b0: int
    b1: int
    q0: int
    q1: int
    k0: int
    k1: int
    kind: Kind
    g0: int = 0
    window: int = 0

    def band_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        if self.kind is not Kind.BAND:
            return None
        q = torch.arange(self.g0, self.g0 + self.q1 - self.q0, device=device).unsqueeze(1)
        k = torch.arange(self.k0, self.k1, device=device).unsqueeze(0)
        mask = torch.zeros((self.q1 - self.q0, self.k1 - self.k0), dtype=dtype, device=device)
        return mask.masked_fill_(k <= q - self.window, float("-inf"))[None, None]


@dataclass(frozen=True, slots=True)
class Span:
    """Local queries ``[local, local + n)`` at global positions ``[start, start + n)`` of a
    segment that begins at ``segment``: they attend to keys ``[segment, own position]``."""

    local: int
    start: int
    n: int
    segment: int


def span_blocks(span: Span, rows: tuple[int, int], window: int | None) -> list[Block]:
    """The blocks of one query span: unmasked prefix and causal diagonal, or window tiles."""
    b0, b1 = rows
    end = span.start + span.n
    if not window or end - span.segment <= window:  # the window never binds here
        blocks = [Block(b0, b1, span.local, span.local + span.n, span.start, end, Kind.CAUSAL)]
        if span.start > span.segment:
            blocks.append(Block(b0, b1, span.local, span.local + span.n, span.segment, span.start, Kind.FULL))
        return blocks
    tile = max(1, min(window - 1, MAX_TILE))
    blocks = []
    for t0 in range(span.start, end, tile):
        t1 = min(end, t0 + tile)
        local = span.local + (t0 - span.start)
        blocks.append(Block(b0, b1, local, local + t1 - t0, t0, t1, Kind.CAUSAL))
        lo = max(span.segment, t0 - window + 1)
        if lo < t0:  # with tile < window every query of the tile sees key t0 - 1
            blocks.append(Block(b0, b1, local, local + t1 - t0, lo, t0, Kind.BAND, g0=t0, window=window))
    return blocks


# --------------------------------------------------------------------------- kernels
# (output, log-sum-exp, what the kernel's backward needs besides them)
_Forward = tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float) -> _Forward:
    mask = block.band_mask(q.dtype, q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, block.kind is Kind.CAUSAL, attn_mask=mask, scale=scale
    )
    return out, lse, ()


def _cpu_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float,
    saved: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = block.band_mask(q.dtype, q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, block.kind is Kind.CAUSAL, attn_mask=mask, scale=scale
    )
    return dq, dk, dv


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv*G, t, D] -> [B, Hkv, G*t, D]: a query group shares its key head."""
    b, h, t, d = x.shape
    return x.reshape(b, h // groups, groups * t, d)


def _ungrouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, hkv, gt = x.shape[:3]
    return x.reshape(b, hkv * groups, gt // groups, *x.shape[3:])


def _expanded(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def _cuda_bias(block: Block, dtype: torch.dtype, device: torch.device, groups: int) -> torch.Tensor | None:
    mask = block.band_mask(dtype, device)
    if mask is None:
        return None
    if groups > 1:
        mask = mask.repeat(1, 1, groups, 1)
    # the memory-efficient kernel reads the bias with rows aligned to 16 elements
    rows, cols = mask.shape[-2:]
    padded = mask.new_zeros((1, 1, rows, -(-cols // 16) * 16))
    padded[..., :cols] = mask
    return padded[..., :cols]


def _cuda_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return q, k, v, 1, False
    if block.kind is Kind.CAUSAL:  # the diagonal block's keys are local: expand them
        return q, _expanded(k, groups), _expanded(v, groups), 1, True
    return _grouped(q, groups), k, v, groups, False


# The memory-efficient kernel's pair (module names, so a test can stand in for them on CPU).
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def _cuda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float) -> _Forward:
    t = q.shape[2]
    qq, kk, vv, groups, _ = _cuda_inputs(q, k, v, block)
    bias = _cuda_bias(block, q.dtype, q.device, groups)
    out, lse, seed, offset = _EFFICIENT(qq, kk, vv, bias, True, 0.0, block.kind is Kind.CAUSAL, scale=scale)
    lse = lse[..., : groups * t]
    return _ungrouped(out, groups), _ungrouped(lse, groups), (seed, offset)


def _cuda_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float,
    saved: tuple[Any, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed, offset = saved
    qq, kk, vv, groups, expanded = _cuda_inputs(q, k, v, block)
    bias = _cuda_bias(block, q.dtype, q.device, groups)
    g, o = (_grouped(x, groups) if groups > 1 else x for x in (grad, out))
    lse_in = lse.reshape(lse.shape[0], kk.shape[1], -1)
    padded = lse_in.new_zeros((*lse_in.shape[:2], -(-lse_in.shape[2] // 32) * 32))  # the kernel's row stride
    padded[..., : lse_in.shape[2]] = lse_in
    dq, dk, dv, _ = _EFFICIENT_BACKWARD(
        g.contiguous(),
        qq,
        kk,
        vv,
        bias,
        o.contiguous(),
        padded,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        block.kind is Kind.CAUSAL,
        scale=scale,
    )
    if groups > 1:
        dq = _ungrouped(dq, groups)
    if expanded:  # sum the expanded heads' gradients back onto their key head
        shape = (k.shape[0], k.shape[1], q.shape[1] // k.shape[1], *k.shape[2:])
        dk, dv = dk.reshape(shape).sum(2), dv.reshape(shape).sum(2)
    return dq, dk, dv


# --------------------------------------------------------------------------- soft-capping
def tiled(blocks: list[Block], queries: int, keys: int) -> list[Block]:
    """The same attention as ``blocks`` in blocks of at most ``queries x keys`` (a band block is
    already a tile: ``MAX_TILE`` queries and fewer keys than the window). A causal block's query
    tile is its own causal diagonal plus the block's keys before it, unmasked."""
    out: list[Block] = []

    def full(blk: Block, q0: int, q1: int, k0: int, k1: int) -> None:
        for a in range(q0, q1, queries):
            for c in range(k0, k1, keys):
                out.append(Block(blk.b0, blk.b1, a, min(q1, a + queries), c, min(k1, c + keys), Kind.FULL))

    for blk in blocks:
        if blk.kind is Kind.BAND:
            out.append(blk)
        elif blk.kind is Kind.FULL:
            full(blk, blk.q0, blk.q1, blk.k0, blk.k1)
        else:
            for a in range(blk.q0, blk.q1, queries):
                b = min(blk.q1, a + queries)
                k = blk.k0 + (a - blk.q0)
                out.append(Block(blk.b0, blk.b1, a, b, k, k + (b - a), Kind.CAUSAL))
                full(blk, a, b, blk.k0, k)
    return out


def _softcap_scores(
    q: torch.Tensor, k: torch.Tensor, block: Block, scale: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(masked capped scores, ``tanh(raw / cap)``) ``[B, Hkv, G*t, n]`` in fp32 or wider: a
    query group's rows sit under its key head, so no key is repeated."""
    groups = q.shape[1] // k.shape[1]
    acc = _accumulation_dtype(q.dtype)
    raw = torch.matmul(_grouped(q, groups).to(acc), k.to(acc).transpose(-1, -2)) * scale
    tanh = torch.tanh(raw / cap)
    scores = tanh * cap
    t, n = q.shape[2], k.shape[2]
    if block.kind is Kind.CAUSAL:
        i = torch.arange(t, device=q.device).repeat(groups).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(n, device=q.device).unsqueeze(0) > i, float("-inf"))
    elif block.kind is Kind.BAND:
        mask = block.band_mask(acc, q.device)
        assert mask is not None, "a band block has its mask"
        scores = scores + mask.repeat(1, 1, groups, 1)
    return scores, tanh, groups


def _softcap_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float, *, cap: float
) -> _Forward:
    scores, _, groups = _softcap_scores(q, k, block, scale, cap)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(scores.dtype))
    return _ungrouped(out, groups), _ungrouped(lse, groups), ()


def _softcap_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float,
    saved: tuple[Any, ...],
    *,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash backward in matrix products, with the merged output and log-sum-exp (so ``p``
    is this tile's share of the whole softmax), through the cap: ``d raw = d capped * (1 - tanh^2)``."""
    scores, tanh, groups = _softcap_scores(q, k, block, scale, cap)
    acc = scores.dtype
    g, o = _grouped(grad.to(acc), groups), _grouped(out.to(acc), groups)
    p = torch.exp(scores - _grouped(lse.to(acc).unsqueeze(-1), groups))
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, v.to(acc).transpose(-1, -2))
    ds = p * (dp - (g * o).sum(-1, keepdim=True)) * (1 - tanh * tanh) * scale
    dq = _ungrouped(torch.matmul(ds, k.to(acc)), groups)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.to(acc), groups))
    return dq, dk, dv


# --------------------------------------------------------------------------- batched blocks
# Whether the CPU path runs each kind of block of a row group as one kernel call over all of them
# (False: one call per block, the loop this replaced; ``bench/cp_long.py`` measures both).
BATCH_BLOCKS = True


@dataclass(frozen=True, slots=True)
class Batch:
    """Blocks of one kind over the same rows as one kernel call: each block is an entry of the
    kernel's batch, its queries and keys gathered into ``[n, Q]`` / ``[n, K]`` slots padded on the
    right (padding slots repeat the block's first index and are masked out or discarded).

    Exact by construction: a causal block has as many queries as keys, so a padded query or key
    comes after every real one and the causal mask keeps them apart; a full block's padded keys
    get ``-inf`` from a ``[n, 1, 1, K]`` mask (every real query sees at least one real key);
    padded queries' outputs are never read, and their gradient is zero."""

    kind: Kind
    b0: int
    b1: int
    q: Slots  # the blocks' queries: local positions
    k: Slots  # their keys: positions of the gathered sequence

    def key_mask(self, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
        if self.kind is Kind.CAUSAL:
            return None
        mask = torch.zeros(self.k.valid.shape, dtype=dtype, device=self.k.valid.device)
        mask.masked_fill_(~self.k.valid, float("-inf"))
        n, k = mask.shape
        return mask[:, None, None, None, :].expand(n, rows, 1, 1, k).reshape(n * rows, 1, 1, k)


@dataclass(frozen=True, slots=True)
class Slots:
    """Positions laid out a block per row ``[n, L]``, padded on the right; everything made from
    the host's block list, so nothing reads a device (or needs values: a dry run's fake tensors)."""

    index: torch.Tensor  # [n, L] positions; a padding slot repeats its block's first
    valid: torch.Tensor  # [n, L] bool
    real: torch.Tensor  # [P] the real slots' positions, block after block
    flat: torch.Tensor  # [P] the real slots' places in the flattened [n * L]


def _slots(starts: list[int], lengths: list[int], device: torch.device) -> Slots:
    width = max(lengths)
    index = [[s + i if i < n else s for i in range(width)] for s, n in zip(starts, lengths, strict=True)]
    valid = [[i < n for i in range(width)] for n in lengths]
    real = [s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)]
    flat = [b * width + i for b, n in enumerate(lengths) for i in range(n)]
    return Slots(
        index=torch.tensor(index, dtype=torch.long, device=device),
        valid=torch.tensor(valid, dtype=torch.bool, device=device),
        real=torch.tensor(real, dtype=torch.long, device=device),
        flat=torch.tensor(flat, dtype=torch.long, device=device),
    )


# A block of at most this many query x key pairs is batched: below it the call's own cost
# (dispatch, buffers) is a large share of its work; a larger block runs alone, unpadded.
SMALL_BLOCK = 1 << 12


def batched(blocks: list[Block], device: torch.device) -> tuple[list[Batch], list[Block]]:
    """The small causal and full blocks of each row group as batches, one per kind and size
    class (query and key counts within a power of two: the padding at most doubles a side),
    and the blocks left to run one by one (band tiles, each with its own mask; large blocks; a
    block alone in its class)."""
    groups: dict[tuple[Kind, int, int, int, int], list[Block]] = {}
    alone = []
    for blk in blocks:
        queries, keys = blk.q1 - blk.q0, blk.k1 - blk.k0
        if blk.kind is Kind.BAND or queries * keys > SMALL_BLOCK:
            alone.append(blk)
        else:
            groups.setdefault((blk.kind, blk.b0, blk.b1, queries.bit_length(), keys.bit_length()), []).append(blk)
    batches = []
    for (kind, b0, b1, *_), group in groups.items():
        if len(group) == 1:
            alone += group
            continue
        q_slots = _slots([b.q0 for b in group], [b.q1 - b.q0 for b in group], device)
        k_slots = _slots([b.k0 for b in group], [b.k1 - b.k0 for b in group], device)
        batches.append(Batch(kind, b0, b1, q_slots, k_slots))
    return batches, alone


def _gathered(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` at ``[n, Q]`` positions -> ``[n*B, H, Q, D]`` (a batch entry per block and row)."""
    b, h = x.shape[:2]
    n, q = index.shape
    picked = x.index_select(2, index.reshape(-1)).reshape(b, h, n, q, *x.shape[3:])
    return picked.movedim(2, 0).reshape(n * b, h, q, *x.shape[3:])


def _real(x: torch.Tensor, slots: Slots) -> torch.Tensor:
    """``[n*B, H, L, ...]`` kernel outputs -> ``[B, H, P, ...]`` at the real slots."""
    n, width = slots.index.shape
    per_block = x.reshape(n, -1, *x.shape[1:]).movedim(0, 2)  # [B, H, n, L, ...]
    flat = per_block.reshape(*per_block.shape[:2], n * width, *per_block.shape[4:])
    return flat.index_select(2, slots.flat)


def _batch_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: Batch, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One CPU flash call for every block of the batch: (outputs, log-sum-exp) at its real queries."""
    rows = slice(batch.b0, batch.b1)
    q = _gathered(query[rows], batch.q.index)
    k, v = _gathered(key[rows], batch.k.index), _gathered(value[rows], batch.k.index)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, batch.kind is Kind.CAUSAL, attn_mask=batch.key_mask(q.dtype, batch.b1 - batch.b0), scale=scale
    )
    return _real(out, batch.q), _real(lse, batch.q)


def _batch_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    batch: Batch,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's gradients: of its real queries ``[B, H, P, D]``, of its real keys' slots
    ``[B, Hkv, Pk, D]`` (a key two blocks share appears in both: the caller sums them)."""
    rows = slice(batch.b0, batch.b1)
    q = _gathered(query[rows], batch.q.index)
    k, v = _gathered(key[rows], batch.k.index), _gathered(value[rows], batch.k.index)
    real = batch.q.valid.repeat_interleave(batch.b1 - batch.b0, dim=0)[:, None, :]  # [n*B, 1, Q]
    g = _gathered(grad[rows], batch.q.index) * real.unsqueeze(-1)  # a padded query has no gradient
    # ... and a log-sum-exp no score reaches, so that its probabilities are 0, not exp(overflow)
    kernel_lse = _gathered(lse[rows].unsqueeze(-1), batch.q.index).squeeze(-1).masked_fill(~real, 1e30)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g,
        q,
        k,
        v,
        _gathered(out[rows], batch.q.index),
        kernel_lse.contiguous(),
        0.0,
        batch.kind is Kind.CAUSAL,
        attn_mask=batch.key_mask(q.dtype, batch.b1 - batch.b0),
        scale=scale,
    )
    return _real(dq, batch.q), _real(dk, batch.k), _real(dv, batch.k)


# --------------------------------------------------------------------------- the merge
def _kernels(device: torch.device, softcap: float | None) -> tuple[Any, Any]:
    if softcap:
        return partial(_softcap_forward, cap=softcap), partial(_softcap_backward, cap=softcap)
    return (_cuda_forward, _cuda_backward) if device.type == "cuda" else (_cpu_forward, _cpu_backward)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        blocks: list[Block],
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        forward_kernel, _ = _kernels(query.device, softcap)
        acc = _accumulation_dtype(query.dtype)
        out = query.new_zeros(query.shape[:-1] + value.shape[-1:], dtype=acc)
        lse = query.new_full(query.shape[:-1], float("-inf"), dtype=acc)
        batches: list[Batch] = []
        if BATCH_BLOCKS and query.device.type == "cpu" and not softcap:
            batches, blocks = batched(blocks, query.device)
        for batch in batches:
            o, block_lse = _batch_forward(query, key, value, batch, scale)
            at = batch.q.real
            rows = slice(batch.b0, batch.b1)
            old = lse[rows].index_select(2, at)
            block_lse = block_lse.to(acc)
            new = torch.logaddexp(old, block_lse)
            part = out[rows].index_select(2, at)
            part = part * torch.exp(old - new).unsqueeze(-1) + o.to(acc) * torch.exp(block_lse - new).unsqueeze(-1)
            out[rows].index_copy_(2, at, part)
            lse[rows].index_copy_(2, at, new)
        saved = []
        for blk in blocks:
            rows = slice(blk.b0, blk.b1)
            o, block_lse, extra = forward_kernel(
                query[rows, :, blk.q0 : blk.q1],
                key[rows, :, blk.k0 : blk.k1],
                value[rows, :, blk.k0 : blk.k1],
                blk,
                scale,
            )
            saved.append(extra)
            old = lse[rows, :, blk.q0 : blk.q1]
            block_lse = block_lse.to(acc)
            new = torch.logaddexp(old, block_lse)
            part = out[rows, :, blk.q0 : blk.q1]
            part.mul_(torch.exp(old - new).unsqueeze(-1)).add_(o.to(acc) * torch.exp(block_lse - new).unsqueeze(-1))
            old.copy_(new)
        if sinks is not None:  # one more logit per head, with no value
            total = torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))
            out.mul_(torch.exp(lse - total).unsqueeze(-1))
            lse = total
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse, sinks)
        ctx.blocks, ctx.scale, ctx.extra, ctx.has_sinks = blocks, scale, saved, sinks is not None
        ctx.softcap, ctx.batches = softcap, batches
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, sinks = ctx.saved_tensors
        _, backward_kernel = _kernels(query.device, ctx.softcap)
        acc = _accumulation_dtype(query.dtype)
        grad = grad.contiguous()
        dq = torch.zeros_like(query, dtype=acc)
        dk = torch.zeros_like(key, dtype=acc)
        dv = torch.zeros_like(value, dtype=acc)
        kernel_lse = lse.to(torch.float32) if query.dtype != torch.float64 else lse
        for batch in ctx.batches:
            rows = slice(batch.b0, batch.b1)
            gq, gk, gv = _batch_backward(grad, query, key, value, out, kernel_lse, batch, ctx.scale)
            dq[rows].index_add_(2, batch.q.real, gq.to(acc))
            dk[rows].index_add_(2, batch.k.real, gk.to(acc))
            dv[rows].index_add_(2, batch.k.real, gv.to(acc))
        for blk, extra in zip(ctx.blocks, ctx.extra, strict=True):
            rows, qs, ks = slice(blk.b0, blk.b1), slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            gq, gk, gv = backward_kernel(
                grad[rows, :, qs],
                query[rows, :, qs],
                key[rows, :, ks],
                value[rows, :, ks],
                out[rows, :, qs],
                kernel_lse[rows, :, qs].contiguous(),
                blk,
                ctx.scale,
                extra,
            )
            dq[rows, :, qs] += gq
            dk[rows, :, ks] += gk
            dv[rows, :, ks] += gv
        dsinks = None
        if ctx.has_sinks:  # d loss / d sink = -sum_rows p_sink * <grad, out>
            weight = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
            dsinks = -(weight * (grad.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dsinks, None, None, None


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: list[Block],
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[B, H, Sq, D]`` queries against ``[B, Hkv, Sk, D]`` keys and ``[B, Hkv, Sk, Dv]`` values,
    block by block (every query must be in at least one block). ``sinks``: one learned logit per
    head; ``softcap``: the logits' cap (``cap * tanh(score / cap)``), through the tiled kernel.

    The kernels take one head size for queries, keys and values; MLA's value head is narrower
    than its query/key head (DeepSeek-V3: 128 against 192). The narrower side is padded with
    zeros to the wider and the output cut back: exact (a zero column of the values gives a zero
    column of the output, and its gradient is dropped by the cut; zero columns of queries and
    keys add nothing to their products, and the scale is the real head size's). The cost: the
    padded tensor is that much larger (DeepSeek-V3's gathered values 1.5x) and the kernels'
    value products as wide as the query's."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    dqk, dv = query.shape[-1], value.shape[-1]
    if dv < dqk:
        value = torch.nn.functional.pad(value, (0, dqk - dv))
    elif dqk < dv:
        query = torch.nn.functional.pad(query, (0, dv - dqk))
        key = torch.nn.functional.pad(key, (0, dv - dqk))
    if softcap:
        blocks = tiled(blocks, MAX_TILE, KEY_TILE)
    result: torch.Tensor = _BlockAttention.apply(query, key, value, sinks, blocks, scale, softcap or None)
    return result[..., :dv] if result.shape[-1] != dv else result
