"""Bytes each rank receives when loading a Hugging Face folder into a parallelized model:
plancc's rank-0 read + per-rank slices vs torch's
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.

    python bench/loading.py [--nproc 4] [--tp 2]

Prints a table per rank and the ratio. Bytes are counted by wrapping the point-to-point and
broadcast calls both paths use (what arrives at a rank, not what it sends).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import init_gloo, launch  # noqa: E402

CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=8192, hidden_size=256,
              intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              head_dim=32, tie_word_embeddings=False)


def _count_received():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counter = {"bytes": 0}
    rank = dist.get_rank()
    orig_recv, orig_bcast = c10d.recv, c10d.broadcast

    def recv(tensor, *a, **k):
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return orig_recv(tensor, *a, **k)

    def broadcast(tensor, src=None, *a, **k):
        if rank != (src if src is not None else k.get("group_src", 0)):
            counter["bytes"] += tensor.numel() * tensor.element_size()
        return orig_bcast(tensor, src, *a, **k)

    for module in (dist, c10d):
        module.recv, module.broadcast = recv, broadcast
    return counter


def worker(folder, tp, method):
    import torch.distributed as dist

    import plancc
    from plancc.models import build_model, load_config
    from plancc.weights import load_hf_weights

    init_gloo()
    try:
        mesh = plancc.build_mesh(tp=tp, device_type="cpu")
        config = load_config(folder)
        model = build_model(config, device="meta")
        plancc.parallelize(model, plancc.load_plan("plans/qwen3.yaml"), mesh)
        plancc.materialize(model, "cpu")
        counter = _count_received()
        if method == "plancc":
            load_hf_weights(model, folder)
        else:
            from safetensors.torch import load_file
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = load_file(os.path.join(folder, "model.safetensors")) if dist.get_rank() == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=False))
        total = sum(p.numel() * p.element_size() for p in build_model(config, device="meta").parameters())
        return {"received": counter["bytes"], "model_bytes": total}
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    import torch
    from transformers import AutoConfig

    from plancc.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(CONFIG)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        build_model(config, device="cpu").save_pretrained(tmp)
        results = {m: launch(worker, args.nproc, tmp, args.tp, m) for m in ("plancc", "broadcast")}
    model_bytes = results["plancc"][0]["model_bytes"]
    print(f"model: {model_bytes / 2**20:.1f} MiB of parameters; {args.nproc} ranks, "
          f"dp={args.nproc // args.tp} x tp={args.tp} (FSDP over dp)")
    print(f"{'rank':>4}  {'plancc MiB':>11}  {'broadcast MiB':>13}  {'ratio':>6}")
    for rank in sorted(results["plancc"]):
        a, b = results["plancc"][rank]["received"], results["broadcast"][rank]["received"]
        print(f"{rank:>4}  {a / 2**20:>11.2f}  {b / 2**20:>13.2f}  {a / b if b else float('nan'):>6.3f}")


if __name__ == "__main__":
    main()
