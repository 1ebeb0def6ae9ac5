"""suggest's per-rank memory prediction against the peak one training step measures in the dry
run's fake world (``plancc.tools.measured_memory``: the real model code, FSDP2 mixed precision,
the plan's TP/SP/CP, activation checkpointing, the fused lm_head loss, AdamW), side by side.

    python bench/suggest_memory.py            # the cases below; about 30 s each on a 2-core CPU
    python bench/suggest_memory.py reshard    # only the cases whose model or layout holds "reshard"
    python bench/suggest_memory.py --kinds    # each figure by kind too

Both figures are at the measurement's device, the CPU (its lm_head chunking); the ratio is
predicted / measured. Latest results: docs/suggest.md.
"""

from __future__ import annotations

import os
import time

from plancc.compiler.plan import load_plan
from plancc.layout import Layout
from plancc.models import build_meta_model, load_config
from plancc.tools.measured_memory import measure_step_memory
from plancc.tools.suggest import predicted_memory

GiB = 2**30

# (plan, model, layout, seq_len, checkpointing[, reshard_after_forward])
CASES = [
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=8), 4096, "none"),
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=8), 4096, "full"),
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=8), 4096, "plan"),  # selective: the MLPs
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=4, tp=2), 4096, "none"),
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=4, tp=2, sequence_parallel=True), 4096, "none"),
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=4, cp=2), 8192, "none"),  # long sequence, CP
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=2, cp=4), 16384, "full"),
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=8), 4096, "full", False),  # reshard off: units kept gathered
    ("plans/qwen3.yaml", "qwen3-0.6b", Layout(dp=2), 4096, "full", False),
    ("plans/llama.yaml", "llama-3.2-1b", Layout(dp=4, tp=2, sequence_parallel=True), 4096, "plan"),
    ("plans/qwen3_moe.yaml", "qwen3-30b-a3b:4", Layout(dp=8, ep=8), 4096, "none"),  # MoE, 4 of its 48 layers
    ("plans/qwen3_moe.yaml", "qwen3-30b-a3b:4", Layout(dp=4, tp=2, ep=4), 4096, "full"),
]


def _model(name: str) -> str:
    """A preset, or ``preset:N``: the preset with N of its layers (a config file written for it)."""
    import json
    import tempfile

    from plancc.models import presets

    if ":" not in name:
        return name
    preset, layers = name.split(":")
    path = os.path.join(tempfile.gettempdir(), f"plancc-bench-{preset}-{layers}-layers.json")
    with open(path, "w") as f:
        json.dump({**presets()[preset].config, "num_hidden_layers": int(layers)}, f)
    return path


def predicted(
    plan, model_name: str, layout: Layout, seq_len: int, checkpointing: str, reshard: bool = True, device: str = "cpu"
):
    return predicted_memory(
        plan,
        build_meta_model(model_name),
        layout,
        seq_len,
        checkpointing,
        device=device,
        reshard_after_forward=reshard,
    )


def main() -> None:
    import sys

    only = next((a for a in sys.argv[1:] if not a.startswith("--")), "")
    head = f"{'model':<16} {'layout':<22} {'seq':>6} {'ac':<5} {'predicted':>10} {'at':<14} {'measured':>10}"
    print(f"{head} {'ratio':>6}  seconds")
    for plan_path, name, layout, seq_len, ac, *rest in CASES:
        reshard = rest[0] if rest else True
        described = layout.describe() + ("" if reshard else " reshard off")
        if only not in f"{name} {described}":
            continue
        plan, model_name = load_plan(plan_path), _model(name)
        started = time.perf_counter()
        try:
            got = measure_step_memory(
                plan, load_config(model_name), layout, seq_len=seq_len, checkpointing=ac, reshard_after_forward=reshard
            )
        except Exception as exc:  # noqa: BLE001 - a case the fake world cannot run is printed, not fatal
            print(f"{name:<16} {described:<22} {seq_len:>6} {ac:<5} not measured: {type(exc).__name__}: {exc}")
            continue
        seconds = time.perf_counter() - started
        want = predicted(plan, model_name, layout, seq_len, ac, reshard)
        print(
            f"{name:<16} {described:<22} {seq_len:>6} {ac:<5} {want.total / GiB:>8.2f} G {want.at:<14} "
            f"{got.total / GiB:>8.2f} G {want.total / got.total:>6.2f}  {seconds:.0f}"
        )
        if "--kinds" in sys.argv:  # each figure by kind
            print("    predicted:", {k: round(getattr(want, k) / GiB, 2) for k in want.__slots__ if k != "at"})
            print("    measured: ", {k: round(getattr(got, k) / GiB, 2) for k in got.__slots__ if k != "total"})


if __name__ == "__main__":
    main()
