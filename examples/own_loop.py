"""A complete training loop of your own with plancc, launched by torchrun:

    torchrun --nproc-per-node 2 examples/own_loop.py [--sp] [--steps 3]

plancc does the parallelization (a plan instead of a hand-written dict of styles), the loss
from vocab-parallel logits, and gradient clipping across every mesh axis; the loop, the data
and the optimizer are yours. Prints one line per step on rank 0, and returns the losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

import plancc
from plancc.models import build_model, load_config

PLAN = Path(__file__).resolve().parent.parent / "plans" / "qwen3.yaml"


def train(*, steps: int = 3, sequence_parallel: bool = False, seed: int = 0) -> list[float]:
    """Train the tiny Qwen3 preset at tp = world size; returns the loss of every step."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun set the rank and world size
    mesh = plancc.build_mesh(tp=dist.get_world_size(), sequence_parallel=sequence_parallel, device_type="cpu")
    config = load_config("tiny-qwen3")

    torch.manual_seed(seed)  # every rank builds the same full weights, then keeps its shards
    state = build_model(config, device="cpu").state_dict()
    model = build_model(config, device="meta")
    plancc.parallelize(model, plancc.load_plan(PLAN), mesh)
    plancc.materialize(model, "cpu", full_state_dict=state)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed + 1)  # the same batch on every tp rank
    losses = []
    for step in range(steps):
        input_ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
        loss = plancc.causal_lm_loss(model, input_ids, mesh=mesh)
        loss.backward()
        grad_norm = plancc.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step + 1}  loss {loss.item():.6f}  grad_norm {grad_norm.item():.4f}", flush=True)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (the plan's overlay)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    train(steps=args.steps, sequence_parallel=args.sp)
    dist.destroy_process_group()
