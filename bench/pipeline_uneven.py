"""RL's uneven rows through a pipeline: ``Policy(pp=N).train`` on rows of their own lengths (one
schedule step per length) against the same rows padded to the longest (every position attended:
one step), side by side in one run.

    python bench/pipeline_uneven.py [--rows 16] [--pp 2] [--repeats 3]

Two gloo ranks of this CPU (pp=2, 1F1B), a 4-layer Qwen3-shaped model (hidden 256); the rows'
lengths are long-tailed (most short, a few up to 8x longer: what rollouts give). Prints the
tokens each way computes, the step times (median of ``--repeats``, interleaved) and their ratio.
Each distinct length costs a pipeline fill and drain; padding costs the padded tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402


def worker(rows: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config

    import plancc

    from tests.policy_worker import nll

    _, world = init_gloo(timeout_s=1800)
    torch.set_num_threads(1)
    try:
        config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=512, attn_implementation="sdpa")
        policy = plancc.Policy("plans/qwen3.yaml", config, layout=plancc.Layout(pp=world),
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        gen = torch.Generator().manual_seed(3)
        # long-tailed lengths in whole 32s: most near 64, a tail up to 512
        lengths = [int(min(512, 64 * (1 + torch.empty(1).exponential_(generator=gen).item() ** 2))) // 32 * 32
                   for _ in range(rows)]
        longest = max(lengths)
        ids = torch.randint(0, 512, (rows, longest), generator=gen)
        mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
        uneven = {"input_ids": ids, "attention_mask": mask}
        padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # the padding's tokens computed
        times: dict[str, list[float]] = {"by length": [], "padded": []}
        ways = (("by length", lambda: policy.train(uneven, nll)), ("padded", lambda: policy.train(padded, nll)))
        for _ in range(repeats + 1):
            for name, fn in ways:
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        return {
            "lengths": lengths,
            "distinct": len(set(lengths)),
            "tokens": sum(lengths),
            "padded_tokens": rows * longest,
            **{name: statistics.median(t[1:]) for name, t in times.items()},
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    r = launch(worker, args.pp, args.rows, args.repeats)[0]
    print(f"{args.rows} rows, {r['distinct']} distinct lengths, lengths {sorted(r['lengths'])}")
    print(f"tokens computed: by length {r['tokens']}, padded {r['padded_tokens']} "
          f"({r['padded_tokens'] / r['tokens']:.2f}x)")
    print(f"step: by length {r['by length']:.3f} s, padded {r['padded']:.3f} s: "
          f"by length / padded = {r['by length'] / r['padded']:.2f}")


if __name__ == "__main__":
    main()
