"""plancc's own small torch styles (leave whole, rotary under SP, a block's input), and the
placements read off any built torch style (``layouts_of``: what ``plancc styles`` prints and what
``tests/test_styles.py`` holds the declared table to). Imported only where styles are built."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .attention_styles import LatentKeyValueProjection, PerHeadParameters
from .block_input import BlockInput
from .expert_styles import ExpertsOverTensorParallel
from .kinds import Layouts, ModuleKind
from .placements import from_torch


class LeaveWhole(ParallelStyle):
    """Explicitly keeps a module's parameters whole on every TP rank (no communication).

    Naming a module ``replicate`` documents a decision (e.g. Gemma3's tied embedding) and
    still lets the glob check catch typos, which silently omitting it would not.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class RotaryUnderSequenceParallel(ParallelStyle):
    """Rotary embeddings under sequence parallelism (their inputs are a tuple).

    transformers calls ``rotary_emb(hidden_states, position_ids[, layer_type])``; the hidden
    states only supply dtype/device, the position ids decide the result. Under SP the hidden
    states are a local sequence shard, and when ``position_ids`` is not passed HF derives it
    from that shard's length: every rank would rotate as if its shard started at position 0.
    This style hands the module plain tensors and refuses shard-length position ids loudly
    instead of computing wrong cos/sin. ``plancc.parallelize`` passes global position ids.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def to_local(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
            kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
            hidden = args[0] if args else kwargs.get("x")
            positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
            if (
                tp > 1
                and isinstance(hidden, torch.Tensor)
                and isinstance(positions, torch.Tensor)
                and hidden.dim() >= 2
                and positions.shape[-1] == hidden.shape[1]
            ):
                raise RuntimeError(
                    "rotary_sp: position_ids have the length of the local sequence shard "
                    f"({positions.shape[-1]}), so transformers derived them from the shard; pass "
                    "global position_ids to the model (plancc.parallelize does this for you)"
                )
            return args, kwargs

        def local_outputs(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if isinstance(output, tuple):
                return type(output)(o.to_local() if isinstance(o, DTensor) else o for o in output)
            return output.to_local() if isinstance(output, DTensor) else output

        module.register_forward_pre_hook(lambda mod, a, kw: to_local(a, kw), with_kwargs=True)
        module.register_forward_hook(local_outputs, with_kwargs=True)
        return module


def _plain(*, input: Any, output: Any, local_output: bool | None, weight: Any) -> Layouts:
    """``Layouts`` from torch's placement objects (plain values: ``compiler.placements``)."""

    def plain(p: Any) -> Any:
        return None if p is None else from_torch(p)

    return Layouts(
        input=plain(input),
        output=plain(output),
        local_output=local_output,
        weight=None if weight is None else {kind: plain(p) for kind, p in weight.items()},
    )


def layouts_of(style: ParallelStyle) -> Layouts:
    """The placements read off a built torch style, as plain values: the oracle the declared
    table (``styles.style_layouts``) is held to in tests/test_styles.py."""
    if isinstance(style, ColwiseParallel):
        return _plain(
            input=style.input_layouts[0],
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            weight={ModuleKind.LINEAR: Shard(0), ModuleKind.EMBEDDING: Shard(1)},
        )
    if isinstance(style, RowwiseParallel):
        return _plain(
            input=style.input_layouts[0],
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            weight={ModuleKind.LINEAR: Shard(1), ModuleKind.EMBEDDING: Shard(0)},
        )
    if isinstance(style, ExpertsOverTensorParallel):
        return _plain(
            input=Replicate(),
            output=Replicate(),
            local_output=True,
            weight={ModuleKind.EXPERTS: Shard(0)},
        )
    if isinstance(style, PerHeadParameters):
        # the block's input and output are the residual stream; its own parameters follow the heads
        given = style.input_layouts
        return _plain(
            input=given or Replicate(),
            output=Replicate(),
            local_output=given is None,
            weight={ModuleKind.OTHER: Shard(0)},
        )
    if isinstance(style, LatentKeyValueProjection):
        return _plain(input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.LINEAR: Replicate()})
    if isinstance(style, SequenceParallel):
        shard = style.sequence_sharding[0]
        return _plain(
            input=shard,
            output=shard,
            local_output=style.use_local_output,
            weight={kind: Replicate() for kind in ModuleKind},
        )
    if isinstance(style, (PrepareModuleInput, BlockInput)):
        inputs, wanted = style.input_layouts, style.desired_input_layouts
        assert inputs is not None and wanted is not None  # every spec sets both
        return _plain(
            input=inputs[0],
            output=wanted[0],
            local_output=style.use_local_output,
            weight=None,
        )
    if isinstance(style, RotaryUnderSequenceParallel):
        return _plain(input=Shard(1), output=Replicate(), local_output=True, weight=None)
    if isinstance(style, PrepareModuleOutput):
        outputs, desired = style.output_layouts, style.desired_output_layouts
        assert outputs is not None and desired is not None  # every spec sets both
        return _plain(
            input=outputs[0],
            output=desired[0],
            local_output=style.use_local_output,
            weight=None,
        )
    return _plain(input=None, output=None, local_output=None, weight=None)
