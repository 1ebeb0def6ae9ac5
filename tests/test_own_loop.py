"""The README's own-training-loop recipe (examples/own_loop.py) runs under torch's elastic
launcher on 2 gloo ranks, tp=2 with and without SP, and trains exactly like the unsharded
model: the same losses step after step (plancc's loss and clipping are the public API)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from .conftest import ROOT
from .distributed import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _both_layouts(steps: int):
    sys.path.insert(0, str(ROOT / "examples"))
    from own_loop import train

    import torch.distributed as dist

    from .distributed import init_gloo

    init_gloo()
    try:
        return {sp: train(steps=steps, sequence_parallel=sp) for sp in (False, True)}
    finally:
        dist.destroy_process_group()


def _unsharded_losses(steps: int) -> list[float]:
    from plancc.models import build_model, load_config

    config = load_config("tiny-qwen3")
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_the_readme_training_loop_trains_like_the_unsharded_model_at_tp2_with_and_without_sp():
    steps = 3
    results = launch(_both_layouts, 2, steps)
    want = _unsharded_losses(steps)
    for rank, by_sp in results.items():
        for sp, losses in by_sp.items():
            # fp32; Adam amplifies rounding a little after the first step (tests/test_numerics.py)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-5,
                                       msg=f"rank {rank} sp={sp}")
