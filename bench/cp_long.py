"""Context parallelism at long lengths: one decoder layer's forward+backward peak memory per rank.

    python bench/cp_long.py [--lengths 4096 16384 65536] [--cp 2] [--dense-up-to 16384]

A one-layer Qwen3 (hidden 256, 4 query / 2 KV heads of 64, fp32, vocabulary 256) on ``cp``
gloo ranks of this CPU, one fresh set of processes per measurement. Per rank: the peak resident
memory of one forward+backward over a ``[1, S]`` row minus the peak after a warm-up at 256
tokens (``ru_maxrss``: the process's own peak; the model, the libraries and the warm-up are
the baseline). Rows:
- ``blocks``: the cp attention as it runs (``runtime.block_attention``: no mask);
- ``dense``: ``PLANCC_CP_ATTENTION=dense``, the ``[S/cp, S]`` mask it replaced (run up to
  ``--dense-up-to``: at 64k it is ~10 GiB a rank);
- ``unsharded S/cp``: the same layer in one process on ``S/cp`` tokens with SDPA's own causal
  kernel (no mask): what a rank's share of the work costs without cp.
The growth ratio of the longest two lengths shows the order: 4 for linear in S, 16 for
quadratic. Results go in docs/performance.md.

    python bench/cp_long.py --packed [--documents 4 64 512] [--tokens 16384] [--cp 2]

Packed rows: ``--tokens`` tokens of 4, 64 and 512 documents (lengths drawn at random, each a
multiple of 2*cp), the same layer's forward+backward at cp, the block attention batching each
kind of block of the row into one kernel call (``BATCH_BLOCKS``, as it runs) against one call
per block (the loop it replaced), side by side in one run: the kernel calls per layer, the
median time of 3 steps and the peak memory, each in fresh processes.

    python bench/cp_long.py --packed --forward

The same rows forward only (log-probs), where the CPU also runs the one-call flex kernel
(``runtime.flex_blocks``; flex attention has no CPU backward in torch 2.13): calls and median
time of loop, batched and flex, the flex kernel compiled by an untimed first step.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402

WARMUP = 256


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=1 << 18,
        attn_implementation="sdpa",
    )


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _step(model, length: int) -> None:
    import torch

    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    out = model(input_ids=ids, use_cache=False)
    out.logits.float().square().mean().backward()


def _cp_model():
    """This rank's one-layer model under the cp attention over every rank (gloo, one thread),
    and its cp context; the caller destroys the process group."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from plancc.runtime.cp_context import enable_context_parallel
    from plancc.runtime.mesh import build_mesh

    init_gloo(timeout_s=3600)
    torch.set_num_threads(1)
    mesh = build_mesh(cp=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    return model, enable_context_parallel(model, mesh["cp"])


def cp_worker(length: int, dense: bool) -> dict:
    import torch.distributed as dist

    os.environ["PLANCC_CP_ATTENTION"] = "dense" if dense else "blocks"
    model, _ = _cp_model()
    try:
        _step(model, WARMUP)
        model.zero_grad(set_to_none=True)
        base = _peak_mib()
        _step(model, length)
        return {"extra_mib": _peak_mib() - base}
    finally:
        dist.destroy_process_group()


def _documents(count: int, tokens: int, cp: int) -> list[int]:
    """``count`` document lengths, multiples of 2*cp, summing to ``tokens`` (a seeded draw)."""
    import torch

    unit = 2 * cp
    weights = torch.rand(count, generator=torch.Generator().manual_seed(count)) + 0.1
    lengths = [max(1, int(w)) * unit for w in (weights / weights.sum() * (tokens // unit - count) + 1)]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def packed_worker(lengths: list[int], kernel: str, backward: bool = True) -> dict:
    """One layer over the packed row with ``kernel``: ``loop`` (a call per block), ``batched``
    (as the CPU runs it) or ``flex`` (one flex-attention call; forward only on the CPU)."""
    import contextlib
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from plancc.runtime import block_attention

    block_attention.BATCH_BLOCKS = kernel == "batched"
    model, ctx = _cp_model()
    ctx.kernel = "flex" if kernel == "flex" else "blocks"
    try:
        cu = torch.tensor([0, *lengths]).cumsum(0)
        ids = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(1))
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

        def step() -> None:
            with contextlib.nullcontext() if backward else torch.no_grad():
                out = model(input_ids=ids, position_ids=positions, cu_seqlens=cu, use_cache=False)
            if backward:
                out.logits.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        if backward:
            _step(model, WARMUP)
        model.zero_grad(set_to_none=True)
        base = _peak_mib()
        if not backward:  # forward only: one untimed step at the shape (flex compiles its kernel)
            step()
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        blocks = ctx.plan(None)
        assert blocks is not None, "packed rows without holes take the block attention"
        calls = {"loop": len(blocks), "flex": 1}.get(kernel) or sum(
            map(len, block_attention.batched(blocks, ids.device))
        )
        return {"extra_mib": _peak_mib() - base, "seconds": statistics.median(times), "calls": calls}
    finally:
        dist.destroy_process_group()


def _per_kernel(cp: int, lengths: list[int], kernels: tuple[str, ...], *, backward: bool) -> dict[str, dict]:
    """Each kernel's measurement in fresh processes, the busier rank's figure of each."""
    got = {}
    for kernel in kernels:
        ranks = launch(packed_worker, cp, lengths, kernel, backward).values()
        got[kernel] = {key: max(r[key] for r in ranks) for key in ("extra_mib", "seconds", "calls")}
    return got


def packed(args: argparse.Namespace) -> None:
    if args.forward:
        packed_forward(args)
        return
    print(
        f"| {args.tokens} tokens at cp={args.cp}, one layer fwd+bwd | kernel calls a layer (fwd) | median s "
        "| peak MiB above baseline |"
    )
    print("|---|---|---|---|")
    for count in args.documents:
        lengths = _documents(count, args.tokens, args.cp)
        got = _per_kernel(args.cp, lengths, ("loop", "batched"), backward=True)
        loop, one = got["loop"], got["batched"]
        print(
            f"| {count} documents (longest {max(lengths)}) | {loop['calls']} -> {one['calls']} "
            f"| {loop['seconds']:.2f} -> {one['seconds']:.2f} ({loop['seconds'] / one['seconds']:.1f}x) "
            f"| {loop['extra_mib']:.0f} -> {one['extra_mib']:.0f} |",
            flush=True,
        )


def packed_forward(args: argparse.Namespace) -> None:
    """Forward only (log-probs), where the CPU can run flex attention: loop, batched, flex."""
    kernels = ("loop", "batched", "flex")
    print(
        f"| {args.tokens} tokens at cp={args.cp}, one layer forward | kernel calls a layer (loop / batched / flex) "
        "| median s (loop / batched / flex) |"
    )
    print("|---|---|---|")
    for count in args.documents:
        lengths = _documents(count, args.tokens, args.cp)
        got = _per_kernel(args.cp, lengths, kernels, backward=False)
        calls = " / ".join(str(got[k]["calls"]) for k in kernels)
        seconds = " / ".join(f"{got[k]['seconds']:.2f}" for k in kernels)
        print(f"| {count} documents (longest {max(lengths)}) | {calls} | {seconds} |", flush=True)


def unsharded_worker(length: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    _step(model, WARMUP)
    model.zero_grad(set_to_none=True)
    base = _peak_mib()
    _step(model, length)
    return {"extra_mib": _peak_mib() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--dense-up-to", type=int, default=16384)
    parser.add_argument("--packed", action="store_true", help="packed rows: batched blocks against the loop")
    parser.add_argument("--documents", type=int, nargs="+", default=[4, 64, 512])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--forward", action="store_true", help="with --packed: forward only, flex attention too")
    args = parser.parse_args()
    if args.packed:
        packed(args)
        return
    rows = {"blocks": {}, "dense": {}, "unsharded S/cp": {}}
    for length in args.lengths:
        got = launch(cp_worker, args.cp, length, False)
        rows["blocks"][length] = max(r["extra_mib"] for r in got.values())
        if length <= args.dense_up_to:
            got = launch(cp_worker, args.cp, length, True)
            rows["dense"][length] = max(r["extra_mib"] for r in got.values())
        rows["unsharded S/cp"][length] = launch(unsharded_worker, 1, length // args.cp)[0]["extra_mib"]
        print(
            f"S={length}: " + ", ".join(f"{k} {v.get(length, float('nan')):.0f} MiB" for k, v in rows.items()),
            flush=True,
        )
    header = "| per rank, one layer fwd+bwd (MiB above baseline) | " + " | ".join(f"S={n}" for n in args.lengths)
    print(f"\n{header} | growth {args.lengths[-1]}/{args.lengths[-2]} |")
    print("|---" * (len(args.lengths) + 2) + "|")
    for name, values in rows.items():
        cells = [f"{values[n]:.0f}" if n in values else "not run" for n in args.lengths]
        a, b = values.get(args.lengths[-2]), values.get(args.lengths[-1])
        growth = f"{b / a:.1f}x" if a and b else "-"
        print(f"| {name} (cp={args.cp}) | " + " | ".join(cells) + f" | {growth} |")
    ratio = [rows["blocks"][n] / rows["unsharded S/cp"][n] for n in args.lengths if rows["unsharded S/cp"][n] > 0]
    print("\nblocks / unsharded at the same local length: " + ", ".join(f"{r:.2f}x" for r in ratio))


if __name__ == "__main__":
    main()
