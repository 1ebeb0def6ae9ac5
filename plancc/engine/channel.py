"""Weights to a running rollout engine with no disk: a process group of its own between the
policy's rank 0 and receiver processes started separately (another torchrun job, a Ray actor,
an inference server's worker), a manifest the receiver gets first, and the weights bucket by
bucket.

The channel is a TCP store plus a gloo (CPU) or nccl (CUDA) process group that is not the
default group: the policy's own collectives and the channel's never mix. Its rank 0 is the
policy's rank 0 (the sender); ranks 1.. are receivers. Before any bucket the two sides compare
digests of their manifests, so a receiver expecting another model or plan fails at once on
both sides instead of misreading bytes; every wait is bounded by the channel's timeout.

A bucket travels as one flat byte buffer (the tensors of the bucket one after the other, in
manifest order), broadcast from rank 0; the receiver keeps one buffer the size of the largest
bucket and reuses it, so its memory is bounded by the bucket (vLLM's packed broadcast does the
same). The tensors it yields are views into that buffer, valid until the next one is received:
an engine's ``load_weights`` copies them into its parameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import faults

FORMAT = "plancc-weights/1"


class WeightChannelError(RuntimeError):
    """The channel could not carry the weights: a peer missing or gone, or manifests that differ."""


@dataclass(slots=True)
class WeightChannel:
    """One end of a weight channel (``weight_channel``); reusable for every refit until
    ``close()``."""

    group: Any  # the channel's own ProcessGroup (None once closed)
    store: Any  # kept alive with the group
    rank: int
    world_size: int
    device: str
    timeout: timedelta
    # set when a transfer on the channel failed (a peer gone, a refit that failed on some rank):
    # its members may be mid-transfer or dead, so the channel carries nothing more, and closing it
    # skips the closing agreement that would wait the whole timeout for peers that never answer
    broken: bool = False
    # refits begun on this channel (every member counts its handshakes alike): a resharded
    # refit's store keys carry it, so that no refit reads an earlier one's layouts
    refits: int = 0
    # a resharded refit's transfer plan by the digests of every member's layout
    # (``engine.reshard``): computed once per pair of layouts, reused by every refit after
    plans: dict[tuple[int, ...], Any] = field(default_factory=dict)
    # a receiver's own parallelized meta model by (manifest digest, plan, tp): built once
    receiver_layouts: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    @property
    def port(self) -> int:
        """The port the channel meets at (rank 0 may open it at port 0: the system picks one)."""
        return int(self.store.port)

    def close(self) -> None:
        """End the channel on every member (collective over the channel). The sender tears its
        side down first and the receivers leave after it: a receiver's connection closing under
        a sender that is still connected surfaces, in gloo, as "connection closed by peer" in
        whatever collective the sender's process runs next -- its policy's own."""
        if self.group is None:
            return
        if self.broken:  # nothing to agree on with peers that may be gone: tear down locally
            self.group = None
            if self.is_sender:  # a receiver that waits for it in its own close() stops waiting
                with contextlib.suppress(Exception):
                    self.store.set("sender_closed", "1")
            return
        try:
            with contextlib.suppress(WeightChannelError):  # a peer already gone: nothing to agree with
                self.any(False, "closing")
        finally:
            if self.is_sender:
                self.group = None
                self.store.set("sender_closed", "1")
            else:
                with contextlib.suppress(Exception):  # the sender is gone already: nothing to wait for
                    self.store.wait(["sender_closed"], self.timeout)
                self.group = None

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    def _run(self, issue: Callable[[Any], Any], what: str) -> None:
        """``issue(group)`` (a collective or a point-to-point op), waited for within the timeout."""
        if self.group is None:
            raise WeightChannelError(f"weight channel rank {self.rank}: {what}: the channel is closed")
        if self.broken:
            raise WeightChannelError(
                f"weight channel rank {self.rank}: {what}: an earlier transfer on this channel failed; "
                "close it and open a new one (plancc.weight_channel)"
            )
        try:
            issue(self.group).wait(self.timeout)
        except Exception as exc:  # gloo / nccl say "timed out" or "connection closed" in their words
            self.broken = True
            peer = "the receivers" if self.is_sender else "the policy (channel rank 0)"
            raise WeightChannelError(
                f"weight channel rank {self.rank}: {what}: no answer from {peer} within "
                f"{self.timeout.total_seconds():g}s ({str(exc).splitlines()[0][:200]})"
            ) from None

    def broadcast(self, tensor: torch.Tensor, what: str, *, root: int = 0) -> None:
        """``tensor`` from channel rank ``root`` to every member (in place on the others): the
        weights go from rank 0; a rollout engine may answer the same way (its rollouts)."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        self._run(lambda group: group.broadcast([tensor], options), what)

    def send(self, tensor: torch.Tensor, to: int, tag: int, what: str) -> None:
        """``tensor`` to channel rank ``to`` alone (a resharded refit's point-to-point pieces)."""
        self._run(lambda group: group.send([tensor], to, tag), what)

    def recv(self, tensor: torch.Tensor, source: int, tag: int, what: str) -> None:
        """Into ``tensor``, what channel rank ``source`` sends with ``tag``."""
        self._run(lambda group: group.recv([tensor], source, tag), what)

    def gather(self, value: int, what: str) -> list[int]:
        """Every member's ``value`` (an int64), in channel rank order."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run(lambda group: group.allgather([out], [mine]), what)
        return torch.cat(out).tolist()

    def any(self, flag: bool, what: str) -> bool:
        """Whether any member of the channel says ``flag``."""
        t = torch.tensor([int(flag)], device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # the stubs type it as RedOpType
        self._run(lambda group: group.allreduce([t], options), what)
        return bool(t.item())


def weight_channel(
    host: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    backend: str | None = None,
    timeout: float = 60.0,
    on_open: Callable[[int], None] | None = None,
) -> WeightChannel:
    """Join (rank 0: open) the weight channel at ``host:port`` of ``world_size`` members: the
    policy's rank 0 as rank 0, receivers as 1..world_size-1. Rank 0 may pass port 0 and an
    ``on_open(port)`` that tells the receivers the port the system picked (before it waits for
    them): no port is chosen in advance and taken by someone else meanwhile.
    ``backend``: gloo or nccl (default: nccl when CUDA is available). Every member must join
    within ``timeout`` seconds."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a channel of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    wait = timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=wait, wait_for_workers=False)
        if on_open is not None:
            on_open(int(store.port))
        store.add("joined", 1)
        store.wait(["joined"], wait)
        _wait_for_all(store, world_size, wait)
    except WeightChannelError:
        raise
    except Exception as exc:
        raise WeightChannelError(
            f"weight channel rank {rank}: could not meet the other {world_size - 1} member(s) at {host}:{port} "
            f"within {timeout:g}s ({str(exc).splitlines()[0][:200]})"
        ) from None
    if backend == "nccl":
        group: Any = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options(wait))
        device = "cuda"
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, wait)
        device = "cpu"
    return WeightChannel(group, store, rank, world_size, device, wait)


