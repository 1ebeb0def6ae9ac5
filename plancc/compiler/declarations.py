"""What each style does to its module, as one frozen, torch-free class per style kind.

A declaration carries the placements it gives its module's input, output and weight, and
says so itself (``layouts``): the checks, ``plancc explain`` and ``plancc styles`` read it
without importing torch's DTensor package. The runtime builds the torch ``ParallelStyle`` of
a declaration from these same fields (``plancc.runtime.styles.torch_style``, one builder per
class), so what the checks reason with and what runs cannot be two descriptions that drift.

Field defaults are torch's own (``ColwiseParallel()`` is ``Colwise()``); a style of the
vocabulary (``compiler.styles``) is a declaration class plus its own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import Layouts, ModuleKind
from .plain_placements import Placement, Replicate, Shard

_LINEAR_COLWISE = {ModuleKind.LINEAR: Shard(0), ModuleKind.EMBEDDING: Shard(1)}
_LINEAR_ROWWISE = {ModuleKind.LINEAR: Shard(1), ModuleKind.EMBEDDING: Shard(0)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Declaration:
    """A style that touches nothing (``replicate``: the module is left whole on every rank)."""

    def layouts(self) -> Layouts:
        return Layouts(input=None, output=None, local_output=None, weight=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaveWhole(Declaration):
    """Explicitly whole on every tp rank: a decision written down, and still glob-checked."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Colwise(Declaration):
    """Output features sharded (torch's ``ColwiseParallel``)."""

    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)
    use_local_output: bool = True

    def layouts(self) -> Layouts:
        return Layouts(
            input=self.input_layouts,
            output=self.output_layouts,
            local_output=self.use_local_output,
            weight=_LINEAR_COLWISE,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Rowwise(Declaration):
    """Input features sharded, partial outputs reduced (torch's ``RowwiseParallel``)."""

    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()
    use_local_output: bool = True

    def layouts(self) -> Layouts:
        return Layouts(
            input=self.input_layouts,
            output=self.output_layouts,
            local_output=self.use_local_output,
            weight=_LINEAR_ROWWISE,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedColwise(Declaration):
    """Colwise over a fused projection of ``blocks`` projections: each rank gets its 1/tp of
    every block. A consumer sees each block's shard(-1), regrouped: colwise's layouts."""

    blocks: int = 2
    input_layouts: Placement | None = None

    def layouts(self) -> Layouts:
        return Colwise(input_layouts=self.input_layouts or Replicate()).layouts()


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedRowwise(Declaration):
    """Rowwise whose input comes per block from a ``PackedColwise`` producer."""

    blocks: int = 2
    output_layouts: Placement | None = None

    def layouts(self) -> Layouts:
        return Rowwise(output_layouts=self.output_layouts or Replicate()).layouts()


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSharded(Declaration):
    """Weights replicated, activations sharded on ``sequence_dim``, weight gradients summed
    over tp (torch's ``SequenceParallel``)."""

    sequence_dim: int = 1
    use_local_output: bool = False

    def layouts(self) -> Layouts:
        shard = Shard(self.sequence_dim)
        return Layouts(
            input=shard,
            output=shard,
            local_output=self.use_local_output,
            weight={kind: Replicate() for kind in ModuleKind},
        )


# torch's PrepareModuleInput takes one layout (a module of one positional input) or one per
# positional input, None leaving that input alone; keyword inputs by name.
Positional = Placement | tuple[Placement | None, ...] | None
Keywords = tuple[tuple[str, Placement], ...]  # name -> layout, sorted: a declaration is hashable


def first_layout(layouts: Positional) -> Placement | None:
    """The layout of the module's main input (its first positional one): what the checks follow."""
    return layouts[0] if isinstance(layouts, tuple) else layouts


def positional_count(layouts: Positional) -> int:
    """How many positional inputs a module laid out with ``layouts`` must be called with."""
    return len(layouts) if isinstance(layouts, tuple) else 0 if layouts is None else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareInput(Declaration):
    """Inputs redistributed from ``input_layouts`` to ``desired_input_layouts`` (one layout,
    or one per positional input), keyword inputs from ``input_kwarg_layouts`` to
    ``desired_input_kwarg_layouts`` (torch's ``PrepareModuleInput``)."""

    input_layouts: Positional = Replicate()
    desired_input_layouts: Positional = Replicate()
    input_kwarg_layouts: Keywords = ()
    desired_input_kwarg_layouts: Keywords = ()
    use_local_output: bool = True

    def layouts(self) -> Layouts:
        return Layouts(
            input=first_layout(self.input_layouts),
            output=first_layout(self.desired_input_layouts),
            local_output=self.use_local_output,
            weight=None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareInputOutput(Declaration):
    """One module whose inputs and outputs are both redistributed (torch's
    ``PrepareModuleInputOutput``): its input as ``PrepareInput`` lays it out, its output as
    ``PrepareOutput``."""

    input_layouts: Positional = Replicate()
    desired_input_layouts: Positional = Replicate()
    input_kwarg_layouts: Keywords = ()
    desired_input_kwarg_layouts: Keywords = ()
    use_local_input: bool = True
    output_layouts: Placement = Replicate()
    desired_output_layouts: Placement = Replicate()
    use_local_output: bool = True

    def layouts(self) -> Layouts:
        # what reaches the module's consumers is its output: that is what the checks pair
        return Layouts(
            input=first_layout(self.input_layouts),
            output=self.desired_output_layouts,
            local_output=self.use_local_output,
            weight=None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareOutput(Declaration):
    """Outputs redistributed from ``output_layouts`` to ``desired_output_layouts``."""

    output_layouts: Placement = Replicate()
    desired_output_layouts: Placement = Replicate()
    use_local_output: bool = True

    def layouts(self) -> Layouts:
        return Layouts(
            input=self.output_layouts,
            output=self.desired_output_layouts,
            local_output=self.use_local_output,
            weight=None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherSequenceInput(Declaration):
    """A block's input under SP: gathered once from its sequence shard, handed on as one
    replicated DTensor so backward reduce-scatters the projections' summed gradients once."""

    use_local_output: bool = False

    def layouts(self) -> Layouts:
        return Layouts(input=Shard(1), output=Replicate(), local_output=self.use_local_output, weight=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedInput(Declaration):
    """A block's replicated input handed to its projections as one DTensor (one all-reduce of
    their summed input gradients in backward)."""

    use_local_output: bool = False

    def layouts(self) -> Layouts:
        return Layouts(input=Replicate(), output=Replicate(), local_output=self.use_local_output, weight=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertsOverTensorParallel(Declaration):
    """Whole experts spread over the tp (and ep) ranks; the layer's output whole again."""

    def layouts(self) -> Layouts:
        return Layouts(input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.EXPERTS: Shard(0)})


@dataclass(frozen=True, kw_only=True, slots=True)
class PerHeadParameters(Declaration):
    """An attention block's own per-head parameters sharded with its heads. The block's input
    and output are the residual stream; with ``input_layouts`` its input goes on to the
    projections as one DTensor (as ``shared_input`` does)."""

    input_layouts: Placement | None = None

    def layouts(self) -> Layouts:
        return Layouts(
            input=self.input_layouts or Replicate(),
            output=Replicate(),
            local_output=self.input_layouts is None,
            weight={ModuleKind.OTHER: Shard(0)},
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LatentKeyValueProjection(Declaration):
    """MLA's kv_a_proj_with_mqa: whole, the gradient of its shared rotary key summed over tp."""

    rope_dim: int | None = None

    def layouts(self) -> Layouts:
        return Layouts(
            input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.LINEAR: Replicate()}
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RotaryUnderSequenceParallel(Declaration):
    """Rotary embedding under SP: reads a sequence shard (for its dtype only) and global
    positions, returns whole-sequence cos/sin."""

    def layouts(self) -> Layouts:
        return Layouts(input=Shard(1), output=Replicate(), local_output=True, weight=None)
