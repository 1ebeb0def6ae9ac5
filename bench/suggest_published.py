"""``plancc suggest`` against published training runs (issue 42, points 3-5): for each run, the
layout suggest ranks first and its estimate, the published layout's own estimate and rank, and
the published throughput beside the estimate (the gap printed, not hidden); then the time of a
full search for a 70B-class model on 512 GPUs.

    python bench/suggest_published.py [--out docs/measurements/suggest_published.json]

Published runs: torchtitan's Llama 3.1 benchmarks (``benchmarks/llama3_h100_202412_torchtitan.md``
in pytorch/torchtitan: H100 SXM with 96 GB HBM2e at a 500 W power limit, 8 per host, 400 Gb/s per
GPU; bf16 with and without torch.compile / Float8 -- the rows without either where published).
Published configurations without a published figure, on their launcher's default 8 GPUs
(80 GB H100s): torchtitan's ``qwen3_30b_a3b`` (Qwen3 MoE, ``torchtitan/models/qwen3/config_registry.py``:
FSDP over every GPU, no TP, CP, PP or EP, full activation checkpointing, 2 x 4096 tokens per
rank) and ``deepseek_v3_16b`` (``torchtitan/models/deepseek_v3/config_registry.py``: FSDP 8 with
EP 8, selective activation checkpointing, 4 x 4096 tokens per rank). The 16B is torchtitan's
DeepSeek-V3 of DeepSeek-V2-Lite's sizes (its flavor "16B": 27 layers, the first dense, 64 routed
experts of which 6 per token and 2 shared, MLA without a query down projection); it has no
Hugging Face checkpoint, so the bench writes its sizes into the DeepSeek-V3 config
(``deepseek_v3_16b()``) and the plan's query rule onto ``q_proj`` (routing by sigmoid there,
softmax in torchtitan: neither memory nor FLOPs differ). torchtitan's ``deepseek_v3_671b`` names
no GPU count and runs pipeline parallelism in its published runs: pipeline parallelism is
outside what plancc runs or searches, so it is not here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "llama.yaml")
MOE_PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "qwen3_moe.yaml")
MLA_PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "deepseek_v3.yaml")
GiB = 2**30


def deepseek_v3_16b():
    """torchtitan's DeepSeek-V3 "16B" flavor, in the Hugging Face DeepSeek-V3 config."""
    from plancc.models import load_config

    config = load_config("deepseek-v3")
    config.vocab_size, config.hidden_size, config.intermediate_size = 102400, 2048, 10944
    config.moe_intermediate_size, config.num_hidden_layers, config.first_k_dense_replace = 1408, 27, 1
    config.num_attention_heads = config.num_key_value_heads = 16
    config.n_routed_experts, config.n_shared_experts, config.num_experts_per_tok = 64, 2, 6
    config.q_lora_rank, config.kv_lora_rank = None, 512
    config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim = 128, 64, 128
    config.n_group, config.topk_group, config.routed_scaling_factor = 1, 1, 1.0
    return config


