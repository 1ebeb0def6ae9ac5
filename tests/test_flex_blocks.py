"""The CP attention's one-call form: the block attention's blocks as a flex-attention block mask.

The tiles are checked against the rule element by element (cheap, on the host, many layouts);
the compiled call against the dense reference (forward: flex attention has no CPU backward in
torch 2.13; on CUDA its backward is torch's own and runs when a GPU is lent, docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plancc.runtime import flex_blocks
from plancc.runtime.block_attention import span_blocks
from plancc.runtime.cp_context import load_balanced_indices, load_balanced_indices_packed, query_spans, row_segments
from plancc.runtime.flex_blocks import flex_block_attention, flex_layout

from .test_block_attention import _allowed, _dense


def _layout_of(positions, valid, bounds, cp, rank, window, sink):
    total = positions.shape[1]
    segments = row_segments(positions, valid, bounds)
    assert segments is not None
    spans = [
        (first, end, span)
        for first, end, starts in segments
        for span in query_spans(bounds or [0, total], starts, cp, rank)
    ]
    blocks = [blk for first, end, span in spans for blk in span_blocks(span, (first, end), window)]
    shape = (positions.shape[0], total // cp, total)
    return flex_layout(spans, blocks, shape, window, sink, torch.device("cpu"))


def _rows(docs, cp, packed, pad):
    lengths = [2 * cp * n for n in docs]
    total = sum(lengths)
    if packed:  # one packed row; positions restart at every document
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        return positions, torch.ones_like(positions, dtype=torch.bool), bounds
    positions = torch.arange(total).expand(2, -1)
    valid = torch.ones((2, total), dtype=torch.bool)
    left, right = min(pad[0], total - 1), min(pad[1], total - 1 - min(pad[0], total - 1))
    valid[1, :left] = False
    valid[1, total - right :] = False
    return positions, valid, None


def _tile_table(counts, indices, shape):
    table = torch.zeros(shape, dtype=torch.bool)
    for b in range(shape[0]):
        for qt in range(shape[1]):
            n = int(counts[b, 0, qt])
            table[b, qt, indices[b, 0, qt, :n].long()] = True
    return table


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    docs=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    packed=st.booleans(),
    pad=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    window=st.sampled_from([None, 1, 3, 7, 100]),
    sink=st.booleans(),
    tile=st.sampled_from([2, 4, 8]),
)
def test_the_tiles_are_exactly_where_the_rule_allows_a_pair(cp, docs, packed, pad, window, sink, tile):
    """A tile is listed iff some (real query, key) pair in it is allowed, and listed whole only if
    every pair is: the mask_mod's rule -- segment <= key <= position, inside the window -- equals
    the dense reference's mask for every real query of every rank."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flex_blocks, "TILE", tile)
        _check_tiles(cp, docs, packed, pad, window, sink, tile)


def _check_tiles(cp, docs, packed, pad, window, sink, tile):
    positions, valid, bounds = _rows(docs, cp, packed, pad)
    rows, total = positions.shape
    dense = _allowed(positions, valid, window)[:, 0]  # [B, S, S]
    for rank in range(cp):
        index = (
            load_balanced_indices(total, cp, rank) if bounds is None else load_balanced_indices_packed(bounds, cp, rank)
        )
        layout = _layout_of(positions, valid, bounds, cp, rank, window, sink)
        keys = torch.arange(total + (1 if sink else 0))
        p, s = layout.position.long()[..., None], layout.segment.long()[..., None]
        rule = (keys >= s) & (keys <= p)
        if window:
            rule &= keys > p - window
        if sink:
            rule[..., total] = True
        real = valid[:, index]
        assert torch.equal(layout.position.long(), index.expand(rows, -1))
        assert torch.equal(rule[..., :total][real], dense[:, index][real])
        # the tiles, from the blocks: where the rule (for queries of real or padded rows) allows pairs
        qt, kt = -(-(total // cp) // tile), -(-rule.shape[-1] // tile)
        padded = torch.zeros((rows, qt * tile, kt * tile), dtype=torch.bool)
        padded[:, : total // cp, : rule.shape[-1]] = rule
        tiles = padded.reshape(rows, qt, tile, kt, tile)
        partial = _tile_table(*layout.partial, (rows, qt, kt))
        whole = _tile_table(*layout.whole, (rows, qt, kt))
        assert not (partial & whole).any()
        assert torch.equal(partial | whole, tiles.any(4).any(2))
        assert tiles.all(4).all(2)[whole].all()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("packed", "cp", "rank", "window", "sink", "softcap", "dims", "compiled"),
    [
        # a packed row of documents that end inside tiles and span several; a window, sinks,
        # soft-capping (no model has both: the kernel takes them together), GQA, MLA's narrower
        # value head. Uncompiled in the default run: flex attention's eager form evaluates the
        # mask_mod and score_mod everywhere (it ignores the tiles, which the test above pins)
        (True, 2, 1, 24, True, 5.0, (24, 8), False),
        # the same compiled, as it runs (inductor's CPU kernel, honouring the tiles: ~20 s to compile)
        pytest.param(True, 2, 1, 24, True, 5.0, (24, 8), True, marks=pytest.mark.extended),
        # two rows, the second padded on both sides, at cp=4
        pytest.param(False, 4, 0, None, False, None, (16, 16), True, marks=pytest.mark.extended),
    ],
    ids=["packed-window-sinks-softcap-mla", "compiled", "padded-compiled"],
)
def test_one_flex_call_equals_the_dense_reference(monkeypatch, packed, cp, rank, window, sink, softcap, dims, compiled):
    monkeypatch.setattr(flex_blocks, "TILE", 32)  # tiles whole, partial and skipped at a test's length
    if not compiled:
        from torch.nn.attention.flex_attention import flex_attention

        monkeypatch.setattr(flex_blocks, "_compiled", lambda: flex_attention)
    gen = torch.Generator().manual_seed(0)
    docs = [5, 16, 74, 33] if packed else [64]
    positions, valid, bounds = _rows(docs, cp, packed, (37, 11))
    rows, total = positions.shape
    d, dv = dims
    q = torch.randn(rows, 4, total, d, generator=gen)
    k = torch.randn(rows, 2, total, d, generator=gen)
    v = torch.randn(rows, 2, total, dv, generator=gen)
    sinks = torch.randn(4, generator=gen) if sink else None
    want = _dense(q, k, v, _allowed(positions, valid, window), sinks, softcap)
    index = load_balanced_indices(total, cp, rank) if bounds is None else load_balanced_indices_packed(bounds, cp, rank)
    layout = _layout_of(positions, valid, bounds, cp, rank, window, sink)
    if packed:  # sparse: a minority of the tiles run at all
        assert (
            int(layout.partial[0].sum() + layout.whole[0].sum())
            < 0.5 * layout.partial[1].shape[2] * layout.partial[1].shape[3]
        )
    with torch.no_grad():
        got = flex_block_attention(q[:, :, index], k, v, layout, sinks=sinks, softcap=softcap)
    real = valid[:, index].unsqueeze(1).expand_as(got[..., 0])
    assert torch.allclose(got[real], want[:, :, index][real], atol=2e-6)
