"""``plancc suggest``'s pipeline estimates beside Calculon's on the same configuration, and the
published figures (issue 59, point 6): torchtitan's Llama 3.1 405B on 512 H100s as FSDP 8 x TP 8 x
PP 8, 8192-token sequences, 1M tokens a step, full activation checkpointing; 1F1B and
Interleaved 1F1B (published: 100 and 128 tokens/s/GPU, 82.5 and 72.7 GiB).

    python bench/suggest_vs_calculon.py --calculon PATH [--out docs/measurements/suggest_vs_calculon.json]

Calculon (calculon-ai/calculon: Isaev et al., SC'23; 3.7% mean step-time error against
Megatron's measured runs) is not on PyPI (the ``calculon`` there is another package): PATH is a
checkout of its repository. It models Megatron-style layouts, so the configuration is the
nearest it can say:

- the model: hidden 16384, 126 blocks, 128 heads of 128, sequences of 8192; Llama's SwiGLU MLP
  (three 16384 x 53248 matrices) as Calculon's two-matrix MLP of width 79872 (the same FLOPs and
  weights), grouped-query attention as multi-head (Calculon has no GQA: 2.7% more attention
  weights);
- the execution: TP 8 within a node, PP 8 and DP 8 across, microbatch 1, 128 sequences a step,
  full recompute, ZeRO-1 (``optimizer_sharding``; FSDP shards the weights too, which Calculon
  does not model), data-parallel overlap on, fp16 numbers (Calculon has no bf16: the same
  throughput); ``pipeline_interleaving`` 1 (1F1B) and 2 (interleaved);
- the system: its own ``systems/h100_80g_nvl8.json``. Where Calculon finds the layout does not
  fit 80 GiB it says how much it needs, and its time is taken again with the memory cap lifted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "llama.yaml")
GiB = 2**30
SEQ, GPUS, TOKENS = 8192, 512, 1_048_576
PUBLISHED = {"1f1b": (100, 82.5), "interleaved_1f1b": (128, 72.7)}
MODEL = {"hidden": 16384, "feedforward": 79872, "seq_size": SEQ, "attn_heads": 128, "attn_size": 128, "num_blocks": 126}


def execution(interleaving: int) -> dict:
    return {
        "num_procs": GPUS,
        "tensor_par": 8,
        "pipeline_par": 8,
        "data_par": 8,
        "tensor_par_net": 0,
        "pipeline_par_net": 1,
        "data_par_net": 1,
        "batch_size": TOKENS // SEQ,
        "microbatch_size": 1,
        "datatype": "float16",
        "fused_activation": True,
        "attention_type": "multihead",
        "activation_recompute": "full",
        "pipeline_interleaving": interleaving,
        "optimizer_sharding": True,
        "tensor_par_comm_type": "ar",
        "tensor_par_overlap": "none",
        "seq_par_ag_redo": False,
        "data_par_overlap": True,
        "weight_offload": False,
        "activations_offload": False,
        "optimizer_offload": False,
        "training": True,
    }


def calculon(checkout: str, interleaving: int, folder: str) -> dict:
    """Calculon's step time and memory for the configuration (its cap lifted where it refuses)."""
    model, exe, out = (os.path.join(folder, f"{n}_{interleaving}.json") for n in ("model", "exe", "out"))
    with open(model, "w") as f:
        json.dump(MODEL, f)
    with open(exe, "w") as f:
        json.dump(execution(interleaving), f)
    system_path = os.path.join(checkout, "systems", "h100_80g_nvl8.json")

    def run(system: str) -> subprocess.CompletedProcess:
        command = [sys.executable, os.path.join(checkout, "bin", "calculon"), "llm", model, exe, system, out]
        return subprocess.run(command, cwd=checkout, env={**os.environ, "PYTHONPATH": checkout},
                              capture_output=True, text=True, timeout=300)

    done = run(system_path)
    refusal = ""
    if not os.path.exists(out):
        refusal = (done.stdout + done.stderr).strip().splitlines()[-1]
        with open(system_path) as f:
            system = json.load(f)
        system["mem1"]["GiB"] = 1024  # the time of the same layout, memory aside
        lifted = os.path.join(folder, "system_lifted.json")
        with open(lifted, "w") as f:
            json.dump(system, f)
        run(lifted)
    with open(out) as f:
        found = json.load(f)
    return {
        "tokens_per_s_per_gpu": found["sample_rate"] * SEQ / GPUS,
        "step_s": found["total_time"],
        "bubble_s": found["bubble_time"],
        "memory_gib": found["proc_mem_tier1_cap_req"] / GiB,
        "refused": refusal,
    }


def suggest_estimates() -> dict:
    import plancc
    from plancc.layout import Layout

    result = plancc.suggest(PLAN, "llama-3.1-405b", gpus=GPUS, seq_len=SEQ, tokens_per_step=TOKENS, allow=("pp",))
    published = Layout(dp=8, tp=8, pp=8)
    return {
        c.schedule: {
            "tokens_per_s_per_gpu": c.tokens_per_s / GPUS,
            "step_s": c.time.total,
            "bubble_s": c.time.pipeline,
            "memory_gib": c.memory.total / GiB,
        }
        for c in result.candidates
        if c.layout == published and c.checkpointing == "full" and c.reshard_after_forward
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calculon", required=True, help="a checkout of github.com/calculon-ai/calculon")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    ours = suggest_estimates()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for schedule, interleaving in (("1f1b", 1), ("interleaved_1f1b", 2)):
            theirs = calculon(args.calculon, interleaving, folder)
            rows.append({"schedule": schedule, "published": PUBLISHED[schedule], "suggest": ours[schedule],
                         "calculon": theirs})
    print("Llama 3.1 405B, 512 H100s, FSDP 8 x TP 8 x PP 8, 8192 x 128 sequences a step, full recompute")
    print(f"{'schedule':<18} {'published tok/s/GPU':>20} {'suggest':>9} {'calculon':>9}   "
          f"{'published GiB':>13} {'suggest':>8} {'calculon':>9}")
    for row in rows:
        tok, mem = row["published"]
        ours_row, theirs = row["suggest"], row["calculon"]
        note = f"   (calculon: {theirs['refused']})" if theirs["refused"] else ""
        print(f"{row['schedule']:<18} {tok:>20} {ours_row['tokens_per_s_per_gpu']:>9.1f} "
              f"{theirs['tokens_per_s_per_gpu']:>9.1f}   {mem:>13} {ours_row['memory_gib']:>8.1f} "
              f"{theirs['memory_gib']:>9.1f}{note}")
        print(f"{'':<18} {'ratio to published':>20} {ours_row['tokens_per_s_per_gpu'] / tok:>9.2f} "
              f"{theirs['tokens_per_s_per_gpu'] / tok:>9.2f}   bubble s: suggest {ours_row['bubble_s']:.2f}, "
              f"calculon {theirs['bubble_s']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
