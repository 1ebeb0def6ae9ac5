"""Both sides of a resharded refit for tests/test_reshard.py: the policy (spawned by
tests/distributed.py) and a rollout engine of its own at tp=2 (``receiver_rank``, its two ranks launched
beside the policy's by ``tests.distributed.launch_beside``). Channel ranks: the policy's first, then the engine's."""

from __future__ import annotations

import json
import os
import time

from .distributed import init_gloo, sized

PLAN = "plans/qwen3.yaml"
MODEL = "tiny-qwen3"


def _batch(vocab):
    from .policy_worker import global_batch

    return global_batch(4, vocab, seed=21)


class CountingStore:
    """A channel's store that counts the reads a refit makes of it (``get``)."""

    def __init__(self, store):
        self.store, self.reads = store, 0

    def get(self, key):
        self.reads += 1
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def policy_side(port, manifest_path, layout, dtype=None, fault=None, lora=None, then=None, refits=1, model=MODEL):
    """The policy's rank: trains a step, sends its weights resharded (in ``dtype`` when given),
    and reports what it sent, the peak bytes the send made (tests/live_bytes.py), and for the
    bound: the largest parameter and all the strided ones (FSDP x TP) together, full size.
    With ``fault`` the refit fails; ``then`` (port, manifest path): a second refit after it, on a
    new channel to a new engine, and the policy's log-probs for that engine's to equal."""
    import torch
    from torch.distributed.tensor import DTensor

    import plancc
    from plancc.engine.reshard import local_box
    from plancc.models import load_config

    from .live_bytes import LiveBytes
    from .policy_worker import nll

    init_gloo()
    policy = plancc.Policy(PLAN, model, lora=lora, layout=sized(**layout))
    batch = _batch(load_config(model).vocab_size)
    mine = policy.slice_of(batch["input_ids"].shape[0])
    policy.train({k: v[mine] for k, v in batch.items()}, nll)
    def publish_manifest(path):
        if torch.distributed.get_rank() == 0:
            with open(path + ".tmp", "w") as f:
                manifest = policy.weights_manifest(dtype=getattr(torch, dtype) if dtype else None)
                note = {"policy_ranks": torch.distributed.get_world_size(), "policy_model": model}
                json.dump({**manifest, **note}, f)
            os.replace(path + ".tmp", path)

    publish_manifest(manifest_path)
    world = torch.distributed.get_world_size() + 2
    channel = plancc.weight_channel(
        "127.0.0.1", port, rank=torch.distributed.get_rank(), world_size=world, backend="gloo", timeout=60
    )
    held = [t._local_tensor if isinstance(t, DTensor) else t for t in [*policy.model.parameters()]]
    if fault is not None:  # a policy rank that fails mid-refit: what every rank raises
        os.environ["PLANCC_FAULT"] = fault
        try:
            policy.send_weights(channel, reshard=True)
            out = {"error": None}
        except Exception as exc:  # the channel is left broken: closing it does not wait for the dead engine
            out = {"type": type(exc).__name__, "error": str(exc), "broken": channel.broken}
        finally:
            os.environ["PLANCC_FAULT"] = ""
            torch.distributed.barrier()  # no rank left inside a collective
            channel.close()
        if then is not None:  # the next refit, to a new engine: exact
            publish_manifest(then[1])
            again = plancc.weight_channel(
                "127.0.0.1", then[0], rank=torch.distributed.get_rank(), world_size=world, backend="gloo", timeout=60
            )
            out["sent"] = policy.send_weights(again, reshard=True)
            again.close()
            out.update(start=mine.start, logprobs=policy.logprobs({k: v[mine] for k, v in batch.items()}))
        torch.distributed.destroy_process_group()
        return out
    with LiveBytes(held) as counter:
        sent = policy.send_weights(channel, reshard=True, dtype=getattr(torch, dtype) if dtype else None)
    reads = []  # each later refit's reads of the store: its transfer plan is the first's
    for _ in range(refits - 1):
        policy.train({k: v[mine] for k, v in batch.items()}, nll)
        channel.store = CountingStore(channel.store)
        sent = policy.send_weights(channel, reshard=True, dtype=getattr(torch, dtype) if dtype else None)
        reads.append(channel.store.reads)
        channel.store = channel.store.store
    channel.close()
    out = {"sent": sent, "later_refits_store_reads": reads, "start": mine.start, "logprobs": policy.logprobs({k: v[mine] for k, v in batch.items()})}
    full = {name: p.numel() * p.element_size() for name, p in policy.model.named_parameters()}
    strided = [name for name, p in policy.model.named_parameters() if local_box(p)[0] is None]
    out.update(peak=counter.peak, largest=max(full.values()), strided_total=sum(full[n] for n in strided))
    torch.distributed.destroy_process_group()
    return out


def receiver_rank(port, manifest_path, timeout=60, refits=1):
    import torch
    from torch.distributed.tensor import DTensor

    import plancc
    from plancc.models import build_model, load_config
    from plancc.runtime.vocab_parallel_logprobs import token_logprobs

    init_gloo()
    while not os.path.exists(manifest_path):
        time.sleep(0.05)
    with open(manifest_path) as f:
        manifest = json.load(f)
    rank = torch.distributed.get_rank()
    policy_world = int(manifest.pop("policy_ranks"))  # the test's notes, not part of the manifest
    name = manifest.pop("policy_model")
    channel = plancc.weight_channel(
        "127.0.0.1", port, rank=policy_world + rank, world_size=policy_world + 2, backend="gloo", timeout=timeout
    )
    # the engine's own model at its own layout, filled with other weights until the refit
    config = load_config(name)
    mesh = plancc.build_mesh(tp=2, device_type="cpu")
    model = build_model(config, device="meta")
    plancc.parallelize(model, plancc.load_plan(PLAN), mesh)
    torch.manual_seed(123)
    plancc.materialize(model, "cpu", full_state_dict=build_model(config, device="cpu").state_dict())
    params = dict(model.named_parameters())
    reads = []
    for refit in range(refits):
        stats = {}
        shard_bytes, dtypes = 0, set()
        if refit:
            channel.store = CountingStore(channel.store)
        with torch.no_grad():
            for name, shard in plancc.receive_weights(channel, manifest, plan=PLAN, tp=2, stats=stats):
                local = params[name].to_local() if isinstance(params[name], DTensor) else params[name]
                local.copy_(shard)
                shard_bytes += shard.numel() * shard.element_size()
                dtypes.add(str(shard.dtype))
        if refit:
            reads.append(channel.store.reads)
            channel.store = channel.store.store
    channel.close()
    with torch.no_grad():
        lp = token_logprobs(model.eval(), _batch(config.vocab_size)["input_ids"],
                            attention_mask=_batch(config.vocab_size)["attention_mask"], mesh=mesh)
    out = {"received": stats.get("bytes", 0), "shard": shard_bytes, "logprobs": lp, "dtypes": sorted(dtypes),
           "later_refits_store_reads": reads}
    torch.distributed.destroy_process_group()
    return out

