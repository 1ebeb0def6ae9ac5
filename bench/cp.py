"""Context-parallel shard + gather against a plain all-gather of the same bytes, and against
the reference (NeMo-RL) design's gather, re-written here for comparison only.

    python bench/cp.py [--cp 2] [--shape 1 8192 2048]

Each rank shards the full sequence (load-balanced) and gathers it back in order with
``plancc.cp.all_gather`` (forward and backward). "plain" is ``all_gather_single`` of a
tensor of the shard's size with no reordering: the floor. "reference" all-gathers into a
list and reorders with chunk/cat as the reference's AllGatherCPTensor does. Median of 5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402


def reference_gather(x, group, world):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    halves = [p.chunk(2, dim=1) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=1)


def worker(shape, repeats):
    import torch
    import torch.distributed as dist

    from plancc.cp import all_gather, shard

    rank, world = init_gloo(timeout_s=600)
    try:
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(0))  # the same on every rank
        group = dist.group.WORLD

        def timed_rounds(fns: dict) -> dict:
            """Interleave the variants round by round, so drift on a shared machine hits all
            of them alike; the median of each after one warm-up round."""
            times = {name: [] for name in fns}
            for _ in range(repeats + 1):
                for name, fn in fns.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            return {name: statistics.median(t[1:]) for name, t in times.items()}

        mine = shard(full, world, rank, dim=1).contiguous()

        def ours():
            x = shard(full, world, rank, dim=1)
            return all_gather(x, group, dim=1)

        def gather_only():
            return all_gather(mine, group, dim=1)

        def shard_only():
            return shard(full, world, rank, dim=1)

        def ours_fwd_bwd():
            x = shard(full, world, rank, dim=1).requires_grad_(True)
            all_gather(x, group, dim=1).sum().backward()

        def plain():
            out = mine.new_empty((world * mine.shape[0], *mine.shape[1:]))
            dist.all_gather_single(out, mine, group=group)

        def reference():
            return reference_gather(shard(full, world, rank, dim=1), group, world)

        assert torch.equal(ours(), full) and torch.equal(reference(), full)
        result = timed_rounds({"ours": ours, "plain": plain, "reference": reference, "ours_fwd_bwd": ours_fwd_bwd,
                               "gather_only": gather_only, "shard_only": shard_only})
        return {**result, "bytes": mine.numel() * mine.element_size()}
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=3, default=[1, 8192, 2048])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's default mmap thresholds")
    args = parser.parse_args()
    if not args.system_malloc:  # read by glibc when the (spawned) workers start
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**32))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
    results = launch(worker, args.cp, tuple(args.shape), args.repeats, timeout_s=900)
    r = max(results.values(), key=lambda x: x["ours"])
    malloc = "glibc defaults" if args.system_malloc else "freed memory kept (caching-allocator-like)"
    print(f"cp={args.cp} gloo, full tensor {args.shape} fp32, shard {r['bytes'] / 2**20:.1f} MiB per rank; "
          f"malloc: {malloc}")
    print(f"  plancc shard+gather      {r['ours'] * 1e3:8.1f} ms   ratio to plain all-gather {r['ours'] / r['plain']:.3f}")
    print(f"  plain all_gather_single  {r['plain'] * 1e3:8.1f} ms")
    print(f"  reference gather         {r['reference'] * 1e3:8.1f} ms   plancc / reference {r['ours'] / r['reference']:.3f}")
    print(f"  of which shard           {r['shard_only'] * 1e3:8.1f} ms; gather alone {r['gather_only'] * 1e3:.1f} ms "
          f"(ratio to plain {r['gather_only'] / r['plain']:.3f})")
    print(f"  plancc fwd+bwd           {r['ours_fwd_bwd'] * 1e3:8.1f} ms   (backward: one reduce-scatter)")


if __name__ == "__main__":
    main()
