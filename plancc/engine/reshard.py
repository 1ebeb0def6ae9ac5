"""Resharded refit: every rank of a rollout engine gets only its own shard of each weight, sent
straight from the policy ranks that hold those elements.

Both sides know their layouts as data: a parameter's DTensor placements on its mesh say which
box of the global tensor (offsets and lengths per dim) a rank holds. Every member of the channel
publishes its boxes in the channel's store; the policy ranks publish theirs (and which of them
own a box: of the ranks that hold the same replicated elements, the first), the receivers
theirs (from their own plan at their own tensor-parallel size). Both sides then walk the same
list of transfers -- for each parameter, each receiver, each policy owner: the intersection of
the two boxes -- in the same order, as point-to-point messages over the channel: a global order,
so no cycle of waits. A receiver gets exactly its shard, whatever the two layouts are. The list
is computed once per pair of layouts and kept on the channel (``transfer_plan``): a later
refit's members all-gather their layouts' digests and, finding them known, publish and read
nothing (Perplexity's static transfer schedule, computed once).

Under pipeline stages a policy rank publishes boxes for its stages' tensors alone, at the whole
model's names: every piece goes out from a rank of the stage that holds it, straight to its
receiver, and nothing crosses the pipeline first (a tied weight's copy on the last stage is not
one of the model's names: the first stage sends the weight).

FSDP2 over a dim TP also shards (``_StridedShard`` on dp, at dp > 1: every column-sharded weight
under FSDP x TP) cuts each tp shard into dp rows, a box torch's own rule gives: each policy rank
sends its piece of those too. A parameter whose local elements are no box (a ``Partial``, or a
strided layout torch's box does not cover) is gathered whole by the policy's ranks and sent from
rank 0: the only tensors any policy rank gathers are those whose layouts do not line up. Each is
gathered when the walk reaches its first transfer (every policy rank walks the same list, so
the gathers line up) and dropped after its last, so a rank holds one such tensor at a time,
never all of them together.

``dtype`` (the manifest's, from ``send_weights(dtype=)``): floating pieces are sent in it and
the receivers' shards are made in it.

No piece is waited for on its own: a policy rank starts its sends and waits for the oldest only
once ``in_flight`` buckets' bytes are on the wire, and a receiver starts every receive of a
parameter before it waits for the first. On nccl those waits order the CUDA stream; the host
waits once a refit, for the last piece (``engine.channel``).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..runtime import faults
from ..runtime.local_tensors import full_value, local_tensor
from ..runtime.lora import adapters_of, merged
from .channel import InFlight, WeightChannel, WeightChannelError, digest
from .refit_agreement import RefitAgreement

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths) in the global tensor


def local_box(param: torch.Tensor) -> tuple[Box | None, bool]:
    """(the box of the global tensor this rank holds, or None when its elements are no box;
    whether this rank is the one that sends it: the first of the ranks holding the same box)."""
    if not isinstance(param, DTensor):
        return (tuple(0 for _ in param.shape), tuple(param.shape)), True
    mesh, placements = param.device_mesh, list(param.placements)
    owner = True
    for axis, placement in enumerate(placements):
        if mesh.size(axis) == 1:
            placements[axis] = Replicate()  # a size-1 axis shards nothing
        elif isinstance(placement, Replicate):
            owner = owner and mesh.get_local_rank(axis) == 0
        elif not isinstance(placement, Shard | _StridedShard):  # Partial: no box of the global tensor
            return None, False
    lengths, offsets = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    box = (tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
    # FSDP2 over a dim TP also shards (``_StridedShard(0, sf=tp)`` on dp, ``Shard(0)`` on tp) cuts
    # each tp shard into dp rows: contiguous, and torch's rule gives their box. A strided layout
    # whose elements are not one box (the box's size differs from the local shard's) is gathered.
    if math.prod(box[1]) != param.to_local().numel():
        return None, False
    return box, owner


def intersect(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for (ao, al), (bo, bl) in zip(zip(*a, strict=True), zip(*b, strict=True), strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def _slices(box: Box, within: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor holding ``within``."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(box[0], box[1], within[0], strict=True))


def _key(refit: int, rank: int) -> str:
    return f"boxes/{refit}/{rank}"


def _publish(channel: WeightChannel, boxes: Mapping[str, Any]) -> None:
    """This rank's boxes for this refit; its previous refit's key deleted (every member has
    passed this refit's handshake, so none reads the previous layouts any more)."""
    channel.store.set(_key(channel.refits, channel.rank), json.dumps(boxes))
    if channel.refits > 1:
        with contextlib.suppress(Exception):  # a store without delete_key keeps it: the keys differ anyway
            channel.store.delete_key(_key(channel.refits - 1, channel.rank))


def _read(channel: WeightChannel, rank: int) -> dict[str, Any]:
    key = _key(channel.refits, rank)
    try:
        channel.store.wait([key], channel.timeout)
    except Exception:
        raise WeightChannelError(
            f"weight channel rank {channel.rank}: rank {rank} published no layout within "
            f"{channel.timeout.total_seconds():g}s"
        ) from None
    return dict(json.loads(channel.store.get(key)))


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Every member's boxes (the policy ranks', then the receivers') and every message of a refit
    between them, in the one order both sides walk."""

    policy: list[dict[str, Any]]
    receivers: list[dict[str, Any]]
    transfers: list[tuple[str, int, int, Box]]


def transfer_plan(channel: WeightChannel, mine: dict[str, Any], names: list[str], policy_world: int) -> TransferPlan:
    """The refit's transfer plan: computed from every member's published boxes the first time
    these layouts meet on ``channel``, then reused -- one all-gather of the layouts' digests (and
    one agreement that every member knows them) replaces the store's reads of every member's
    boxes and the walk over every parameter, receiver and policy rank."""
    digests = tuple(channel.gather(digest(mine), "the refit's layouts"))
    known = channel.plans.get(digests)
    if not channel.any(known is None, "the refit's layouts"):
        assert known is not None, "no member lacks the plan, this one included"
        return known
    _publish(channel, mine)
    every = [mine if r == channel.rank else _read(channel, r) for r in range(channel.world_size)]
    policy, receivers = every[:policy_world], every[policy_world:]
    plan = TransferPlan(policy, receivers, list(_transfers(names, policy, receivers, policy_world)))
    channel.plans[digests] = plan
    return plan


def _transfers(
    names: list[str], policy: list[dict[str, Any]], receivers: list[dict[str, Any]], first_receiver: int
) -> Iterator[tuple[str, int, int, Box]]:
    """(parameter, policy rank, receiver channel rank, box) of every message, in one order."""
    for name in names:
        for r, wanted in enumerate(receivers):
            want = _box(wanted[name]["box"])
            for p, held in enumerate(policy):
                entry = held.get(name)  # None: another pipeline stage's
                if entry is None or not entry["owner"]:
                    continue
                if entry.get("gathered") and any(name in boxes for boxes in policy[:p]):
                    continue  # gathered whole by its holders: the first of them alone sends it
                part = intersect(_box(entry["box"]), want)
                if part is not None:
                    yield name, p, first_receiver + r, part


def _box(value: Any) -> Box:
    offsets, lengths = value
    return tuple(offsets), tuple(lengths)


def _whole(param: torch.Tensor) -> torch.Tensor:
    return full_value(param).detach()


def _merged_piece(piece: torch.Tensor, part: Box, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``piece`` of a base weight (its ``part`` of the global ``[out, in]`` tensor) plus the same
    block of ``scale * B @ A``: the merged weight's piece (``runtime.lora.merged``, blockwise)."""
    (row, col), (rows, cols) = part
    return merged(piece, a[:, col : col + cols], b[row : row + rows], scale)


