"""One cp rank's attention at 128k tokens, cp = 8, on one GPU: the block attention's peak memory
against the unsharded flash kernel at the same local length, and its numbers against SDPA.

    python bench/gpu/gpu_cp_long.py [--device cuda] [--length 131072] [--cp 8] [--preset llama-3.1-8b]

A rank of a cp group holds ``S / cp`` queries (its head and tail chunk) and the all-gathered keys
and values of the whole sequence; what the collectives bring is given here as tensors (the fake
world of one rank: the gather's bytes are the ``[S]`` keys and values allocated below). Per rank
in bf16 with the preset's head counts: forward + backward of ``runtime.block_attention`` (the
path the cp attention takes) for every rank position, against SDPA's causal kernel over the
local ``S / cp`` tokens alone (the floor: what the rank's queries cost without cp), and, at
``--check-length``, against SDPA with a dense mask (fp32) for exactness. On CUDA also the
one-call flex kernel (``runtime.flex_blocks``, the CUDA default): its exactness with gradients
(causal; packed documents with a window and sinks, the sinks' gradient too), its row of the
table, and packed rows of 4, 64 and 512 documents in ``--packed-tokens`` at cp=2 (blocks
against flex: kernel calls, fwd+bwd time). Prints the tables.
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
    from plancc.runtime.cp_context import load_balanced_indices, load_balanced_indices_packed, query_spans
    from plancc.runtime.document_attention import attention_with_sinks
    from plancc.runtime.flex_blocks import flex_block_attention, flex_layout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--check-length", type=int, default=4096)
    parser.add_argument("--packed-tokens", type=int, default=16384)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = load_config(args.preset)
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    heads, kv = heads // 8 if device.type == "cpu" else heads, max(1, kv // 8) if device.type == "cpu" else kv

    def spans_of(bounds, cp, rank):
        return [(0, 1, span) for span in query_spans(bounds, bounds[:-1], cp, rank)]

    def blocks_of(total, cp, rank, window=None, bounds=None):
        return [b for _, _, span in spans_of(bounds or [0, total], cp, rank) for b in span_blocks(span, (0, 1), window)]

    def layout_of(total, cp, rank, window=None, bounds=None, sink=False):
        bounds = bounds or [0, total]
        blocks = blocks_of(total, cp, rank, window, bounds)
        return flex_layout(spans_of(bounds, cp, rank), blocks, (1, total // cp, total), window, sink, device)

    flex = device.type == "cuda"  # flex attention has no backward on the CPU (torch 2.13)

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
    if flex:
        print(
            _flex_exactness(
                device,
                heads,
                kv,
                dim,
                n,
                args.cp,
                layout_of,
                flex_block_attention,
                attention_with_sinks,
                load_balanced_indices,
                load_balanced_indices_packed,
            )
        )

    # memory and time at the long length, bf16, the busiest rank (rank 0 and cp-1 do equal work)
    total, local = args.length, args.length // args.cp
    dtype = torch.bfloat16
    rows = []
    names = ["blocks (cp rank)", "SDPA causal, S/cp alone"] + (["flex, one call (cp rank)"] if flex else [])
    for name in names:
        q = torch.randn(1, heads, local, dim, device=device, dtype=dtype, requires_grad=True)
        length = local if name.startswith("SDPA") else total
        k, v = (torch.randn(1, kv, length, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        blocks = blocks_of(total, args.cp, 0)
        layout = layout_of(total, args.cp, 0) if name.startswith("flex") else None

        def step(q=q, k=k, v=v, blocks=blocks, name=name, layout=layout):
            if name.startswith("blocks"):
                out = block_attention(q, k, v, blocks)
            elif layout is not None:
                out = flex_block_attention(q, k, v, layout)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.float().square().mean().backward()

        step()  # warm-up
        start = time.perf_counter()
        peak = _peak(device, step)
        rows.append((name, peak, time.perf_counter() - start))
    print(
        f"\n{args.preset}: {heads} heads, {kv} KV heads of {dim}; S={total}, cp={args.cp} ({local} local tokens), bf16"
    )
    print("| attention fwd+bwd | peak above inputs (MiB) | time (s) |\n|---|---|---|")
    for name, peak, seconds in rows:
        print(f"| {name} | {peak:.0f} | {seconds:.3f} |")
    if rows[1][1] == rows[1][1] and rows[1][1] > 0:
        print(f"\nblocks / unsharded flash at the same local length: {rows[0][1] / rows[1][1]:.2f}x memory")
    if flex:
        _packed_table(
            device, heads, kv, dim, args.packed_tokens, blocks_of, layout_of, block_attention, flex_block_attention
        )


def _timed(device, fn, repeat: int = 3) -> float:
    import statistics
    import time

    import torch

    fn()  # warm-up (flex compiles its kernel)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _flex_exactness(
    device, heads, kv, dim, n, cp, layout_of, flex_block_attention, attention_with_sinks, balanced, balanced_packed
) -> str:
    """Flex against the dense reference in fp32, outputs and gradients, every rank: a causal row,
    and a packed row of uneven documents with a window of 300 and sinks (the sinks' gradient)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    lengths = [2 * cp * m for m in (3, 40, 170, 11, n // (2 * cp) - 224)]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    pos = torch.arange(n, device=device)
    worst = {}
    for case, (window, sink, packed) in {
        "causal": (None, False, False),
        "packed+window+sinks": (300, True, True),
    }.items():
        q = torch.randn(1, heads, n, dim, generator=gen).to(device)
        k, v = (torch.randn(1, kv, n, dim, generator=gen).to(device) for _ in range(2))
        s = torch.randn(heads, generator=gen).to(device) if sink else None
        allowed = pos[None, :] <= pos[:, None]
        if packed:
            allowed &= doc[:, None] == doc[None, :]
        if window:
            allowed &= pos[:, None] - pos[None, :] < window
        g = torch.randn(1, heads, n, dim, generator=gen).to(device)
        rq, rk, rv = (t.clone().requires_grad_(True) for t in (q, k, v))
        rs = None if s is None else s.clone().requires_grad_(True)
        groups = heads // kv
        want = attention_with_sinks(
            rq,
            rk.repeat_interleave(groups, 1),
            rv.repeat_interleave(groups, 1),
            allowed[None, None],
            rs,
            dropout_p=0.0,
            scale=None,
        )
        want.backward(g)
        diff = 0.0
        for rank in range(cp):
            index = (balanced_packed(bounds, cp, rank) if packed else balanced(n, cp, rank)).to(device)
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q[:, :, index], k, v))
            ss = None if s is None else s.clone().requires_grad_(True)
            layout = layout_of(n, cp, rank, window, bounds if packed else None, sink)
            got = flex_block_attention(qq, kk, vv, layout, sinks=ss)
            got.backward(g[:, :, index])
            diff = max(
                diff, (got - want[:, :, index]).abs().max().item(), (qq.grad - rq.grad[:, :, index]).abs().max().item()
            )
            if rank == 0:
                kg, vg, sg = kk.grad, vv.grad, None if ss is None else ss.grad
            else:
                kg, vg = kg + kk.grad, vg + vv.grad
                sg = None if ss is None else sg + ss.grad
        diff = max(diff, (kg - rk.grad).abs().max().item(), (vg - rv.grad).abs().max().item())
        if s is not None:
            diff = max(diff, (sg - rs.grad).abs().max().item())
        worst[case] = diff
    return "flex exactness, fp32, outputs and gradients summed over the ranks: " + ", ".join(
        f"{case} {d:.2e}" for case, d in worst.items()
    )


