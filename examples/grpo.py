"""GRPO on a tiny model on CPU, end to end: a parallelized policy (plancc.Policy) with a frozen
reference, rollouts sampled by an unsharded Hugging Face model in another process that receives
the policy's weights over a weight channel after every step, group-normalized advantages, and
the clipped objective with a KL term. The reward is verifiable: the share of sampled tokens that
lie in the lower half of the vocabulary (a random model scores about 0.5; a trained one 1.0).

    python examples/grpo.py [--steps 16] [--nproc 2] [--tp 1] [--metrics grpo.jsonl]
    plancc plot grpo.jsonl --out grpo.png
    python examples/grpo.py --rollout vllm [--vllm-python .venv-vllm/bin/python] [--vllm-tp 2]

With ``--rollout vllm`` the samples are a real vLLM's (``plancc.engine.vllm_rollout``, from the
environment ``scripts/vllm_env.sh`` builds): the policy refits it every step through vLLM's
weight-transfer protocol (each vLLM worker its own shard), and each step also logs the refit's
time, the bytes per vLLM worker and the policy's agreement with vLLM's log-probs of its samples.
The model is tiny-qwen3 with heads of 64 (vLLM's CPU attention refuses 16).

The policy runs on ``--nproc`` ranks started by torch's elastic launcher (torchrun's machinery);
the rollout engine is one more process. All of them are forked from one server that imported
torch, transformers and plancc once (a process started afresh imports them again: seconds of CPU
each). Each step:

1. the policy's rank 0 sends the weights over the channel (bucket by bucket); the rollout engine
   loads them (``load_state_dict`` of what arrives: the names are Hugging Face's);
2. the engine samples ``--group`` responses for each of ``--prompts`` prompts and sends the
   token ids back over the same channel;
3. every policy rank takes its dp slice, computes the old log-probs (the policy's) and the
   reference's, the rewards and the group-normalized advantages, and calls ``Policy.train``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

PLAN = os.path.join(HERE, "..", "plans", "qwen3.yaml")
MODEL = "tiny-qwen3"
PROMPT_LEN = 4
RESPONSE_LEN = 6


# ----------------------------------------------------------------------------- the task
def reward(responses, vocab):
    """The share of each response's tokens in the lower half of the vocabulary: [rows]."""
    return (responses < vocab // 2).float().mean(1)


def grpo_loss(lp, tokens, norm, eps=0.2, beta=0.02):
    """The clipped surrogate with group-normalized advantages and a k3 KL to the reference,
    a token mean over the global batch (``norm.tokens``). A sum of per-token terms, so the
    policy trains it as ``token_loss``: ``lp`` and every field come per token (``advantages``,
    a per-row field, at each token's row), and the lm_head costs 3 matmuls, not 4."""
    import torch

    mask = tokens["token_mask"].float()
    ratio = torch.exp(lp - tokens["old_logprobs"])
    adv = tokens["advantages"]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    delta = tokens["ref_logprobs"] - lp
    kl = torch.exp(delta) - delta - 1
    loss = ((beta * kl - surrogate) * mask).sum() / norm.tokens
    return loss, {"kl_sum": (kl.detach() * mask).sum()}  # summed where it is, read once per step


# ----------------------------------------------------------------------------- rollout engine
def rollout(args) -> int:
    """The rollout engine: an unsharded model that takes the policy's weights every step."""
    import torch

    import plancc
    from plancc.models import build_model, load_config

    torch.set_num_threads(1)
    config = load_config(MODEL)
    model = build_model(config, device="cpu").eval()  # its weights come over the channel
    manifest = _wait_for_file(args.manifest)
    channel = plancc.weight_channel("127.0.0.1", args.port, rank=1, world_size=2, backend="gloo", timeout=120)
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = args.prompts * args.group
    for _ in range(args.steps):
        with torch.no_grad():
            received = {name: tensor.clone() for name, tensor in plancc.receive_weights(channel, manifest)}
            missing, unexpected = model.load_state_dict(received, strict=False)
            assert not unexpected, unexpected
            model.tie_weights()
            prompts = torch.randint(0, config.vocab_size, (args.prompts, PROMPT_LEN), generator=gen)
            ids = prompts.repeat_interleave(args.group, dim=0)
            for _ in range(RESPONSE_LEN):
                logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
                token = torch.multinomial(torch.softmax(logits / args.temperature, -1), 1, generator=gen)
                ids = torch.cat([ids, token], dim=1)
        channel.broadcast(ids.contiguous(), "rollouts", root=1)
        assert ids.shape == (rows, PROMPT_LEN + RESPONSE_LEN)
    channel.close()
    return 0


def _wait_for_file(path: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise SystemExit(f"rollout: no manifest at {path} within {timeout:g}s") from None
            time.sleep(0.1)


LORA_TARGETS = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]


def vllm_config():
    """tiny-qwen3 with heads of 64, which vLLM's CPU attention takes."""
    from plancc.models import load_config

    config = load_config(MODEL)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 128, 4, 2, 64
    return config


def vllm_samples(args, rollout, policy, step, gen) -> tuple:
    """One step's rollouts from vLLM: refit to this step's weights, sample, and check the policy's
    log-probs of the samples against vLLM's. (token ids [rows, prompt + response], the step's
    rollout metrics)."""
    import torch

    from plancc.engine.vllm_rollout import agreement

    refit = rollout.refit(policy, version=str(step))
    prompts = torch.randint(0, policy.config.vocab_size, (args.prompts, PROMPT_LEN), generator=gen).tolist()
    samples = rollout.generate(prompts, n=args.group, max_tokens=RESPONSE_LEN, temperature=args.temperature,
                               seed=args.seed + step, ignore_eos=True)
    ids = torch.tensor([prompts[c["prompt"]] + c["token_ids"] for c in samples])
    metrics = {"refit_s": refit["seconds"], "bytes_per_vllm_worker": max(refit["bytes_per_worker"])}
    metrics.update(agreement(policy, prompts, samples))
    bound = args.max_logprob_diff
    if bound is not None and metrics["rollout_logprob_max_abs_diff"] > bound:
        raise SystemExit(
            f"step {step}: the policy's log-probs of vLLM's samples differ from vLLM's by up to "
            f"{metrics['rollout_logprob_max_abs_diff']:.3g} (> --max-logprob-diff {bound:g}): the refit or the "
            "two models' numerics disagree"
        )
    return ids, metrics


# ----------------------------------------------------------------------------- policy
def policy_rank(args) -> list[dict]:
    """One rank of the policy: the GRPO loop. Rank 0 returns the per-step metrics."""
    import torch
    import torch.distributed as dist

    import plancc

    # --lora R: adapters on every projection train instead of the whole model; the frozen base
    # is the reference (no second copy), and the rollout still receives merged weights
    lora = {"r": args.lora, "alpha": 2 * args.lora, "targets": LORA_TARGETS} if args.lora else None
    policy = plancc.Policy(
        PLAN,
        vllm_config() if args.rollout == "vllm" else MODEL,
        layout=plancc.Layout.infer(world_size=dist.get_world_size(), tp=args.tp),  # the other ranks: dp
        reference=True,
        lora=lora,
        seed=args.seed,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": args.lora_lr if args.lora else args.lr}},
    )
    vocab = policy.config.vocab_size
    rank0 = dist.get_rank() == 0
    channel = rollout = None
    if args.rollout == "vllm":
        from plancc.engine.vllm_rollout import VLLMRollout, VLLMSpec

        rollout = VLLMRollout(VLLMSpec(python=args.vllm_python, tensor_parallel_size=args.vllm_tp), policy.config)
    elif rank0:
        manifest = policy.weights_manifest(bucket_bytes=1 << 20)
        with open(args.manifest + ".tmp", "w") as f:
            json.dump(manifest, f)
        os.replace(args.manifest + ".tmp", args.manifest)
        channel = plancc.weight_channel("127.0.0.1", args.port, rank=0, world_size=2, backend="gloo", timeout=120)
    rows = args.prompts * args.group
    history = []
    gen = torch.Generator().manual_seed(args.seed + 1)  # vLLM's prompts: the same on every rank
    for step in range(1, args.steps + 1):
        extra: dict = {}
        if rollout is not None:
            ids, extra = vllm_samples(args, rollout, policy, step, gen)
        else:
            policy.send_weights(channel, bucket_bytes=1 << 20)
            ids = torch.zeros((rows, PROMPT_LEN + RESPONSE_LEN), dtype=torch.long)
            if channel is not None:
                channel.broadcast(ids, "rollouts", root=1)
            dist.broadcast(ids, src=0)  # to every policy rank
        rewards = reward(ids[:, PROMPT_LEN:], vocab)
        grouped = rewards.view(args.prompts, args.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        token_mask = torch.zeros_like(ids, dtype=torch.bool)
        token_mask[:, PROMPT_LEN:] = True  # the response tokens are trained, the prompt is not
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "token_mask": token_mask,
            "advantages": advantages,
        }
        mine = policy.balanced_slices(batch["attention_mask"].sum(1))  # rows, tokens even over dp
        batch = {k: v[mine] for k, v in batch.items()}
        # every log-prob at the sampler's temperature: the ratio is exactly 1 before the step
        batch["old_logprobs"] = policy.logprobs(batch, temperature=args.temperature)
        batch["ref_logprobs"] = policy.reference_logprobs(batch, temperature=args.temperature)
        metrics = policy.train(
            batch, token_loss=grpo_loss, micro_batch_size=args.micro_batch_size, temperature=args.temperature
        )
        row = {
            "step": step,
            "reward": float(rewards.mean()),
            "kl": metrics["kl_sum"] / metrics["tokens"],
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            **extra,
        }
        history.append(row)
        if rank0:
            line = f"step {step:>3}  reward {row['reward']:.3f}  kl {row['kl']:.5f}  loss {row['loss']:+.5f}"
            if extra:
                line += (f"  refit {extra['refit_s']:.2f}s {extra['bytes_per_vllm_worker'] / 2**20:.2f} MiB/worker"
                         f"  vllm |dlogp| max {extra['rollout_logprob_max_abs_diff']:.1e}"
                         f" mean {extra['rollout_logprob_mean_abs_diff']:.1e} k3 {extra['rollout_kl_k3']:.1e}")
            print(line, flush=True)
    if channel is not None:
        channel.close()
    if rollout is not None:
        rollout.close()
    return history


def _policy_entry(args_dict: dict) -> list[dict]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        return policy_rank(argparse.Namespace(**args_dict))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollout_entry(args_dict: dict) -> None:
    code = rollout(argparse.Namespace(**args_dict))
    if code:
        raise SystemExit(code)


def run(args) -> list[dict]:
    """The rollout process and the policy's ranks; the metrics of every step."""
    import multiprocessing

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    folder = tempfile.mkdtemp(prefix="plancc-grpo-")
    args.port, args.manifest = _free_port(), os.path.join(folder, "manifest.json")
    forkserver = multiprocessing.get_context("forkserver")
    # "__main__": this file, so that the server's children find _rollout_entry and _policy_entry
    forkserver.set_forkserver_preload(["__main__", "torch", "transformers", "plancc", "plancc.models"])
    engine = None
    if args.rollout == "plancc":  # vLLM is started by the policy's rank 0
        engine = forkserver.Process(target=_rollout_entry, args=(vars(args),), name="rollout")
        engine.start()
    try:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=args.nproc,
            run_id=f"plancc-grpo-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{_free_port()}",
            max_restarts=0,
            monitor_interval=0.2,
            start_method="forkserver",
        )
        history = elastic_launch(config, _policy_entry)(vars(args))[0]
        if engine is not None:
            engine.join(timeout=120)
            if engine.exitcode is None:
                raise SystemExit("the rollout engine did not finish within 120 s of the policy")
            if engine.exitcode != 0:
                raise SystemExit(f"the rollout engine exited with {engine.exitcode}")
    finally:
        if engine is not None and engine.is_alive():
            engine.kill()
    if args.metrics:
        with open(args.metrics, "w") as f:
            for row in history:
                f.write(json.dumps(row) + "\n")
    return history


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R instead")
    parser.add_argument("--lora-lr", type=float, default=3e-2, help="the adapters' learning rate (with --lora)")
    parser.add_argument("--temperature", type=float, default=0.8, help="the sampler's, and so the log-probs'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics", default=None, help="one JSON line per step: reward, kl, loss")
    parser.add_argument("--rollout", choices=["plancc", "vllm"], default="plancc",
                        help="who samples: plancc's own sampler in another process, or a real vLLM")
    parser.add_argument("--vllm-python", default=os.environ.get("PLANCC_VLLM_PYTHON")
                        or os.path.join(HERE, "..", ".venv-vllm", "bin", "python"),
                        help="vLLM's environment (scripts/vllm_env.sh prints it)")
    parser.add_argument("--vllm-tp", type=int, default=1, help="vLLM's tensor parallel size")
    parser.add_argument("--max-logprob-diff", type=float, default=1e-3,
                        help="stop when the policy's and vLLM's log-probs of a sample differ by more (fp32)")
    args = parser.parse_args(argv)
    if args.rollout == "vllm" and args.lora:
        parser.error("--rollout vllm with --lora: not yet (the refit sends merged weights; vLLM's LoRA is not wired)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    history = run(args)
    first, last = history[: len(history) // 4 or 1], history[-(len(history) // 4 or 1) :]
    mean = lambda rows: sum(r["reward"] for r in rows) / len(rows)  # noqa: E731
    print(f"reward: first steps {mean(first):.3f} -> last steps {mean(last):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
