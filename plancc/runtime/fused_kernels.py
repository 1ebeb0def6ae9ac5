"""Triton kernels for the fused evaluator's per-chunk math on CUDA.

The pure-PyTorch chunk math (``fused_walk._stats`` and ``_local_grad_logits``) reads and
writes each fp32 chunk of logits four to six times (max, subtract, exp, sum, scale, scatter).
On a GPU that traffic, not the lm_head matmul, is what separates the evaluator from a fused
kernel: at 16k tokens x 152k vocab it is ~60 GB against a ~29 ms matmul. The kernels below
make one pass over each row instead:

- ``chunk_stats``: the online max / sum of exponentials (and, for the entropy, the sum of
  ``exp(x - m) * (x - m)``) of every row, reading the chunk once;
- ``grad_logits``: the gradient of ``sum g_lp * logp + g_ent * H`` with respect to the
  chunk's logits, reading the chunk once and writing it once, in the dtype the gradient
  matmuls take.

Both accumulate in fp32 and implement exactly the formulas of the PyTorch path (the tests on
a GPU compare the two); the CPU path stays pure PyTorch. CPU builds of torch ship without
Triton, so this module imports without it and ``active`` says when the kernels apply.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # the CPU wheel of torch has no Triton
    triton = None

BLOCK = 4096  # columns per step of a row's loop: 16 KiB of fp32, enough loads in flight
NUM_WARPS = 8


def active(device: torch.device) -> bool:
    """Whether chunks on this device go through the kernels (CUDA with Triton). Their chunks of
    logits are fp32 with contiguous rows there (``fused_walk._matmul_fp32``)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _stats_kernel(  # type: ignore[no-untyped-def]
        x_ptr, stride, n_cols, scale, m_ptr, s_ptr, t_ptr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * scale
            m_new = tl.maximum(m, tl.max(x, 0))
            # rescale what was summed against the old max (nothing yet: s == 0, no inf * 0)
            alpha = tl.exp(m - m_new)
            z = x - m_new
            e = tl.where(inside, tl.exp(z), 0.0)
            if ENTROPY:
                t = tl.where(s > 0, alpha * (t + (m - m_new) * s), 0.0) + tl.sum(tl.where(inside, e * z, 0.0), 0)
            s = s * alpha + tl.sum(e, 0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        if ENTROPY:
            tl.store(t_ptr + row, t)

    @triton.jit
    def _grad_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        x_stride,
        g_ptr,
        g_stride,
        n_cols,
        scale,
        lse_ptr,
        ent_ptr,
        g_lp_ptr,
        g_ent_ptr,
        col_ptr,
        ENTROPY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        g_lp = tl.load(g_lp_ptr + row)
        target = tl.load(col_ptr + row)  # -1 where this rank does not hold the target
        if ENTROPY:
            g_ent = tl.load(g_ent_ptr + row)
            ent = tl.load(ent_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            z = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32) * scale - lse
            p = tl.exp(z)
            if ENTROPY:
                grad = tl.where(cols == target, g_lp, 0.0) - (g_lp + g_ent * (z + ent)) * p
            else:
                grad = tl.where(cols == target, g_lp, 0.0) - g_lp * p
            tl.store(g_ptr + row * g_stride + cols, (grad * scale).to(g_ptr.dtype.element_ty), mask=inside)


def _launch_options(n_cols: int) -> dict[str, Any]:
    return {"BLOCK": min(BLOCK, triton.next_power_of_2(max(n_cols, 16))), "num_warps": NUM_WARPS}


def chunk_stats(x: torch.Tensor, scale: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(max, sum of exp(x*scale - max), and with ``entropy`` the sum of
    exp(x*scale - max) * (x*scale - max)) of each row of ``x`` (read once, not changed)."""
    rows, n_cols = x.shape
    m = torch.empty(rows, dtype=torch.float32, device=x.device)
    s, t = torch.empty_like(m), torch.empty_like(m) if entropy else m
    if rows:
        _stats_kernel[(rows,)](x, x.stride(0), n_cols, scale, m, s, t, ENTROPY=entropy, **_launch_options(n_cols))
    return m, s, (t if entropy else None)


def grad_logits(
    x: torch.Tensor,
    scale: float,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    cols: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d(sum g_lp*logp + g_ent*H) / d(x) for logits ``x * scale`` whose logsumexp is ``lse``
    (``cols``: each row's target column on this rank, -1 where another rank holds it). Written
    in ``dtype``: into ``x`` itself when that is fp32, else into a new buffer."""
    rows, n_cols = x.shape
    out = x if dtype == torch.float32 else torch.empty(x.shape, dtype=dtype, device=x.device)
    entropy = ent is not None and g_ent is not None
    ent, g_ent = (ent, g_ent) if (ent is not None and g_ent is not None) else (lse, g_lp)  # unread then
    if rows:
        _grad_kernel[(rows,)](
            x,
            x.stride(0),
            out,
            out.stride(0),
            n_cols,
            scale,
            lse.float().contiguous(),
            ent.float().contiguous(),
            g_lp.float().contiguous(),
            g_ent.float().contiguous(),
            cols.to(torch.int64).contiguous(),
            ENTROPY=entropy,
            **_launch_options(n_cols),
        )
    return out
