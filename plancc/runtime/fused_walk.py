"""How the fused evaluator (``fused_logprobs``) walks the ``[N, V_local]`` logits it never holds:
chunks of tokens or, on CPU, blocks of vocabulary columns (``default_columns``); each chunk's
statistics (max, sum of exponentials, the target's logit) and its logits' gradient, on the
PyTorch path or the CUDA kernels (``fused_kernels``); the vocabulary a rank's lm_head rows are
(``_Vocab``) and the sampler's filters."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import fused_kernels
from .vocab_stats import ChunkStats, default_chunk, merge


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
