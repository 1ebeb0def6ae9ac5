"""``Policy.train`` against the loop a user writes by hand on ``plancc.parallelize``, uniform lengths
(issue 40, point 6): what the engine's bookkeeping costs when there is nothing to cut or balance.

    python bench/policy_vs_hand.py [--steps 10] [--nproc 2] [--layout dp|tp]

Both live in one job (gloo, CPU), built from the same weights: the Policy trains the NLL as a
``token_loss`` (the fused lm_head); the hand loop runs ``plancc.runtime.loss.sharded_loss`` (the
same fused lm_head), backward, clips the gradient norm, steps AdamW -- a step of
``plancc.parallelize`` in a user's own loop. Steps alternate Policy, hand, hand, Policy, ... Prints
the median step time of each, their ratio, the median of each step's ratio and both losses (they
must agree); ``--profile``: rank 0's time by function for each way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "llama.yaml")


def worker(steps: int, layout: str, profile: bool = False):
    import copy
    import cProfile
    import io
    import pstats
    import time

    import torch

    import plancc
    from plancc.engine.parallel_model import seeded_model
    from plancc.engine.losses import token_nll
    from plancc.models import build_model, load_config
    from plancc.runtime.gradnorm import clip_grad_norm_
    from plancc.runtime.loss import reported_loss, sharded_loss

    rank, world = init_gloo(timeout_s=600)
    config = load_config("tiny-llama")
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 4, 256, 768
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 32
    sizes = {"dp": world} if layout == "dp" else {"tp": world}
    adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}}
    policy = plancc.Policy(PLAN, config, optimizer=adamw, layout=plancc.Layout(**sizes))
    mesh = policy.mesh
    model = build_model(copy.deepcopy(config), device="meta")
    plancc.parallelize(model, plancc.load_plan(PLAN), mesh)
    plancc.materialize(model, "cpu", full_state_dict=seeded_model(config, 0).state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def hand(ids, mask):
        loss = sharded_loss(model, ids, mask, mesh)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # this dp slice's mean: reduced to the global mean after the timing

    def engine(ids, mask):
        return policy.train({"input_ids": ids, "attention_mask": mask}, token_loss=token_nll)["loss"]

    ways = {"policy": engine, "hand": hand}
    times: dict = {name: [] for name in ways}
    losses: dict = {name: [] for name in ways}
    gen = torch.Generator().manual_seed(1)
    rows = 4 * policy.dp_size
    profiles = {name: cProfile.Profile() for name in ways}
    for step in range(steps + 2):  # two warm-ups
        ids = torch.randint(0, config.vocab_size, (rows, 256), generator=gen)[policy.slice_of(rows)]
        mask = torch.ones_like(ids)
        for name in ("policy", "hand") if step % 2 == 0 else ("hand", "policy"):
            torch.distributed.barrier()
            started = time.perf_counter()
            if profile and step >= 2:
                profiles[name].enable()
            loss = ways[name](ids, mask)
            if profile and step >= 2:
                profiles[name].disable()
            torch.distributed.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - started)
                losses[name].append(loss)
    losses["hand"] = [reported_loss(loss, mesh) for loss in losses["hand"]]
    torch.distributed.destroy_process_group()
    printed = {}
    if profile:  # where each way's time goes on this rank, by function (cumulative)
        for name, prof in profiles.items():
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
            printed[name] = out.getvalue()
    return {"times": times, "losses": losses, "profiles": printed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layout", choices=["dp", "tp"], default="dp")
    parser.add_argument("--profile", action="store_true", help="rank 0's time by function, for each way")
    args = parser.parse_args()
    result = launch(worker, args.nproc, args.steps, args.layout, args.profile, timeout_s=900)[0]
    for name, text in result["profiles"].items():
        print(f"--- {name}, rank 0, cumulative ---\n{text}")
    med = {name: statistics.median(t) for name, t in result["times"].items()}
    print(f"tiny Llama x4 layers, {args.layout}={args.nproc}, {args.steps} alternating steps each (median):")
    print(f"  Policy.train(token_loss=)  {med['policy'] * 1e3:8.1f} ms/step")
    print(f"  hand loop on parallelize   {med['hand'] * 1e3:8.1f} ms/step")
    print(f"  ratio Policy/hand          {med['policy'] / med['hand']:8.3f}")
    # each step's two timings are neighbours: their ratio cancels what drifts over the run
    pairs = [p / h for p, h in zip(result["times"]["policy"], result["times"]["hand"], strict=True)]
    print(f"  median of per-step ratios  {statistics.median(pairs):8.3f}")
    print(f"  losses: Policy {[round(x, 5) for x in result['losses']['policy'][:3]]} ...")
    print(f"          hand   {[round(x, 5) for x in result['losses']['hand'][:3]]} ...")


if __name__ == "__main__":
    main()
