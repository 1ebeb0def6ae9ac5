"""Which collectives a forward and a backward send, on which mesh axis, and how many bytes.

``CountCollectives`` is a dispatch mode: every collective an op issues passes through it --
DTensor's (functional collectives: all-reduce, all-gather, reduce-scatter, all-to-all), FSDP2's
and plancc's own (c10d ops) -- with the process group it runs on, which names the mesh axis.
Under a fake process group and fake tensors (the dry run) it counts what a real job at that
layout sends, without one: the same code runs, only the wire is missing.

Bytes are what one rank sends on a ring: an all-reduce of S bytes 2(n-1)/n x S, an all-gather
(n-1) x its input, a reduce-scatter and an all-to-all (n-1)/n x their input.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

Phase = Literal["forward", "backward"]

# op name (functional or c10d) -> the collective it is
_KINDS: Final = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    phase: Phase
    axis: str  # the mesh axis it runs on ("tp", "dp_cp", "ep", ...), or "other"
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    count: int
    wire_bytes: int  # sent by one rank, summed over the calls


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """What one step's forward and backward sent, per (phase, axis, kind)."""

    collectives: tuple[Collective, ...] = ()

    def counts(self, phase: Phase, axis: str | None = None) -> dict[str, int]:
        """{kind: calls} of one phase (on one axis, or on all)."""
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            if c.phase == phase and (axis is None or c.axis == axis):
                out[c.kind] += c.count
        return dict(out)

    def wire_bytes(self, phase: Phase, axis: str | None = None) -> int:
        return sum(c.wire_bytes for c in self.collectives if c.phase == phase and (axis is None or c.axis == axis))

    def minus(self, other: Traffic) -> Traffic:
        """This traffic less ``other``'s (what a model's extra layers add)."""
        theirs = {(c.phase, c.axis, c.kind): c for c in other.collectives}
        rows = []
        for c in self.collectives:
            o = theirs.get((c.phase, c.axis, c.kind))
            count, wire = c.count - (o.count if o else 0), c.wire_bytes - (o.wire_bytes if o else 0)
            if count:
                rows.append(Collective(phase=c.phase, axis=c.axis, kind=c.kind, count=count, wire_bytes=wire))
        return Traffic(collectives=tuple(rows))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.collectives:
            out.setdefault(c.phase, {}).setdefault(c.axis, {})[c.kind] = {"count": c.count, "wire_bytes": c.wire_bytes}
        return out


Ranks = tuple[int, ...]

# which axis a rank set is named after when two axes hold the same ranks (cp=1: dp and dp_cp)
_PRECEDENCE = ("tp", "cp", "dp_cp", "dp", "dp_shard_cp", "dp_shard", "dp_replicate")


def mesh_axes(*meshes: DeviceMesh | None) -> dict[Ranks, str]:
    """The ranks of this rank's group on each named axis of ``meshes`` (flattened axes included:
    FSDP's ``dp_cp``) -> the axis. By ranks, not group names: torch reuses one process group
    for meshes built over the same ranks (a second mesh's collectives can run on the first's)."""
    found: dict[Ranks, str] = {}
    for mesh in meshes:
        if mesh is None:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        # flattened axes are kept on the root mesh (slicing them off it is deprecated in 2.13)
        axes: dict[str, DeviceMesh] = {axis: root[axis] for axis in root.mesh_dim_names or ()}
        axes.update(getattr(root, "_flatten_mapping", None) or {})
        ordered = sorted(axes, key=lambda a: _PRECEDENCE.index(a) if a in _PRECEDENCE else len(_PRECEDENCE))
        for axis in ordered:
            found.setdefault(tuple(sorted(dist.get_process_group_ranks(axes[axis].get_group()))), axis)
    return found


def _group_of(args: tuple[Any, ...]) -> tuple[Ranks, int] | None:
    """(ranks, size) of a collective op's process group argument."""
    for a in args:
        group = None
        if isinstance(a, str) and not a.isalpha():  # functional collectives pass the group's name
            try:
                group = dist.distributed_c10d._resolve_process_group(a)  # type: ignore[arg-type]
            except (KeyError, RuntimeError, ValueError):
                continue
        elif isinstance(a, torch.ScriptObject):  # c10d ops pass the boxed process group
            try:
                group = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
        if group is not None:
            return tuple(sorted(dist.get_process_group_ranks(group))), group.size()
    return None


def _first_tensor_bytes(args: tuple[Any, ...], *, index: int = 0) -> int:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    flat = [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    pool = tensors or flat
    if not pool:
        return 0
    t = pool[min(index, len(pool) - 1)]
    return t.numel() * t.element_size()


def _wire_bytes(kind: str, name: str, args: tuple[Any, ...], size: int) -> int:
    if size <= 1:
        return 0
    if name in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, group, ...)
        payload = _first_tensor_bytes(args, index=1)
    else:
        payload = _first_tensor_bytes(args)
    if kind == "all_reduce":
        return 2 * (size - 1) * payload // size
    if kind == "all_gather":
        return (size - 1) * payload
    return (size - 1) * payload // size


class CountCollectives(TorchDispatchMode):
    """Counts collectives by (phase, axis, kind) while active; set ``phase`` between passes."""

    def __init__(self, axes: Mapping[Ranks, str], *, unknown: str = "other"):
        super().__init__()
        self.axes = dict(axes)
        self.unknown = unknown
        self.phase: Phase = "forward"
        self._rows: dict[tuple[Phase, str, str], list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func.namespace in ("_c10d_functional", "c10d"):
            name = func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0]
            kind = _KINDS.get(name)
            group = _group_of(args) if kind else None
            if kind is not None and group is not None and group[1] > 1:
                row = self._rows[(self.phase, self.axes.get(group[0], self.unknown), kind)]
                row[0] += 1
                row[1] += _wire_bytes(kind, name, args, group[1])
        return func(*args, **(kwargs or {}))

    def traffic(self) -> Traffic:
        return Traffic(
            collectives=tuple(
                Collective(phase=phase, axis=axis, kind=kind, count=count, wire_bytes=wire)
                for (phase, axis, kind), (count, wire) in sorted(self._rows.items())
            )
        )
