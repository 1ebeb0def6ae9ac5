"""The global gradient norm within 1e-6 of the fp64 norm, whatever the gradients' dtype (NeMo-RL's
``test_get_grad_norm_precision`` asks 1e-6 for bf16 gradients; fp32 sums of the squares of a
million bf16 values missed it by ~5e-5)."""

import pytest
import torch

from plancc.runtime.gradnorm import global_grad_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gradient_norm_is_the_fp64_norm_within_1e_6(dtype):
    torch.manual_seed(0)
    shapes = [(1024, 1024), (4096,), (512, 2048), (3,), (151936 // 64, 64)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape) * 0.01).to(dtype)
        params.append(p)
    exact = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    found = global_grad_norm(params)
    assert found.dtype == torch.float32
    assert abs(found.double() - exact).item() / exact.item() <= 1e-6
