"""Run-time parity: a training step of a model parallelized by ``plancc.parallelize`` against
the same styles and FSDP units written by hand with ``parallelize_module`` + ``fully_shard``.

    python bench/step_parity.py [--steps 12] [--layers 4] [--nproc 2]

Both models live in one job (tp=2 on gloo, CPU), built from the same seed, and train on the
same batches with steps alternating plancc, hand, plancc, hand, ... so drift on a shared
machine hits both alike. Prints the median step time of each and their ratio (plancc/hand);
activation checkpointing is left out of both (``plans/llama.yaml`` names it; a hand-written
plan of the usual kind does not). The losses are printed too: both must train identically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "llama.yaml")


def _hand_parallelize(model, mesh):
    """What a user writes by hand for Llama: the reference NeMo-RL-style dict, then FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh["tp"], styles)
    from plancc.runtime.mesh import dp_cp_mesh

    mp = MixedPrecisionPolicy(reduce_dtype=None)
    fsdp = dp_cp_mesh(mesh)
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=fsdp, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=fsdp, mp_policy=mp)
    return model


def worker(steps: int, layers: int):
    import copy
    import time

    import torch

    import plancc
    from plancc.models import build_model, load_config
    from plancc.runtime.loss import sharded_loss

    rank, world = init_gloo(timeout_s=600)
    config = load_config("tiny-llama")
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = layers, 256, 768
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 32
    mesh = plancc.build_mesh(tp=world, device_type="cpu")
    torch.manual_seed(0)
    state = build_model(config, device="cpu").state_dict()
    models = {}
    for name in ("plancc", "hand"):
        model = build_model(copy.deepcopy(config), device="meta")
        if name == "plancc":
            plancc.parallelize(model, plancc.load_plan(PLAN), mesh, activation_checkpointing=False)
        else:
            _hand_parallelize(model, mesh)
        plancc.materialize(model, "cpu", full_state_dict={k: v.clone() for k, v in state.items()})
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {"plancc": [], "hand": []}
    losses: dict[str, list[float]] = {"plancc": [], "hand": []}
    gen = torch.Generator().manual_seed(1)
    for step in range(steps + 2):  # two warm-up steps, not timed
        ids = torch.randint(0, config.vocab_size, (4, 256), generator=gen)
        mask = torch.ones_like(ids)
        order = ("plancc", "hand") if step % 2 == 0 else ("hand", "plancc")
        for name in order:
            model, opt = models[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = sharded_loss(model, ids, mask, mesh)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
                losses[name].append(loss.item())
    torch.distributed.destroy_process_group()
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    result = launch(worker, args.nproc, args.steps, args.layers, timeout_s=600)[0]
    med = {name: statistics.median(t) for name, t in result["times"].items()}
    same = result["losses"]["plancc"] == result["losses"]["hand"]
    print(f"tiny Llama x{args.layers} layers, tp={args.nproc}, {args.steps} alternating steps each (median):")
    print(f"  plancc.parallelize    {med['plancc'] * 1e3:8.1f} ms/step")
    print(f"  by hand               {med['hand'] * 1e3:8.1f} ms/step")
    print(f"  ratio plancc/hand     {med['plancc'] / med['hand']:8.3f}")
    print(f"  losses identical: {same}")


if __name__ == "__main__":
    main()
