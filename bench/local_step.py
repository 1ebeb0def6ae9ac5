"""The optimizer's host time a step, side by side in one run: torch's step over DTensor
parameters (DTensor's dispatch) against plancc's step on their local shards
(``runtime.local_step``), with plain tensors as the floor.

    python bench/local_step.py [--params 146] [--size 16] [--rounds 30]

``--params`` parameters of ``--size`` x ``--size`` (146: Llama 3.2 1B's count; small, so that
the kernels cost little and what is timed is the host's work per step), each a DTensor sharded
on a one-rank mesh as FSDP2 holds it at world size 1, gradients set; AdamW fused and foreach,
``--rounds`` steps each after a warm-up, interleaved. Prints milliseconds a step and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _params(count: int, size: int, mesh) -> list:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    made = []
    for _ in range(count):
        value = torch.randn(size, size)
        if mesh is not None:
            value = distribute_tensor(value, mesh, [Shard(0)])
        param = torch.nn.Parameter(value)
        param.grad = distribute_tensor(torch.randn(size, size), mesh, [Shard(0)]) if mesh else torch.randn(size, size)
        made.append(param)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=146)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tests.distributed import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from plancc.runtime.local_step import optimizer_step

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    for fused in (True, False):
        ways = {
            "DTensor, torch's step": (_params(args.params, args.size, mesh), lambda o: o.step()),
            "DTensor, on the local shards": (_params(args.params, args.size, mesh), optimizer_step),
            "plain tensors (the floor)": (_params(args.params, args.size, None), lambda o: o.step()),
        }
        optimizers = {
            name: (torch.optim.AdamW(params, lr=1e-3, fused=fused, foreach=None if fused else True), step)
            for name, (params, step) in ways.items()
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for optimizer, step in optimizers.values():
            for _ in range(3):
                step(optimizer)
        for _ in range(args.rounds):
            for name, (optimizer, step) in optimizers.items():
                started = time.perf_counter()
                step(optimizer)
                times[name].append(time.perf_counter() - started)
        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        base = median["DTensor, torch's step"]
        print(f"AdamW ({'fused' if fused else 'foreach'}), {args.params} parameters of {args.size}x{args.size}, "
              f"median of {args.rounds}:")
        for name, ms in median.items():
            print(f"  {name:32s} {ms:7.2f} ms a step   {ms / base:5.2f}x torch's step on DTensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
