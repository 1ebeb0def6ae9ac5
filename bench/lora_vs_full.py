"""LoRA against full fine-tuning (issue 41, point 7): per-rank bytes of parameters, gradients
and optimizer state -- ``plancc explain``'s estimate and what a ``Policy`` holds -- the step time
side by side, and what ``reference=True`` costs in each.

    torchrun --nproc-per-node 1 bench/lora_vs_full.py [--model qwen3-0.6b] [--layers N]
        [--device cpu|cuda] [--rows 4] [--seq 256] [--steps 3] [--r 16] [--out result.json]

Both policies are built from the same plan and seed in one process (one rank); the steps
alternate full, LoRA, LoRA, full, ... on the same batches (the NLL as a token loss, AdamW).
LoRA adapts every attention and MLP projection. Device memory on CUDA: ``torch.cuda``'s
allocated bytes before and after building each policy with ``reference=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PLAN = os.path.join(os.path.dirname(__file__), "..", "plans", "qwen3.yaml")
TARGETS = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]


def held_bytes(policy) -> dict:
    """What the policy holds on this rank after a step: parameters, the gradients the optimizer
    stepped on (taken by a step pre-hook: the step sets them to None), its state, the reference."""
    import torch

    params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for s in policy.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    reference = sum(t.numel() * t.element_size() for t in policy._reference or [])
    return {"parameters": params, "optimizer_state": state, "reference_copy": reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (a quicker CPU run)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="param_dtype, e.g. bfloat16")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    import plancc
    from plancc.checks.report import validate_plan
    from plancc.compiler.lora_spec import LoraSpec
    from plancc.engine.losses import token_nll
    from plancc.models import load_config
    from plancc.tools.explain import explain

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config(args.model)
    # fp32 master weights (what plancc explain counts; the preset's config says bf16, which a
    # Policy would keep as the master weights), bf16 compute with --dtype bfloat16
    config.dtype = torch.float32
    if args.layers:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: args.layers]
    lora = {"r": args.r, "alpha": 2 * args.r, "targets": TARGETS}
    result: dict = {"model": args.model, "layers": config.num_hidden_layers, "device": device, "r": args.r}
    policies, grads = {}, {}
    for way, spec in (("full", None), ("lora", lora)):
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        policy = plancc.Policy(
            PLAN,
            config,
            device=device,
            lora=spec,
            reference=True,
            param_dtype=args.dtype,
            optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
        )
        if device == "cuda":
            torch.cuda.synchronize()
            result[f"{way}_device_bytes_built"] = torch.cuda.memory_allocated() - before

        def hold(optimizer, a, k, way=way, policy=policy):
            grads[way] = sum(
                p.grad.numel() * p.grad.element_size() for p in policy.model.parameters() if p.grad is not None
            )

        policy.optimizer.register_step_pre_hook(hold)
        policies[way] = policy
        report = validate_plan(PLAN, model=config, skeleton=False, world_size=1)
        exp = explain(report.meta_model, report.resolved_for(False), report.layout, lora=LoraSpec.of(spec))
        result[f"{way}_explain"] = {
            "parameters": exp.param_bytes,
            "gradients": exp.grad_bytes,
            "adamw_state": exp.optimizer_bytes,
        }
    gen = torch.Generator().manual_seed(0)
    times: dict = {"full": [], "lora": []}
    for step in range(args.steps + 1):
        batch = {
            "input_ids": torch.randint(0, config.vocab_size, (args.rows, args.seq), generator=gen),
            "attention_mask": torch.ones(args.rows, args.seq, dtype=torch.long),
        }
        for way in ("full", "lora") if step % 2 == 0 else ("lora", "full"):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            policies[way].train(batch, token_loss=token_nll)
            if device == "cuda":
                torch.cuda.synchronize()
            if step > 0:  # the first: warm-up
                times[way].append(time.perf_counter() - started)
    for way in ("full", "lora"):
        held = held_bytes(policies[way])
        result[way] = {**held, "gradients": grads[way], "step_s": statistics.median(times[way])}
    ratio = result["lora"]["step_s"] / result["full"]["step_s"]
    result["lora_over_full_step"] = ratio
    print(json.dumps(result, indent=1))

    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    for way in ("full", "lora"):
        r, e = result[way], result[f"{way}_explain"]
        print(
            f"{way:5s} params {mib(r['parameters'])} (explain {mib(e['parameters'])})  grads {mib(r['gradients'])} "
            f"(explain {mib(e['gradients'])})  AdamW {mib(r['optimizer_state'])} (explain {mib(e['adamw_state'])})  "
            f"reference copy {mib(r['reference_copy'])}  step {r['step_s']:.3f} s"
        )
    print(f"LoRA step / full step: {ratio:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
