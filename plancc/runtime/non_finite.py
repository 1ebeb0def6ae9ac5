"""Which tensor of a model holds a NaN or an infinity, agreed over every rank."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .local_tensors import local_tensor


def first_non_finite(named: Iterable[tuple[str, torch.Tensor | None]], device: torch.device | str) -> str | None:
    """Collective: the first name whose tensor holds a NaN or an infinity on any rank's shard, or
    None: in the order given on the lowest rank that holds one (the same order on every rank of a
    layout without pipeline stages; pipeline ranks hold their stages' tensors, in stage order).
    A ``None`` tensor (a parameter without a gradient) counts as finite."""
    found = None
    for name, tensor in named:
        local = local_tensor(tensor) if tensor is not None else None
        if local is not None and local.numel() > 0 and not bool(torch.isfinite(local.detach()).all()):
            found = name
            break
    if not dist.is_initialized():
        return found
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return next((n for n in every if n is not None), None)
