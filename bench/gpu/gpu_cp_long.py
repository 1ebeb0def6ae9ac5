"""One cp rank's attention at 128k tokens, cp = 8, on one GPU: the block attention's peak memory
against the unsharded flash kernel at the same local length, and its numbers against SDPA.

    python bench/gpu/gpu_cp_long.py [--device cuda] [--length 131072] [--cp 8] [--preset llama-3.1-8b]

A rank of a cp group holds ``S / cp`` queries (its head and tail chunk) and the all-gathered keys
and values of the whole sequence; what the collectives bring is given here as tensors (the fake
world of one rank: the gather's bytes are the ``[S]`` keys and values allocated below). Per rank
in bf16 with the preset's head counts: forward + backward of ``runtime.block_attention`` (the
path the cp attention takes) for every rank position, against SDPA's causal kernel over the
local ``S / cp`` tokens alone (the floor: what the rank's queries cost without cp), and, at
``--check-length``, against SDPA with a dense mask (fp32) for exactness. Prints one table.
Written for a GPU session (``docs/gpu.md``); ``--device cpu --length 4096 --cp 2`` runs it here.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _peak(device, fn) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    fn()
    return float("nan")  # CPU: bench/cp_long.py measures the process's peak


def main() -> None:
    import time

    import torch

    from plancc.models import load_config
    from plancc.runtime.block_attention import block_attention, span_blocks
    from plancc.runtime.cp import load_balanced_indices, query_spans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--check-length", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = load_config(args.preset)
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    heads, kv = heads // 8 if device.type == "cpu" else heads, max(1, kv // 8) if device.type == "cpu" else kv

    def blocks_of(total, cp, rank, window=None):
        return [b for span in query_spans([0, total], [0], cp, rank) for b in span_blocks(span, (0, 1), window)]

    # exactness at a checkable length, fp32, every rank
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = args.check_length
    q = torch.randn(1, heads, n, dim, generator=gen).to(device)
    k, v = (torch.randn(1, kv, n, dim, generator=gen).to(device) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    worst = 0.0
    for rank in range(args.cp):
        index = load_balanced_indices(n, args.cp, rank).to(device)
        got = block_attention(q[:, :, index], k, v, blocks_of(n, args.cp, rank))
        worst = max(worst, (got - want[:, :, index]).abs().max().item())
    print(f"exactness at S={n}, cp={args.cp}, fp32: max |blocks - SDPA causal| = {worst:.2e}")

    # memory and time at the long length, bf16, the busiest rank (rank 0 and cp-1 do equal work)
    total, local = args.length, args.length // args.cp
    dtype = torch.bfloat16
    rows = []
    for name in ("blocks (cp rank)", "SDPA causal, S/cp alone"):
        q = torch.randn(1, heads, local, dim, device=device, dtype=dtype, requires_grad=True)
        length = total if name.startswith("blocks") else local
        k, v = (torch.randn(1, kv, length, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        blocks = blocks_of(total, args.cp, 0)

        def step(q=q, k=k, v=v, blocks=blocks, name=name):
            if name.startswith("blocks"):
                out = block_attention(q, k, v, blocks)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.float().square().mean().backward()

        step()  # warm-up
        start = time.perf_counter()
        peak = _peak(device, step)
        rows.append((name, peak, time.perf_counter() - start))
    print(f"\n{args.preset}: {heads} heads, {kv} KV heads of {dim}; S={total}, cp={args.cp} ({local} local tokens), bf16")
    print("| attention fwd+bwd | peak above inputs (MiB) | time (s) |\n|---|---|---|")
    for name, peak, seconds in rows:
        print(f"| {name} | {peak:.0f} | {seconds:.3f} |")
    if rows[1][1] == rows[1][1] and rows[1][1] > 0:
        print(f"\nblocks / unsharded flash at the same local length: {rows[0][1] / rows[1][1]:.2f}x memory")


if __name__ == "__main__":
    main()
