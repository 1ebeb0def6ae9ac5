"""A tensor's local part: a DTensor's shard on this rank, any other tensor as it is (what the
engine reads and writes in place when it swaps, offloads or sends this rank's storage)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor


def local_tensor(x: Any) -> Any:
    """``x``'s local shard where it is a DTensor, else ``x``."""
    return x.to_local() if isinstance(x, DTensor) else x
