"""plancc's plain placements (``compiler.plain_placements``) as torch's DTensor placements, and back."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from ...compiler.plain_placements import Placement, Replicate, Shard


def to_torch(placement: Placement) -> Any:
    """torch's DTensor placement of the same meaning."""
    return TorchShard(placement.dim) if isinstance(placement, Shard) else TorchReplicate()


def optional_torch(placement: Placement | None) -> Any:
    return None if placement is None else to_torch(placement)


def from_torch(placement: Any) -> Placement:
    """The plain value of a torch ``Shard``/``Replicate`` placement."""
    if isinstance(placement, TorchShard):
        return Shard(placement.dim)
    if isinstance(placement, TorchReplicate):
        return Replicate()
    raise ValueError(f"no plain placement for {placement!r}")
