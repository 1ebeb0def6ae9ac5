"""Both sides of a colocated refit for tests/test_colocated.py: the policy's ranks (spawned by
tests/distributed.py); rank 0 starts the consumer process itself, as a colocated engine is."""

from __future__ import annotations

import multiprocessing

from .distributed import init_gloo, sized


def consumer(connection, out_path):
    """Takes every weight by handle, copies it (an engine's load_weights), saves them, and
    beside them the shared buffers they came in (by address: a buffer mapped again would
    land elsewhere while the last mapping is held)."""
    import torch

    import plancc

    received, buffers = {}, set()
    for name, tensor in plancc.receive_shared_weights(connection):
        received[name] = tensor.clone()
        buffers.add(tensor.untyped_storage().data_ptr())
    torch.save({"weights": received, "buffers": len(buffers)}, out_path)


def policy_side(out_path, export_dir, bucket, layout):
    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, global_batch, nll

    init_gloo()
    policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3-tied", layout=sized(**layout))
    policy.train(global_batch(ROWS_PER_RANK, load_config("tiny-qwen3-tied").vocab_size, seed=6), nll)
    process, mine = None, None
    if torch.distributed.get_rank() == 0:
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        process = context.Process(target=consumer, args=(theirs, out_path))
        process.start()
    shared = policy.share_weights(mine, bucket_bytes=bucket)
    if process is not None:
        process.join(timeout=120)
    policy.export_hf(export_dir)
    torch.distributed.destroy_process_group()
    return {"shared": shared, "consumer_exit": process.exitcode if process is not None else None}


def _ready(connection):
    """An engine that is up: its imports done (a spawned process takes seconds to import torch,
    more than the short timeouts of the failure tests), it says so once."""
    import torch  # noqa: F401

    import plancc  # noqa: F401

    connection.send("ready")


def ready_consumer(connection, out_path):
    _ready(connection)
    consumer(connection, out_path)


def consumer_that_dies(connection, after_buckets):
    """Takes ``after_buckets`` buckets, then dies without a word (an engine that crashed)."""
    import os

    _ready(connection)
    kind, manifest = connection.recv()
    connection.recv()  # the refit's buffers
    for _ in range(after_buckets):
        _, index = connection.recv()
        connection.send(("done", index))
    connection.recv()  # the next bucket arrives
    os._exit(3)


def consumer_that_hangs(connection):
    """Reads the manifest, the buffers and the first bucket, then never answers (an engine stuck)."""
    import time

    _ready(connection)
    connection.recv()
    connection.recv()
    connection.recv()
    time.sleep(600)


def refit_failures(modes):
    """Each failure mode of a colocated refit: the error every rank raised (type, message), that
    every rank then meets at a barrier (no rank left inside a collective), and that a clean refit
    to a new consumer works afterwards."""
    import os
    import time

    import torch

    import plancc

    init_gloo()
    policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3-tied", layout=sized(tp=2))
    rank0 = torch.distributed.get_rank() == 0
    context = multiprocessing.get_context("spawn")
    out = {}
    for mode in modes:
        os.environ["PLANCC_FAULT"] = {"pack": "pack:raise@0#2", "gather": "gather:raise@1#2"}.get(mode, "")
        process, mine = None, None
        if rank0:
            mine, theirs = context.Pipe()
            target, args = {"dies": (consumer_that_dies, (theirs, 1)), "hangs": (consumer_that_hangs, (theirs,))}.get(
                mode, (ready_consumer, (theirs, os.devnull)))
            process = context.Process(target=target, args=args)
            process.start()
            theirs.close()  # the consumer's end is the consumer's: its death then closes it
            assert mine.recv() == "ready"
        started = time.monotonic()
        try:
            policy.share_weights(mine, bucket_bytes=32 * 1024, timeout=3.0)
            out[mode] = {"error": None}
        except Exception as exc:
            out[mode] = {"type": type(exc).__name__, "error": str(exc)}
        out[mode]["seconds"] = time.monotonic() - started
        torch.distributed.barrier()
        if process is not None:
            process.kill()
            process.join(timeout=30)
    os.environ["PLANCC_FAULT"] = ""
    process, mine = None, None
    if rank0:
        mine, theirs = context.Pipe()
        process = context.Process(target=consumer, args=(theirs, os.devnull))
        process.start()
    out["after"] = policy.share_weights(mine, bucket_bytes=32 * 1024, timeout=30.0)
    if process is not None:
        process.join(timeout=60)
    torch.distributed.destroy_process_group()
    return out
