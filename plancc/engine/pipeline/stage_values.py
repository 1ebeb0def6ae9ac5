"""The full tensors of a model cut into pipeline stages, for the weights that go out.

With ``pp > 1`` a rank holds its stages only; the weights out (``weights``, ``send_weights``,
``share_weights``, ``export_hf``) are streamed from the whole model on meta -- its names, tied
weights and transformers' conversions, as at pp=1 -- with each full tensor from ``StageValues``:
the ranks of the stage that holds it gather it over their dp / tp mesh, and its pipeline rank
broadcasts it over the pipeline. Every rank asks for the same names in the same order
(``streaming.weight_buckets`` plans them from the whole model), so the broadcasts pair up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...runtime.local_tensors import full_value
from ..streaming import state_entries


class StageValues:
    """``values(name)``: the full tensor of a whole-model state-dict name, on every rank of the
    pipeline (collective over the pipeline group, and over the holding stage's mesh)."""

    def __init__(self, stages: nn.Module, whole: nn.Module, group: Any, device: str) -> None:
        self.group, self.device = group, device
        # this rank's tensors, by the model's names: the parameters and buffers themselves (the
        # optimizer and a checkpoint load write into these objects; offloading keeps them)
        self.held = dict(state_entries(stages))
        self.meta = dict(state_entries(whole))
        self._owners: dict[str, int] | None = None

    def owners(self) -> dict[str, int]:
        """The pipeline rank holding each name (one gather of every pipeline rank's names)."""
        if self._owners is None:
            every: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, sorted(self.held), group=self.group)
            self._owners = {name: rank for rank, names in enumerate(every) for name in names}
        return self._owners

    def __call__(self, name: str) -> torch.Tensor:
        owner = self.owners().get(name)
        if owner is None:
            raise KeyError(f"{name}: no pipeline stage holds it")
        mine = self.held.get(name)
        if mine is not None:
            tensor = full_value(mine).detach().contiguous()
        else:
            meta = self.meta[name]
            tensor = torch.empty(tuple(meta.shape), dtype=meta.dtype, device=self.device)
        dist.broadcast(tensor, group_src=owner, group=self.group)
        return tensor
