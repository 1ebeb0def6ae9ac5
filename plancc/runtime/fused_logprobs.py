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
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import fused_kernels
from .mesh import MeshLike
from .vocab_stats import ChunkStats, combine_over_ranks, default_chunk, merge


def default_columns(n: int, v_local: int, device: torch.device) -> int | None:
    """Vocabulary columns per block where ``fused_logprobs`` walks blocks of columns over all
    tokens (forward and backward), or None for chunks of tokens.

    A chunk of tokens reads the whole ``[V, H]`` weight for its matmul, and in backward adds its
    ``gx.T @ h`` into the whole ``[V, H]`` weight gradient (a read and a write of all of it per
    chunk, with an inner dimension of a chunk's rows). A block of columns reads all of ``h``
    instead (``[N, H]``: here 16 MiB, which stays in the cache, where W is 128 MiB), writes its
    own rows of the weight gradient once (inner dimension: every token) and adds into the
    ``[N, H]`` hidden gradient. Under the same byte budget the traffic is ``N * V**2 * H /
    budget`` for token chunks against ``V * N**2 * H / budget`` for column blocks, so columns
    should win when N < V. Measured (``bench/fused_walk.py``, docs/performance.md, H=512 fp32,
    fwd+bwd columns / tokens): 0.62-0.97x wherever V >= 2N (N from 1024 to 4096, V up to
    65536), a tie at V = N (1.01-1.02x at N = 2048 and 4096, 1.09x at 8192), 1.0x at N=8192,
    V=16384, and 1.1-1.5x at V < N. So columns from V >= 2N. On CUDA the token chunks'
    kernels stay (measured there, docs/gpu.md)."""
    if device.type != "cpu" or 2 * n > v_local:
        return None
    return default_chunk(v_local, n, device)  # the same budget with the roles of rows and columns swapped


