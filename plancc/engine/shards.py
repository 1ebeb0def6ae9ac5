"""A parallelized model's own storage: every FSDP unit back to its shards, and this rank's shard
of every parameter (what ``engine.reference`` swaps and ``Policy.offload`` moves)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from ..runtime.local_tensors import local_tensor


def back_to_shards(model: nn.Module) -> None:
    """Every FSDP unit back to its sharded parameters: the root keeps its gathered ones after a
    forward without backward, and a weight written or read then would be the stale copy.

    Also after a forward that raised (an out-of-memory, a caller's hook): a unit whose forward
    never finished is left in FSDP's forward state, and ``reshard()`` skips such a unit when it
    does not reshard after forward (the plan's last layer, the root) -- its gathered parameters
    would stay in place of the shards, and the next ``reference_logprobs``, ``save`` or step
    would read them. Such a unit is marked idle first (FSDP2 keeps no other state of the pass)."""
    for module, group in fsdp_units(model):
        if group is not None and group._training_state == TrainingState.FORWARD:
            group._training_state = TrainingState.IDLE
        module.reshard()


def fsdp_units(model: nn.Module) -> Iterator[tuple[FSDPModule, Any]]:
    """Every FSDP unit of ``model`` and its parameter group (FSDP2's ``FSDPParamGroup``; None for
    a unit that holds no parameter of its own)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield module, module._get_fsdp_state()._fsdp_param_group


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """This rank's storage of every parameter, in order (written in place by weight swaps)."""
    back_to_shards(model)
    return [local_tensor(p) for p in model.parameters()]
