"""Workers for tests/test_verify_memory.py: the reference's optimizer split over ranks, and the
fp64 look, each in a real gloo group."""

from __future__ import annotations

from .distributed import init_gloo


def split_adamw_against_adamw(steps: int) -> dict[str, float]:
    """The largest difference between a model stepped by ``SplitAdamW`` (moments split over the
    ranks) and a copy stepped by one plain AdamW, over ``steps`` steps with weight decay, the
    weights turned fp64 and back in place between two of them (the fp64 look does that)."""
    import copy

    import torch

    from plancc.engine.param_groups import trained_parameters
    from plancc.job.verify_reference import SplitAdamW, in_fp64

    init_gloo()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7), torch.nn.LayerNorm(7))
    twin = copy.deepcopy(model)
    split = SplitAdamW(model, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(trained_parameters(twin, 0.1), lr=1e-2)
    ids = torch.arange(11).reshape(1, 11)
    for step in range(steps):
        for m in (model, twin):
            m(ids).square().sum().backward()
        if step == 1:
            with in_fp64(model, set()):
                pass
        split.step()
        plain.step()
        plain.zero_grad(set_to_none=True)
    return {
        name: (p - dict(twin.named_parameters())[name]).abs().max().item() for name, p in model.named_parameters()
    }


def fp64_look(plan_path: str) -> dict:
    """verify with the fixed gradient bar at 0, so fp32 always 'misses' it and the fp64 look runs."""
    import plancc
    from plancc.job import verify
    from plancc.runtime.mesh import build_mesh

    init_gloo()
    verify.TOLERANCES["grad_rel"] = 0.0
    mesh = build_mesh(dp=1, tp=2, device_type="cpu")
    return verify.verify_against_unsharded(plancc.load_plan(plan_path), "tiny-qwen3", mesh, steps=2).as_dict()
