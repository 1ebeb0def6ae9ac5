"""What both log-prob evaluators share: per-token statistics over some of the vocabulary, their
merge into statistics over all of it, and how many tokens one chunk of logits holds.

A log-prob needs three numbers per token over the whole vocabulary -- the max logit, the sum of
``exp(x - max)`` and the target's logit (four with the entropy) -- and each can be formed over
a part of the vocabulary and merged later: across the column blocks of one rank (the fused
evaluator's CPU walk) and across the tp ranks that each hold a vocabulary shard (both
evaluators). The merge moves every part to a common max, then sums: ``merge`` for two parts on
one rank, ``combine_over_ranks`` for the tp group (two all-reduces of O(tokens) values).

The chunk rule is one too: ``default_chunk`` says how many tokens' fp32 logits a chunk holds on
CPU and on GPU, for the logits path (``plancc.runtime.vocab_parallel_logprobs``) and the fused path alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Chunk bounds: on CPU small enough to stay near the cache between the matmul and the
# reductions; on GPU large enough that each chunk's kernel launches are noise.
CPU_CHUNK_BYTES = 24 * 2**20
CPU_CHUNK_FRACTION = 24  # at most 1/24 of the tokens: one fp32 chunk about 4% of the logits
# Whole blocks of rows: MKL's sgemm (AVX2, AMD EPYC) ran the chunks of 4096 x 1024 x 32768 in
# 2.2 s at 160 or 192 rows, 2.7 s at 128 and 3.7 s at 205 (the whole matmul at once: 2.5 s).
CPU_ROW_BLOCK = 32
GPU_CHUNK_BYTES = 256 * 2**20
GPU_ROW_TILE = 128  # the matmul's row tile: a chunk of 220 rows would pay for 256
# Gradient chunks on GPU are larger: each one adds its gx.T @ h into the fp32 [V, H] weight
# gradient, a read and a write of all of it, so few chunks keep that traffic well below the
# matmuls' time (measured on an H100, docs/gpu.md: 2048 rows 137 ms, 1024 rows 145 ms, 512
# rows 177 ms at 16k x 152k x 4096). Powers of two: 1664-row chunks measured 154 ms.
GPU_GRAD_CHUNK_BYTES = 1280 * 2**20
MIN_ROWS = 16


def default_chunk(n: int, v_local: int, device: torch.device, *, grad: bool = False) -> int:
    """Tokens per chunk of ``[n, v_local]`` fp32 logits. CPU: whole blocks of CPU_ROW_BLOCK
    rows, at most 1/CPU_CHUNK_FRACTION of the tokens (one fp32 chunk is then below 5% of the
    logits it replaces) and within CPU_CHUNK_BYTES; GPU: whole row tiles within
    GPU_CHUNK_BYTES, or where the chunk forms gradients a power of two within
    GPU_GRAD_CHUNK_BYTES."""
    row_bytes = 4 * max(1, v_local)
    if device.type == "cpu":
        return whole_blocks(
            max(1, min(max(MIN_ROWS, n // CPU_CHUNK_FRACTION), CPU_CHUNK_BYTES // row_bytes)), CPU_ROW_BLOCK
        )
    if grad:
        return 1 << max(0, (GPU_GRAD_CHUNK_BYTES // row_bytes).bit_length() - 1)
    return max(1, whole_blocks(GPU_CHUNK_BYTES // row_bytes, GPU_ROW_TILE))


def whole_blocks(rows: int, block: int) -> int:
    """``rows`` rounded down to whole blocks, when there is at least one."""
    return rows - rows % block if rows >= block else rows


@dataclass(frozen=True, slots=True)
class ChunkStats:
    """Per-token partial statistics over some vocabulary columns, relative to ``m``."""

    m: torch.Tensor  # max logit
    s: torch.Tensor  # sum of exp(x - m)
    picked: torch.Tensor  # the target's logit where these columns hold it, else 0
    t: torch.Tensor | None = None  # sum of exp(x - m) * (x - m): for the entropy

    @classmethod
    def of_logsumexp(cls, lse: torch.Tensor, picked: torch.Tensor) -> ChunkStats:
        """The statistics of columns whose log-sum-exp is already known (s = 1 at m = lse)."""
        return cls(lse, torch.ones_like(lse), picked)


def moved_to(st: ChunkStats, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``st``'s sum of exponentials (and entropy term) relative to a max ``m >= st.m`` instead of
    its own."""
    scale = (st.m - m).exp()
    t = (st.t + (st.m - m) * st.s) * scale if st.t is not None else None
    return st.s * scale, t


def merge(a: ChunkStats, b: ChunkStats) -> ChunkStats:
    """The statistics over the columns of ``a`` and ``b`` together (a running merge on one rank)."""
    m = torch.maximum(a.m, b.m)
    (s_a, t_a), (s_b, t_b) = moved_to(a, m), moved_to(b, m)
    t = t_a + t_b if t_a is not None and t_b is not None else None
    return ChunkStats(m, s_a + s_b, a.picked + b.picked, t)


def combine_over_ranks(
    parts: ChunkStats, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logsumexp, target logit, entropy or None) over the whole vocabulary, from every tp
    rank's partial statistics: two all-reduces of O(tokens) values (none without a group)."""
    m, s, picked, t = parts.m, parts.s, parts.picked, parts.t
    if group is not None and dist.get_world_size(group) > 1:
        g = m.clone()
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
        s_g, t_g = moved_to(parts, g)
        rows = [s_g, picked] + ([t_g] if t_g is not None else [])
        stacked = torch.stack(rows)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        m, s, picked = g, stacked[0], stacked[1]
        t = stacked[2] if t is not None else None
    lse = m + s.log()
    # H = lse - E[x] and E[x] = m + t / s, both relative to the same max
    ent = (s.log() - t / s) if t is not None else None
    return lse, picked, ent
