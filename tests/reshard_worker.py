"""Both sides of a resharded refit for tests/test_reshard.py: the policy (spawned by
tests/distributed.py) and a rollout engine of its own at tp=2 (``python -m tests.reshard_worker``,
which launches its two ranks the same way). Channel ranks: the policy's first, then the engine's."""

from __future__ import annotations

import json
import os
import sys
import time

from .distributed import init_gloo, launch

PLAN = "plans/qwen3.yaml"
MODEL = "tiny-qwen3"


def _batch(vocab):
    from .policy_worker import global_batch

    return global_batch(4, vocab, seed=21)


def policy_side(port, manifest_path, layout):
    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import nll

    init_gloo()
    policy = plancc.Policy(PLAN, MODEL, **layout)
    batch = _batch(load_config(MODEL).vocab_size)
    mine = policy.slice_of(batch["input_ids"].shape[0])
    policy.train({k: v[mine] for k, v in batch.items()}, nll)
    if torch.distributed.get_rank() == 0:
        with open(manifest_path + ".tmp", "w") as f:
            json.dump({**policy.weights_manifest(), "policy_ranks": torch.distributed.get_world_size()}, f)
        os.replace(manifest_path + ".tmp", manifest_path)
    world = torch.distributed.get_world_size() + 2
    channel = plancc.weight_channel(
        "127.0.0.1", port, rank=torch.distributed.get_rank(), world_size=world, backend="gloo", timeout=60
    )
    sent = policy.send_weights(channel, reshard=True)
    channel.close()
    out = {"sent": sent, "start": mine.start, "logprobs": policy.logprobs({k: v[mine] for k, v in batch.items()})}
    torch.distributed.destroy_process_group()
    return out


def receiver_rank(port, manifest_path):
    import torch
    from torch.distributed.tensor import DTensor

    import plancc
    from plancc.models import build_model, load_config
    from plancc.runtime.logprobs import token_logprobs

    init_gloo()
    while not os.path.exists(manifest_path):
        time.sleep(0.05)
    with open(manifest_path) as f:
        manifest = json.load(f)
    rank = torch.distributed.get_rank()
    policy_world = int(manifest.pop("policy_ranks"))  # the test's note, not part of the manifest
    channel = plancc.weight_channel(
        "127.0.0.1", port, rank=policy_world + rank, world_size=policy_world + 2, backend="gloo", timeout=60
    )
    # the engine's own model at its own layout, filled with other weights until the refit
    config = load_config(MODEL)
    mesh = plancc.build_mesh(tp=2, device_type="cpu")
    model = build_model(config, device="meta")
    plancc.parallelize(model, plancc.load_plan(PLAN), mesh)
    torch.manual_seed(123)
    plancc.materialize(model, "cpu", full_state_dict=build_model(config, device="cpu").state_dict())
    params = dict(model.named_parameters())
    stats = {}
    shard_bytes = 0
    with torch.no_grad():
        for name, shard in plancc.receive_weights(channel, manifest, plan=PLAN, tp=2, stats=stats):
            local = params[name].to_local() if isinstance(params[name], DTensor) else params[name]
            local.copy_(shard)
            shard_bytes += local.numel() * local.element_size()
    channel.close()
    with torch.no_grad():
        lp = token_logprobs(model.eval(), _batch(config.vocab_size)["input_ids"],
                            attention_mask=_batch(config.vocab_size)["attention_mask"], mesh=mesh)
    out = {"received": stats.get("bytes", 0), "shard": shard_bytes, "logprobs": lp}
    torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    import torch

    results = launch(receiver_rank, 2, int(sys.argv[1]), sys.argv[2])
    torch.save(results, sys.argv[3])
