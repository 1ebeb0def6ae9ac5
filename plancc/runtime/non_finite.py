"""Which tensor of a model holds a NaN or an infinity, agreed over every rank."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .styles.experts import plain


def first_non_finite(named: Iterable[tuple[str, torch.Tensor | None]], device: torch.device | str) -> str | None:
    """Collective: the first name (in the order given, the same on every rank) whose tensor holds
    a NaN or an infinity on any rank's shard, or None. A ``None`` tensor (a parameter without a
    gradient) counts as finite."""
    names, flags = [], []
    for name, tensor in named:
        local = plain(tensor) if tensor is not None else None
        names.append(name)
        flags.append(int(local is not None and local.numel() > 0 and not bool(torch.isfinite(local.detach()).all())))
    bad = torch.tensor(flags or [0], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return next((n for n, f in zip(names, bad.tolist(), strict=False) if f), None)