def send_shards(
    channel: WeightChannel,
    model: nn.Module,
    *,
    receivers: int,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    bucket_bytes: int = 512 * 2**20,
    held: nn.Module | None = None,
    values: Callable[[str], torch.Tensor] | None = None,
) -> int:
    """The policy's side (every policy rank; channel rank == its global rank). Returns bytes
    this rank sent, with at most ``channel.in_flight * bucket_bytes`` of them unfinished at a
    time. A problem on any policy rank is raised on every one (``engine.refit_agreement``;
    ``device``: the policy's process group's).

    With pipeline stages ``model`` is the whole model on meta (the names every rank walks, in one
    order), ``held`` this rank's stages at the model's names and ``values`` a tensor's full value
    from its stage (``engine.pipeline.stage_values``): a rank publishes boxes for what it holds only, so
    each piece goes out from the stage that holds it, and nothing crosses the pipeline."""
    agreement = RefitAgreement(device, unit="transfer")
    flights = _Sends(channel, agreement, channel.in_flight * bucket_bytes)
    params = dict(model.named_parameters())  # the names, in the order every member walks
    mine = dict((held or model).named_parameters())  # the tensors this rank holds
    # LoRA: the receivers hold the base model; each adapted weight goes out merged, piece by
    # piece (a piece's block of B @ A from the adapters, gathered whole first: r x (in + out))
    adapters = adapters_of(model)
    whole = values if values is not None else (lambda name: _whole(params[name]))
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if adapters is not None:
        for base, (a, b) in adapters.by_base_weight().items():  # collective, in one order on every rank
            deltas[base] = (whole(a), whole(b))
        for name in adapters.parameter_names():
            del params[name]
    boxes = {}
    for name in params:
        param = mine.get(name)
        if param is None:  # another pipeline stage's
            continue
        found, owner = local_box(param)
        # no box here: gathered whole by its ranks when its turn comes, the first of them sends
        box = found if found is not None else (tuple(0 for _ in param.shape), tuple(param.shape))
        boxes[name] = {"box": [list(box[0]), list(box[1])], "owner": owner or found is None, "gathered": found is None}
    plan = transfer_plan(channel, boxes, list(params), channel.world_size - receivers)
    policy, transfers = plan.policy, plan.transfers
    # every policy rank knows which tensors are gathered (the plan holds every rank's boxes), so
    # all of them settle at the same transfers, holders or not
    strided = {name for boxes_of in policy for name, entry in boxes_of.items() if entry.get("gathered")}
    last = {name: index for index, (name, *_) in enumerate(transfers)}
    sent, gathered, held_name = 0, None, None
    for index, (name, p, r, part) in enumerate(transfers):
        agreement.bucket = index + 1
        if name in strided and name != held_name:  # collective: every policy rank is here now
            agreement.settle()
            # the holders gather it (a collective over their stage's mesh alone)
            gathered = full_value(mine[name]).detach() if name in mine else None
            held_name = name
        if p == channel.rank and not agreement.problem:  # after a failure this rank sends no more
            try:
                faults.inject("send", rank=channel.rank, step=index + 1)
                held_value = gathered if name == held_name else local_tensor(mine[name]).detach()
                assert held_value is not None, "a transfer's sender holds its tensor"
                piece = held_value[_slices(part, _box(policy[p][name]["box"]))]
                if name in deltas:
                    piece = _merged_piece(piece, part, *deltas[name], adapters.spec.scale if adapters else 1.0)
                if dtype is not None and piece.is_floating_point():
                    piece = piece.to(dtype)
                piece = piece.contiguous().to(channel.device)
                flights.send(piece, r, index, f"{name} to channel rank {r}")
                sent += piece.numel() * piece.element_size()
                del piece
            except Exception as exc:
                agreement.note(exc)
        if name == held_name and index == last[name]:
            gathered, held_name = None, None  # its last transfer: dropped before the next gather
    flights.drain()
    agreement.settle()
    return sent


