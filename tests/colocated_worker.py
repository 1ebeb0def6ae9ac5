"""Both sides of a colocated refit for tests/test_colocated.py: the policy's ranks (spawned by
tests/distributed.py); rank 0 starts the consumer process itself, as a colocated engine is."""

from __future__ import annotations

import multiprocessing

from .distributed import init_gloo


def consumer(connection, out_path):
    """Takes every weight by handle, copies it (an engine's load_weights), saves them."""
    import torch

    import plancc

    received = {name: tensor.clone() for name, tensor in plancc.receive_shared_weights(connection)}
    torch.save(received, out_path)


def policy_side(out_path, export_dir, bucket):
    import torch

    import plancc
    from plancc.models import load_config

    from .policy_worker import ROWS_PER_RANK, global_batch, nll

    init_gloo()
    policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3-tied", tp=2)
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
