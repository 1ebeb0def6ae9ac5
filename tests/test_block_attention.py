"""The CP attention's blocks equal one softmax over the dense mask: outputs and gradients.

No process group is needed: a rank's queries are its head-tail shard of the full queries, its
keys the whole sequence, exactly what the cp attention sees after the all-gather."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plancc.runtime.block_attention import MAX_TILE, Kind, block_attention, span_blocks
from plancc.runtime.cp_context import load_balanced_indices, load_balanced_indices_packed, query_spans, row_segments
from plancc.runtime.document_attention import attention_with_sinks


def _dense(q, k, v, allowed, sinks, softcap=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if sinks is None and softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return attention_with_sinks(q, k, v, allowed, sinks, dropout_p=0.0, scale=None, softcap=softcap)


def _allowed(positions, valid, window):
    """[B, 1, S, S]: the reference's rule -- same segment (documents restart positions), valid
    key, key at or before the query, inside the window; a query that may see nothing sees itself."""
    doc = torch.ones_like(positions, dtype=torch.bool)
    doc[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc = doc.long().cumsum(1)
    q, k = positions.unsqueeze(-1), positions.unsqueeze(1)
    allowed = (k <= q) & (doc.unsqueeze(-1) == doc.unsqueeze(1)) & valid.unsqueeze(1)
    if window:
        allowed &= (q - k) < window
    eye = torch.eye(positions.shape[1], dtype=torch.bool).unsqueeze(0)
    allowed |= ~allowed.any(-1, keepdim=True) & eye
    return allowed.unsqueeze(1)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    cp=st.sampled_from([1, 2, 4]),
    docs=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    packed=st.booleans(),
    pad=st.tuples(st.integers(0, 5), st.integers(0, 5)),
    window=st.sampled_from([None, 1, 3, 7, 100]),
    groups=st.sampled_from([1, 2]),
    sinks=st.booleans(),
    softcap=st.sampled_from([None, None, 1.5]),
    seed=st.integers(0, 99),
)
def test_blocks_equal_the_dense_mask_for_every_rank(cp, docs, packed, pad, window, groups, sinks, softcap, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [2 * cp * n for n in docs]
    total = sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] if packed else None
    if packed:  # one packed row; positions restart at every document
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        valid = torch.ones_like(positions, dtype=torch.bool)
    else:  # two rows: the second left- and right-padded
        positions = torch.arange(total).expand(2, -1)
        valid = torch.ones((2, total), dtype=torch.bool)
        left, right = min(pad[0], total - 1), min(pad[1], total - 1 - min(pad[0], total - 1))
        valid[1, :left] = False
        valid[1, total - right :] = False
    batch, heads = positions.shape[0], 2 * groups
    q = torch.randn(batch, heads, total, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    s = torch.randn(heads, generator=gen, dtype=torch.float64) if sinks else None
    want = _dense(q, k, v, _allowed(positions, valid, window), s, softcap)
    segments = row_segments(positions, valid, bounds)
    assert segments is not None
    grad = torch.randn_like(want)
    for rank in range(cp):
        index = (
            load_balanced_indices(total, cp, rank) if bounds is None else load_balanced_indices_packed(bounds, cp, rank)
        )
        blocks = [
            blk
            for first, end, starts in segments
            for span in query_spans(bounds or [0, total], starts, cp, rank)
            for blk in span_blocks(span, (first, end), window)
        ]
        assert not [b for b in blocks if b.kind is Kind.BAND and b.q1 - b.q0 > MAX_TILE]
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q[:, :, index], k, v))
        ss = None if s is None else s.clone().requires_grad_(True)
        got = block_attention(qq, kk, vv, blocks, sinks=ss, softcap=softcap)
        real = valid[:, index]  # padded queries' outputs are ignored
        assert torch.allclose(
            got[real.unsqueeze(1).expand_as(got[..., 0])],
            want[:, :, index][real.unsqueeze(1).expand_as(got[..., 0])],
            atol=1e-10,
        )
        # the gradient of this rank's real outputs, against autograd through the dense reference
        g = grad[:, :, index] * real[:, None, :, None]
        got.backward(g)
        rq, rk, rv = (t.clone().requires_grad_(True) for t in (q, k, v))
        rs = None if s is None else s.clone().requires_grad_(True)
        full = _dense(rq, rk, rv, _allowed(positions, valid, window), rs, softcap)
        full[:, :, index].backward(g)
        assert torch.allclose(qq.grad, rq.grad[:, :, index], atol=1e-10)
        assert torch.allclose(kk.grad, rk.grad, atol=1e-10) and torch.allclose(vv.grad, rv.grad, atol=1e-10)
        if s is not None:
            assert torch.allclose(ss.grad, rs.grad, atol=1e-10)


def test_a_hole_in_the_mask_is_left_to_the_dense_reference():
    positions = torch.arange(8).expand(1, -1)
    assert row_segments(positions, torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0]]), None) is None
    assert row_segments(positions, torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]]), None) == [(0, 1, [0, 2, 6])]


def test_a_window_keeps_every_mask_the_size_of_a_tile_and_the_window():
    """128k tokens at cp=8 under a 4096-token window: no block is longer than the window plus a
    tile in keys, and the band masks are T x (w - 1) at most -- never S/cp x S."""
    total, cp, window = 131072, 8, 4096
    blocks = [blk for span in query_spans([0, total], [0], cp, 3) for blk in span_blocks(span, (0, 1), window)]
    assert max(b.k1 - b.k0 for b in blocks) <= window - 1
    assert max((b.q1 - b.q0) * (b.k1 - b.k0) for b in blocks if b.kind is Kind.BAND) <= MAX_TILE * (window - 1)
    assert sum(b.q1 - b.q0 for b in blocks if b.kind is Kind.CAUSAL) == total // cp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_of_a_long_chunk_is_two_unmasked_blocks(dtype):
    """No window, no documents: a chunk is its prefix (no mask) and its diagonal (causal)."""
    spans = query_spans([0, 64], [0], 4, 1)
    blocks = [blk for span in spans for blk in span_blocks(span, (0, 1), None)]
    assert sorted((b.kind.value, b.k0, b.k1) for b in blocks) == [
        ("causal", 8, 16),
        ("causal", 48, 56),
        ("full", 0, 8),
        ("full", 0, 48),
    ]
    q = torch.randn(1, 4, 16, 8, dtype=dtype)
    k, v = torch.randn(1, 2, 64, 8, dtype=dtype), torch.randn(1, 2, 64, 8, dtype=dtype)
    got = block_attention(q, k, v, blocks)
    index = load_balanced_indices(64, 4, 1)
    allowed = (torch.arange(64).unsqueeze(0) <= index.unsqueeze(1))[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=allowed, enable_gqa=True
    )
    assert got.dtype == dtype and (got.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


class _EfficientOnCpu:
    """The memory-efficient kernel's contract, in plain torch, as the CUDA adapter calls it: equal
    head counts (a GQA mistake fails here), the additive bias, causal aligned top-left, the
    log-sum-exp padded to a multiple of 32 rows, and a backward that takes the caller's output
    and log-sum-exp."""

    @staticmethod
    def forward(q, k, v, bias, compute_lse, dropout, causal, scale=None):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the kernel takes equal head counts"
        s = _scores(q, k, bias, causal, scale)
        lse = s.logsumexp(-1)
        padded = lse.new_full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), 123.0)  # junk past the rows
        padded[..., : lse.shape[2]] = lse
        return torch.softmax(s, -1) @ v, padded, torch.tensor(0), torch.tensor(0)

    @staticmethod
    def backward(grad, q, k, v, bias, out, lse, seed, offset, dropout, mask, causal, scale=None):
        assert q.shape[1] == k.shape[1] and lse.shape[2] % 32 == 0
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        p = torch.exp(_scores(q, k, bias, causal, scale) - lse[..., : q.shape[2], None])
        dv = p.transpose(-1, -2) @ grad
        ds = p * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
        return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv, None


def _scores(q, k, bias, causal, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


@pytest.mark.parametrize("window,kinds", [(None, {Kind.CAUSAL, Kind.FULL}), (7, {Kind.CAUSAL, Kind.BAND})])
@pytest.mark.parametrize("groups", [1, 2])
def test_the_cuda_adapter_folds_query_groups_and_pads_the_log_sum_exp_as_the_kernel_wants(
        monkeypatch, groups, window, kinds):
    """The CUDA path's bookkeeping (query groups folded into the length for unmasked and band
    blocks, the local diagonal's keys expanded, the bias repeated per group, the log-sum-exp cut
    and padded back) against the dense reference, on CPU with the kernel's contract stood in."""
    from plancc.runtime import block_attention as ba

    monkeypatch.setattr(ba, "_EFFICIENT", _EfficientOnCpu.forward)
    monkeypatch.setattr(ba, "_EFFICIENT_BACKWARD", _EfficientOnCpu.backward)
    monkeypatch.setattr(ba, "_kernels", lambda device, softcap: (ba._cuda_forward, ba._cuda_backward))
    gen = torch.Generator().manual_seed(3)
    total, cp = 48, 2
    positions = torch.arange(total).expand(2, -1)
    valid = torch.ones((2, total), dtype=torch.bool)
    valid[1, 40:] = False
    q = torch.randn(2, 2 * groups, total, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(2 * groups, generator=gen, dtype=torch.float64)
    segments = row_segments(positions, valid, None)
    want = _dense(q, k, v, _allowed(positions, valid, window), sinks)
    for rank in range(cp):
        index = load_balanced_indices(total, cp, rank)
        blocks = [blk for first, end, starts in segments for span in query_spans([0, total], starts, cp, rank)
                  for blk in span_blocks(span, (first, end), window)]
        assert {b.kind for b in blocks} == kinds
        qq, kk, vv, ss = (t.clone().requires_grad_(True) for t in (q[:, :, index], k, v, sinks))
        got = block_attention(qq, kk, vv, blocks, sinks=ss)
        real = valid[:, index][:, None, :, None]
        assert torch.allclose(got * real, want[:, :, index] * real, atol=1e-10)
        g = torch.randn(got.shape, generator=gen, dtype=torch.float64) * real
        got.backward(g)
        rq, rk, rv, rs = (t.clone().requires_grad_(True) for t in (q, k, v, sinks))
        _dense(rq, rk, rv, _allowed(positions, valid, window), rs)[:, :, index].backward(g)
        for mine, ref in ((qq.grad, rq.grad[:, :, index]), (kk.grad, rk.grad), (vv.grad, rv.grad), (ss.grad, rs.grad)):
            assert torch.allclose(mine, ref, atol=1e-10)


@pytest.mark.parametrize("dqk,dv", [(24, 16), (16, 24)])
def test_a_value_head_of_another_size_than_the_query_key_head_is_exact(dqk, dv):
    """MLA's value head is narrower than its query/key head (DeepSeek-V3: 128 of 192), and the
    kernels take one head size ("Q/K/V should have the same head size" since the block attention):
    the narrower side is padded and the output cut. Outputs and gradients equal one dense softmax."""
    spans = query_spans([0, 32], [0], 2, 0)
    blocks = [blk for span in spans for blk in span_blocks(span, (0, 1), None)]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 16, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 32, dqk, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 32, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    got = block_attention(q, k, v, blocks)
    index = load_balanced_indices(32, 2, 0)
    allowed = (torch.arange(32).unsqueeze(0) <= index.unsqueeze(1))[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert got.shape == want.shape == (1, 4, 16, dv)
    torch.testing.assert_close(got, want)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    mine = torch.autograd.grad(got, (q, k, v), grad)
    exact = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(mine, exact):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("groups", [1, 3])
def test_soft_capped_logits_run_in_bounded_tiles_and_equal_the_capped_softmax(monkeypatch, groups):
    """Gemma 2's ``cap * tanh(score / cap)``: tiles of 3 queries x 5 keys (the real ones are 512
    x 2048) cover each block's keys exactly once, and the merged result -- outputs, gradients of
    queries, keys and values -- is the capped softmax over the dense mask, windows included."""
    from plancc.runtime import block_attention as module

    monkeypatch.setattr(module, "MAX_TILE", 3)
    monkeypatch.setattr(module, "KEY_TILE", 5)
    cp, total, window, cap = 2, 40, 7, 2.0
    positions = torch.arange(total).unsqueeze(0)
    valid = torch.ones_like(positions, dtype=torch.bool)
    gen = torch.Generator().manual_seed(groups)
    q = torch.randn(1, 2 * groups, total, 8, generator=gen, dtype=torch.float64) * 2
    k, v = (torch.randn(1, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    for win in (None, window):
        want = _dense(q, k, v, _allowed(positions, valid, win), None, cap)
        grad = torch.randn_like(want)
        for rank in range(cp):
            index = load_balanced_indices(total, cp, rank)
            blocks = [b for span in query_spans([0, total], [0], cp, rank) for b in span_blocks(span, (0, 1), win)]
            pieces = module.tiled(blocks, 3, 5)
            assert max((b.q1 - b.q0) for b in pieces) <= 3
            assert max(b.k1 - b.k0 for b in pieces if b.kind is not Kind.BAND) <= 5
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q[:, :, index], k, v))
            got = block_attention(qq, kk, vv, blocks, softcap=cap)
            assert torch.allclose(got, want[:, :, index], atol=1e-10)
            got.backward(grad[:, :, index])
            rq, rk, rv = (t.clone().requires_grad_(True) for t in (q, k, v))
            _dense(rq, rk, rv, _allowed(positions, valid, win), None, cap)[:, :, index].backward(grad[:, :, index])
            assert torch.allclose(qq.grad, rq.grad[:, :, index], atol=1e-10)
            assert torch.allclose(kk.grad, rk.grad, atol=1e-10) and torch.allclose(vv.grad, rv.grad, atol=1e-10)


def test_many_short_documents_run_in_a_few_kernel_calls_with_the_loops_numbers(monkeypatch):
    """A packed row of 512 documents at cp=2: 1536 blocks on a rank, a dozen kernel calls (one
    per kind and size class); a row of 40 documents of 4 to 60 tokens gives the one-call-per-block
    loop's outputs and gradients (the padding never reaches a real query or key)."""
    from plancc.runtime import block_attention as module

    def blocks_of(lengths, cp, rank):
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        return [b for span in query_spans(bounds, bounds[:-1], cp, rank) for b in span_blocks(span, (0, 1), None)]

    gen = torch.Generator().manual_seed(0)
    many = blocks_of((4 * torch.randint(1, 17, (512,), generator=gen)).tolist(), 2, 0)
    batches, alone = module.batched(many, torch.device("cpu"))
    assert len(many) >= 1024 and len(batches) + len(alone) <= 16
    lengths = (4 * torch.randint(1, 16, (40,), generator=gen)).tolist()
    total = sum(lengths)
    q = torch.randn(1, 4, total // 2, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(1, 4, total // 2, 8, generator=gen, dtype=torch.float64)
    results = []
    for batch in (True, False):
        monkeypatch.setattr(module, "BATCH_BLOCKS", batch)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = block_attention(qq, kk, vv, blocks_of(lengths, 2, 1))
        out.backward(grad)
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for got, want in zip(*results, strict=True):
        assert torch.allclose(got, want, atol=1e-12)
