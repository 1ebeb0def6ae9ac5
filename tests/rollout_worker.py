"""What the rollout tier's ranks run (module-level: the launcher pickles their reference)."""

from __future__ import annotations

import os
import time

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5]]


# model -> (preset, plan): the tier's models, each cut to a head size vLLM's CPU attention takes
MODELS = {
    "qwen3": ("tiny-qwen3", "plans/qwen3.yaml"),
    "qwen3-moe-tied": ("tiny-qwen3-moe", "plans/qwen3_moe.yaml"),  # its head tied to its embedding
}


def tiny_config(model="qwen3"):
    """A Qwen3 (or Qwen3-MoE) of head size 64 (vLLM's CPU attention refuses the presets' 16)."""
    from plancc.models import load_config

    config = load_config(MODELS[model][0])
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 128, 4, 2, 64
    config.tie_word_embeddings = model.endswith("-tied")
    return config


def _policy(sizes):
    import plancc
    from plancc.layout import Layout

    sizes = dict(sizes)
    model = sizes.pop("model", "qwen3")
    lora = sizes.pop("lora", None)  # adapters on every projection: vLLM gets the merged weights
    if lora:
        lora = {
            "r": lora,
            "alpha": 2 * lora,
            "targets": ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"],
        }
    return plancc.Policy(
        MODELS[model][1],
        tiny_config(model),
        layout=Layout(**sizes),
        device="cpu",
        lora=lora,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        max_grad_norm=None,
    )


def _nll(lp, tokens, norm):
    return -(lp * tokens["attention_mask"].float()).sum() / norm.tokens


def refit_sample_train_refit(vllm_python, layouts, vllm_tp):
    """Per layout: refit, sample, the agreement; a step of training (vLLM's samples now stale);
    refit again and the agreement on new samples. One vLLM serves every layout in turn."""
    import torch.distributed as dist

    from plancc.engine.vllm_rollout import VLLMRollout, VLLMSpec, agreement, rows_of

    out, rollout = {}, None
    try:
        for name, sizes in layouts:
            policy = _policy(sizes)
            if rollout is None:
                rollout = VLLMRollout(VLLMSpec(python=vllm_python, tensor_parallel_size=vllm_tp), policy.config)
            first = rollout.refit(policy, version=f"{name}-0")
            samples = rollout.generate(PROMPTS, n=2, max_tokens=8, seed=0, ignore_eos=True)
            fresh = agreement(policy, PROMPTS, samples)
            policy.train(rows_of(PROMPTS, samples), token_loss=_nll)
            stale = agreement(policy, PROMPTS, samples)
            second = rollout.refit(policy, version=f"{name}-1")
            again = agreement(policy, PROMPTS, rollout.generate(PROMPTS, n=2, max_tokens=8, seed=1, ignore_eos=True))
            stats = rollout.worker_stats() if rollout.driver else None
            serving = rollout.serving() if rollout.driver else None
            out[name] = {
                "fresh": fresh,
                "stale": stale,
                "again": again,
                "refits": [first, second],
                "workers": stats,
                "serving": serving,
            }
            del policy
    finally:
        if rollout is not None:
            rollout.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


class _KillAfter:
    """The driver's gloo group, killing vLLM's server after ``count`` weights went out."""

    def __init__(self, group, process, count):
        self.group, self.process, self.count = group, process, count

    def send(self, tensors, dst, tag):
        if self.count == 0:
            self.process.kill()
            self.process.wait()
        self.count -= 1
        return self.group.send(tensors, dst, tag)


def _alive_in_session(session):
    """Processes of the session that still run (a zombie waiting for its reaper is not running)."""
    from pathlib import Path

    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            alive.append(int(stat.parent.name))
    return alive


def killed_mid_update_then_a_new_vllm(vllm_python):
    """vLLM's server killed after 5 weights of a refit: what each rank raised and how long it took;
    then a new vLLM and the next refit's agreement."""
    import torch.distributed as dist

    from plancc.engine.vllm_rollout import RolloutError, VLLMRollout, VLLMSpec, agreement

    out = {}
    try:
        policy = _policy({"dp": 2})
        rollout = VLLMRollout(VLLMSpec(python=vllm_python), policy.config)
        rollout.refit(policy, version="a")
        if rollout.driver:
            rollout._group = _KillAfter(rollout._group, rollout._process, 5)
        start = time.monotonic()
        try:
            rollout.refit(policy, version="b")
            out["raised"] = None
        except RolloutError as error:
            out["raised"] = str(error)
        out["seconds"] = time.monotonic() - start
        session = rollout._process.pid if rollout.driver else None
        rollout.close()
        if session is not None:  # vLLM's engine core and workers outlived their killed server: gone now
            time.sleep(2)
            out["leftover"] = _alive_in_session(session)
        with VLLMRollout(VLLMSpec(python=vllm_python), policy.config) as fresh:
            out["refit"] = fresh.refit(policy, version="c")
            samples = fresh.generate(PROMPTS, max_tokens=6, seed=0, ignore_eos=True)
            out["agreement"] = agreement(policy, PROMPTS, samples)
        out["pid"] = os.getpid()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def another_model_is_refused(vllm_python, folder):
    """vLLM started from a folder whose vocabulary is not the policy's: what each rank raised."""
    import torch.distributed as dist

    from plancc.engine.vllm_rollout import RolloutError, VLLMRollout, VLLMSpec

    try:
        policy = _policy({"dp": 2})
        try:
            VLLMRollout(VLLMSpec(python=vllm_python, model=folder), policy.config)
            return None
        except RolloutError as error:
            return str(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _LostMidRefit:
    """A policy whose weights stop after ``count`` tensors, as when a rank is lost mid-refit."""

    def __init__(self, policy, count):
        self.policy, self.count = policy, count

    def weights_manifest(self, fmt):
        return self.policy.weights_manifest(fmt)

    def weights(self, fmt):
        for i, item in enumerate(self.policy.weights(fmt)):
            if i == self.count:
                raise RuntimeError("a policy rank was lost")
            yield item


def a_refit_lost_part_way(vllm_python):
    """A refit whose policy fails after 7 weights: how long the driver took to raise, what vLLM
    says it serves, what sampling says; then the next refit and its agreement."""
    import torch.distributed as dist

    from plancc.engine.vllm_rollout import RolloutError, VLLMRollout, VLLMSpec, agreement

    out = {}
    try:
        policy = _policy({})
        with VLLMRollout(VLLMSpec(python=vllm_python, tensor_parallel_size=2), policy.config) as rollout:
            rollout.refit(policy, version="a")
            start = time.monotonic()
            try:
                rollout.refit(_LostMidRefit(policy, 7), version="b")
            except RuntimeError as error:
                out["raised"] = str(error)
            out["seconds"] = time.monotonic() - start
            out["serving"] = rollout.serving()
            try:
                rollout.generate(PROMPTS, max_tokens=4)
                out["sampled"] = True
            except RolloutError as error:
                out["sampled"] = str(error)
            rollout.refit(policy, version="c")
            out["after"] = rollout.serving()
            out["agreement"] = agreement(
                policy, PROMPTS, rollout.generate(PROMPTS, max_tokens=6, seed=0, ignore_eos=True)
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out
