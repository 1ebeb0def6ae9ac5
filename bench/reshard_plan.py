"""The resharded refit's transfer plan kept on the channel (issue 60, point 1), side by side in
one run: refits that reuse the plan the first refit computed against refits that compute it
again (every member's plan dropped first: each publishes its boxes and reads every member's
from the channel's store, then walks every parameter, receiver and policy rank; the engine
builds and lays out its meta model again).

    python bench/reshard_plan.py [--layers 24] [--rounds 4]

A policy at dp=2 (two gloo ranks) sends to an engine of its own at tp=2 (two more) a
Qwen3-shaped tiny model with ``--layers`` decoder layers (the plan's cost grows with the
parameters). The two kinds of refit alternate round by round; prints the median refit time on
the policy's rank 0, the store reads a refit made on it, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.distributed import free_port, init_gloo, launch, launch_beside  # noqa: E402
from tests.reshard_worker import CountingStore  # noqa: E402

PLAN = "plans/qwen3.yaml"


def _config(layers: int):
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    config.num_hidden_layers, config.layer_types = layers, ["full_attention"] * layers
    return config


def policy(port: int, manifest_path: str, layers: int, rounds: int) -> dict:
    import torch

    import plancc

    init_gloo(timeout_s=1800)
    rank = torch.distributed.get_rank()
    engine = plancc.Policy(PLAN, _config(layers), layout=plancc.Layout(dp=2))
    if rank == 0:
        with open(manifest_path + ".tmp", "w") as f:
            json.dump({**engine.weights_manifest(), "policy_ranks": 2}, f)
        os.replace(manifest_path + ".tmp", manifest_path)
    channel = plancc.weight_channel("127.0.0.1", port, rank=rank, world_size=4, backend="gloo", timeout=600)
    engine.send_weights(channel, reshard=True)  # the first refit computes the plan either way
    times: dict[str, list[float]] = {"kept": [], "computed": []}
    reads: dict[str, int] = {}
    for _ in range(rounds):
        for kind in ("kept", "computed"):
            if kind == "computed":
                channel.plans.clear()
            channel.store = CountingStore(channel.store)
            torch.distributed.barrier()
            started = time.perf_counter()
            engine.send_weights(channel, reshard=True)
            times[kind].append(time.perf_counter() - started)
            reads[kind] = channel.store.reads
            channel.store = channel.store.store
    channel.close()
    torch.distributed.destroy_process_group()
    return {"times": times, "reads": reads, "parameters": len(list(engine.model.parameters()))}


def engine_rank(port: int, manifest_path: str, rounds: int) -> int:
    import torch

    import plancc

    init_gloo(timeout_s=1800)
    while not os.path.exists(manifest_path):
        time.sleep(0.05)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest.pop("policy_ranks")
    rank = torch.distributed.get_rank()
    channel = plancc.weight_channel("127.0.0.1", port, rank=2 + rank, world_size=4, backend="gloo", timeout=600)
    got = 0
    for refit in range(1 + 2 * rounds):
        if refit and refit % 2 == 0:  # the same order as the policy's: kept, then computed
            channel.plans.clear()
            channel.receiver_layouts.clear()
        for _, shard in plancc.receive_weights(channel, manifest, plan=PLAN, tp=2):
            got += shard.numel()
    channel.close()
    torch.distributed.destroy_process_group()
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = os.path.join(tmp, "manifest.json")
        beside = launch_beside(engine_rank, 2, port, manifest, args.rounds, timeout_s=1800)
        results = launch(policy, 2, port, manifest, args.layers, args.rounds, timeout_s=1800)
        beside.result(timeout=1800)
    rank0 = results[0]
    kept = statistics.median(rank0["times"]["kept"])
    computed = statistics.median(rank0["times"]["computed"])
    print(f"resharded refit, policy dp=2 -> engine tp=2, {args.layers} layers ({rank0['parameters']} parameters), "
          f"median of {args.rounds}:")  # fmt: skip
    print(
        f"  plan kept on the channel: {kept * 1e3:8.1f} ms a refit, {rank0['reads']['kept']:3d} store reads on rank 0"
    )
    print(f"  plan computed again:      {computed * 1e3:8.1f} ms a refit, "
          f"{rank0['reads']['computed']:3d} store reads on rank 0")  # fmt: skip
    print(f"  kept / computed: {kept / computed:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
