"""A colocated refit on one GPU: the policy's weights to a consumer process on the same GPU by
CUDA IPC, plancc's way (``Policy.share_weights``: bucket by bucket, one handle per bucket) against
the seed's (``get_model_state_dict(full_state_dict=True)``, then one handle per tensor).

    torchrun --nproc-per-node 1 bench/gpu/colocated_gpu.py [--model llama-3.2-1b] [--bucket-mib 256]

The consumer copies every tensor it gets into memory of its own (an engine's ``load_weights``).
Prints, for each way, the median time of ``--rounds`` refits and the producer's peak device
memory above what it held before (``torch.cuda.max_memory_allocated``), and the bound: one
device-to-device copy of every weight into memory already held (``_foreach_copy_``, median of
``--rounds``), the least a refit that ends with the weights in another buffer can take.
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


def consumer(connection, rounds: int) -> None:
    import torch

    import plancc

    torch.cuda.set_device(0)
    for _ in range(rounds):
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
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    import plancc

    policy = plancc.Policy(args.plan, args.model, device="cuda")
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(target=consumer, args=(theirs, args.rounds))
    process.start()
    times: dict[str, list[float]] = {"plancc": [], "seed": []}
    peaks: dict[str, int] = {"plancc": 0, "seed": 0}
    for _ in range(args.rounds):
        for way in ("plancc", "seed"):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if way == "plancc":
                policy.share_weights(mine, bucket_bytes=args.bucket_mib * 2**20)
            else:
                seed_share(policy, mine)
            torch.cuda.synchronize()
            times[way].append(time.perf_counter() - t0)
            peaks[way] = max(peaks[way], torch.cuda.max_memory_allocated() - base)
    process.join(timeout=300)
    total = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    bound = copy_bound([p.to_local() if hasattr(p, "to_local") else p for p in policy.model.parameters()], args.rounds)
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "weights_bytes": total,
        "plancc_s": statistics.median(times["plancc"]),
        "seed_s": statistics.median(times["seed"]),
        "copy_bound_s": bound,
        "plancc_over_bound": statistics.median(times["plancc"]) / bound,
        "plancc_peak_extra_bytes": peaks["plancc"],
        "seed_peak_extra_bytes": peaks["seed"],
        "bucket_bytes": args.bucket_mib * 2**20,
    }
    report(result, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
