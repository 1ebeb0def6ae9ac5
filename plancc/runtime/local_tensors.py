"""A tensor's local part: a DTensor's shard on this rank, any other tensor as it is (what the
engine reads and writes in place when it swaps, offloads or sends this rank's storage)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import quiet_logger


def local_tensor(x: Any) -> Any:
    """``x``'s local shard where it is a DTensor, else ``x``."""
    return x.to_local() if isinstance(x, DTensor) else x


def full_value(x: torch.Tensor) -> torch.Tensor:
    """``x`` whole (a DTensor gathered over its mesh; collective; differentiable), on the mesh's
    device: a shard FSDP offloads to host memory is moved to the device its collectives run
    on first (NCCL gathers no host tensor)."""
    if not isinstance(x, DTensor):
        return x
    local = x.to_local()
    if x.device_mesh.device_type != local.device.type:
        kind = x.device_mesh.device_type
        device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
        x = DTensor.from_local(local.to(device), x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    return x.full_tensor()


def full_value_quietly(x: torch.Tensor) -> torch.Tensor:
    """``full_value``, for comparing with an unsharded model: gathering FSDP x TP's strided shards
    takes two all-gathers, and torch warns about it on every call; a comparison accepts the cost."""
    if not isinstance(x, DTensor):
        return x
    with quiet_logger("torch.distributed.tensor._redistribute"):
        return full_value(x)
