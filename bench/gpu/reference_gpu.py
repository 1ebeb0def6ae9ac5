"""``Policy.reference_logprobs`` against ``Policy.logprobs`` on one GPU (issue 60, point 3), for
each way of keeping the reference: on the device in the compute dtype (``reference=True``, the
default) and in pinned host buffers copied in without blocking (``reference="host"``).

    torchrun --nproc-per-node 1 bench/gpu/reference_gpu.py [--model qwen3-0.6b] [--rows 8] [--seq 1024]

The ratio of the medians of ``--repeat`` alternating calls after a warm-up, bf16 compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_report import report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = parser.parse_args()

    import torch

    import plancc

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": args.model,
        "rows": args.rows,
        "seq": args.seq,
    }
    for kept in (True, "host"):
        policy = plancc.Policy(
            "plans/qwen3.yaml", args.model, reference=kept, device=args.device, param_dtype="bfloat16"
        )
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, policy.config.vocab_size, (args.rows, args.seq), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        own = policy.logprobs(batch)
        ref = policy.reference_logprobs(batch)
        same = bool(torch.equal(own, ref))  # no step taken: the reference is the policy's weights
        times: dict[str, list[float]] = {"logprobs": [], "reference_logprobs": []}
        for _ in range(args.repeat):
            for name in times:
                sync()
                started = time.perf_counter()
                getattr(policy, name)(batch)
                sync()
                times[name].append(time.perf_counter() - started)
        mine, theirs = (statistics.median(times[n]) for n in times)
        way = "device" if kept is True else "host"
        result[f"{way}_logprobs_s"], result[f"{way}_reference_s"] = mine, theirs
        result[f"{way}_ratio"], result[f"{way}_equal_before_a_step"] = theirs / mine, same
        del policy
        if cuda:
            torch.cuda.empty_cache()
    report(result, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
