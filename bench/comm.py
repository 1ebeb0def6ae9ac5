"""Bytes on the wire per decoder layer, per rank, at real model sizes: plancc before the
block-input styles, plancc now, and torchtitan's llama3 pattern, side by side in one run.

    python bench/comm.py [--tp 2 4 8] [--seq-len 4096] [--only qwen3 llama]

Each figure comes from the dry run's collective counter (a fake process group and fake
tensors: the code a job runs, without the wire) on one decoder layer of the published config
(``plancc.tools.dryrun.layer_traffic``), batch 1, fp32 activations as FSDP's fp32 training
sends them (bf16 halves every figure alike). Columns, forward / backward MiB:

- ``before``: the shipped plan as it was (no ``shared_input``; ``gather_seq_input`` handing each
  projection a local tensor, so each all-reduced its own input gradient);
- ``now``: the shipped plan;
- ``torchtitan`` (dense models, SP): torchtitan's llama3 ``parallelize`` styles written with
  torch's classes on the Hugging Face module names (``PrepareModuleInput`` keeping a
  replicated DTensor on each block, colwise q/k/v and w1/w3, rowwise to ``Shard(1)``, SP
  norms, a sequence-sharded embedding and a vocab-parallel output), applied by hand.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PLANS = Path(__file__).resolve().parent.parent / "plans"
# shipped plan -> a published config it serves (gemma-3-1b has one KV head: no tp > 1)
MODELS = {
    "qwen3": "qwen3-8b",
    "llama": "llama-3.1-8b",
    "phi3": "phi-3-mini-4k",
    "qwen3_moe": "qwen3-30b-a3b",
    "mixtral": "mixtral-8x7b",
    "deepseek_v3": "deepseek-v3",
    "gpt_oss": "gpt-oss-120b",
}
DENSE = ("qwen3", "llama")
MIB = 2**20


def old_styles(text: str) -> str:
    """The plan as it was before the block-input styles (tests/test_communication.py too)."""
    lines = [line for line in text.splitlines() if ": shared_input" not in line]
    text = "\n".join(lines) + "\n"
    text = text.replace(": gather_seq_input", ": {style: gather_seq_input, use_local_output: true}")
    return text.replace("{style: per_head_params, input_layouts: replicate}", "per_head_params")


def torchtitan_layer(config, tp: int, seq_len: int):
    """One layer's traffic under torchtitan's llama3 TP+SP styles, applied by hand."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plancc.layout import Layout
    from plancc.models import build_model
    from plancc.runtime.collectives import CountCollectives, mesh_axes
    from plancc.runtime.hooks import GlobalSequenceInputs
    from plancc.runtime.mesh import build_mesh

    def traffic(layers: int):
        model = build_model(copy.deepcopy(config), device="meta", dtype=torch.float32)
        model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:layers])
        mesh = build_mesh(Layout(tp=tp), device_type="cpu")
        block = {"hidden_states": Shard(1)}, {"hidden_states": Replicate()}
        styles = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.self_attn": PrepareModuleInput(
                input_kwarg_layouts=block[0], desired_input_kwarg_layouts=block[1], use_local_output=False
            ),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        if hasattr(model.model.layers[0].self_attn, "q_norm"):  # Qwen3: per-head norms, weights replicated
            styles["model.layers.*.self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            styles["model.layers.*.self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(model, mesh["tp"], styles)
        # global positions and masks for the sequence shards (what torchtitan's own model computes)
        model.model.register_forward_pre_hook(GlobalSequenceInputs(model.model), with_kwargs=True)
        counter = CountCollectives(mesh_axes(mesh))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            ids = torch.randint(0, config.vocab_size, (1, seq_len))
            with counter:
                logits = model(input_ids=ids, use_cache=False).logits
                counter.phase = "backward"
                logits.to_local().float().sum().backward()
        return counter.traffic()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        return traffic(2).minus(traffic(1))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--only", nargs="*", help="shipped plan names (default: all with a published config)")
    args = parser.parse_args()

    import plancc
    from plancc.models import load_config
    from plancc.tools.dryrun import layer_traffic

    def mib(traffic, phase: str) -> float:
        return traffic.wire_bytes(phase) / MIB

    folder = Path(tempfile.mkdtemp(prefix="plancc-comm-"))
    print(f"bytes on the wire per rank, one decoder layer, batch 1 x {args.seq_len} tokens, fp32; forward / backward MiB")
    print(f"{'plan':12} {'model':15} {'tp':>3} {'sp':3} {'before':>17} {'now':>17} {'torchtitan':>17} {'now/before bwd':>15}")
    for name, preset in MODELS.items():
        if args.only and name not in args.only:
            continue
        plan = plancc.load_plan(PLANS / f"{name}.yaml")
        old_path = folder / f"{name}.yaml"
        old_path.write_text(old_styles((PLANS / f"{name}.yaml").read_text()))
        old = plancc.load_plan(old_path)
        config = load_config(preset)
        for tp in args.tp:
            for sp in (False, True) if plan.sequence_parallel else (False,):
                layout = plancc.Layout(tp=tp, sequence_parallel=sp)
                refused = sorted({d.rule for d in plancc.check_plan(plan, config, layout) if d.is_error})
                if refused:  # e.g. qwen3-30b-a3b's 4 KV heads at tp=8
                    print(f"{name:12} {preset:15} {tp:>3} {'yes' if sp else 'no':3} refused by validate: {refused}")
                    continue
                now = layer_traffic(plan, config, layout, seq_len=args.seq_len).layer
                before = layer_traffic(old, config, layout, seq_len=args.seq_len).layer
                titan = torchtitan_layer(config, tp, args.seq_len) if sp and name in DENSE else None
                cells = [f"{mib(t, 'forward'):7.1f} / {mib(t, 'backward'):7.1f}" for t in (before, now)]
                cells.append(f"{mib(titan, 'forward'):7.1f} / {mib(titan, 'backward'):7.1f}" if titan else "-")
                ratio = mib(now, "backward") / max(mib(before, "backward"), 1e-9)
                print(f"{name:12} {preset:15} {tp:>3} {'yes' if sp else 'no':3} {cells[0]:>17} {cells[1]:>17} "
                      f"{cells[2]:>17} {ratio:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
