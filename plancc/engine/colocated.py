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

from .channel import check_manifest, pack_into, unpack


def share_buckets(
    connection: Any, manifest: Mapping[str, Any], buckets: Iterator[list[tuple[str, torch.Tensor]]], device: str
) -> int:
    """The producer's side: each bucket packed into one buffer and handed over; returns bytes."""
    check_manifest(manifest)
    connection.send(("manifest", dict(manifest)))
    shared = 0
    for index, (bucket, expected) in enumerate(zip(buckets, manifest["buckets"], strict=True)):
        flat = torch.zeros(int(expected["bytes"]), dtype=torch.uint8, device=device)
        if flat.device.type == "cpu":
            flat.share_memory_()
        pack_into(flat, bucket)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)  # the copies are done before the handle is read
        connection.send(("bucket", index, flat))
        if connection.recv() != ("done", index):  # the consumer has what it needs of this bucket
            raise RuntimeError(f"the consumer did not acknowledge bucket {index}")
        shared += flat.numel()
        del flat
    connection.send(("end", None))
    return shared


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
