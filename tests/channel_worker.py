"""Both sides of a weight channel for tests/test_channel.py: the policy's ranks (spawned by
tests/distributed.py) and a receiver in a process of its own (``python -m tests.channel_worker``)."""

from __future__ import annotations

import json
import sys
import time

from .distributed import init_gloo


def policy_side(plan, model_name, port, bucket_bytes, manifest_path, export_dir):
    """One training step, the manifest written for the receiver, the weights sent over the
    channel (rank 0 sends, every rank gathers), then export_hf for the comparison."""
    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, global_batch, nll

    init_gloo()
    policy = plancc.Policy(plan, model_name, tp=2)
    batch = global_batch(ROWS_PER_RANK, load_config(model_name).vocab_size, seed=4)
    policy.train(batch, nll)
    result = {}
    if torch.distributed.get_rank() == 0:
        manifest = policy.weights_manifest(bucket_bytes=bucket_bytes)
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(manifest, f)
        import os

        os.replace(manifest_path + ".tmp", manifest_path)
        channel = plancc.weight_channel("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout=60)
    else:
        channel = None
    try:
        result["sent"] = policy.send_weights(channel, bucket_bytes=bucket_bytes)
    except plancc.WeightChannelError as exc:
        result["error"] = str(exc)
    if channel is not None:
        channel.close()
    policy.export_hf(export_dir)
    torch.distributed.destroy_process_group()
    return result


def receiver(port: int, manifest_path: str, out_path: str, tamper: bool) -> int:
    """Join the channel as rank 1 once the manifest is there; save what arrives."""
    import torch

    import plancc

    deadline = time.monotonic() + 120
    while True:
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                print("ERROR: no manifest", flush=True)
                return 3
            time.sleep(0.1)
    if tamper:  # a receiver that expects another model: one tensor of another shape
        manifest["buckets"][0]["tensors"][0]["shape"][0] += 1
    channel = plancc.weight_channel("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout=60)
    try:
        received = {name: tensor.clone() for name, tensor in plancc.receive_weights(channel, manifest)}
    except plancc.WeightChannelError as exc:
        print(f"ERROR: {exc}", flush=True)
        channel.close()
        return 3
    channel.close()
    torch.save(received, out_path)
    largest = max(int(b["bytes"]) for b in manifest["buckets"])
    print(f"RECEIVED {len(received)} BUFFER {largest}", flush=True)
    return 0


if __name__ == "__main__":
    port, manifest_path, out_path, tamper = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    sys.exit(receiver(port, manifest_path, out_path, tamper))
