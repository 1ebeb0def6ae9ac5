"""Weights to a consumer on the same device in another process (a rollout engine colocated with
the policy on one GPU), bucket by bucket, by handle instead of by copy over a socket: each
bucket is gathered into one flat buffer and handed over with torch.multiprocessing's reductions
-- a CUDA IPC handle for a CUDA buffer, shared memory for a CPU one -- through a
``multiprocessing`` connection. The consumer's tensors are views into that buffer; it answers
once it is done with a bucket, and only then is the buffer reused for the next one, so the
producer holds one bucket (and the consumer none of its own) at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import faults
from .channel import WeightChannelError, check_manifest, pack_into, unpack


def share_buckets(
    connection: Any,
    manifest: Mapping[str, Any],
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
    device: str,
    *,
    timeout: float = 60.0,
) -> int:
    """The producer's side: each bucket packed into one buffer and handed over; returns bytes.
    The consumer has ``timeout`` seconds to take each bucket: a consumer that hangs or dies is
    a ``WeightChannelError`` naming the bucket, never a wait without end."""
    check_manifest(manifest)
    connection.send(("manifest", dict(manifest)))
    shared = 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    for index, (bucket, expected) in enumerate(zip(buckets, manifest["buckets"], strict=True)):
        faults.inject("pack", rank=rank, step=index + 1)
        flat = torch.zeros(int(expected["bytes"]), dtype=torch.uint8, device=device)
        if flat.device.type == "cpu":
            flat.share_memory_()
        pack_into(flat, bucket)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)  # the copies are done before the handle is read
        connection.send(("bucket", index, flat))
        _acknowledged(connection, index, timeout)  # the consumer has what it needs of this bucket
        shared += flat.numel()
        del flat
    connection.send(("end", None))
    return shared


def _acknowledged(connection: Any, index: int, timeout: float) -> None:
    """The consumer's answer to bucket ``index`` (0-based on the wire, 1-based in messages, as
    every refit error counts buckets). A consumer that died is seen only once no other process
    holds its end of the connection: the process that started it closes its copy."""
    try:
        ready = connection.poll(timeout)
        answer = connection.recv() if ready else None
    except (EOFError, OSError):
        raise WeightChannelError(
            f"the colocated consumer is gone (its end closed) before taking bucket {index + 1}"
        ) from None
    if not ready:
        raise WeightChannelError(f"the colocated consumer did not take bucket {index + 1} within {timeout:g}s")
    if answer != ("done", index):
        raise WeightChannelError(f"the colocated consumer answered {answer!r} to bucket {index + 1}")


def receive_shared_weights(connection: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The consumer's side: ``(hf_name, tensor)`` of every weight, each a view into the bucket's
    shared buffer, valid until the next bucket (an engine's ``load_weights`` copies them)."""
    kind, manifest = connection.recv()
    if kind != "manifest":
        raise RuntimeError(f"expected the manifest first, got {kind!r}")
    while True:
        message = connection.recv()
        if message[0] == "end":
            return
        _, index, flat = message
        yield from unpack(flat, manifest["buckets"][index]["tensors"])
        del flat
        connection.send(("done", index))
