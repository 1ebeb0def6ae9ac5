"""Where a tensor lives on the tp axis, as plain values: ``Shard(dim)`` or ``Replicate()``.

The plan, the checks and ``plancc explain`` reason about placements without touching torch's
DTensor package (importing ``torch.distributed.tensor`` costs about a second, which every
``plancc validate`` in a pre-commit hook would pay). Only a style built for a real model
(``compiler.styles.built_style``) turns them into torch's placements, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Shard:
    """Split along ``dim`` over the tp ranks (negative dims count from the end)."""

    dim: int


@dataclass(frozen=True, slots=True)
class Replicate:
    """Whole on every tp rank."""


Placement = Shard | Replicate


def to_torch(placement: Placement) -> Any:
    """torch's DTensor placement of the same meaning."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    return TorchShard(placement.dim) if isinstance(placement, Shard) else TorchReplicate()


def from_torch(placement: Any) -> Placement:
    """The plain value of a torch ``Shard``/``Replicate`` placement."""
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(placement, TorchShard):
        return Shard(placement.dim)
    if type(placement).__name__ == "Replicate":
        return Replicate()
    raise ValueError(f"no plain placement for {placement!r}")
