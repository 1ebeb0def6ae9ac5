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
manifest order), broadcast from rank 0. Each side keeps ``in_flight`` buffers, allocated once a
refit and used in turn, so its memory is bounded by that many buckets (vLLM's packed broadcast
does the same): with two (the default on nccl), the sender packs bucket k + 1 while bucket k is
on the wire and a receiver's engine loads bucket k while k + 1 arrives. A buffer is filled again
only once the broadcast that last used it is done; on nccl that wait orders the CUDA stream, not
the host, which waits once a refit, for the last bucket, within the channel's timeout (a peer
gone mid-refit is reported there, or by NCCL's watchdog at the same timeout). The tensors a
receiver yields are views into a buffer, valid until the next bucket is asked for: an engine's
``load_weights`` copies them into its parameters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import faults
from .bucket import Pair, names_of, one_by_one

FORMAT = "plancc-weights/1"


class WeightChannelError(RuntimeError):
    """The channel could not carry the weights: a peer missing or gone, or manifests that differ."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """An op started on the channel and not yet waited for (``WeightChannel.start``)."""

    work: Any
    what: str
    tensor: torch.Tensor | None  # what the op reads or fills: alive until it is done


def _broadcast(tensor: torch.Tensor, root: int) -> Callable[[Any], Any]:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    return lambda group: group.broadcast([tensor], options)


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
    # buckets on the wire at once, each in a buffer of its own (``weight_channel``)
    in_flight: int = 1

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
        self.finish(self.start(issue, what, None), on_host=True)

    def start(self, issue: Callable[[Any], Any], what: str, tensor: torch.Tensor | None) -> InFlight:
        """``issue(group)``, not waited for: ``finish`` it (``tensor``, the one it reads or
        fills, is kept alive until then)."""
        if self.group is None:
            raise WeightChannelError(f"weight channel rank {self.rank}: {what}: the channel is closed")
        if self.broken:
            raise WeightChannelError(
                f"weight channel rank {self.rank}: {what}: an earlier transfer on this channel failed; "
                "close it and open a new one (plancc.weight_channel)"
            )
        try:
            return InFlight(issue(self.group), what, tensor)
        except Exception as exc:
            raise self._failed(what, exc) from None

    def finish(self, flight: InFlight, *, on_host: bool) -> None:
        """Wait for a started op: on the host within the timeout when ``on_host`` (and always on
        gloo, whose ops are the host's work), else -- nccl -- by ordering the current CUDA stream
        after it, so that the host goes on queuing work."""
        try:
            if on_host or self.device == "cpu":
                flight.work.wait(self.timeout)
            else:
                flight.work.wait()
        except Exception as exc:  # gloo / nccl say "timed out" or "connection closed" in their words
            raise self._failed(flight.what, exc) from None

    def _failed(self, what: str, exc: Exception) -> WeightChannelError:
        self.broken = True
        peer = "the receivers" if self.is_sender else "the policy (channel rank 0)"
        return WeightChannelError(
            f"weight channel rank {self.rank}: {what}: no answer from {peer} within "
            f"{self.timeout.total_seconds():g}s ({str(exc).splitlines()[0][:200]})"
        )

    def broadcast(self, tensor: torch.Tensor, what: str, *, root: int = 0) -> None:
        """``tensor`` from channel rank ``root`` to every member (in place on the others): the
        weights go from rank 0; a rollout engine may answer the same way (its rollouts)."""
        self._run(_broadcast(tensor, root), what)

    def start_broadcast(self, tensor: torch.Tensor, what: str) -> InFlight:
        """``broadcast`` from rank 0, started and not waited for (``finish`` it)."""
        return self.start(_broadcast(tensor, 0), what, tensor)

    def start_send(self, tensor: torch.Tensor, to: int, tag: int, what: str) -> InFlight:
        """``tensor`` to channel rank ``to`` alone (a resharded refit's point-to-point pieces),
        started and not waited for (``finish`` it)."""
        return self.start(lambda group: group.send([tensor], to, tag), what, tensor)

    def start_recv(self, tensor: torch.Tensor, source: int, tag: int, what: str) -> InFlight:
        """Into ``tensor``, what channel rank ``source`` sends with ``tag``, started and not waited
        for (``finish`` it)."""
        return self.start(lambda group: group.recv([tensor], source, tag), what, tensor)

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
    in_flight: int | None = None,
) -> WeightChannel:
    """Join (rank 0: open) the weight channel at ``host:port`` of ``world_size`` members: the
    policy's rank 0 as rank 0, receivers as 1..world_size-1. Rank 0 may pass port 0 and an
    ``on_open(port)`` that tells the receivers the port the system picked (before it waits for
    them): no port is chosen in advance and taken by someone else meanwhile.
    ``backend``: gloo or nccl (default: nccl when CUDA is available). Every member must join
    within ``timeout`` seconds. ``in_flight``: buckets this member has on the wire at once, each
    in a buffer of its own (default 2 on nccl, whose copies overlap the packing; 1 on gloo, where
    packing the next bucket competes for the cores gloo sends with: ``docs/performance.md``);
    each member chooses its own."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a channel of {world_size}")
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1):
        raise ValueError(f"in_flight={in_flight!r}: a number of buckets, 1 or more")
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
    depth = in_flight or (2 if backend == "nccl" else 1)
    return WeightChannel(group, store, rank, world_size, device, wait, in_flight=depth)


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


def send_buckets(channel: WeightChannel, manifest: Mapping[str, Any], buckets: Iterator[Iterable[Pair]]) -> int:
    """Rank 0's side: the manifest handshake, then each bucket as one buffer. Returns bytes sent."""
    check_manifest(manifest)
    handshake(channel, manifest)
    try:
        return _send_each(channel, manifest, buckets)
    except Exception:  # mid-transfer: the receivers wait for a bucket that will not come
        channel.broken = True
        raise


