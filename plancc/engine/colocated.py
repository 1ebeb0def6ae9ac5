"""Weights to a consumer on the same device in another process (a rollout engine colocated with
the policy on one GPU), bucket by bucket, by handle instead of by copy over a socket: each
bucket is gathered into a flat buffer and handed over with torch.multiprocessing's reductions
-- a CUDA IPC handle for a CUDA buffer, shared memory for a CPU one -- through a
``multiprocessing`` connection. The consumer's tensors are views into that buffer; it answers
once it is done with a bucket.

Two buffers per refit, allocated once at its start and used in turn: bucket k+1 is packed while
the consumer copies bucket k, and a buffer is packed again only after the consumer has answered
for the bucket it held (so a failure the consumer causes is seen at most two buckets after the
bucket it concerns). Both buffers are handed over once, at the refit's start -- one CUDA IPC
handle or one shared-memory file each -- and a bucket is then only its number on the
connection (bucket k is in buffer k % 2; the manifest says its bytes): handing a tensor over
costs torch an IPC event, a reference-counter file and a handle per message, more host time
than a 256 MiB bucket's copy on the device. Both buffers are freed when the refit ends, so
nothing is held between refits, when the GPU belongs to the rollout engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import faults
from .bucket import Pair
from .channel import WeightChannelError, check_manifest, largest_of_each_turn, pack_into, unpack


def share_buckets(
    connection: Any,
    manifest: Mapping[str, Any],
    buckets: Iterator[Iterable[Pair]],
    device: str,
    *,
    timeout: float = 60.0,
) -> int:
    """The producer's side: each bucket packed into one buffer and handed over; returns bytes.
    The consumer has ``timeout`` seconds to take each bucket: a consumer that hangs or dies is
    a ``WeightChannelError`` naming the bucket, never a wait without end."""
    check_manifest(manifest)
    connection.send(("manifest", dict(manifest)))
    pool = _buffers(manifest, device)
    _hand_over(connection, ("buffers", pool), 0)
    shared = 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    unanswered: deque[int] = deque()
    for index, (bucket, expected) in enumerate(zip(buckets, manifest["buckets"], strict=True)):
        faults.inject("pack", rank=rank, step=index + 1)
        if len(unanswered) == len(pool):  # this buffer's last bucket is the oldest unanswered one
            _acknowledged(connection, unanswered.popleft(), timeout)
        flat = pool[index % len(pool)][: int(expected["bytes"])]
        pack_into(flat, bucket)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)  # the copies are done before the consumer reads
        _hand_over(connection, ("bucket", index), unanswered[0] if unanswered else index)
        unanswered.append(index)
        shared += flat.numel()
    while unanswered:
        _acknowledged(connection, unanswered.popleft(), timeout)
    connection.send(("end", None))
    return shared


def _buffers(manifest: Mapping[str, Any], device: str) -> list[torch.Tensor]:
    """The refit's two byte buffers: the first as large as its largest even-numbered bucket,
    the second its largest odd-numbered one (a bucket over the bucket size -- one large
    tensor -- then costs one buffer of its size, not two); shared memory on the CPU."""
    sizes = [int(b["bytes"]) for b in manifest["buckets"]]
    pool = []
    for size in largest_of_each_turn(sizes, 2):
        if size:
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            pool.append(flat.share_memory_() if flat.device.type == "cpu" else flat)
    return pool


def _hand_over(connection: Any, message: tuple, index: int) -> None:
    """Sends ``message``; a consumer gone fails naming ``index``, the first bucket it did not take."""
    try:
        connection.send(message)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        raise WeightChannelError(
            f"the colocated consumer is gone (its end closed) before taking bucket {index + 1}"
        ) from None


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
    kind, pool = connection.recv()  # the producer's buffers, mapped once for the refit
    if kind != "buffers":
        raise RuntimeError(f"expected the refit's buffers after the manifest, got {kind!r}")
    while True:
        message = connection.recv()
        if message[0] == "end":
            return
        _, index = message
        expected = manifest["buckets"][index]
        flat = pool[index % len(pool)][: int(expected["bytes"])]
        yield from unpack(flat, expected["tensors"])
        if flat.is_cuda:  # the caller's copies out of the buffer have run before it is refilled
            torch.cuda.synchronize(flat.device)
        connection.send(("done", index))
