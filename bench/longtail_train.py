"""``Policy.train`` on a long-tailed RL batch: each microbatch cut to its own rows against the
old padding to the whole batch's length, side by side in one run (issue 40, point 1).

    torchrun --nproc-per-node 2 bench/longtail_train.py [--rows 32] [--max-tokens 4096] [--steps 3]

Response lengths are drawn log-normally between 16 and 2048 tokens (most rows short, a few at the
limit), ``max_tokens`` bins the rows of each dp rank. "padded" is the engine before the cut: every
microbatch padded to the batch's longest row (``Microbatch.of`` given the batch's width as every
row's end); "cut" is the engine now; "packed" packs each microbatch's rows into one. The rows are
given out by ``balanced_slices``. Prints real tokens per second of each way (the median step
after a warm-up) and their ratios; the loss of each way must agree (the cut only skips padding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="global batch")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per way (after one warm-up)")
    parser.add_argument("--model", default="tiny-qwen3")
    args = parser.parse_args()

    import torch

    import plancc
    from plancc.engine import policy as engine_policy
    from plancc.engine.losses import token_nll

    policy = plancc.Policy("plans/qwen3.yaml", args.model, optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.0}})
    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(args.rows, generator=gen) * 1.0 + 5.0).clamp(16, 2048).long()
    seq = int(lengths.max())
    ids = torch.randint(0, policy.config.vocab_size, (args.rows, seq), generator=gen)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    mine = policy.balanced_slices(mask.sum(1))
    batch = {"input_ids": ids[mine] * mask[mine], "attention_mask": mask[mine]}

    cut = engine_policy.row_spans

    def padded(m: torch.Tensor) -> list:  # every row "ends" at the batch's width: the old path
        return [replace(span, end=m.shape[1]) for span in cut(m)]

    ways = {"padded": (padded, False), "cut": (cut, False), "packed": (cut, True)}
    result = {}
    for name, (spans, pack) in ways.items():
        engine_policy.row_spans = spans
        times, loss = [], 0.0
        for step in range(args.steps + 1):
            row = policy.train(batch, token_loss=token_nll, max_tokens=args.max_tokens, pack=pack)
            if step:
                times.append(row["seconds"])
            loss = row["loss"]
        result[name] = (row["tokens"] / statistics.median(times), loss, row["microbatches"])
    engine_policy.row_spans = cut
    if torch.distributed.get_rank() == 0:
        print(
            f"rows {args.rows} (lengths 16..{seq}, median {int(lengths.median())}), max_tokens {args.max_tokens}, "
            f"dp {policy.dp_size}, {args.model}"
        )
        for name, (rate, loss, micro) in result.items():
            ratio = rate / result["padded"][0]
            print(
                f"{name:7s} {rate:10,.0f} tokens/s  x{ratio:.2f} of padded  loss {loss:.6f}  microbatches {micro:.0f}"
            )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
