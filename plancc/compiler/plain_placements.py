"""Where a tensor lives on the tp axis, as plain values: ``Shard(dim)`` or ``Replicate()``.

The plan, the checks and ``plancc explain`` reason about placements without touching torch's
DTensor package (importing ``torch.distributed.tensor`` costs about a second, which every
``plancc validate`` in a pre-commit hook would pay). Only the runtime, building a style for a
real model, turns them into torch's placements (``plancc.runtime.styles.dtensor_placements``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shard:
    """Split along ``dim`` over the tp ranks (negative dims count from the end)."""

    dim: int


@dataclass(frozen=True, slots=True)
class Replicate:
    """Whole on every tp rank."""


Placement = Shard | Replicate
