"""Which way should the CPU fused evaluator walk the logits it never holds: chunks of tokens, or
blocks of vocabulary columns over all tokens? ``default_columns`` picks columns when there are
no more tokens than local columns (N <= V_local); this bench times both ways at shapes on
either side of that line.

    python bench/fused_walk.py                 # H=512, a few (N, V_local) shapes, fp32, 3 rounds
    python bench/fused_walk.py --rounds 5 --h 1024 --shapes 4096x8192 8192x16384

For each shape: ``fused_logprobs`` forward (no grad) and forward+backward, walked by token
chunks (the default chunk size) and by column blocks (the default width), both in one process,
timed round robin (each round runs both once). "columns / tokens" is the median of each
round's own ratio; below 1 means columns are faster. The rule's pick is marked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = [(2048, 65536), (4096, 32768), (4096, 18992), (8192, 8192), (16384, 4096), (32768, 2048)]


def _run(h, w, t, g, chunks, backward):
    import torch

    from plancc.runtime.fused_logprobs import _FusedLogprobs, _Vocab

    vocab = _Vocab(group=None, start=0, size=w.shape[0])
    if not backward:
        with torch.no_grad():
            _FusedLogprobs.apply(h, w, t, vocab, chunks, False)
        return
    hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    lp, _ = _FusedLogprobs.apply(hh, ww, t, vocab, chunks, False)
    (lp * g).sum().backward()


def main():
    import torch

    from plancc.runtime.fused_logprobs import _Chunks, default_chunk, default_columns

    parser = argparse.ArgumentParser()
    parser.add_argument("--h", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", default=[f"{n}x{v}" for n, v in SHAPES], help="NxV_local ...")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    torch.set_num_threads(os.cpu_count() or 2)
    cpu = torch.device("cpu")
    print(f"H={args.h} fp32, {torch.get_num_threads()} threads; ratio = columns / tokens, median of rounds")
    print(f"{'N':>6}{'V_local':>9}{'rule':>9}{'phase':>9}{'tokens s':>10}{'columns s':>11}{'ratio':>8}{'rounds':>13}")
    for n, v in shapes:
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(n, args.h, generator=gen)
        w = torch.randn(v, args.h, generator=gen) * 0.02
        t = torch.randint(0, v, (n,), generator=gen)
        g = torch.rand(n, generator=gen)
        fwd, grad = default_chunk(n, v, cpu), default_chunk(n, v, cpu, grad=True)
        width = default_chunk(v, n, cpu)  # default_columns' width, whichever side of the rule
        ways = {"tokens": _Chunks(fwd, grad), "columns": _Chunks(fwd, grad, width)}
        rule = "columns" if default_columns(n, v, cpu) is not None else "tokens"
        for phase, backward in (("fwd", False), ("fwd+bwd", True)):
            times: dict[str, list[float]] = {name: [] for name in ways}
            for chunks in ways.values():
                _run(h, w, t, g, chunks, backward)  # warm-up
            for _ in range(args.rounds):
                for name, chunks in ways.items():
                    t0 = time.perf_counter()
                    _run(h, w, t, g, chunks, backward)
                    times[name].append(time.perf_counter() - t0)
            ratios = [c / k for c, k in zip(times["columns"], times["tokens"], strict=True)]
            print(
                f"{n:>6}{v:>9}{rule:>9}{phase:>9}{statistics.median(times['tokens']):>10.3f}"
                f"{statistics.median(times['columns']):>11.3f}{statistics.median(ratios):>8.3f}"
                f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}",
                flush=True,
            )


if __name__ == "__main__":
    main()