def _packed_table(device, heads, kv, dim, tokens, blocks_of, layout_of, block_attention, flex_block_attention) -> None:
    """Packed rows at cp=2, bf16: the block attention's calls and time against one flex call."""
    import torch

    cp = 2
    print(
        f"\n| {tokens} tokens packed, cp={cp}, bf16, fwd+bwd | kernel calls (blocks -> flex) "
        "| median s (blocks -> flex) |"
    )
    print("|---|---|---|")
    for count in (4, 64, 512):
        gen = torch.Generator().manual_seed(count)
        weights = torch.rand(count, generator=gen) + 0.1
        unit = 2 * cp
        lengths = [max(1, int(w)) * unit for w in (weights / weights.sum() * (tokens // unit - count) + 1)]
        lengths[-1] += tokens - sum(lengths)
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        q = torch.randn(1, heads, tokens // cp, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(1, kv, tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
        )
        blocks = blocks_of(tokens, cp, 0, None, bounds)
        layout = layout_of(tokens, cp, 0, None, bounds)
        inputs = (q, k, v)
        loop = _timed(device, lambda i=inputs, b=blocks: block_attention(*i, b).float().square().mean().backward())
        one = _timed(device, lambda i=inputs, y=layout: flex_block_attention(*i, y).float().square().mean().backward())
        print(f"| {count} documents | {len(blocks)} -> 1 | {loop:.4f} -> {one:.4f} ({loop / one:.1f}x) |", flush=True)


if __name__ == "__main__":
    main()
