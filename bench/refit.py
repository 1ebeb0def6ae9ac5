"""Refit, side by side in one run: the policy's weights to a rollout engine in another process,
plancc's way (``send_weights``: bucket by bucket over a weight channel) against the seed's
(NeMo-RL's ``broadcast_weights_for_collective``: every policy rank takes the full state dict,
``get_model_state_dict(full_state_dict=True)``, then rank 0 broadcasts one tensor at a time).

    python bench/refit.py [--model tiny-qwen3] [--tp 2] [--bucket-mib 4] [--rounds 3] [--in-flight 1 2]
                          [--agree-every N]

All run over the same channel, alternately, ``--rounds`` times each: plancc with each
``--in-flight`` (buckets on the wire at once, on both sides; gloo's default 1, nccl's 2), and
the seed; prints the median time per refit on the sender, the bytes the receiver got and the
number of messages, the ratios, and the peak bytes of tensors each way holds on a policy rank
(tests/live_bytes.py, one more untimed round: counting slows the ops).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tests.distributed import free_port, init_gloo, launch, sized  # noqa: E402
from tests.live_bytes import LiveBytes  # noqa: E402


def _seed_send(policy, channel) -> tuple[int, int]:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True))
    sent = messages = 0
    if channel is not None:
        for _, tensor in state.items():
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            channel.broadcast(flat, "seed refit")
            sent, messages = sent + flat.numel(), messages + 1
    return sent, messages


def _ways(in_flight: list[int]) -> list[str]:
    return [f"plancc x{depth}" for depth in in_flight] + ["seed"]


def policy_side(model, tp, bucket, rounds, port, manifest_path, in_flight, agree_every):
    import torch

    import plancc

    init_gloo()
    policy = plancc.Policy(os.path.join(ROOT, "plans", "qwen3.yaml"), model, layout=sized(tp=tp))
    rank0 = torch.distributed.get_rank() == 0
    channel = None
    if rank0:
        manifest = policy.weights_manifest(bucket_bytes=bucket)
        with open(manifest_path + ".tmp", "w") as f:
            json.dump({"manifest": manifest, "seed": [[k, list(v.shape), str(v.dtype)] for k, v in
                                                      policy.model.state_dict().items()]}, f)
        os.replace(manifest_path + ".tmp", manifest_path)
        channel = plancc.weight_channel("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout=120)
    ways = _ways(in_flight)
    times: dict[str, list[float]] = {way: [] for way in ways}
    peaks = dict.fromkeys(ways, 0)
    info = {}
    from torch.distributed.tensor import DTensor

    held = [t._local_tensor if isinstance(t, DTensor) else t for t in [*policy.model.parameters(),
                                                                      *policy.model.buffers()]]
    manifest_buckets = len(policy.weights_manifest(bucket_bytes=bucket)["buckets"])
    def refit(way: str) -> tuple[int, int]:
        if way == "seed":
            return _seed_send(policy, channel)
        if channel is not None:
            channel.in_flight = int(way.removeprefix("plancc x"))
        return policy.send_weights(channel, bucket_bytes=bucket, agree_every=agree_every), manifest_buckets

    for _ in range(rounds):
        for way in ways:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            info[way] = refit(way)
            times[way].append(time.perf_counter() - t0)
    for way in ways:  # once more, counting what each way holds (slower: not timed)
        with LiveBytes(held) as counter:
            refit(way)
        peaks[way] = counter.peak
    if channel is not None:
        channel.close()
    torch.distributed.destroy_process_group()
    return {"times": times, "info": info, "peaks": peaks}


def receiver(port: int, manifest_path: str, rounds: int, in_flight: list[int]) -> None:
    import torch

    import plancc

    while not os.path.exists(manifest_path):
        time.sleep(0.05)
    with open(manifest_path) as f:
        both = json.load(f)
    channel = plancc.weight_channel("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout=120)
    for _ in range(rounds + 1):
        for way in _ways(in_flight):
            if way != "seed":
                channel.in_flight = int(way.removeprefix("plancc x"))
                for _ in plancc.receive_weights(channel, both["manifest"]):
                    pass
                continue
            for _name, shape, dtype in both["seed"]:
                count = 1
                for s in shape:
                    count *= s
                buffer = torch.empty(count * getattr(torch, dtype.removeprefix("torch.")).itemsize, dtype=torch.uint8)
                channel.broadcast(buffer, "seed refit")
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bucket-mib", type=float, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--agree-every", type=int, default=None)
    parser.add_argument("--role", default="driver")
    parser.add_argument("--port", type=int)
    parser.add_argument("--manifest")
    args = parser.parse_args()
    if args.role == "receiver":
        receiver(args.port, args.manifest, args.rounds, args.in_flight)
        return
    port = free_port()
    manifest = os.path.join(tempfile.mkdtemp(prefix="plancc-refit-"), "manifest.json")
    engine = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "receiver", "--port", str(port),
                               "--manifest", manifest, "--rounds", str(args.rounds),
                               "--in-flight", *map(str, args.in_flight)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        bucket = int(args.bucket_mib * 2**20)
        results = launch(policy_side, args.tp, args.model, args.tp, bucket, args.rounds, port, manifest,
                         args.in_flight, args.agree_every)
        result = results[0]
        engine.wait(timeout=300)
    finally:
        engine.kill()
    times, info = result["times"], result["info"]
    ways = _ways(args.in_flight)
    peak = {way: max(r["peaks"][way] for r in results.values()) for way in ways}
    median = {way: statistics.median(times[way]) for way in ways}
    every = args.agree_every or 1
    print(f"{args.model} at tp={args.tp}, one receiver process, gloo, {args.rounds} alternating rounds (median), "
          f"{args.bucket_mib:g} MiB buckets, the policy's ranks agreeing every {every} bucket(s):")
    for way in ways:
        label = "seed: full state dict, one tensor at a time" if way == "seed" else f"{way} buckets in flight"
        print(f"  {label:44s} {median[way] * 1e3:8.1f} ms   {info[way][0] / 2**20:8.2f} MiB in {info[way][1]} "
              f"messages, peak held per policy rank {peak[way] / 2**20:8.2f} MiB")
    for way in ways[:-1]:
        print(f"  time ratio {way}/seed {median[way] / median['seed']:8.3f}"
              + (f"   {way}/{ways[0]} {median[way] / median[ways[0]]:8.3f}" if way != ways[0] else ""))


if __name__ == "__main__":
    main()
