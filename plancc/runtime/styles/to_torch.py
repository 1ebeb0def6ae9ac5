"""A declaration (``compiler.declarations``) as the torch ``ParallelStyle`` that does it.

One builder per declaration class, chosen by the declaration's type: the style's behaviour is
its class's, never a name looked up in a table. Every builder passes the declaration's own
placements, so the torch object cannot do something other than what the checks read.
"""

from __future__ import annotations

from functools import cache, singledispatch
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

from ...compiler import declarations as d
from .attention import LatentKeyValueProjection, PerHeadParameters
from .basic import LeaveWhole, RotaryUnderSequenceParallel
from .block_input import GatherSequenceInput, SharedInput
from .dtensor_placements import optional_torch, to_torch
from .experts import ExpertsOverTensorParallel
from .packed import PackedColwise, PackedRowwise


@cache
def torch_style(declaration: d.Declaration) -> ParallelStyle:
    """The torch style of ``declaration``: one object per distinct declaration (torch's styles
    keep no per-module state, so one serves every module of a rule)."""
    return _build(declaration)


@singledispatch
def _build(declaration: d.Declaration) -> ParallelStyle:
    raise TypeError(f"no torch style for the declaration {declaration!r}")


@_build.register
def _(decl: d.LeaveWhole) -> ParallelStyle:
    return LeaveWhole()


@_build.register
def _(decl: d.Colwise) -> ParallelStyle:
    return ColwiseParallel(
        input_layouts=to_torch(decl.input_layouts),
        output_layouts=to_torch(decl.output_layouts),
        use_local_output=decl.use_local_output,
    )


@_build.register
def _(decl: d.Rowwise) -> ParallelStyle:
    return RowwiseParallel(
        input_layouts=to_torch(decl.input_layouts),
        output_layouts=to_torch(decl.output_layouts),
        use_local_output=decl.use_local_output,
    )


@_build.register
def _(decl: d.PackedColwise) -> ParallelStyle:
    return PackedColwise(blocks=decl.blocks, input_layouts=optional_torch(decl.input_layouts))


@_build.register
def _(decl: d.PackedRowwise) -> ParallelStyle:
    return PackedRowwise(blocks=decl.blocks, output_layouts=optional_torch(decl.output_layouts))


@_build.register
def _(decl: d.SequenceSharded) -> ParallelStyle:
    return SequenceParallel(sequence_dim=decl.sequence_dim, use_local_output=decl.use_local_output)


def _positional(layouts: d.Positional) -> Any:
    if isinstance(layouts, tuple):
        return tuple(optional_torch(p) for p in layouts)
    return optional_torch(layouts)


def _keywords(layouts: d.Keywords) -> dict[str, Any] | None:
    return {name: to_torch(p) for name, p in layouts} or None


def _inputs(decl: d.PrepareInput | d.PrepareInputOutput) -> dict[str, Any]:
    """The input half of torch's PrepareModuleInput(Output): positional and keyword layouts."""
    return {
        "input_layouts": _positional(decl.input_layouts),
        "desired_input_layouts": _positional(decl.desired_input_layouts),
        "input_kwarg_layouts": _keywords(decl.input_kwarg_layouts),
        "desired_input_kwarg_layouts": _keywords(decl.desired_input_kwarg_layouts),
    }


@_build.register
def _(decl: d.PrepareInput) -> ParallelStyle:
    return PrepareModuleInput(**_inputs(decl), use_local_output=decl.use_local_output)


@_build.register
def _(decl: d.PrepareInputOutput) -> ParallelStyle:
    return PrepareModuleInputOutput(
        **_inputs(decl),
        use_local_input=decl.use_local_input,
        output_layouts=to_torch(decl.output_layouts),
        desired_output_layouts=to_torch(decl.desired_output_layouts),
        use_local_output=decl.use_local_output,
    )


@_build.register
def _(decl: d.PrepareOutput) -> ParallelStyle:
    return PrepareModuleOutput(
        output_layouts=to_torch(decl.output_layouts),
        desired_output_layouts=to_torch(decl.desired_output_layouts),
        use_local_output=decl.use_local_output,
    )


@_build.register
def _(decl: d.GatherSequenceInput) -> ParallelStyle:
    return GatherSequenceInput(use_local_output=decl.use_local_output)


@_build.register
def _(decl: d.SharedInput) -> ParallelStyle:
    return SharedInput(use_local_output=decl.use_local_output)


@_build.register
def _(decl: d.ExpertsOverTensorParallel) -> ParallelStyle:
    return ExpertsOverTensorParallel()


@_build.register
def _(decl: d.PerHeadParameters) -> ParallelStyle:
    return PerHeadParameters(input_layouts=optional_torch(decl.input_layouts))


@_build.register
def _(decl: d.LatentKeyValueProjection) -> ParallelStyle:
    return LatentKeyValueProjection(rope_dim=decl.rope_dim)


@_build.register
def _(decl: d.RotaryUnderSequenceParallel) -> ParallelStyle:
    return RotaryUnderSequenceParallel()
