"""``Policy.train`` with ``token_loss`` (the fused lm_head: 3 matmuls) against ``loss_fn`` (log-probs
handed to the loss: 4 matmuls) at a large vocabulary, on the CPU (issue 40, point 6).

    python bench/lm_head_paths.py [--vocab 65536] [--tokens 2048] [--steps 3] [--rounds 2]

Each way runs in a fresh process (one rank, gloo) so that its peak resident memory is its own;
the ways alternate round by round (A B A B). A small Qwen3 body (2 layers, hidden 256) under a
``--vocab`` lm_head, so the vocabulary projection is most of the step. Prints each way's median
step time, its peak memory above the model's resident size, and the ratios; the losses of both
ways must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(way: str, vocab: int, tokens: int, steps: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    import plancc
    from plancc.models import load_config

    dist.init_process_group("gloo", init_method=f"file:///tmp/plancc-lm-head-{os.getpid()}", rank=0, world_size=1)
    config = load_config("tiny-qwen3")
    config.vocab_size, config.hidden_size, config.intermediate_size = vocab, 256, 512
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    policy = plancc.Policy(
        "plans/qwen3.yaml", config, device="cpu", optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.0}}
    )
    gen = torch.Generator().manual_seed(0)
    rows = 4
    batch = {"input_ids": torch.randint(0, vocab, (rows, tokens // rows), generator=gen)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])

    def per_microbatch(lp, mb, norm):
        return -lp.sum() / norm.tokens, {}

    def per_token(lp, tokens, norm):
        return -lp.sum() / norm.tokens

    loss = {"token_loss": {"token_loss": per_token}, "loss_fn": {"loss_fn": per_microbatch}}[way]
    resident = _rss_mib()
    times, losses = [], []
    for step in range(steps + 1):
        started = time.perf_counter()
        losses.append(policy.train(batch, **loss)["loss"])
        if step:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    dist.destroy_process_group()
    return {"seconds": statistics.median(times), "peak_above_resident_mib": peak - resident, "loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=["token_loss", "loss_fn"])
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.vocab, args.tokens, args.steps)), flush=True)
        return
    results: dict = {"token_loss": [], "loss_fn": []}
    for _ in range(args.rounds):
        for way in results:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    way,
                    "--vocab",
                    str(args.vocab),
                    "--tokens",
                    str(args.tokens),
                    "--steps",
                    str(args.steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results[way].append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    print(
        f"vocab {args.vocab}, {args.tokens} tokens per step, hidden 256, CPU ({os.cpu_count()} cores), "
        f"{args.rounds} rounds of {args.steps} steps:"
    )
    summary = {}
    for way, rows in results.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        peak = statistics.median(r["peak_above_resident_mib"] for r in rows)
        summary[way] = (seconds, peak)
        print(f"  {way:10s} {seconds:7.2f} s/step  peak +{peak:7.0f} MiB  loss {rows[-1]['loss']:.6f}")
    (t3, m3), (t4, m4) = summary["token_loss"], summary["loss_fn"]
    print(f"  token_loss / loss_fn: time x{t3 / t4:.2f}, peak memory x{m3 / m4:.2f}")


if __name__ == "__main__":
    main()
