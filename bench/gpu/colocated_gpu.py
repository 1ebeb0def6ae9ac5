"""A colocated refit on one GPU: the policy's weights to a consumer process on the same GPU by
CUDA IPC, plancc's way (``Policy.share_weights``: bucket by bucket, one handle per bucket) against
the seed's (``get_model_state_dict(full_state_dict=True)``, then one handle per tensor).

    torchrun --nproc-per-node 1 bench/gpu/colocated_gpu.py [--model llama-3.2-1b] [--bucket-mib 256 ...]
        [--profile]

The consumer copies every tensor it gets into memory of its own (an engine's ``load_weights``).
Prints, for each way, the median time of ``--rounds`` refits and the producer's peak device
memory above what it held before (``torch.cuda.max_memory_allocated``), and the bound: one
device-to-device copy of every weight into memory already held (``_foreach_copy_``, median of
``--rounds``), the least a refit that ends with the weights in another buffer can take. Several
``--bucket-mib`` sizes: plancc's refit at each (its time against the number of buckets: what a
bucket costs beyond its bytes). ``--profile``: one more refit at the first size under cProfile,
the producer's functions by their own time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_report import report  # noqa: E402


def consumer(connection, rounds: int, sizes: int) -> None:
    import torch

    import plancc

    torch.cuda.set_device(0)
    for _ in range(rounds):
        for _ in range(sizes):
            held = [t.clone() for _, t in plancc.receive_shared_weights(connection)]
            del held
        while True:  # the seed's way: one tensor at a time
            message = connection.recv()
            if message[0] == "end":
                break
            _, name, tensor = message
            kept = tensor.clone()
            del kept, tensor
            connection.send(("done", name))


def seed_share(policy, connection) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True))
    for name, tensor in state.items():
        connection.send(("tensor", name, tensor))
        connection.recv()
    connection.send(("end", None))


def profile_refit(policy, connection, bucket_bytes: int) -> None:
    """One refit under cProfile; the producer's 15 costliest functions by their own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(policy.share_weights, connection, bucket_bytes=bucket_bytes)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def copy_bound(tensors: list, rounds: int) -> float:
    """The median time of one device-to-device copy of ``tensors`` into buffers held already."""
    import torch

    with torch.no_grad():
        targets = [torch.empty_like(t) for t in tensors]
        seen = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch._foreach_copy_(targets, tensors)
            torch.cuda.synchronize()
            seen.append(time.perf_counter() - t0)
    return statistics.median(seen[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--plan", default="plans/llama.yaml")
    parser.add_argument("--bucket-mib", type=int, nargs="+", default=[256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    import plancc

    policy = plancc.Policy(args.plan, args.model, device="cuda")
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    rounds = args.rounds + (1 if args.profile else 0)
    process = context.Process(target=consumer, args=(theirs, rounds, len(args.bucket_mib)))
    process.start()
    ways = [f"plancc_{mib}" for mib in args.bucket_mib] + ["seed"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    peaks: dict[str, int] = dict.fromkeys(ways, 0)
    for round_ in range(rounds):
        profiled = args.profile and round_ == rounds - 1
        for way, mib in [*zip(ways, args.bucket_mib), ("seed", 0)]:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if way == "seed":
                seed_share(policy, mine)
            elif profiled and mib == args.bucket_mib[0]:
                profile_refit(policy, mine, mib * 2**20)
            else:
                policy.share_weights(mine, bucket_bytes=mib * 2**20)
            torch.cuda.synchronize()
            if not profiled:
                times[way].append(time.perf_counter() - t0)
                peaks[way] = max(peaks[way], torch.cuda.max_memory_allocated() - base)
    process.join(timeout=300)
    total = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    bound = copy_bound([p.to_local() if hasattr(p, "to_local") else p for p in policy.model.parameters()], args.rounds)
    first = ways[0]
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "weights_bytes": total,
        "plancc_s": statistics.median(times[first]),
        "seed_s": statistics.median(times["seed"]),
        "copy_bound_s": bound,
        "plancc_over_bound": statistics.median(times[first]) / bound,
        "plancc_peak_extra_bytes": peaks[first],
        "seed_peak_extra_bytes": peaks["seed"],
        "bucket_bytes": args.bucket_mib[0] * 2**20,
        "by_bucket_mib": {
            mib: {
                "plancc_s": statistics.median(times[way]),
                "plancc_over_bound": statistics.median(times[way]) / bound,
                "plancc_peak_extra_bytes": peaks[way],
            }
            for way, mib in zip(ways, args.bucket_mib)
        },
    }
    report(result, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
