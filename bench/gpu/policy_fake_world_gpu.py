"""plancc.Policy's multi-rank CUDA paths on one GPU, in a fake world (as the dry run does).

    python bench/gpu/policy_fake_world_gpu.py [--out FILE.json]

One GPU cannot hold the ranks of a tp2 / cp2 / dp2 x tp2 / ep2 job, but every tensor plancc makes
on a rank can still be made on the device: this process is rank 0 of a fake process group
(torch's ``fake`` backend; every collective returns at once, all-gathers and all-to-alls copy
this rank's part), and it runs the real model code and the real engine on CUDA at the rank's
local shapes. What that finds is the class of bug the CPU suite cannot see: a tensor made on
the CPU beside CUDA neighbours (``Policy._check_slices`` raised in ``torch.stack`` at tp > 1
on CUDA until 2026-11-25), a CPU-only op on a path that runs at tp, cp or ep > 1.

The numbers are *not* meaningful (every peer's part is a copy of rank 0's); the numerics of the
same code at the same layouts are verified on gloo by the test suite. A call passes here when it
returns (or refuses a step as not finite, which the fake data may cause) and every parameter
and optimizer state is still on the device afterwards. Each case runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

CASES = {
    # a real world of one rank (nccl on CUDA): the only case where a checkpoint can be saved and
    # loaded -- DCP validates the union of every rank's plan, and fake ranks' plans are copies
    "one-rank": ("plans/qwen3.yaml", "tiny-qwen3", {}),
    "tp2": ("plans/qwen3.yaml", "tiny-qwen3", {"tp": 2}),
    "tp2-sp": ("plans/qwen3.yaml", "tiny-qwen3", {"tp": 2, "sequence_parallel": True}),
    "cp2": ("plans/qwen3.yaml", "tiny-qwen3", {"cp": 2}),
    "dp2xtp2": ("plans/qwen3.yaml", "tiny-qwen3", {"dp": 2, "tp": 2}),
    "cp2xtp2": ("plans/qwen3.yaml", "tiny-qwen3", {"cp": 2, "tp": 2}),
    "ep2": ("plans/qwen3_moe.yaml", "tiny-qwen3-moe", {"ep": 2, "dp": 2}),
    # LoRA adapters (issue 41): colwise and rowwise placements under tp, SP and FSDP on CUDA
    "one-rank-lora": ("plans/qwen3.yaml", "tiny-qwen3", {}),
    "tp2-sp-lora": ("plans/qwen3.yaml", "tiny-qwen3", {"tp": 2, "sequence_parallel": True}),
    "dp2xtp2-lora": ("plans/qwen3.yaml", "tiny-qwen3", {"dp": 2, "tp": 2}),
}
LORA = {
    "r": 4,
    "alpha": 8,
    "init_lora_weights": False,
    "targets": ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"],
}


def nll(lp, mb, norm):
    from plancc.engine.batches import default_token_mask

    mask = default_token_mask(mb["attention_mask"]).to(lp.dtype)
    return -(lp * mask).sum() / norm.tokens, {}


def grpo(lp, mb, norm):
    ratio = (lp - mb["old_logprobs"]).exp()
    adv = mb["advantages"][:, None]
    clipped = ratio.clamp(0.8, 1.2)
    mask = mb["token_mask"].to(lp.dtype)
    return -(torch_min(ratio * adv, clipped * adv) * mask).sum() / norm.tokens, {}


def grpo_tokens(lp, tokens, norm):
    """``grpo`` as per-token terms (``train(token_loss=)``: the 3-matmul lm_head)."""
    ratio = (lp - tokens["old_logprobs"]).exp()
    adv = tokens["advantages"]
    mask = tokens["token_mask"].to(lp.dtype)
    return -(torch_min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / norm.tokens


def torch_min(a, b):
    import torch

    return torch.minimum(a, b)


def _older_torch_shims() -> list[str]:
    """What the GPU machine's torch (2.11; the CUDA wheel of the pinned 2.13 is too large to carry
    there) lacks, filled in so the fake world runs the pinned code: ``all_gather_single`` and
    ``reduce_scatter_single`` (2.13's names of ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``), and an all-to-all on the fake backend that copies this
    rank's part into the output as 2.13's does (2.11's leaves the output unwritten, so the expert
    exchange reads garbage split sizes)."""
    import torch.distributed as dist

    shims = []
    if not hasattr(dist, "all_gather_single"):
        dist.all_gather_single = dist.all_gather_into_tensor
        shims.append("all_gather_single = all_gather_into_tensor")
    if not hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = dist.reduce_scatter_tensor
        shims.append("reduce_scatter_single = reduce_scatter_tensor")
    version = tuple(int(x) for x in __import__("torch").__version__.split(".")[:2])
    if version < (2, 13):
        original = dist.all_to_all_single

        def all_to_all_single(output, input, *args, **kwargs):
            work = original(output, input, *args, **kwargs)
            if output.shape == input.shape:
                output.copy_(input)
            return work

        dist.all_to_all_single = all_to_all_single
        shims.append("fake all_to_all_single copies its input")
    return shims


def run_case(name: str, device: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import plancc
    from plancc.engine.policy import NonFiniteError

    shims = _older_torch_shims()
    plan, model, sizes = CASES[name]
    layout = plancc.Layout(**sizes)
    fake = layout.world_size > 1
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    else:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if device == "cuda":
        torch.cuda.set_device(0)
    calls: dict[str, str] = {}
    lora = LORA if name.endswith("-lora") else None
    policy = plancc.Policy(plan, model, layout=layout, device=device, reference=True, lora=lora)
    vocab = policy.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows, seq = 4, 32
    lengths = torch.tensor([32, 9, 20, 5])
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": torch.randint(0, vocab, (rows, seq), generator=gen) * mask, "attention_mask": mask}

    def on_device() -> str:
        off = [n for n, p in policy.model.named_parameters() if p.device.type != device]
        off += [
            f"optimizer state of {i}"
            for i, s in enumerate(policy.optimizer.state.values())
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device.type != device
        ]
        return f"; off the device: {off[:3]}" if off else ""

    def call(label: str, fn) -> object:
        try:
            out = fn()
            calls[label] = "ok" + on_device()
            return out
        except NonFiniteError as exc:  # the fake world's numbers may diverge; the path still ran
            calls[label] = f"ok (refused as not finite: {str(exc)[:80]})" + on_device()
        except Exception as exc:  # noqa: BLE001 - the report names every failure
            last = traceback.extract_tb(exc.__traceback__)[-1]
            calls[label] = f"FAILED {type(exc).__name__}: {str(exc)[:300]} at {last.filename}:{last.lineno}"
        return None

    call("train padded", lambda: policy.train(batch, nll, micro_batch_size=2))
    call("train packed + budget", lambda: policy.train(batch, nll, max_tokens=48, pack=True))
    call(
        "train entropy + temperature",
        lambda: policy.train(batch, nll, micro_batch_size=4, entropy=True, temperature=0.7),
    )
    old = call("logprobs", lambda: policy.logprobs(batch, temperature=0.7))
    call("logprobs + entropy", lambda: policy.logprobs(batch, entropy=True, micro_batch_size=2))
    call("reference_logprobs", lambda: policy.reference_logprobs(batch, temperature=0.7))
    if isinstance(old, torch.Tensor):
        grpo_batch = {
            **batch,
            "old_logprobs": old.cpu(),
            "advantages": torch.tensor([1.0, -1.0, 0.5, 0.0]),
            "token_mask": plancc.engine.batches.default_token_mask(mask),
        }
        call("train grpo at temperature", lambda: policy.train(grpo_batch, grpo, micro_batch_size=2, temperature=0.7))
        call(
            "train token_loss grpo, packed, at temperature",
            lambda: policy.train(grpo_batch, token_loss=grpo_tokens, max_tokens=48, pack=True, temperature=0.7),
        )
        call("train token_loss padded", lambda: policy.train(grpo_batch, token_loss=grpo_tokens, micro_batch_size=2))
    call("weights()", lambda: sum(t.numel() for _, t in policy.weights(bucket_bytes=2**16)))
    if lora is not None:
        call("weights(adapters_only)", lambda: sum(t.numel() for _, t in policy.weights(adapters_only=True)))
    call("offload + onload", lambda: (policy.offload(), policy.onload()))
    call("train after onload", lambda: policy.train(batch, nll, micro_batch_size=2))
    with tempfile.TemporaryDirectory() as folder:
        if not fake:
            call("save", lambda: policy.save(os.path.join(folder, "ckpt")))
            call("load", lambda: policy.load(os.path.join(folder, "ckpt")))
        call("export_hf", lambda: policy.export_hf(os.path.join(folder, "hf")))
        if lora is not None:
            call("export_hf(adapters_only)", lambda: policy.export_hf(os.path.join(folder, "ad"), adapters_only=True))
    dist.destroy_process_group()
    return {"case": name, "layout": layout.describe(), "torch_shims": shims, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), help="only these (default: all)")
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.device)), flush=True)
        return
    import torch

    results = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cases": [],
    }
    for name in args.cases or CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name, "--device", args.device],
            capture_output=True,
            text=True,
            timeout=300,
        )
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = (
            json.loads(found[0]) if found else {"case": name, "crashed": proc.returncode, "stderr": proc.stderr[-2000:]}
        )
        results["cases"].append(result)
        print(json.dumps(result, indent=1), flush=True)
    failed = [
        c["case"]
        for c in results["cases"]
        if "crashed" in c or any(v.startswith("FAILED") for v in c["calls"].values())
    ]
    results["failed"] = failed
    print("fake-world CUDA cases failed:", failed or "none", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