class _Sends:
    """A policy rank's sends in flight, oldest first, finished once their bytes pass ``budget``
    and all at the end; a failed one is noted (raised on every rank at the next settle)."""

    def __init__(self, channel: WeightChannel, agreement: RefitAgreement, budget: int) -> None:
        self.channel, self.agreement, self.budget = channel, agreement, budget
        self.flights: deque[InFlight] = deque()
        self.held = 0

    def send(self, piece: torch.Tensor, to: int, tag: int, what: str) -> None:
        self.flights.append(self.channel.start_send(piece, to, tag, what))
        self.held += piece.numel() * piece.element_size()
        while self.held > self.budget and len(self.flights) > 1:
            self._finish_oldest(on_host=False)

    def drain(self) -> None:
        """Every send finished; the host waits for the last (and so for every one before it)."""
        while self.flights:
            self._finish_oldest(on_host=len(self.flights) == 1)

    def _finish_oldest(self, *, on_host: bool) -> None:
        flight = self.flights.popleft()
        assert flight.tensor is not None  # a send's piece
        self.held -= flight.tensor.numel() * flight.tensor.element_size()
        try:
            self.channel.finish(flight, on_host=on_host)
        except Exception as exc:  # the receiver is gone: this rank sends no more
            self.agreement.note(exc)


def receive_shards(
    channel: WeightChannel, model: nn.Module, *, policy_world: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor, int]]:
    """A receiver's side: (name, this rank's local shard, bytes received for it) of every
    parameter of ``model`` (the receiver's own parallelized model, meta or real), in order;
    floating shards in ``dtype`` when the sender sends in one."""
    params = dict(model.named_parameters())
    mine = {}
    for name, param in params.items():
        box, _ = local_box(param)
        if box is None:
            raise WeightChannelError(
                f"the receiver's layout of {name} is no box of the tensor ({getattr(param, 'placements', None)})"
            )
        mine[name] = {"box": [list(box[0]), list(box[1])], "owner": True}
    plan = transfer_plan(channel, mine, list(params), policy_world)
    incoming: dict[str, list[tuple[int, int, Box]]] = {}  # this receiver's transfers by parameter, in order
    for index, (name, p, r, part) in enumerate(plan.transfers):
        if r == channel.rank:
            incoming.setdefault(name, []).append((index, p, part))
    for position, (name, pieces) in enumerate(incoming.items()):
        box = _box(mine[name]["box"])
        kind = params[name].dtype
        wanted = dtype if dtype is not None and kind.is_floating_point else kind
        shard = torch.empty(box[1], dtype=wanted, device=channel.device)
        started = []
        for index, p, part in pieces:  # all of the parameter's pieces on the wire at once
            whole = part == box  # one piece is the whole shard: received in place
            piece = shard if whole else torch.empty(part[1], dtype=wanted, device=channel.device)
            started.append((channel.start_recv(piece, p, index, f"{name} from channel rank {p}"), part))
        got = 0
        for number, (flight, part) in enumerate(started):
            last = position == len(incoming) - 1 and number == len(started) - 1
            channel.finish(flight, on_host=last)  # the host waits for the refit's last piece alone
            assert flight.tensor is not None  # a receive's buffer
            if flight.tensor is not shard:
                shard[_slices(part, box)] = flight.tensor
            got += flight.tensor.numel() * flight.tensor.element_size()
        yield name, shard, got