@dataclass(frozen=True, slots=True)
class _Chunks:
    """How the evaluator walks the ``[N, V_local]`` logits it never holds."""

    forward: int  # tokens per chunk of a forward that keeps nothing of it
    grad: int  # tokens per chunk where a chunk forms gradients
    columns: int | None = None  # fused_logprobs by blocks of vocab columns (default_columns)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Vocab:
    """How this rank's lm_head rows sit in the vocabulary, and how logits are turned into a
    distribution (the sampler's temperature and filters)."""

    group: dist.ProcessGroup | None
    start: int
    size: int  # global vocabulary (rows of the whole lm_head)
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    ignore_index: int = -100
    # the hidden states came as a DTensor replicated over the tp group: their gradient leaves as
    # each rank's partial sum over its vocabulary columns (``Partial``), and DTensor's backward
    # reduces it where they were made -- under SP a reduce-scatter to the sequence shards, half
    # an all-reduce's bytes, instead of an all-reduce here and a chunk taken there
    partial_hidden_grad: bool = False

    @property
    def tp(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def filtered(self) -> bool:
        return self.top_k is not None or self.top_p is not None


def _matmul_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h @ w.T`` as fp32 with fp32 accumulation (bf16/fp16 inputs: their products are exact
    in fp32, so only the accumulation order differs from an fp64 reference).

    Computed as ``(w @ h.T).T``: for a chunk of few rows, ``h @ w.T`` makes CPU BLAS copy the
    whole transposed weight first (measured: +128 MiB and 30% slower at V=32768, H=1024);
    the result is a transposed view, which every reduction here reads as it is. cuBLAS takes
    either operand transposed without a copy, so on CUDA the rows come out contiguous, as the
    kernels want them."""
    if h.is_cuda:
        return h @ w.T if h.dtype == torch.float32 else torch.mm(h, w.T, out_dtype=torch.float32)
    return (_as_fp32(w) @ _as_fp32(h).T).T


class _ChunkLogits:
    """``h_c @ W.T`` in fp32 chunk after chunk. On CPU every chunk is written into one buffer
    allocated once, and a 16-bit weight is cast to fp32 once: a fresh chunk-sized allocation
    per chunk leaves the freed ones in glibc's heap (its mmap threshold rises to the chunk's
    size), about two chunks of resident memory instead of one, and a cast per chunk costs a
    pass over the whole weight. The returned logits are valid until the next call."""

    def __init__(self, weight: torch.Tensor, rows: int, w32: torch.Tensor | None = None):
        self.weight = weight
        self.w32, self.buffer = None, None
        if not weight.is_cuda:
            self.w32 = w32 if w32 is not None else _as_fp32(weight)
            self.buffer = torch.empty(weight.shape[0] * rows, dtype=torch.float32, device=weight.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.buffer is None or self.w32 is None or h.shape[0] * self.w32.shape[0] > self.buffer.numel():
            return _matmul_fp32(h, self.weight)
        out = self.buffer[: h.shape[0] * self.w32.shape[0]].view(self.w32.shape[0], h.shape[0])
        torch.mm(self.w32, _as_fp32(h).T, out=out)
        return out.T  # (w @ h.T).T, as _matmul_fp32 computes it on CPU


def _grad_matmuls(
    gx: torch.Tensor,
    weight: torch.Tensor,
    w32: torch.Tensor | None,
    h: torch.Tensor,
    grad_h_rows: torch.Tensor,
    grad_w: torch.Tensor | None,
) -> None:
    """``grad_h_rows = gx @ weight`` and ``grad_w += gx.T @ h``, both fp32 (no ``grad_w`` for a
    frozen weight -- a LoRA run's lm_head: one vocabulary matmul fewer).

    ``gx`` in fp32 (CPU, or fp32 inputs): fp32 products. ``gx`` in the inputs' 16-bit dtype (the
    CUDA kernels write it so): tensor-core products with fp32 accumulation and output, so the
    weight's gradient is summed over chunks in fp32 -- the same rounding of the logits'
    gradient as autograd of the naive ``log_softmax(h @ W.T)`` applies, none more."""
    if gx.dtype == torch.float32:
        assert w32 is not None, "fp32 gradients of the logits need the fp32 weight"
        grad_h_rows.copy_(gx @ w32)
        if grad_w is not None:
            grad_w.addmm_(gx.T, _as_fp32(h))
        return
    grad_h_rows.copy_(torch.mm(gx, weight, out_dtype=torch.float32))
    if grad_w is not None:
        torch.addmm(grad_w, gx.T, h, out_dtype=torch.float32, out=grad_w)


def _column_blocks(
    h32: torch.Tensor, w32: torch.Tensor, vocab: _Vocab, width: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, _Vocab]]:
    """(first column, weight rows, fp32 logits ``[N, width]`` divided by the temperature, where
    the block sits in the vocabulary) for each block of ``width`` local columns, every block
    written into one buffer allocated once (valid until the next block)."""
    n = h32.shape[0]
    buffer = torch.empty(n * min(width, w32.shape[0]), dtype=torch.float32, device=h32.device)
    for lo in range(0, w32.shape[0], width):
        w_b = w32[lo : lo + width]
        x = buffer[: n * w_b.shape[0]].view(n, w_b.shape[0])
        torch.mm(h32, w_b.T, out=x)
        if vocab.temperature != 1.0:
            x /= vocab.temperature
        yield lo, w_b, x, replace(vocab, start=vocab.start + lo)


def _stats_by_columns(
    hidden: torch.Tensor, w32: torch.Tensor, targets: torch.Tensor, vocab: _Vocab, width: int, entropy: bool
) -> ChunkStats:
    """Every token's partial statistics over this rank's columns, a block of columns at a time,
    merged with a running max as the blocks come (``vocab_stats.merge``, the merge the tp ranks' statistics get)."""
    h32 = _as_fp32(hidden)
    run: ChunkStats | None = None
    for _, _, x, block in _column_blocks(h32, w32, vocab, width):
        cols, here = _target_columns(targets, block, x.shape[1])
        st = _stats(x, cols, here, entropy)[0]
        run = st if run is None else merge(run, st)
    assert run is not None, "a rank holds at least one column"
    return run


_Maybe = torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Backward:
    """What a gradient walker takes from the forward and from autograd: the flat inputs, the
    per-token log-normalizer and entropy forward saved, and the incoming gradients."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V_local, H] (fp32 for the column walk)
    targets: torch.Tensor  # [N]
    lse: torch.Tensor  # [N] over the whole vocabulary
    ent: torch.Tensor | None  # [N], where the entropy was asked for
    g_lp: torch.Tensor  # [N] d loss / d log-prob
    g_ent: torch.Tensor | None  # [N] d loss / d entropy
    vocab: _Vocab

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, _Maybe, torch.Tensor, _Maybe]:
        """(targets, lse, ent, g_lp, g_ent) of tokens lo..hi."""
        ent = self.ent[lo:hi] if self.ent is not None else None
        g_ent = self.g_ent[lo:hi] if self.g_ent is not None else None
        return self.targets[lo:hi], self.lse[lo:hi], ent, self.g_lp[lo:hi], g_ent


def _grad_by_columns(b: _Backward, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of hidden, grad of the local weight), both fp32, a block of ``width`` vocabulary
    columns at a time over all tokens (``default_columns`` says why): each block's logits are
    recomputed, turned into their gradient in place, and give ``grad_h += gx @ W_b`` and the
    block's own rows ``grad_w[b] = gx.T @ h``."""
    h32, w32 = _as_fp32(b.hidden), b.weight
    grad_h = torch.zeros(h32.shape, dtype=torch.float32, device=h32.device)
    grad_w = torch.empty(w32.shape, dtype=torch.float32, device=w32.device)  # every row written once
    for lo, w_b, x, block in _column_blocks(h32, w32, b.vocab, width):
        gx = _local_grad_logits(x, b.targets, b.lse, b.ent, b.g_lp, b.g_ent, block)
        grad_h.addmm_(gx, w_b)
        torch.mm(gx.T, h32, out=grad_w[lo : lo + w_b.shape[0]])
    return grad_h, grad_w


def _target_columns(targets: torch.Tensor, vocab: _Vocab, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local column of each target clamped into range, whether this rank holds it)."""
    local = targets - vocab.start
    here = (local >= 0) & (local < v_local) & (targets != vocab.ignore_index)
    return local.clamp(0, v_local - 1), here


def _keep_mask(full: torch.Tensor, vocab: _Vocab) -> torch.Tensor:
    """Which entries of whole-vocabulary logits ``[c, V]`` the sampler keeps: the top k
    (ties at the k-th value kept), then the smallest head of the renormalized distribution
    whose mass reaches top_p (the entry that crosses top_p is kept)."""
    keep = torch.ones_like(full, dtype=torch.bool)
    if vocab.top_k is not None and vocab.top_k < full.shape[-1]:
        kth = full.topk(vocab.top_k, dim=-1).values[:, -1:]
        keep &= full >= kth
    if vocab.top_p is not None and vocab.top_p < 1.0:
        masked = full.masked_fill(~keep, float("-inf"))
        probs, order = masked.softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass strictly ahead of each entry
        keep_sorted = before < vocab.top_p
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter_(1, order, keep_sorted)
    return keep


def _stats(x: torch.Tensor, cols: torch.Tensor, here: torch.Tensor, entropy: bool) -> tuple[ChunkStats, torch.Tensor]:
    """Partial statistics of a chunk of logits, and ``exp(x - m)``, computed in the storage of
    ``x`` (consumed: one chunk buffer, not three)."""
    hit = x.gather(1, cols.unsqueeze(1)).squeeze(1)
    picked = torch.where(here, hit, torch.zeros_like(hit))
    m = x.amax(dim=1)  # not max(): it also computes indices, at several times the cost
    z = x.sub_(m.unsqueeze(1))
    if not entropy:
        e = z.exp_()
        return ChunkStats(m, e.sum(1), picked, None), e
    e = z.exp()
    return ChunkStats(m, e.sum(1), picked, (e * z).sum(1)), e


def _gather_vocab(x: torch.Tensor, group: dist.ProcessGroup | None, widths: list[int]) -> torch.Tensor:
    """The whole-vocabulary logits of one chunk from every rank's columns."""
    if group is None or len(widths) == 1:
        return x
    # equal sizes for every backend (gloo requires them): pad to the widest shard, then trim
    widest = max(widths)
    padded = torch.nn.functional.pad(x, (0, widest - x.shape[1]))
    parts = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:, :w] for part, w in zip(parts, widths, strict=True)], dim=1)


