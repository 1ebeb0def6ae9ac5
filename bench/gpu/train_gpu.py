"""``Policy.train`` on one GPU against a hand-written loop, packed documents in bf16 (issue 40,
point 6): tokens/s and MFU, side by side in one process, steps alternating between the ways.

    torchrun --nproc-per-node 1 bench/gpu/train_gpu.py [--model qwen3-0.6b] [--tokens 16384] [--steps 4]

The ways, each training the same model (random weights, bf16 parameters, AdamW) on the same
batches -- documents whose lengths are drawn log-normally between 64 and 4096 tokens, packed
into microbatches of ``--tokens`` tokens, two microbatches per step:

- ``policy token_loss``: ``Policy.train(batch, token_loss=token_nll, max_tokens=, pack=True)``, the
  NLL through the 3-matmul fused lm_head;
- ``policy loss_fn``: the same with ``loss_fn`` (log-probs handed to the loss: 4 matmuls);
- ``hand + liger``: transformers' model called on the packed row (position ids restarting per
  document), Liger's ``LigerFusedLinearCrossEntropyLoss`` on the last hidden states, backward,
  clip, AdamW -- what an SFT loop without plancc writes; the MLPs checkpointed as the plan does
  (``activation_checkpointing: [model.layers.*.mlp]``), so both recompute the same.

MFU counts the model's matmul FLOPs (6 x matmul parameters x tokens, the lm_head included, plus
causal attention 6 x heads x head_dim x sum(len^2) per layer), not the recomputation. Then the
peak memory and time of one packed microbatch of ``--long`` tokens through ``Policy.train``,
attending per document (plancc's default) and under transformers' dense block-diagonal mask
(the reference path). Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def nll(lp, mb, norm):
    from plancc.engine.batches import default_token_mask

    return -(lp * default_token_mask(mb["attention_mask"]).to(lp.dtype)).sum() / norm.tokens, {}


def documents(total: int, vocab: int, gen) -> list:
    import torch

    docs, used = [], 0
    while used < total:
        length = int(torch.exp(torch.randn((), generator=gen) * 1.0 + 6.5).clamp(64, 4096))
        length = min(length, total - used)
        if length < 2:
            break
        docs.append(torch.randint(0, vocab, (length,), generator=gen))
        used += length
    return docs


def as_batch(docs: list) -> dict:
    import torch

    width = max(len(d) for d in docs)
    ids = torch.zeros((len(docs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, d in enumerate(docs):
        ids[r, : len(d)], mask[r, : len(d)] = d, 1
    return {"input_ids": ids, "attention_mask": mask}


def model_flops(model, lengths: list[int]) -> float:
    """The matmul FLOPs of a training step over causal documents of these lengths."""
    import torch

    config = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_layer = config.num_attention_heads * config.head_dim
    attention = 6 * config.num_hidden_layers * per_layer * sum(n**2 for n in lengths)
    return 6.0 * matmul * sum(lengths) + attention


class HandLoop:
    """transformers + Liger's fused linear cross-entropy, packed rows, MLPs checkpointed."""

    def __init__(self, model_name: str, state: dict, lr: float):
        import torch
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        from plancc.models import build_model, load_config

        self.model = build_model(load_config(model_name), device="cuda").to(torch.bfloat16)
        self.model.load_state_dict(state, strict=False)
        self.model.tie_weights()
        for layer in self.model.model.layers:
            layer.mlp = checkpoint_wrapper(layer.mlp)
        self.model.train()
        self.loss = LigerFusedLinearCrossEntropyLoss()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, microbatches: list[list]) -> float:
        import torch

        tokens = sum(sum(len(d) for d in mb) for mb in microbatches)
        total = 0.0
        for docs in microbatches:
            ids = torch.cat(docs).cuda()[None]
            positions = torch.cat([torch.arange(len(d)) for d in docs]).cuda()[None]
            labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs]).cuda()
            hidden = self.model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            # a sum over the tokens, divided by the step's count: the global token mean
            loss = self.loss(self.model.lm_head.weight, hidden.view(-1, hidden.shape[-1]), labels)
            predicted = int((labels != -100).sum())
            (loss * predicted / (tokens - len(docs))).backward()
            total += float(loss.detach()) * predicted
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / (tokens - sum(len(mb) for mb in microbatches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per packed microbatch")
    parser.add_argument("--long", type=int, default=32768, help="tokens of the one-microbatch memory probe")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per way (after two warm-ups)")
    parser.add_argument("--profile", action="store_true", help="one profiled step of each policy way")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    import plancc
    from plancc.engine.losses import token_nll
    from plancc.runtime.document_attention import set_documents

    lr = 1e-6
    policy = plancc.Policy(
        "plans/qwen3.yaml",
        args.model,
        device="cuda",
        param_dtype="bfloat16",
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": lr}},
    )
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in policy.model.state_dict().items()}
    ways: dict = {"policy token_loss": None, "policy loss_fn": None}
    try:
        ways["hand + liger"] = HandLoop(args.model, state, lr)
    except ImportError as exc:
        print(f"hand + liger: not run ({exc})")
    del state
    vocab = policy.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    times: dict = {name: [] for name in ways}
    losses: dict = {name: [] for name in ways}
    memory: dict = {}
    flops = []
    for step in range(args.steps + 2):
        microbatches = [documents(args.tokens, vocab, gen) for _ in range(2)]
        docs = [d for mb in microbatches for d in mb]
        flops.append(model_flops(policy.model, [len(d) for d in docs]))
        batch = as_batch(docs)
        order = list(ways) if step % 2 == 0 else list(reversed(ways))
        for name in order:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            if name == "policy token_loss":
                loss = policy.train(batch, token_loss=token_nll, max_tokens=args.tokens, pack=True)["loss"]
            elif name == "policy loss_fn":
                loss = policy.train(batch, nll, max_tokens=args.tokens, pack=True)["loss"]
            else:
                loss = ways[name].step(microbatches)
            torch.cuda.synchronize()
            if step >= 2:
                times[name].append(time.perf_counter() - started)
                losses[name].append(loss)
                memory[name] = max(memory.get(name, 0), torch.cuda.max_memory_allocated() / 2**30)
    tokens = 2 * args.tokens
    result: dict = {"device": device, "torch": torch.__version__, "model": args.model, "tokens_per_step": tokens}
    print(f"{args.model} bf16 on {device}: packed microbatches of {args.tokens} tokens, 2 per step")
    base = statistics.median(times["hand + liger"]) if "hand + liger" in times else None
    for name in ways:
        median = statistics.median(times[name])
        mfu = statistics.median(flops[2:]) / median / peak if peak else float("nan")
        vs = f"x{base / median:.2f} of hand" if base else ""
        print(
            f"  {name:18s} {tokens / median:10,.0f} tokens/s  MFU {mfu:6.1%}  peak {memory[name]:6.1f} GiB  {vs}"
            f"  losses {[round(x, 4) for x in losses[name]]}"
        )
        result[name] = {"tokens_per_s": tokens / median, "mfu": mfu, "peak_gib": memory[name], "losses": losses[name]}
    if args.profile:  # where a policy step's time goes: the device busy, or waiting on the host
        from torch.profiler import ProfilerActivity, profile

        microbatches = [documents(args.tokens, vocab, gen) for _ in range(2)]
        batch = as_batch([d for mb in microbatches for d in mb])
        for name, kwargs in (("token_loss", {"token_loss": token_nll}), ("loss_fn", {"loss_fn": nll})):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                started = time.perf_counter()
                policy.train(batch, max_tokens=args.tokens, pack=True, **kwargs)
                torch.cuda.synchronize()
                wall = time.perf_counter() - started
            events = prof.key_averages()
            busy = sum(e.self_device_time_total for e in events) / 1e6
            print(f"  profile {name}: wall {wall:.2f} s, device busy {busy:.2f} s")
            top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
            for e in top:
                print(f"    {e.self_device_time_total / 1e3:9.1f} ms  x{e.count:<5d} {e.key[:90]}")
            result[f"profile_{name}"] = {"wall_s": wall, "device_busy_s": busy}
    ways.clear()  # the hand model's memory back before the probe
    torch.cuda.empty_cache()
    long_docs = documents(args.long, vocab, gen)
    long_batch = as_batch(long_docs)
    total = sum(len(d) for d in long_docs)
    for way in ("documents", "dense"):
        if way == "dense":  # transformers' block-diagonal [T, T] mask: the reference path
            set_documents(policy.model, None)  # no documents for the attention
            policy.model.__dict__.pop("_plancc_documents", None)  # and none set from now on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**30
        started = time.perf_counter()
        try:
            loss = policy.train(long_batch, token_loss=token_nll, max_tokens=args.long, pack=True)["loss"]
        except torch.cuda.OutOfMemoryError:  # the dense mask's [T, T] scores need more than the card has
            capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
            print(f"  one packed microbatch of {total} tokens, {way}: out of memory on a {capacity:.0f} GiB card")
            result[f"long_microbatch_{way}"] = {"tokens": total, "out_of_memory_gib": capacity}
            break
        torch.cuda.synchronize()
        probe = {
            "tokens": total,
            "documents": len(long_docs),
            "seconds": time.perf_counter() - started,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "resident_gib": before,
            "loss": loss,
        }
        print(
            f"  one packed microbatch of {total} tokens ({len(long_docs)} documents), {way}: peak "
            f"{probe['peak_gib']:.1f} GiB (resident {before:.1f}), {probe['seconds']:.2f} s, loss {loss:.6f}"
        )
        result[f"long_microbatch_{way}"] = probe
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
