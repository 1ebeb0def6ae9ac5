"""The fused evaluator's Triton kernels (CUDA only): the same log-probs, entropy and
gradients as the fp64 full-logits reference, and as the PyTorch chunk math they replace.

Skipped where there is no CUDA device or no Triton (CI's CPU machines); run on a GPU
machine with ``python -m pytest tests/test_fused_kernels_gpu.py`` (docs/gpu.md)."""

import pytest
import torch

from plancc.logprobs import fused_logprobs, fused_nll_loss
from plancc.runtime import fused_kernels

from .fused_worker import reference

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_kernels.active(torch.device("cuda"))),
    reason="needs a CUDA device and Triton",
)

FORWARD_TOL = 1e-6
# fp32 inputs: fp32 gradients throughout. 16-bit inputs: the logits' gradient is rounded to
# the input dtype for the tensor-core matmuls (as autograd of the naive path does), 2^-8.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def _inputs(n, hdim, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=gen).to("cuda", dtype)
    w = (torch.randn(vocab, hdim, generator=gen) * 0.3).to("cuda", dtype)
    t = torch.randint(0, vocab, (n,), generator=gen).to("cuda")
    t[::7] = -100
    return h, w, t


def _rel(a, b):
    return (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "chunk", "temperature"), [(5003, 37, 1.0), (9000, None, 0.7), (3, 5, 1.3)])
def test_kernel_path_matches_fp64_full_logits(dtype, vocab, chunk, temperature):
    h, w, t = _inputs(300, 64, vocab, dtype)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fused_logprobs(hh, ww, t, entropy=True, chunk_size=chunk, temperature=temperature)
    g = torch.randn(len(t), device="cuda")
    ((lp * g).sum() + 0.5 * ent.sum()).backward()

    rh, rw = h.double().requires_grad_(True), w.double().requires_grad_(True)
    ref_lp, ref_ent = reference(rh, rw, t, temperature=temperature)
    ((ref_lp * g.double()).sum() + 0.5 * ref_ent.sum()).backward()
    assert _rel(lp, ref_lp) <= FORWARD_TOL
    assert _rel(ent, ref_ent) <= FORWARD_TOL
    assert bool((lp[t == -100] == 0).all()) and bool((ent[t == -100] == 0).all())
    assert _rel(hh.grad, rh.grad) <= GRAD_TOL[dtype]
    assert _rel(ww.grad, rw.grad) <= GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_with_gradients_in_forward_matches_fp64(dtype):
    h, w, t = _inputs(513, 128, 7001, dtype, seed=1)
    weights = torch.rand(len(t), device="cuda")
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, lp = fused_nll_loss(hh, ww, t, weights, chunk_size=100)
    loss.backward()
    rh, rw = h.double().requires_grad_(True), w.double().requires_grad_(True)
    ref_lp, _ = reference(rh, rw, t)
    ref_loss = -(weights.double() * ref_lp).sum()
    ref_loss.backward()
    assert _rel(lp, ref_lp) <= FORWARD_TOL
    assert abs(loss.item() - ref_loss.item()) <= FORWARD_TOL * max(1.0, abs(ref_loss.item()))
    assert _rel(hh.grad, rh.grad) <= GRAD_TOL[dtype]
    assert _rel(ww.grad, rw.grad) <= GRAD_TOL[dtype]


def test_kernel_path_equals_the_pytorch_chunk_math(monkeypatch):
    """fp32 inputs: both paths form fp32 gradients, so they agree to fp32 rounding (the
    PyTorch path's own distance to fp64 is ~1e-6 on the gradients)."""
    h, w, t = _inputs(257, 96, 12345, torch.float32, seed=2)
    results = []
    for use_kernels in (True, False):
        if not use_kernels:
            monkeypatch.setattr(fused_kernels, "active", lambda device: False)
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = fused_logprobs(hh, ww, t, entropy=True, chunk_size=64, temperature=0.9)
        (lp.sum() + ent.sum()).backward()
        results.append((lp, ent, hh.grad, ww.grad))
    (lp, ent, grad_h, grad_w), (lp0, ent0, grad_h0, grad_w0) = results
    assert _rel(lp, lp0) <= FORWARD_TOL and _rel(ent, ent0) <= FORWARD_TOL
    assert _rel(grad_h, grad_h0) <= GRAD_TOL[torch.float32] and _rel(grad_w, grad_w0) <= GRAD_TOL[torch.float32]