def _filtered_chunk(
    x: torch.Tensor, targets: torch.Tensor, vocab: _Vocab, widths: list[int], entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log-prob, log-normalizer, entropy, keep mask) of a chunk under the sampler's filters."""
    full = _gather_vocab(x, vocab.group, widths)
    keep = _keep_mask(full, vocab)
    kept = full.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(kept, dim=1)
    valid = targets != vocab.ignore_index
    cols = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    lp = kept.gather(1, cols).squeeze(1) - lse
    ent = None
    if entropy:
        p = (kept - lse.unsqueeze(1)).exp()
        ent = -(p * (full - lse.unsqueeze(1)).masked_fill(~keep, 0.0)).sum(1)
        ent = torch.where(valid, ent, torch.zeros_like(ent))
    return torch.where(valid, lp, torch.zeros_like(lp)), lse, ent, keep


def _local_grad_logits(
    x: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    vocab: _Vocab,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(sum g_lp*lp + g_ent*H) / d x for one chunk of local logits ``x`` (already divided by
    the temperature), computed in the storage of ``x`` (consumed):
    d lp_t / d x_j = 1[j = t] - p_j and d H / d x_j = -p_j (x_j - lse + H)."""
    valid = (targets != vocab.ignore_index).to(x.dtype)
    z = x.sub_(lse.unsqueeze(1))
    shifted = z + ent.unsqueeze(1) if (g_ent is not None and ent is not None) else None
    p = z.exp_()
    if keep is not None:
        p.masked_fill_(~keep, 0.0)
    return _finish_grad(p, targets, g_lp * valid, vocab, shifted, None if g_ent is None else g_ent * valid)


def _finish_grad(
    p: torch.Tensor,
    targets: torch.Tensor,
    g_lp: torch.Tensor,
    vocab: _Vocab,
    shifted: torch.Tensor | None = None,
    g_ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """From probabilities ``p`` (consumed) to the gradient of the chunk's logits."""
    cols, here = _target_columns(targets, vocab, p.shape[1])
    if shifted is not None and g_ent is not None:
        shifted.mul_(p).mul_(-g_ent.unsqueeze(1))
        grad = p.mul_(-g_lp.unsqueeze(1)).add_(shifted)
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
    grad.scatter_add_(1, cols.unsqueeze(1), torch.where(here, g_lp, torch.zeros_like(g_lp)).unsqueeze(1))
    if vocab.temperature != 1.0:
        grad.div_(vocab.temperature)
    return grad


def _rank_slice(full: torch.Tensor, vocab: _Vocab, v_local: int) -> torch.Tensor:
    return full[:, vocab.start : vocab.start + v_local]


def _widths(v_local: int, group: dist.ProcessGroup | None) -> list[int]:
    if group is None or dist.get_world_size(group) == 1:
        return [v_local]
    if dist.get_backend(group) == "fake":  # the dry run's world: no rank can be asked; each holds rank 0's share
        return [v_local] * dist.get_world_size(group)
    widths: list[int] = [0] * dist.get_world_size(group)
    dist.all_gather_object(widths, v_local, group=group)
    return widths


def _chunk_logits(h: torch.Tensor, logits: _ChunkLogits, vocab: _Vocab) -> torch.Tensor:
    x = logits(h)
    if vocab.temperature != 1.0:
        x /= vocab.temperature
    return x


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is fp32, else one fp32 copy (made once, for every chunk or block)."""
    return t if t.dtype == torch.float32 else t.float()


def _fp32_weight(weight: torch.Tensor, fast: bool) -> torch.Tensor | None:
    """The weight the fp32 gradient matmuls take (one cast for all chunks); the kernels'
    16-bit gradients take the weight as it is."""
    if fast and weight.dtype != torch.float32:
        return None
    return _as_fp32(weight)


def _chunk_stats(
    h: torch.Tensor, logits: _ChunkLogits, targets: torch.Tensor, vocab: _Vocab, entropy: bool
) -> tuple[ChunkStats, torch.Tensor]:
    """A chunk's partial statistics, and its storage: on the PyTorch path ``exp(x - m)``
    computed in place, on the kernel path the unscaled logits, read once and left as they are."""
    x = logits(h)
    cols, here = _target_columns(targets, vocab, x.shape[1])
    if not fused_kernels.active(x.device):
        if vocab.temperature != 1.0:
            x /= vocab.temperature
        return _stats(x, cols, here, entropy)
    scale = 1.0 / vocab.temperature
    m, s, t = fused_kernels.chunk_stats(x, scale, entropy)
    hit = x.gather(1, cols.unsqueeze(1)).squeeze(1) * scale
    return ChunkStats(m, s, torch.where(here, hit, torch.zeros_like(hit)), t), x


def _kernel_grad(
    x: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    vocab: _Vocab,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``_local_grad_logits`` on the kernel path, from unscaled logits ``x``, in ``dtype``."""
    cols, here = _target_columns(targets, vocab, x.shape[1])
    valid = (targets != vocab.ignore_index).float()
    return fused_kernels.grad_logits(
        x,
        1.0 / vocab.temperature,
        lse,
        ent,
        g_lp * valid,
        None if g_ent is None else g_ent * valid,
        torch.where(here, cols, torch.full_like(cols, -1)),
        dtype,
    )


def _stats_by_tokens(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: _Vocab, chunk: int, entropy: bool
) -> ChunkStats:
    """Every token's partial statistics over this rank's columns, a chunk of tokens at a time."""
    n = hidden.shape[0]
    m, s, picked = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
    t = torch.empty_like(m) if entropy else None
    logits = _ChunkLogits(weight, chunk)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        st = _chunk_stats(hidden[lo:hi], logits, targets[lo:hi], vocab, entropy)[0]
        m[lo:hi], s[lo:hi], picked[lo:hi] = st.m, st.s, st.picked
        if t is not None and st.t is not None:
            t[lo:hi] = st.t
    return ChunkStats(m, s, picked, t)


def _grad_by_tokens(
    b: _Backward, chunk: int, fast: bool, widths: list[int], weight_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of hidden, grad of the local weight or None when it is frozen), both fp32, a chunk
    of tokens at a time: each chunk's logits recomputed, turned into their gradient and added
    into the weight's."""
    hidden, weight, vocab = b.hidden, b.weight, b.vocab
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
    w32 = _fp32_weight(weight, fast)
    logits = _ChunkLogits(weight, chunk, w32)
    for lo in range(0, hidden.shape[0], chunk):
        hi = min(hidden.shape[0], lo + chunk)
        h = hidden[lo:hi]
        targets, lse, ent, g_lp, g_ent = b.rows(lo, hi)
        if fast:
            x = logits(h)
            gx = _kernel_grad(x, targets, lse, ent, g_lp, g_ent, vocab, weight.dtype)
        else:
            x = _chunk_logits(h, logits, vocab)
            keep = None
            if vocab.filtered:
                _, _, _, keep = _filtered_chunk(x, targets, vocab, widths, False)
                keep = _rank_slice(keep, vocab, x.shape[1])
            gx = _local_grad_logits(x, targets, lse, ent, g_lp, g_ent, vocab, keep)
        _grad_matmuls(gx, weight, w32, h, grad_h[lo:hi], grad_w)
        del x, gx
    return grad_h, grad_w


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
