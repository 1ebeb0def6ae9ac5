"""The global gradient norm and clipping (``runtime.gradnorm``) over a real model's gradients,
per-parameter kernels against foreach ones (issue 60, point 4), side by side in one run.

    python bench/gradnorm.py [--model qwen3-0.6b] [--layers 8] [--repeat 20]

One process, no process group: plain gradients (the sharded case adds one all-reduce per mesh
and axis either way). Prints the median time of each and their ratio.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def per_parameter(params, max_norm):
    """The loop ``runtime.gradnorm`` ran before: a square-sum and a scale kernel a parameter."""
    import torch

    total = torch.zeros(())
    for p in params:
        total = total + p.grad.detach().float().pow(2).sum()
    norm = total.sqrt()
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    import torch

    from plancc.models import build_model, load_config
    from plancc.runtime.gradnorm import clip_grad_norm_

    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: args.layers]
    model = build_model(config, device="cpu")
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    times = {"per parameter": [], "foreach": []}
    for _ in range(args.repeat):
        for name, fn in (("per parameter", per_parameter), ("foreach", clip_grad_norm_)):
            started = time.perf_counter()
            norm = fn(params, 1e-3)  # clipping on: both scale every gradient
            times[name].append(time.perf_counter() - started)
            for p in params:  # the same gradients for the next call
                p.grad.mul_(1.0 / min(1.0, 1e-3 / (float(norm) + 1e-6)))
    a, b = (statistics.median(times[n]) for n in ("per parameter", "foreach"))
    print(f"{args.model} cut to {args.layers} layers: {len(params)} gradients, "
          f"{sum(p.numel() for p in params) / 1e6:.0f}M elements")
    print(f"  per parameter {a * 1e3:.1f} ms, foreach {b * 1e3:.1f} ms: foreach {a / b:.2f}x as fast")
    assert math.isfinite(a)


if __name__ == "__main__":
    main()