def nccl_options(timeout: timedelta) -> Any:
    """NCCL options carrying the channel's timeout: built bare, a ``ProcessGroupNCCL`` takes
    NCCL's default (10 minutes) and the channel's timeout never reaches its watchdog. torch's own
    ``new_group`` sets it the same way (``backend_options._timeout``, torch 2.13)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    return options


def _wait_for_all(store: Any, world_size: int, wait: timedelta) -> None:
    """Until every member has joined (the store counts them), or the timeout."""
    import time

    deadline = time.monotonic() + wait.total_seconds()
    while int(store.add("joined", 0)) < world_size:
        if time.monotonic() > deadline:
            joined = int(store.add("joined", 0))
            raise WeightChannelError(
                f"weight channel: {joined} of {world_size} members joined within {wait.total_seconds():g}s; "
                "the missing ones never connected"
            )
        time.sleep(0.05)


# ----------------------------------------------------------------------------- manifest
def make_manifest(
    buckets: list[list[tuple[str, tuple[int, ...], torch.dtype]]],
    *,
    model: str,
    config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The JSON-serialisable description of what will be sent: every tensor's name, shape and
    dtype, bucket by bucket, with each bucket's size in bytes, and the model's config (a
    receiver that reshards builds the model's layout from it) and the dtype floating tensors are
    sent in (null: each its own)."""
    out = []
    for bucket in buckets:
        tensors = [
            {"name": n, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")} for n, shape, dtype in bucket
        ]
        out.append({"bytes": sum(aligned(entry_nbytes(t)) for t in tensors), "tensors": tensors})
    sent_as = str(dtype).removeprefix("torch.") if dtype is not None else None
    return {"format": FORMAT, "model": model, "config": config or {}, "dtype": sent_as, "buckets": out}


def manifest_dtype(manifest: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype floating tensors are sent in, or None (each its own)."""
    name = manifest.get("dtype")
    return _dtype(name) if name else None


def entry_nbytes(entry: Mapping[str, Any]) -> int:
    count = 1
    for size in entry["shape"]:
        count *= int(size)
    return count * _dtype(entry["dtype"]).itemsize


ALIGN = 8  # every tensor starts 8-byte aligned in a bucket's buffer (a dtype view needs it)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise WeightChannelError(f"manifest: unknown dtype {name!r}")
    return value


def digest(manifest: Mapping[str, Any]) -> int:
    """A 63-bit fingerprint of a manifest (both sides compare it before any bucket)."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def check_manifest(manifest: Any) -> None:
    if (
        not isinstance(manifest, Mapping)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("buckets"), list)
    ):
        raise WeightChannelError(f"not a plancc weights manifest (format {FORMAT!r} with 'buckets')")


def handshake(channel: WeightChannel, manifest: Mapping[str, Any]) -> None:
    """Rank 0's manifest digest to every receiver; any mismatch fails every member at once."""
    channel.refits += 1
    mine = digest(manifest)
    theirs = torch.tensor([mine, len(manifest["buckets"])], dtype=torch.int64, device=channel.device)
    channel.broadcast(theirs, "manifest handshake")
    differs = int(theirs[0].item()) != mine
    if channel.any(differs, "manifest handshake"):
        who = "this receiver's" if differs else "a receiver's"
        raise WeightChannelError(
            f"weight channel rank {channel.rank}: {who} manifest differs from the policy's (another model, "
            f"plan, dtype or bucket size): the policy sends {int(theirs[1].item())} buckets, this side expected "
            f"{len(manifest['buckets'])}; nothing was sent"
        )


def send_buckets(
    channel: WeightChannel, manifest: Mapping[str, Any], buckets: Iterator[list[tuple[str, torch.Tensor]]]
) -> int:
    """Rank 0's side: the manifest handshake, then each bucket as one buffer. Returns bytes sent."""
    check_manifest(manifest)
    handshake(channel, manifest)
    try:
        return _send_each(channel, manifest, buckets)
    except Exception:  # mid-transfer: the receivers wait for a bucket that will not come
        channel.broken = True
        raise


def _send_each(
    channel: WeightChannel, manifest: Mapping[str, Any], buckets: Iterator[list[tuple[str, torch.Tensor]]]
) -> int:
    """Each bucket packed into one buffer allocated once (zeroed once: alignment gaps never carry
    stale host memory) and broadcast; a bucket of one tensor goes as its own bytes, uncopied.
    Waited for bucket by bucket: a second buffer in flight (packing k + 1 while k is on the
    wire) measured slower on gloo and held two buckets more (``docs/performance.md``)."""
    count = len(manifest["buckets"])
    largest = max((int(b["bytes"]) for b in manifest["buckets"]), default=0)
    buffer: torch.Tensor | None = None
    sent = 0
    for index, (bucket, expected) in enumerate(zip(buckets, manifest["buckets"], strict=True)):
        names = [n for n, _ in bucket]
        if names != [t["name"] for t in expected["tensors"]]:
            raise WeightChannelError(f"bucket {index}: the weights do not follow the manifest ({names[:3]} ...)")
        flat = _alone(bucket, int(expected["bytes"]), channel.device)
        if flat is None:
            if buffer is None:  # only when some bucket packs several tensors
                buffer = torch.zeros(largest, dtype=torch.uint8, device=channel.device)
            flat = pack_into(buffer[: int(expected["bytes"])], bucket)
        faults.inject("send", rank=dist.get_rank() if dist.is_initialized() else 0, step=index + 1)
        channel.broadcast(flat, f"bucket {index} of {count}")
        sent += flat.numel()
        del flat
    return sent


def _alone(bucket: list[tuple[str, torch.Tensor]], nbytes: int, device: str) -> torch.Tensor | None:
    """A bucket of one tensor (one larger than a bucket, or the last) as its own bytes, with no
    copy, when they are the bucket's bytes exactly; else None."""
    if len(bucket) != 1:
        return None
    tensor = bucket[0][1]
    if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes or tensor.device.type != device:
        return None
    bucket.clear()
    return tensor.detach().reshape(-1).view(torch.uint8)


def pack_into(flat: torch.Tensor, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket's tensors one after the other (each 8-byte aligned) in the byte buffer
    ``flat``, each freed once copied: the bucket is held once, not twice. Empties ``bucket``."""
    offset = 0
    bucket.reverse()
    while bucket:
        _, tensor = bucket.pop()
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset : offset + raw.numel()] = raw.to(flat.device)
        offset += aligned(raw.numel())
        del tensor, raw
    return flat


def unpack(flat: torch.Tensor, entries: list[Mapping[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view into flat)`` of each manifest entry of a bucket ``pack_into`` laid out."""
    offset = 0
    for entry in entries:
        size = entry_nbytes(entry)
        yield entry["name"], flat[offset : offset + size].view(_dtype(entry["dtype"])).reshape(entry["shape"])
        offset += aligned(size)


def receive_buckets(channel: WeightChannel, manifest: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side: ``(hf_name, tensor)`` of every weight the policy sends, one bucket in
    flight at a time, each tensor a view into one reused buffer (valid until the next bucket)."""
    check_manifest(manifest)
    handshake(channel, manifest)
    largest = max((int(b["bytes"]) for b in manifest["buckets"]), default=0)
    buffer = torch.empty(largest, dtype=torch.uint8, device=channel.device)
    count = len(manifest["buckets"])
    for index, bucket in enumerate(manifest["buckets"]):
        flat = buffer[: int(bucket["bytes"])]
        channel.broadcast(flat, f"bucket {index} of {count}")
        yield from unpack(flat, bucket["tensors"])
