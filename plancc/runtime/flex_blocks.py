"""The block attention's blocks as one flex-attention call a layer: packed rows of any number
of documents, windows, sinks and soft-capping in a single kernel launch.

``runtime.block_attention`` runs a rank's blocks (per query span: the unmasked prefix of its
segment and the causal diagonal, or window tiles) as separate kernel calls merged by their
log-sum-exp. Flex attention takes the same description as a *block mask*: which ``T x T`` tiles
of (local query, gathered key) hold any allowed pair (from the blocks, on the host, nothing read
from a device), which of them are allowed whole (no mask evaluated), and a ``mask_mod`` that
decides the pairs of the others -- query ``i`` of row ``b`` sees key ``k`` iff
``segment[b, i] <= k <= position[b, i]`` (and ``k > position - window``): the block attention's
rule, element by element. One call then covers every document of the row, however many.

Sinks (gpt-oss) are one more key at index ``S`` whose value is zero and whose score is the
head's sink logit (``score_mod``): it takes probability mass and gives nothing, exactly the
merged ``out * exp(lse) / (exp(lse) + exp(sink))``; the sink's gradient comes through the
captured tensor, as flex attention differentiates ``score_mod``'s buffers. Soft-capping is
``score_mod``'s ``cap * tanh(score / cap)``.

Where it runs: on CUDA it is the CP attention's default (``PLANCC_CP_ATTENTION=blocks`` keeps
the per-block efficient-attention kernels). On the CPU, flex attention in torch 2.13 has no
backward and its compiled kernel returns no log-sum-exp, so training keeps the block attention's
batched flash calls; ``PLANCC_CP_ATTENTION=flex`` runs it for forward-only work there (log-probs)
-- which is how the suite checks its masks, sinks and caps against the unsharded model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from .block_attention import Block, Kind, Span

# The block mask's tile: flex attention's default sparse block size.
TILE = 128
# The tile tables are built here from the host's block list, then moved to the device once.
HOST = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class FlexLayout:
    """What one flex call needs about a batch at one window: the rule's per-query tensors and the
    tiles (``[B, 1, Qt]`` counts and ``[B, 1, Qt, Kt]`` indices, partial and whole)."""

    position: torch.Tensor  # [B, Sq] int32: the query's index in the gathered sequence
    segment: torch.Tensor  # [B, Sq] int32: where its segment begins
    keys: int  # gathered keys S (the sink, if any, is key S)
    window: int  # 0: none
    sink: bool
    partial: tuple[torch.Tensor, torch.Tensor]
    whole: tuple[torch.Tensor, torch.Tensor]


def _tiles(n: int) -> int:
    return -(-n // TILE)


def _mark(partial: torch.Tensor, whole: torch.Tensor, blk: Block) -> None:
    """Tiles a block reaches: ``partial`` where some pair is allowed, ``whole`` where all are."""
    q_tiles = torch.arange(blk.q0 // TILE, (blk.q1 - 1) // TILE + 1, device=HOST)
    k_tiles = torch.arange(blk.k0 // TILE, (blk.k1 - 1) // TILE + 1, device=HOST)
    q_lo = torch.clamp(q_tiles * TILE, min=blk.q0) - blk.q0  # offsets into the block's queries
    q_hi = torch.clamp((q_tiles + 1) * TILE, max=blk.q1) - 1 - blk.q0
    k_lo = torch.clamp(k_tiles * TILE, min=blk.k0) - blk.k0
    k_hi = torch.clamp((k_tiles + 1) * TILE, max=blk.k1) - 1 - blk.k0
    inside = ((q_tiles * TILE >= blk.q0) & ((q_tiles + 1) * TILE <= blk.q1))[:, None] & (
        (k_tiles * TILE >= blk.k0) & ((k_tiles + 1) * TILE <= blk.k1)
    )[None, :]
    if blk.kind is Kind.FULL:
        some = torch.ones(len(q_tiles), len(k_tiles), dtype=torch.bool, device=HOST)
        every = inside
    elif blk.kind is Kind.CAUSAL:  # query offset i sees key offsets 0..i
        some = k_lo[None, :] <= q_hi[:, None]
        every = inside & (k_hi[None, :] <= q_lo[:, None])
    else:  # BAND: query at g0 + i sees key k0 + j iff k0 + j > g0 + i - window
        some = (blk.k0 + k_hi[None, :]) > (blk.g0 + q_lo[:, None] - blk.window)
        every = inside & ((blk.k0 + k_lo[None, :]) > (blk.g0 + q_hi[:, None] - blk.window))
    rows = slice(blk.b0, blk.b1)
    qs, ks = slice(int(q_tiles[0]), int(q_tiles[-1]) + 1), slice(int(k_tiles[0]), int(k_tiles[-1]) + 1)
    partial[rows, qs, ks] |= some
    whole[rows, qs, ks] |= every


def _indexed(table: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, Qt, Kt]`` bool -> flex's (counts ``[B, 1, Qt]``, indices ``[B, 1, Qt, Kt]``): each
    query tile's key tiles first, in order."""
    counts = table.sum(-1, dtype=torch.int32)
    order = torch.argsort((~table).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None].to(device), order[:, None].to(device)


