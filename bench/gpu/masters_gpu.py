"""fp32 master weights from a bf16 checkpoint's config, on CUDA (issue 56; docs/gpu.md).

Run with ``torchrun --nproc-per-node 1 bench/gpu/masters_gpu.py``. Builds ``plancc.Policy`` from the
published qwen3-0.6b config (``dtype: bfloat16``, every real preset's), with bf16 compute
(FSDP2's ``param_dtype``) and AdamW at lr 1e-6, and reports side by side in one run:

- the dtypes of the parameters and of AdamW's state (fp32 masters whatever the config says);
- the share of weights one step changes: the Policy's fp32 masters against the same model built
  in the config's bf16 (what plancc did before) under the same AdamW step;
- the time of a step of each (not one loop: the Policy's step -- FSDP2 casts, global-norm clipping
  over DTensors, the log-prob path -- against a plain transformers loop; for scale only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.distributed.tensor import DTensor

from plancc import Policy
from plancc.models import build_model, load_config


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _batch(vocab: int, rows: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0)).cuda()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _nll(lp, mb, norm):
    mask = mb["attention_mask"].clone()
    mask[:, 0] = 0
    return -(lp * mask).sum() / norm.tokens


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    changed = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    return changed / sum(b.numel() for b in before)


def policy_side(config, batch, steps: int) -> dict:
    policy = Policy(
        "plans/qwen3.yaml",
        config,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
        param_dtype="bfloat16",
        device="cuda",
    )
    before = [_local(p).detach().clone() for p in policy.model.parameters()]
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        policy.train(batch, _nll)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    after = [_local(p).detach() for p in policy.model.parameters()]
    state = {str(_local(t).dtype) for s in policy.optimizer.state.values() for t in s.values() if t.dim()}
    return {
        "parameters": sorted({str(_local(p).dtype) for p in policy.model.parameters()}),
        "adamw_state": sorted(state),
        "changed_after_steps": _changed(before, after),
        "step_s": min(seconds[1:] or seconds),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def bf16_masters_side(config, batch, steps: int) -> dict:
    """The same model built in the config's dtype (bf16 weights and AdamW state), plain."""
    model = build_model(config, device="cuda")  # follows config.dtype: bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        logits = model(input_ids=batch["input_ids"]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    after = [p.detach() for p in model.parameters()]
    return {
        "parameters": sorted({str(p.dtype) for p in model.parameters()}),
        "adamw_state": sorted({str(t.dtype) for s in opt.state.values() for t in s.values() if t.dim()}),
        "changed_after_steps": _changed(before, after),
        "step_s": min(seconds[1:] or seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = load_config("qwen3-0.6b")
    assert config.dtype == torch.bfloat16
    batch = _batch(config.vocab_size, rows=4, seq=args.seq)
    result = {
        "model": "qwen3-0.6b (published config, dtype bfloat16; random weights)",
        "batch": f"4 x {args.seq}",
        "policy_fp32_masters_bf16_compute": policy_side(config, batch, args.steps),
        "bf16_masters_as_before": bf16_masters_side(config, batch, args.steps),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
