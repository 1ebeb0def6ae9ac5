"""Packed (fused) projections under tensor parallelism: ``gate_up_proj`` and its kind.

A packed Linear computes several projections at once, its output features laid out block after
block (``[gate | up]``), and its consumer splits them (``gate, up = x.chunk(2, dim=-1)``). Plain
colwise hands each rank a contiguous ``1/tp`` of *all* the features: at tp=2 rank 0 holds all
of gate and rank 1 all of up, so each rank's ``chunk`` pairs the wrong halves and the model
trains wrong without an error. Each rank must instead hold its ``1/tp`` of *every* block.

How: the weight stays an ordinary colwise ``Shard(0)`` DTensor in the Hugging Face layout, and
the output is regrouped by one all-to-all over tp so rank r ends up with ``[gate_r | up_r]``.
Why not shard the weight block-wise, as transformers does with DTensor's ``_StridedShard``:
torch.distributed.checkpoint cannot save such a tensor in torch 2.13 ("overlapping chunks"),
and a weight in the plain layout loads, saves, reshards and exports like every colwise weight.
The cost is one all-to-all of this rank's output (``(tp-1)/tp`` of it moves), less than the
all-gather of the whole output that transformers' ``colwise_gather_output`` plans use for these
modules, after which every rank would compute the activation on all features.

``packed_rowwise`` is the inverse: a rowwise Linear whose input arrives regrouped per block
(from a ``packed_colwise`` producer, unsplit) gets it back in the contiguous layout its
``Shard(1)`` weight expects.

The exchange is DTensor's shard-dim redistribute: an all-to-all under NCCL; gloo has none, so
on CPU torch all-gathers and keeps its chunk (the same numbers, more traffic).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

Routes = tuple[int, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


@cache
def _routes(blocks: int, tp: int, to_blocks: bool) -> Routes:
    """Where each unit goes: (slots per rank pair, send slot per rank and local unit, receive
    slot per rank and wanted unit).

    The features split into ``blocks * tp`` units of ``features / (blocks * tp)``; unit m is
    part ``m % tp`` of block ``m // tp``. Contiguously sharded, rank ``m // blocks`` holds it at
    position ``m % blocks``; regrouped per block, rank ``m % tp`` holds it at ``m // tp``.
    """
    units = range(blocks * tp)

    def contiguous(m: int) -> tuple[int, int]:
        return m // blocks, m % blocks

    def per_block(m: int) -> tuple[int, int]:
        return m % tp, m // tp

    hold, need = (contiguous, per_block) if to_blocks else (per_block, contiguous)
    slot: dict[int, int] = {}
    used: dict[tuple[int, int], int] = {}
    for m in sorted(units, key=lambda m: hold(m)[1]):
        pair = (hold(m)[0], need(m)[0])
        slot[m] = used.get(pair, 0)
        used[pair] = slot[m] + 1
    width = max(used.values())
    send = [[0] * blocks for _ in range(tp)]
    receive = [[0] * blocks for _ in range(tp)]
    for m in units:
        (src, at), (dst, to) = hold(m), need(m)
        send[src][at] = dst * width + slot[m]
        receive[dst][to] = src * width + slot[m]
    return width, tuple(map(tuple, send)), tuple(map(tuple, receive))


def _route_indices(
    blocks: int, tp: int, to_blocks: bool, rank: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``_routes`` of one rank as index tensors on ``device``."""
    width, send, receive = _routes(blocks, tp, to_blocks)
    return width, torch.tensor(send[rank], device=device), torch.tensor(receive[rank], device=device)


# made once per device, not a host-to-device copy per forward; a dry run's fake tensors belong
# to its fake mode, so they are made afresh there
_cached_route_indices = cache(_route_indices)


def regroup(x: torch.Tensor, blocks: int, mesh: DeviceMesh, *, to_blocks: bool = True) -> torch.Tensor:
    """This rank's last-dim features of a packed activation in the other layout: from a
    contiguous ``1/tp`` of all features to this rank's ``1/tp`` of each block (``to_blocks``),
    or back. Differentiable (the gradient takes the reverse route)."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    if tp == 1:
        return x
    indices = _route_indices if is_fake(x) else _cached_route_indices
    width, send, receive = indices(blocks, tp, to_blocks, rank, x.device)
    lead, features = x.shape[:-1], x.shape[-1]
    unit = features // blocks
    units = x.reshape(-1, blocks, unit).transpose(0, 1)  # [blocks, tokens, unit]
    outbox = units.new_zeros(tp * width, units.shape[1], unit)
    outbox = outbox.index_copy(0, send, units)
    # the boxes of every rank pair as one tensor [src, dst, ...]: moving from Shard(0) to
    # Shard(1) is DTensor's all-to-all
    boxes = DTensor.from_local(outbox.reshape(1, tp, width, -1, unit), mesh, [Shard(0)], run_check=False)
    inbox = boxes.redistribute(placements=[Shard(1)]).to_local().reshape(tp * width, -1, unit)
    mine = inbox.index_select(0, receive)
    return mine.transpose(0, 1).reshape(*lead, blocks * unit)


def _check_splits(module: nn.Module, features: int, blocks: int, tp: int) -> None:
    if blocks < 2:
        raise ValueError(f"a packed projection has at least 2 blocks, got {blocks}")
    if features % (blocks * tp):
        raise ValueError(
            f"{type(module).__name__}: {features} packed features do not split into {blocks} blocks of tp={tp} parts"
        )


class PackedColwise(ColwiseParallel):
    """Colwise whose output each rank gets as its ``1/tp`` of every one of ``blocks`` blocks."""

    def __init__(self, *, blocks: int = 2, input_layouts: Placement | None = None):
        super().__init__(input_layouts=input_layouts or Replicate(), output_layouts=Shard(-1), use_local_output=True)
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _check_splits(module, module.out_features, self.blocks, device_mesh.size())
        module = super()._apply(module, device_mesh)
        blocks = self.blocks

        def per_block(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            return regroup(output, blocks, device_mesh)

        module.register_forward_hook(per_block)
        return module


class PackedRowwise(RowwiseParallel):
    """Rowwise whose input arrives as this rank's ``1/tp`` of each of ``blocks`` blocks."""

    def __init__(self, *, blocks: int = 2, output_layouts: Placement | None = None):
        super().__init__(input_layouts=Shard(-1), output_layouts=output_layouts or Replicate(), use_local_output=True)
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _check_splits(module, module.in_features, self.blocks, device_mesh.size())
        blocks = self.blocks

        def contiguous(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (regroup(args[0], blocks, device_mesh, to_blocks=False), *args[1:])

        module = super()._apply(module, device_mesh)
        # before rowwise's own input hook, which wraps the (now contiguous) shard as Shard(-1)
        module.register_forward_pre_hook(contiguous, prepend=True)
        return module