def _send_each(channel: WeightChannel, manifest: Mapping[str, Any], buckets: Iterator[Iterable[Pair]]) -> int:
    """Each bucket packed into one of ``channel.in_flight`` buffers, used in turn, and broadcast
    without a wait: a buffer is packed again once the broadcast that last read it is done (the
    oldest one in flight). A bucket's tensors are taken one at a time (a ``Bucket`` gathers each
    as it is taken) and each freed once packed: the peak is the buffers and one tensor. A bucket
    of one tensor goes as its own bytes, uncopied (held until its broadcast is done). The
    buffers are allocated once a refit, zeroed (alignment gaps never carry stale memory), each
    as large as the largest bucket it packs."""
    count = len(manifest["buckets"])
    pool = _Buffers(manifest, channel.in_flight, channel.device)
    flights: deque[InFlight] = deque()
    sent = 0
    for index, (bucket, expected) in enumerate(zip(buckets, manifest["buckets"], strict=True)):
        names = names_of(bucket)
        if names != [t["name"] for t in expected["tensors"]]:
            raise WeightChannelError(f"bucket {index}: the weights do not follow the manifest ({names[:3]} ...)")
        if len(flights) == channel.in_flight:  # the oldest broadcast's buffer is this bucket's
            channel.finish(flights.popleft(), on_host=False)
        flat = None
        if len(names) == 1:  # taken (gathered) now: sent as its own bytes when they are the bucket's
            bucket = list(bucket)
            flat = _alone(bucket, int(expected["bytes"]), channel.device)
        if flat is None:
            flat = pack_into(pool.slot(index, int(expected["bytes"])), bucket)
        faults.inject("send", rank=dist.get_rank() if dist.is_initialized() else 0, step=index + 1)
        flights.append(channel.start_broadcast(flat, f"bucket {index} of {count}"))
        sent += flat.numel()
        del flat
    while flights:  # the host waits once: for the last bucket, and so for every one before it
        channel.finish(flights.popleft(), on_host=not flights)
    return sent


def largest_of_each_turn(sizes: list[int], depth: int) -> list[int]:
    """The size of each of ``depth`` buffers used in turn (bucket k in buffer k % depth): the
    largest bucket of its turn (0 for a turn no bucket has)."""
    return [max(sizes[turn::depth], default=0) for turn in range(depth)]


class _Buffers:
    """A sender's byte buffers: bucket k is packed in buffer k % depth, allocated (zeroed) when
    first needed, as large as the largest bucket of that turn that the manifest says packs
    several tensors (a bucket of one tensor is usually sent as its own bytes)."""

    def __init__(self, manifest: Mapping[str, Any], depth: int, device: str) -> None:
        self.depth, self.device = depth, device
        packed = [int(b["bytes"]) if len(b["tensors"]) > 1 else 0 for b in manifest["buckets"]]
        self.sizes = largest_of_each_turn(packed, depth)
        self.buffers: list[torch.Tensor | None] = [None] * depth

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of bucket ``index``'s buffer."""
        turn = index % self.depth
        buffer = self.buffers[turn]
        if buffer is None or buffer.numel() < nbytes:  # a one-tensor bucket that must be packed grows it
            buffer = torch.zeros(max(nbytes, self.sizes[turn]), dtype=torch.uint8, device=self.device)
            self.buffers[turn] = buffer
        return buffer[:nbytes]


def _alone(bucket: list[Pair], nbytes: int, device: str) -> torch.Tensor | None:
    """A bucket of one tensor (one larger than a bucket, or the last; the caller checked it is
    one) as its own bytes, with no copy, when they are the bucket's bytes exactly; else None."""
    ((_, tensor),) = bucket
    if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes or tensor.device.type != device:
        return None
    bucket.clear()
    return tensor.detach().reshape(-1).view(torch.uint8)


def pack_into(flat: torch.Tensor, bucket: Iterable[Pair]) -> torch.Tensor:
    """The bucket's tensors one after the other (each 8-byte aligned) in the byte buffer
    ``flat``, each taken (a ``Bucket`` gathers it then) and freed once copied: the bucket is
    never held twice, and a ``Bucket`` never whole. Empties ``bucket``."""
    offset = 0
    for _, tensor in one_by_one(bucket):
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
    """A receiver's side: ``(hf_name, tensor)`` of every weight the policy sends, each a view into
    one of ``channel.in_flight`` buffers used in turn (valid until the next bucket is asked for).
    The next buckets' broadcasts are started before a bucket is handed on, so they arrive while
    the caller loads it; a buffer is filled again only once the caller has moved past its
    bucket."""
    check_manifest(manifest)
    handshake(channel, manifest)
    sizes = [int(b["bytes"]) for b in manifest["buckets"]]
    count, depth = len(sizes), channel.in_flight
    pool = [torch.empty(size, dtype=torch.uint8, device=channel.device) for size in largest_of_each_turn(sizes, depth)]

    def start(index: int) -> InFlight:
        flat = pool[index % depth][: sizes[index]]
        return channel.start_broadcast(flat, f"bucket {index} of {count}")

    flights = deque(start(index) for index in range(min(depth, count)))
    for index, bucket in enumerate(manifest["buckets"]):
        flight = flights.popleft()
        channel.finish(flight, on_host=index == count - 1)  # the host waits for the last bucket alone
        assert flight.tensor is not None  # a broadcast's buffer
        yield from unpack(flight.tensor, bucket["tensors"])
        if index + depth < count:  # the caller is done with this bucket's buffer
            flights.append(start(index + depth))