def flex_layout(
    spans: list[tuple[int, int, Span]],
    blocks: list[Block],
    shape: tuple[int, int, int],
    window: int | None,
    sink: bool,
    device: torch.device,
) -> FlexLayout:
    """The layout of ``spans`` (per group of rows ``[first, end)``) and their ``blocks`` for
    ``shape = (rows, local queries, gathered keys)``: built on the host, then moved once."""
    rows, queries, keys = shape
    position = torch.zeros((rows, queries), dtype=torch.int32, device=HOST)
    segment = torch.zeros((rows, queries), dtype=torch.int32, device=HOST)
    for first, end, span in spans:
        at = slice(span.local, span.local + span.n)
        position[first:end, at] = torch.arange(span.start, span.start + span.n, dtype=torch.int32, device=HOST)
        segment[first:end, at] = span.segment
    total = keys + 1 if sink else keys
    partial = torch.zeros((rows, _tiles(queries), _tiles(total)), dtype=torch.bool, device=HOST)
    whole = torch.zeros_like(partial)
    for blk in blocks:
        _mark(partial, whole, blk)
    if sink:  # every query sees the sink key; its tile is decided by the mask
        partial[:, :, keys // TILE] = True
    partial &= ~whole
    return FlexLayout(
        position=position.to(device),
        segment=segment.to(device),
        keys=keys,
        window=window or 0,
        sink=sink,
        partial=_indexed(partial, device),
        whole=_indexed(whole, device),
    )


def uses_flex(device: torch.device, choice: str | None = None) -> bool:
    """Whether the blocks run as one flex call: ``PLANCC_CP_ATTENTION`` (read per call, it is
    one dict lookup) ``flex`` anywhere, ``blocks`` or ``dense`` never, ``auto`` (the default) on
    CUDA -- for packed rows at cp = 1 (``runtime.document_attention``) as under cp."""
    choice = choice or os.environ.get("PLANCC_CP_ATTENTION", "auto")
    return choice == "flex" or (choice == "auto" and device.type == "cuda")


@functools.cache
def _compiled() -> Any:
    # flex attention is a compiled kernel; uncompiled it materializes every score
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: FlexLayout,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[B, H, Sq, D]`` queries against ``[B, Hkv, S, D]`` keys and ``[B, Hkv, S, Dv]`` values
    in one flex-attention call under ``layout``'s block mask: ``[B, H, Sq, Dv]``."""
    from torch.nn.attention.flex_attention import BlockMask

    assert (sinks is not None) == layout.sink, "the layout was built for this layer's sinks"
    position, segment, keys, window = layout.position, layout.segment, layout.keys, layout.window
    if sinks is not None:  # one more key, zero value: its score is the sink (score_mod)
        key = torch.nn.functional.pad(key, (0, 0, 0, 1))
        value = torch.nn.functional.pad(value, (0, 0, 0, 1))

    def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        p = position[b, q]
        allowed = (k >= segment[b, q]) & (k <= p)
        if window:
            allowed = allowed & (k > p - window)
        if sinks is not None:
            allowed = allowed | (k == keys)
        return allowed

    def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if sinks is not None:
            score = torch.where(k == keys, sinks[h].to(score.dtype), score)
        return score

    block_mask = BlockMask.from_kv_blocks(
        *layout.partial,
        *layout.whole,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(query.shape[2], key.shape[2]),
    )
    out = _compiled()(
        query,
        key,
        value,
        score_mod=score_mod if (softcap or sinks is not None) else None,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    assert isinstance(out, torch.Tensor)
    return out
