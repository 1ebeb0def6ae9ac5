"""Both sides of a weight channel for tests/test_channel.py: the policy's ranks (spawned by
tests/distributed.py) and a receiver in a process of its own (``python -m tests.channel_worker``)."""

from __future__ import annotations

import json
import sys
import time

from .distributed import init_gloo, sized


def policy_side(plan, model_name, port, bucket_bytes, manifest_path, export_dir, in_flight=None, agree_every=None):
    """One training step, the manifest written for the receiver, the weights sent over the
    channel (rank 0 sends ``in_flight`` buckets at once, every rank gathers, the ranks agreeing
    every ``agree_every`` buckets), then export_hf for the comparison."""
    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, global_batch, nll

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=sized(tp=2))
    batch = global_batch(ROWS_PER_RANK, load_config(model_name).vocab_size, seed=4)
    policy.train(batch, nll)
    result = {}
    if torch.distributed.get_rank() == 0:
        manifest = policy.weights_manifest(bucket_bytes=bucket_bytes)
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(manifest, f)
        import os

        os.replace(manifest_path + ".tmp", manifest_path)
        channel = _open_on_any_port(port, in_flight)  # a file the receiver reads the port from
    else:
        channel = None
    from torch.distributed.tensor import DTensor

    from .live_bytes import LiveBytes

    held = [t._local_tensor if isinstance(t, DTensor) else t for t in [*policy.model.parameters(),
                                                                      *policy.model.buffers()]]
    try:
        with LiveBytes(held) as counter:  # what the send makes and holds beside the model
            result["sent"] = policy.send_weights(channel, bucket_bytes=bucket_bytes, agree_every=agree_every)
        result["peak"] = counter.peak
    except plancc.WeightChannelError as exc:
        result["error"] = str(exc)
    if channel is not None:
        channel.close()
    policy.export_hf(export_dir)
    torch.distributed.destroy_process_group()
    return result


def receiver(
    port: str, manifest_path: str, out_path: str, tamper: bool, timeout: float = 60, in_flight: int | None = None
) -> int:
    """Join the channel as rank 1 once the manifest is there; save what arrives, and print the
    buffers the tensors were views into (their count and bytes)."""
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
    channel = plancc.weight_channel(
        "127.0.0.1", _port(port), rank=1, world_size=2, backend="gloo", timeout=timeout, in_flight=in_flight
    )
    buffers: dict[int, int] = {}
    try:
        received = {}
        for name, tensor in plancc.receive_weights(channel, manifest):
            storage = tensor.untyped_storage()
            buffers[storage.data_ptr()] = storage.nbytes()
            received[name] = tensor.clone()
    except plancc.WeightChannelError as exc:
        print(f"ERROR: {exc}", flush=True)
        channel.close()
        return 3
    channel.close()
    torch.save(received, out_path)
    print(f"RECEIVED {len(received)} BUFFERS {len(buffers)} BYTES {sum(buffers.values())}", flush=True)
    return 0


def _port(value) -> int:
    """A port, or ``file:PATH``: the port rank 0's channel got, once it writes it there."""
    text = str(value)
    if not text.startswith("file:"):
        return int(text)
    path = text.removeprefix("file:")
    deadline = time.monotonic() + 120
    while True:
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise SystemExit(f"no port at {path}") from None
            time.sleep(0.05)


def _open_on_any_port(port_path: str, in_flight: int | None = None):
    """Rank 0's channel on a port the system picks, written to ``port_path`` for the receiver."""
    import os

    import plancc

    def tell(port: int) -> None:
        with open(port_path + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_path + ".tmp", port_path)

    return plancc.weight_channel(
        "127.0.0.1", 0, rank=0, world_size=2, backend="gloo", timeout=60, on_open=tell, in_flight=in_flight
    )


def policy_side_twice(plan, model_name, port_paths, bucket_bytes, manifest_path, export_dir, layout=None):
    """The weights sent to a receiver that dies after the first bucket (every policy rank gets one
    error naming the bucket and the peer, the weights stay as they were), then over a new channel
    to a receiver that takes them all; two buckets in flight on the policy's side, the ranks
    agreeing every 2 buckets (the pipelined sender's failure path)."""
    import os

    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, _full_state, global_batch, nll

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=plancc.Layout(**(layout or {"tp": 2})))
    policy.train(global_batch(ROWS_PER_RANK, load_config(model_name).vocab_size, seed=4), nll)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(policy.weights_manifest(bucket_bytes=bucket_bytes), f)
        os.replace(manifest_path + ".tmp", manifest_path)
    before = _full_state(policy.model)
    result = {}
    for attempt, port_path in enumerate(port_paths):
        channel = _open_on_any_port(port_path, in_flight=2) if rank0 else None
        try:
            result[f"sent_{attempt}"] = policy.send_weights(channel, bucket_bytes=bucket_bytes, agree_every=2)
            if channel is not None:
                channel.close()
        except plancc.WeightChannelError as exc:
            result[f"error_{attempt}"] = str(exc)
    after = _full_state(policy.model)
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    policy.export_hf(export_dir)
    torch.distributed.destroy_process_group()
    return result


def dying_receiver(port: str, manifest_path: str) -> int:
    """Joins, takes the first bucket, and dies (no goodbye)."""
    import os

    import plancc

    while not os.path.exists(manifest_path):
        time.sleep(0.1)
    with open(manifest_path) as f:
        manifest = json.load(f)
    channel = plancc.weight_channel("127.0.0.1", _port(port), rank=1, world_size=2, backend="gloo", timeout=20)
    for _ in plancc.receive_weights(channel, manifest):
        os._exit(9)
    return 0


def main(argv: list[str]) -> int:
    """``dying PORT MANIFEST`` or ``PORT MANIFEST OUT TAMPER [TIMEOUT [IN_FLIGHT]]``: a receiver's
    exit code."""
    if argv[0] == "dying":
        return dying_receiver(argv[1], argv[2])
    port, manifest_path, out_path, tamper = argv[0], argv[1], argv[2], argv[3] == "1"
    timeout = float(argv[4]) if len(argv) > 4 else 60
    in_flight = int(argv[5]) if len(argv) > 5 else None
    return receiver(port, manifest_path, out_path, tamper, timeout, in_flight)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def pipeline_policy_side(plan, model_name, port, bucket_bytes, manifest_path, weights_path):
    """``Policy(pp=2)``: a training step, then its weights over the channel from every stage
    (each tensor gathered by its stage and broadcast over the pipeline; rank 0 sends), and the
    same weights from ``weights()`` saved for the comparison."""
    import os

    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, global_batch, nll

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=sized(pp=2))
    policy.train(global_batch(ROWS_PER_RANK, load_config(model_name).vocab_size, seed=4), nll)
    channel = None
    if torch.distributed.get_rank() == 0:
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(policy.weights_manifest(bucket_bytes=bucket_bytes), f)
        os.replace(manifest_path + ".tmp", manifest_path)
        channel = _open_on_any_port(port)
    result = {"sent": policy.send_weights(channel, bucket_bytes=bucket_bytes)}
    if channel is not None:
        channel.close()
    whole = {name: tensor.clone() for name, tensor in policy.weights()}
    if torch.distributed.get_rank() == 0:
        torch.save(whole, weights_path)
    torch.distributed.destroy_process_group()
    return result