def mla_plan_without_query_lora(folder: str) -> str:
    """The shipped DeepSeek-V3 plan with its query rule on ``q_proj`` (no ``q_lora_rank``: one
    per-head query projection in place of ``q_a_proj``/``q_b_proj``)."""
    with open(MLA_PLAN) as f:
        text = f.read().replace("self_attn.q_b_proj: colwise", "self_attn.q_proj: colwise")
    path = os.path.join(folder, "deepseek_v3_q_proj.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


MODELS = {"deepseek-v3-16b": deepseek_v3_16b}

# (what, model, gpus, seq_len, local batch (sequences per dp rank), published layout, its AC,
#  published tokens/s per GPU, published memory GiB (None: a configuration, no figure), note[, plan])
RUNS = [
    ("Llama 3.1 8B, 8 GPUs, FSDP (Table 1)", "llama-3.1-8b", 8, 8192, 2, {"dp": 8}, "plan", 5762, 82.4, "bf16, eager"),
    ("Llama 3.1 8B, 128 GPUs, FSDP (Table 3)", "llama-3.1-8b", 128, 8192, 2, {"dp": 128}, "plan", 5605, 67.0,
     "bf16, eager"),
    ("Llama 3.1 8B, 8 GPUs, FSDP 8, seq 32768 (Table 2)", "llama-3.1-8b", 8, 32768, 1, {"dp": 8}, "full", 3890, 83.9,
     "compile + Float8"),
    ("Llama 3.1 8B, 8 GPUs, FSDP 4 x CP 2, seq 65536 (Table 2)", "llama-3.1-8b", 8, 65536, 1, {"dp": 4, "cp": 2},
     "full", 2540, 84.2, "compile + Float8"),
    # torchtitan's TP always runs sequence parallelism (its norms sharded on the sequence)
    ("Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8 (Table 4)", "llama-3.1-70b", 256, 8192, 16,
     {"dp": 32, "tp": 8, "sequence_parallel": True}, "full", 829, 71.9, "compile + Float8"),
    ("Qwen3-30B-A3B, 8 GPUs, FSDP 8 (torchtitan's qwen3_30b_a3b config)", "qwen3-30b-a3b", 8, 4096, 2, {"dp": 8},
     "full", None, None, "a configuration: no published figure", MOE_PLAN),
    # torchtitan's selective (per-op) checkpointing has no counterpart here: the plan's (each MLP) is
    # the nearest, and "full" is printed beside it
    ("DeepSeek-V3 16B, 8 GPUs, FSDP 8 x EP 8 (torchtitan's deepseek_v3_16b config)", "deepseek-v3-16b", 8, 4096, 4,
     {"dp": 8, "ep": 8}, "plan", None, None, "a configuration: no published figure", "MLA"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import plancc
    from plancc.layout import Layout
    from plancc.tools.suggest import HARDWARE

    # their H100s: 96 GB, and a 500 W limit (peak unknown, below the 700 W SXM's: the table's)
    hardware = HARDWARE["h100"]
    rows = []
    folder = tempfile.mkdtemp(prefix="suggest-published-")
    for what, model, gpus, seq, local, layout, ac, tps, memory, note, *rest in RUNS:
        config = MODELS[model]() if model in MODELS else model
        published = Layout(**layout)
        tokens = published.dp * local * seq
        plan = rest[0] if rest else PLAN
        plan = mla_plan_without_query_lora(folder) if plan == "MLA" else plan
        costing = dict(
            gpus=gpus,
            seq_len=seq,
            tokens_per_step=tokens,
            hardware=hardware,
            # torchtitan's benchmark H100s have 96 GB; a configuration is costed on the table's 80 GiB
            gpu_memory=96 * 10**9 if tps else None,
            allow=("sp", "cp") if plan == PLAN else ("sp", "cp", "ep"),
        )
        # like for like: each published run is one pass over its local batch
        result = plancc.suggest(plan, config, accumulate=False, **costing)
        accumulating = plancc.suggest(plan, config, **costing).best
        # torchtitan reshards after forward (its default for runs without pipeline parallelism)
        theirs = [
            c
            for c in result.candidates
            if c.layout == published and c.checkpointing == ac and c.reshard_after_forward
        ]
        mine = theirs[0] if theirs else None
        rank = result.candidates.index(mine) + 1 if mine else None
        # the published layout under full checkpointing too, where its own is not
        fully = [
            c
            for c in result.candidates
            if c.layout == published and c.checkpointing == "full" and c.reshard_after_forward
        ]
        full = fully[0] if fully and ac != "full" else None
        best = result.best
        row = {
            "run": what,
            "note": note,
            "published_layout": published.describe(),
            "published_ac": ac,
            "published_tps_per_gpu": tps,
            "published_memory_gib": memory,
            "estimate_published_layout": None
            if mine is None
            else {
                "rank": rank,
                "tps_per_gpu": mine.tokens_per_s / gpus,
                "memory_gib": mine.memory.total / GiB,
                "fits": mine.fits,
            },
            "estimate_published_layout_full_ac": None
            if full is None
            else {
                "rank": result.candidates.index(full) + 1,
                "tps_per_gpu": full.tokens_per_s / gpus,
                "memory_gib": full.memory.total / GiB,
                "fits": full.fits,
            },
            "best_with_accumulation": None
            if accumulating is None
            else {
                "layout": accumulating.describe(),
                "tps_per_gpu": accumulating.tokens_per_s / gpus,
                "memory_gib": accumulating.memory.total / GiB,
            },
            "best": None
            if best is None
            else {
                "layout": best.describe(),
                "tps_per_gpu": best.tokens_per_s / gpus,
                "memory_gib": best.memory.total / GiB,
            },
        }
        rows.append(row)
        est = row["estimate_published_layout"]
        print(what, f"[{note}]")
        figures = f"{tps:,} tokens/s/GPU, {memory} GiB" if tps else "no published figure"
        print(f"  published {published.describe()} ac={ac}: {figures}")
        if est:
            vs = f" ({est['tps_per_gpu'] / tps:.2f}x published)" if tps else ""
            print(
                f"  estimate of it: rank {est['rank']} of {len(result.candidates)}, "
                f"{est['tps_per_gpu']:,.0f} tokens/s/GPU{vs}, {est['memory_gib']:.1f} GiB, fits {est['fits']}"
            )
        if full is not None:
            print(f"  with full checkpointing: rank {result.candidates.index(full) + 1}, "
                  f"{full.tokens_per_s / gpus:,.0f} tokens/s/GPU, {full.memory.total / GiB:.1f} GiB")  # fmt: skip
        if best:
            print(f"  suggest's best: {best.describe()}: {best.tokens_per_s / gpus:,.0f} tokens/s/GPU, "
                  f"{best.memory.total / GiB:.1f} GiB")  # fmt: skip
        if accumulating is not None and accumulating.microbatches > 1:
            print(f"  with gradient accumulation allowed: {accumulating.describe()}: "
                  f"{accumulating.tokens_per_s / gpus:,.0f} tokens/s/GPU, {accumulating.memory.total / GiB:.1f} GiB")  # fmt: skip
    started = time.perf_counter()
    search = plancc.suggest(PLAN, "llama-3.1-70b", gpus=512, seq_len=8192, allow=("sp", "cp"))
    seconds = time.perf_counter() - started
    costed, refused = len(search.candidates), len(search.rejected)
    print(f"search: Llama 70B on 512 GPUs, {costed} costed, {refused} refused: {seconds:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": rows, "search_70b_512_seconds": seconds}, f, indent=1)


if __name__ == "__main__":
    main()
