"""Compile time of a plan on deep models: ``compile_plan`` (resolve globs + lower to torch
styles) of ``plans/llama.yaml`` on a Llama built on the meta device, at 100 and 1000 layers.

    python bench/compile_time.py [--layers 100 1000] [--repeats 7]

Prints the median over ``--repeats`` runs per depth, the time per layer (linear in depth
means this stays flat) and, beside it, the cost of the naive matching the compiler replaced:
testing every glob against every module name with fnmatch-style matching, measured in the
same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import plancc  # noqa: E402
from plancc.compiler.globs import glob_problem  # noqa: E402
from plancc.models import build_model, load_config  # noqa: E402

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "llama.yaml")


def _naive_match(patterns: list[str], names: list[str]) -> int:
    """Every glob against every name, segment by segment (what resolving did before)."""
    from fnmatch import fnmatchcase

    hits = 0
    for pattern in patterns:
        p = pattern.split(".")
        for name in names:
            n = name.split(".")
            hits += len(p) == len(n) and all(fnmatchcase(a, b) for a, b in zip(n, p))
    return hits


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    plan = plancc.load_plan(PLAN)
    patterns = [r.pattern for r in plan.tensor_parallel if glob_problem(r.pattern) is None]
    print(f"{'layers':>6}  {'modules':>7}  {'compile_plan':>12}  {'per layer':>9}  {'naive glob matching':>19}")
    for layers in args.layers:
        config = load_config("tiny-llama")
        config.num_hidden_layers = layers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(config, device="meta")
        names = [n for n, _ in model.named_modules() if n]
        compiled = plancc.compile_plan(plan, model, tp_size=2)  # warm: first-use imports and caches
        seconds = _median_seconds(lambda: plancc.compile_plan(plan, model, tp_size=2), args.repeats)
        naive = _median_seconds(lambda: _naive_match(patterns, names), max(1, args.repeats // 2))
        print(f"{layers:>6}  {len(names):>7}  {seconds * 1e3:>9.1f} ms  {seconds / layers * 1e6:>6.1f} us  "
              f"{naive * 1e3:>16.1f} ms   ({len(compiled)} styled modules)")


if __name__ == "__main__":
    main()
