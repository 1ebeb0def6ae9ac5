"""``Policy.reference_logprobs`` against ``Policy.logprobs`` on the same batch (issue 60, point 3):
the time of the reference's weight swap, as a ratio, at dp2 and tp2 on this CPU (gloo).

    python bench/reference_logprobs.py [--model qwen3-0.6b-layers4] [--rows 8] [--seq 256] [--repeat 5]

Each rank times ``logprobs`` and ``reference_logprobs`` alternately ``--repeat`` times after a
warm-up; the ratio of the medians is printed per layout (rank 0's; every rank runs the same
calls). The model is a preset's config cut to a few layers, so that the weights (what the swap
moves) are a real model's per layer while the run stays minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def measure(layout: dict, preset: str, layers: int, rows: int, seq: int, repeat: int) -> dict:
    import torch

    import plancc
    from plancc.models import load_config

    from tests.distributed import init_gloo, sized

    init_gloo()
    config = load_config(preset)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    policy = plancc.Policy("plans/qwen3.yaml", config, reference=True, layout=sized(**layout))
    gen = torch.Generator().manual_seed(0)
    per = rows // policy.dp_size
    ids = torch.randint(0, config.vocab_size, (per, seq), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    times: dict[str, list[float]] = {"logprobs": [], "reference_logprobs": []}
    policy.logprobs(batch)
    policy.reference_logprobs(batch)
    for _ in range(repeat):
        for name in times:
            started = time.perf_counter()
            getattr(policy, name)(batch)
            times[name].append(time.perf_counter() - started)
    params = sum(p.numel() for p in policy.model.parameters())
    torch.distributed.destroy_process_group()
    own, ref = (statistics.median(times[n]) for n in ("logprobs", "reference_logprobs"))
    return {"logprobs_s": own, "reference_s": ref, "ratio": ref / own, "parameters": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from tests.distributed import launch

    print(f"{args.model} cut to {args.layers} layers, {args.rows} rows x {args.seq} tokens, median of {args.repeat}")
    for layout in ({"dp": 2}, {"tp": 2}):
        found = launch(measure, 2, layout, args.model, args.layers, args.rows, args.seq, args.repeat)[0]
        name = ",".join(f"{k}{v}" for k, v in layout.items())
        print(
            f"  {name}: logprobs {found['logprobs_s'] * 1e3:.1f} ms, reference_logprobs "
            f"{found['reference_s'] * 1e3:.1f} ms: {found['ratio']:.2f}x ({found['parameters'] / 1e6:.0f}M parameters a rank)"
        )


if __name__ == "__main__":
    main()
