"""Rank-side code of tests/test_parallel_mesh.py (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def two_ways_to_say_sp():
    """The same plan under SP at tp=2, told two ways: a ``Layout`` to build_mesh, and build_mesh's
    sizes. A bare DeviceMesh, and plancc 0.1's keyword beside the mesh, are refused. Returns this
    rank's losses, the refusals and what the mesh says of itself."""
    import copy

    import torch

    import plancc
    from plancc.models import build_model, load_config
    from plancc.runtime.mesh import ParallelMesh

    init_gloo()
    config = load_config("tiny-qwen3")
    torch.manual_seed(0)
    state = build_model(copy.deepcopy(config), device="cpu").state_dict()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    plan = plancc.load_plan("plans/qwen3.yaml")
    pm = plancc.build_mesh(plancc.Layout(tp=2, sequence_parallel=True), device_type="cpu")
    sized = plancc.build_mesh(tp=2, sequence_parallel=True, device_type="cpu")
    refused = {}
    for name, call in {
        "device_mesh": lambda: plancc.parallelize(build_model(config, device="meta"), plan, sized.device_mesh),
        "keyword": lambda: plancc.parallelize(build_model(config, device="meta"), plan, sized, sequence_parallel=True),
    }.items():
        try:
            call()
            refused[name] = None
        except (TypeError, ValueError) as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    losses, seen = {}, {}
    for name, mesh in {"layout": pm, "sizes": sized}.items():
        model = build_model(copy.deepcopy(config), device="meta")
        plancc.parallelize(model, plan, mesh)
        plancc.materialize(model, "cpu", full_state_dict=dict(state))
        # under SP a decoder layer holds this rank's half of the sequence
        model.model.layers[0].register_forward_pre_hook(
            lambda _m, args, kwargs: seen.__setitem__(name, (args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        )
        losses[name] = plancc.causal_lm_loss(model, ids, mesh=mesh).item()
    rebuilt = plancc.Layout(**pm.to_json())
    # the fused evaluator takes its tp group off the mesh, as plancc 0.1's group= said it
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(6, 8, generator=gen), torch.randn(10, 8, generator=gen)
    rows = weight[pm["tp"].get_local_rank() * 5 :][:5]
    targets = torch.randint(0, 10, (6,), generator=gen)
    by_mesh = plancc.logprobs.fused_logprobs(hidden, rows, targets, mesh=pm)
    by_group = plancc.logprobs.fused_logprobs(hidden, rows, targets, group=pm["tp"].get_group())
    whole = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    return {
        "fused_mesh_equals_group": torch.equal(by_mesh, by_group),
        "fused_mesh_right": torch.allclose(by_mesh, whole, atol=1e-5),
        "losses": losses,
        "sequence_seen": seen,
        "is_parallel_mesh": isinstance(pm, ParallelMesh),
        "tp": pm["tp"].size(),
        "sp": pm.sequence_parallel,
        "rebuilt_equal": rebuilt == pm.layout,
        "copy_equal": copy.copy(pm) == pm,
        "sized_equal": sized.layout == pm.layout,
        "refused": refused,
    }
