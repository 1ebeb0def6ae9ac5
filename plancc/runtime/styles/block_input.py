"""The input of an attention or MLP block, laid out once for every projection inside it:
``shared_input`` (replicated, without SP) and ``gather_seq_input`` (a sequence shard, under SP)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class BlockInput(ParallelStyle):
    """The input of an attention or MLP block, laid out once for every projection in it.

    Put on the block (``self_attn``, ``mlp``) rather than on its projections: the input is the
    first positional argument or, as HF decoder layers pass it to attention, the
    ``hidden_states`` keyword. It is handed on as one replicated DTensor (``use_local_output:
    false``, the default), which the projections' colwise styles take as it is; in backward
    DTensor sums their partial input gradients and meets this style's layout change once: one
    all-reduce per block without SP (Megatron's "f"), one reduce-scatter under SP, where a
    local tensor handed on made every projection all-reduce its own. ``use_local_output: true``
    keeps that older behaviour (a plain tensor, for blocks with modules no style prepares).
    """

    def __init__(self, *, input_layouts: Placement, use_local_output: bool = False):
        self.input_layouts = (input_layouts,)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _prepare(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        x = x.redistribute(placements=self.desired_input_layouts)
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor):
                args = (self._prepare(args[0], device_mesh), *args[1:])
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                kwargs = {**kwargs, "hidden_states": self._prepare(kwargs["hidden_states"], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class GatherSequenceInput(BlockInput):
    """All-gather a sequence-sharded block input (``Shard(1)``) into the whole sequence: HF
    attention reshapes q/k/v with its *input's* sequence length, so the block itself must see
    the full sequence; one all-gather then serves q, k and v (and one reduce-scatter their
    summed gradients)."""

    def __init__(self, *, use_local_output: bool = False):
        super().__init__(input_layouts=Shard(1), use_local_output=use_local_output)


class SharedInput(BlockInput):
    """A replicated block input shared by its projections: no communication forward, one
    all-reduce of their summed input gradients in backward."""

    def __init__(self, *, use_local_output: bool = False):
        super().__init__(input_layouts=Replicate(), use_local_output=use_local_output)
