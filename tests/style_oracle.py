"""The placements read off a built torch style, independently of plancc's declarations: the
oracle tests/test_styles.py holds the declared table to (torch's own attributes, read here)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from plancc.compiler.kinds import Layouts, ModuleKind
from plancc.compiler.plain_placements import Replicate, Shard
from plancc.runtime.styles.attention import LatentKeyValueProjection, PerHeadParameters
from plancc.runtime.styles.basic import RotaryUnderSequenceParallel
from plancc.runtime.styles.block_input import BlockInput
from plancc.runtime.styles.experts import ExpertsOverTensorParallel
from plancc.runtime.styles.dtensor_placements import from_torch


def _plain(*, input: Any, output: Any, local_output: bool | None, weight: Any) -> Layouts:
    def plain(p: Any) -> Any:
        if p is None or isinstance(p, (Shard, Replicate)):  # already plancc's plain value
            return p
        return from_torch(p)

    return Layouts(
        input=plain(input),
        output=plain(output),
        local_output=local_output,
        weight=None if weight is None else {kind: plain(p) for kind, p in weight.items()},
    )


def layouts_of(style: ParallelStyle) -> Layouts:
    """What a built torch style does, read off its attributes."""
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
        return _plain(input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.EXPERTS: Shard(0)})
    if isinstance(style, PerHeadParameters):
        given = style.input_layouts
        return _plain(
            input=given or Replicate(), output=Replicate(), local_output=given is None, weight={ModuleKind.OTHER: Shard(0)}
        )
    if isinstance(style, LatentKeyValueProjection):
        return _plain(input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.LINEAR: Replicate()})
    if isinstance(style, SequenceParallel):
        shard = style.sequence_sharding[0]
        return _plain(
            input=shard, output=shard, local_output=style.use_local_output, weight={kind: Replicate() for kind in ModuleKind}
        )
    if isinstance(style, PrepareModuleInputOutput):  # the input's first layout, the output's
        inputs = style.prepare_module_input.input_layouts
        out = style.prepare_module_output
        return _plain(
            input=inputs[0] if inputs else None,
            output=out.desired_output_layouts[0],
            local_output=out.use_local_output,
            weight=None,
        )
    if isinstance(style, (PrepareModuleInput, BlockInput)):
        inputs, wanted = style.input_layouts, style.desired_input_layouts  # None: positional inputs left alone
        return _plain(
            input=inputs[0] if inputs else None,
            output=wanted[0] if wanted else None,
            local_output=style.use_local_output,
            weight=None,
        )
    if isinstance(style, RotaryUnderSequenceParallel):
        return _plain(input=Shard(1), output=Replicate(), local_output=True, weight=None)
    if isinstance(style, PrepareModuleOutput):
        outputs, desired = style.output_layouts, style.desired_output_layouts
        return _plain(input=outputs[0], output=desired[0], local_output=style.use_local_output, weight=None)
    return _plain(input=None, output=None, local_output=None, weight=None)
