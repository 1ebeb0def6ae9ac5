"""Mixture-of-experts layers under tensor parallelism: whole experts spread over the tp ranks.

transformers 5.x stores a layer's experts as one module with 3-D weights (``gate_up_proj``:
``[experts, 2 * intermediate, hidden]``, ``down_proj``: ``[experts, hidden, intermediate]``, or
transposed) and calls it as ``experts(hidden_states, top_k_index, top_k_weights)`` after the
router. Inside a tp group every rank holds the same tokens (the attention block all-reduced
them), so no token has to move: each rank keeps ``experts / tp`` whole experts (the weights'
expert dim, ``Shard(0)``), runs them on the tokens routed to them, and the partial outputs are
summed over tp -- the "all-gather dispatcher" of Megatron with expert parallelism equal to tp.

Why whole experts and not each expert's intermediate dim split (transformers' own
``moe_tp_experts`` + ``packed_colwise``): the packed ``gate_up_proj`` split that way needs
DTensor's ``_StridedShard``, which torch.distributed.checkpoint cannot save in torch 2.13
("overlapping chunks"); ``Shard(0)`` saves, reshards and exports like any colwise weight. The
arithmetic per rank is the same; the load per rank follows the router.

Routing ids stay global: ids of another rank's experts become the sentinel transformers' own
expert-parallel path understands (``num_experts`` of this rank, ``_is_expert_parallel``), with
their weights zeroed, so every experts implementation (eager, batched_mm, grouped_mm) skips them.

With expert parallelism (``--ep``) the runtime spreads the same experts over an (ep, tp)
mesh and moves tokens between ep ranks: ``plancc.runtime.expert_dispatch``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ...compiler.kinds import expert_count, is_experts_module
from ..local_tensors import local_tensor


def sum_gradients_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the mesh (each rank's gradient of a
    replicated input covers only its own experts): a replicated DTensor whose local gradient
    is declared partial, so DTensor all-reduces it on the way back."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_over(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum of every rank's partial output (all-reduce); the replicated gradient passes."""
    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()])
    return summed.to_local()


def local_parameters_during_forward(module: nn.Module) -> None:
    """The module's own forward sees this rank's slice of its DTensor parameters as plain
    tensors (it indexes and reshapes them; ``to_local`` keeps the gradient flowing to the
    DTensor): swapped in by a pre-hook, swapped back by a hook that runs even when the forward
    raises. FSDP2 prepends its own pre-hook (unshard) and appends its post-hook (reshard), so
    the swap sees the unsharded parameters and is undone before they are resharded."""
    saved: list[dict[str, Any]] = []  # a stack: activation checkpointing re-enters the forward

    def swap_in(mod: nn.Module, _args: Any) -> None:
        saved.append(dict(mod._parameters))
        for name, param in saved[-1].items():
            if isinstance(param, DTensor):
                mod._parameters[name] = param.to_local()  # type: ignore[assignment]  # for this forward only

    def swap_back(mod: nn.Module, _args: Any, output: Any) -> Any:
        if saved:
            mod._parameters.update(saved.pop())
        return output

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


class ExpertsOverTensorParallel(ParallelStyle):
    """Whole experts spread over the tp ranks; their partial outputs all-reduced.

    All by hooks: the routing ids of other ranks' experts become transformers' sentinel on the
    way in, and the partial outputs are summed on the way out."""

    def __init__(self, *, src_data_rank: int | None = 0):
        self.src_data_rank = src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local, first = shard_experts(module, device_mesh, src_data_rank=self.src_data_rank)
        tp_mesh = device_mesh
        arguments = ExpertArguments.of(module)

        def keep_own_experts(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            bound = arguments.bind(args, kwargs)
            hidden, ids, weights = arguments.read(bound)
            ids = ids - first
            elsewhere = (ids < 0) | (ids >= local)
            weights = sum_gradients_over(local_tensor(weights), tp_mesh).masked_fill(elsewhere, 0)
            hidden = sum_gradients_over(local_tensor(hidden), tp_mesh)
            return arguments.write(bound, hidden, ids.masked_fill(elsewhere, local), weights)

        def sum_partial_outputs(_module: nn.Module, _args: Any, partial: torch.Tensor) -> torch.Tensor:
            return sum_over(partial, tp_mesh)

        module.register_forward_pre_hook(keep_own_experts, with_kwargs=True)
        local_parameters_during_forward(module)
        module.register_forward_hook(sum_partial_outputs)
        return module


@dataclass(frozen=True)
class ExpertArguments:
    """Where transformers' experts forward takes its three inputs
    (``hidden_states, top_k_index, top_k_weights``), by name, positional or keyword."""

    signature: inspect.Signature
    hidden: str
    index: str
    weight: str

    @classmethod
    def of(cls, module: nn.Module) -> ExpertArguments:
        signature = inspect.signature(module.forward)
        hidden, index, weight = list(signature.parameters)[:3]
        return cls(signature, hidden, index, weight)

    def bind(self, args: Any, kwargs: Any) -> inspect.BoundArguments:
        return self.signature.bind(*args, **kwargs)

    def read(self, bound: inspect.BoundArguments) -> tuple[Any, Any, Any]:
        given = bound.arguments
        return given[self.hidden], given[self.index], given[self.weight]

    def write(
        self, bound: inspect.BoundArguments, hidden: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
    ) -> tuple[Any, Any]:
        bound.arguments.update({self.hidden: hidden, self.index: index, self.weight: weight})
        return bound.args, bound.kwargs


def shard_experts(module: nn.Module, mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> tuple[int, int]:
    """Shard the expert weights on dim 0 over every axis of ``mesh`` (row-major: rank (e, t) of
    an (ep, tp) mesh holds block ``e * tp + t``, which is what ``[Shard(0)] * ndim`` gives and
    FSDP composes with) and point transformers' sentinel at this rank's count; returns
    (experts on this rank, global id of the first)."""
    # style-module-kind and shape-divisible report these with the plan's line
    if not is_experts_module(module):
        raise ValueError(f"{type(module).__name__} is not transformers' routed experts (moe_experts)")
    ranks = mesh.size()
    total = expert_count(module)
    if total % ranks:
        raise ValueError(f"{type(module).__name__}: {total} experts do not split over {ranks} ranks")
    local = total // ranks
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is part of the mesh it shards over"
    block = 0
    for axis, index in enumerate(coordinate):  # row-major: the block Shard(0) x ndim gives
        block = block * mesh.size(axis) + index
    placements = [Shard(0)] * mesh.ndim
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, placements, src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    # this rank's experts; other ids are the sentinel ``local``
    setattr(module, "num_experts", local)  # noqa: B010 (an attribute of transformers' module)
    setattr(module, "_is_expert_parallel", True)  # noqa: B010
    return local, block * local
