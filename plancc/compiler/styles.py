"""The style vocabulary: the one table mapping a style name to a torch ``ParallelStyle``.

Every style is declared once: a declaration class (``compiler.declarations``: one frozen,
torch-free class per style kind, carrying the placements it gives its module's input, output
and weight) and its keyword defaults. The checks, ``plancc explain`` and ``plancc styles`` read
the declaration; the runtime builds the torch ``ParallelStyle`` from the same object
(``plancc.runtime.styles.torch_style``). A property test builds every style with random
overrides and holds the built torch object's placements to the declared ones.

Conventions shared by the whole vocabulary (they are what makes styles compose):
- Between modules, activations are plain local tensors (``use_local_output=True``), except
  the logits styles, which hand the vocab-sharded DTensor to the logprob evaluator, and the
  block-input styles (``shared_input``, ``gather_seq_input``), which hand one DTensor to the
  projections inside their block so that backward sums the projections' input gradients before
  one collective. transformers 5.x mixes module outputs with plain tensors (residual adds,
  masks, rotary cos/sin), so a DTensor reaching anything else fails with "mixed torch.Tensor
  and DTensor" (the ``dtensor-output`` check says so before a run).
- Sequence-parallel regions hold ``Shard(1)`` local shards; a consumer of a sequence-sharded
  activation must declare ``Shard(1)`` input (``colwise_seq``, ``sequence_parallel``,
  ``gather_seq_input``), because a plain tensor carries no layout for torch to redistribute.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

from . import declarations as d
from .kinds import Layouts, ModuleKind, module_kind
from .plain_placements import Placement, Replicate, Shard

__all__ = ["Layouts", "ModuleKind", "module_kind"]  # re-exported: the checks' vocabulary


@dataclass(frozen=True, kw_only=True, slots=True)
class StyleSpec:
    """One row of the vocabulary."""

    name: str
    summary: str
    declaration: type[d.Declaration]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    module_kinds: frozenset[ModuleKind] = frozenset(ModuleKind)
    # Override keys a plan may set in the mapping form for this style.
    overridable: frozenset[str] = frozenset()
    aliases: tuple[str, ...] = ()

    def declare(self, overrides: Mapping[str, Any] | None = None) -> d.Declaration:
        """The declaration of this style with a plan's overrides (no torch import)."""
        given = dict(overrides or {})
        fields = {**self.defaults, **given}
        if given.keys() & _KEYWORDS and not given.keys() & _POSITIONAL:
            # keyword inputs only: the module's positional inputs are left alone (torch's own
            # default), so a module called with keywords alone is not asked for one
            fields.update(input_layouts=None, desired_input_layouts=None)
        return self.declaration(**fields)

    @property
    def fits_any_module(self) -> bool:
        return self.module_kinds == frozenset(ModuleKind)


_LINEAR_OVERRIDES = frozenset({"input_layouts", "output_layouts", "use_local_output"})
_POSITIONAL = frozenset({"input_layouts", "desired_input_layouts"})
_KEYWORDS = frozenset({"input_kwarg_layouts", "desired_input_kwarg_layouts"})
_PREPARE_INPUT_OVERRIDES = _POSITIONAL | _KEYWORDS
_LINEAR_LIKE = frozenset({ModuleKind.LINEAR, ModuleKind.EMBEDDING})

_SPECS: tuple[StyleSpec, ...] = (
    StyleSpec(
        name="colwise",
        summary="shard the output features; output stays sharded for a rowwise consumer",
        declaration=d.Colwise,
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_rep",
        summary="colwise, then all-gather the output features",
        declaration=d.Colwise,
        defaults={"output_layouts": Replicate()},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
        aliases=("colwise_gather_output",),
    ),
    StyleSpec(
        name="colwise_seq",
        summary="colwise whose input is sequence-sharded (all-gathered on the sequence first)",
        declaration=d.Colwise,
        defaults={"input_layouts": Shard(1)},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_logits",
        summary="lm_head: vocab-sharded logits kept as a DTensor for the logprob evaluator",
        declaration=d.Colwise,
        defaults={"output_layouts": Shard(-1), "use_local_output": False},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_logits_seq",
        summary="colwise_logits whose input is sequence-sharded (lm_head under SP)",
        declaration=d.Colwise,
        defaults={"input_layouts": Shard(1), "output_layouts": Shard(-1), "use_local_output": False},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="rowwise",
        summary="shard the input features; partial outputs are all-reduced",
        declaration=d.Rowwise,
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="rowwise_rep",
        summary="rowwise whose input is replicated (each rank slices its part locally)",
        declaration=d.Rowwise,
        defaults={"input_layouts": Replicate()},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
        aliases=("rowwise_split_input",),
    ),
    StyleSpec(
        name="rowwise_seq",
        summary="rowwise with a reduce-scatter onto the sequence dim (closes a TP region under SP)",
        declaration=d.Rowwise,
        defaults={"output_layouts": Shard(1)},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="packed_colwise",
        summary="colwise for a fused projection whose output holds `blocks` projections (gate_up_proj): "
        "each rank gets its 1/tp of every block (one all-to-all of the output)",
        declaration=d.PackedColwise,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"blocks", "input_layouts"}),
    ),
    StyleSpec(
        name="packed_rowwise",
        summary="rowwise whose input comes per block from a packed_colwise producer, unsplit",
        declaration=d.PackedRowwise,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"blocks", "output_layouts"}),
    ),
    StyleSpec(
        name="embedding_rowwise",
        summary="vocab-parallel embedding: rows (vocab) sharded, lookups all-reduced",
        declaration=d.Rowwise,
        defaults={"input_layouts": Replicate()},
        module_kinds=frozenset({ModuleKind.EMBEDDING}),
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="embedding_seq",
        summary="vocab-parallel embedding reduce-scattered onto the sequence dim (opens SP)",
        declaration=d.Rowwise,
        defaults={"input_layouts": Replicate(), "output_layouts": Shard(1)},
        module_kinds=frozenset({ModuleKind.EMBEDDING}),
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="sequence_parallel",
        summary="norm on a sequence shard; weights replicated, gradients summed over tp",
        declaration=d.SequenceSharded,
        defaults={"use_local_output": True},
        module_kinds=frozenset({ModuleKind.NORM, ModuleKind.OTHER}),
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="qk_norm",
        summary="weights replicated, gradients summed over tp: a module with parameters inside a tp "
        "region (per-head q/k norms, learnable activations)",
        declaration=d.SequenceSharded,
        # q/k enter the norm as [batch, seq, heads, head_dim] with heads sharded by the
        # colwise projection (an MLP activation: [batch, seq, features], features sharded):
        # dim 2 either way, and the weight's gradient is a sum over it, i.e. over tp.
        defaults={"sequence_dim": 2, "use_local_output": True},
        module_kinds=frozenset({ModuleKind.NORM, ModuleKind.OTHER}),
        aliases=("replicated_with_grad_allreduce",),
    ),
    StyleSpec(
        name="moe_experts",
        summary="mixture-of-experts: whole experts spread over tp (experts / tp each), tokens "
        "routed to another rank's experts skipped, partial outputs all-reduced; with --ep over "
        "ep x tp, tokens exchanged by all-to-all",
        declaration=d.ExpertsOverTensorParallel,
        module_kinds=frozenset({ModuleKind.EXPERTS}),
    ),
    StyleSpec(
        name="per_head_params",
        summary="an attention block's own per-head parameters (learned sinks) sharded with its heads "
        "(shard(0) over tp), the block computing with this rank's entries; with input_layouts, the block's "
        "input laid out once for its projections too (as shared_input / gather_seq_input)",
        declaration=d.PerHeadParameters,
        module_kinds=frozenset({ModuleKind.OTHER}),
        overridable=frozenset({"input_layouts"}),
        aliases=("local_params",),
    ),
    StyleSpec(
        name="mla_kv_a_proj",
        summary="multi-head latent attention's kv_a_proj_with_mqa: whole, the gradient of its rotary "
        "key (last rope_dim outputs, shared by every head) summed over tp",
        declaration=d.LatentKeyValueProjection,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"rope_dim"}),
    ),
    StyleSpec(
        name="rotary_sp",
        summary="rotary embedding under SP: plain tensors in and out, global position ids required",
        declaration=d.RotaryUnderSequenceParallel,
        module_kinds=frozenset({ModuleKind.ROTARY}),
    ),
    StyleSpec(
        name="replicate",
        summary="explicitly left whole on every tp rank",
        declaration=d.LeaveWhole,
    ),
    StyleSpec(
        name="shard_seq_output",
        summary="adapter: slice a replicated output onto the sequence dim (opens SP)",
        declaration=d.PrepareOutput,
        defaults={
            "output_layouts": Replicate(),
            "desired_output_layouts": Shard(1),
            "use_local_output": True,
        },
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="gather_seq_input",
        summary="a block's input (attention/MLP under SP): all-gathered once from the sequence shard and handed "
        "to its projections as one DTensor, so backward reduce-scatters their summed gradients once",
        declaration=d.GatherSequenceInput,
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="shared_input",
        summary="a block's replicated input (attention/MLP without SP) handed to its projections as one DTensor: "
        "backward all-reduces their summed input gradients once, not once per projection",
        declaration=d.SharedInput,
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="prepare_input",
        summary="adapter: redistribute inputs from input_layouts to desired_input_layouts (one layout, or a list "
        "with one per positional input, null leaving it alone), keyword inputs by input_kwarg_layouts",
        declaration=d.PrepareInput,
        defaults={"input_layouts": Replicate(), "desired_input_layouts": Replicate(), "use_local_output": True},
        overridable=_PREPARE_INPUT_OVERRIDES | {"use_local_output"},
    ),
    StyleSpec(
        name="prepare_output",
        summary="adapter: redistribute outputs from output_layouts to desired_output_layouts",
        declaration=d.PrepareOutput,
        defaults={"output_layouts": Replicate(), "desired_output_layouts": Replicate(), "use_local_output": True},
        overridable=frozenset({"output_layouts", "desired_output_layouts", "use_local_output"}),
    ),
    StyleSpec(
        name="prepare_input_output",
        summary="adapter: prepare_input and prepare_output on one module (torch's PrepareModuleInputOutput)",
        declaration=d.PrepareInputOutput,
        defaults={
            "input_layouts": Replicate(),
            "desired_input_layouts": Replicate(),
            "use_local_input": True,
            "output_layouts": Replicate(),
            "desired_output_layouts": Replicate(),
            "use_local_output": True,
        },
        overridable=_PREPARE_INPUT_OVERRIDES
        | {"use_local_input", "output_layouts", "desired_output_layouts", "use_local_output"},
    ),
)

STYLES: dict[str, StyleSpec] = {spec.name: spec for spec in _SPECS}
ALIASES: dict[str, str] = {alias: spec.name for spec in _SPECS for alias in spec.aliases}

# transformers' tp_plan names that plancc does not take, and why: a user pasting an HF plan
# must not be steered to the nearest-looking name when that name would shard differently.
HF_UNSUPPORTED: dict[str, str] = {
    "embedding_colwise": "an embedding sharded on its hidden dim is not in plancc's vocabulary; "
    "'embedding_rowwise' (vocab-parallel) is",
    "all_reduce": "a bare all-reduce of a module's output is not a plancc style",
    "moe_tp_experts": "only with transformers' fused experts (the forward taking hidden_states, "
    "top_k_index, top_k_weights); plancc's 'moe_experts' spreads whole experts over tp",
    "moe_identity_expert": "identity (zero-compute) experts beside routed ones are not supported yet",
    "grouped_gemm": "expert parallelism is a layout flag in plancc, not a style: give the experts module "
    "'moe_experts' and run with --ep N (all-to-all dispatch over N data-parallel ranks)",
    "ep_dispatch_experts": "expert parallelism is a layout flag in plancc, not a style: give the experts "
    "module 'moe_experts' and run with --ep N (all-to-all dispatch over N data-parallel ranks)",
}
STYLE_NAMES: tuple[str, ...] = tuple(STYLES) + tuple(ALIASES)

_LAYOUT_RE = re.compile(r"^(?:replicate|shard\((-?\d+)\))$")


def canonical_style(name: str) -> StyleSpec:
    """The spec for a style name or alias (names are validated by the schema first)."""
    return STYLES[ALIASES.get(name, name)]


class StyleChoice(Protocol):
    """What a plan rule says about a style (``plancc.compiler.plan.StyleRef``)."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> Mapping[str, Any]: ...


def declared(choice: StyleChoice) -> d.Declaration:
    """The declaration of a plan's style choice, one object per distinct choice: torch's
    styles keep no per-module state, so the runtime builds one torch style per declaration and
    a 1000-layer plan builds a few dozen objects instead of thousands."""
    return _declared(canonical_style(choice.name).name, tuple(sorted(choice.overrides.items())))


@cache
def _declared(name: str, overrides: tuple[tuple[str, Any], ...]) -> d.Declaration:
    return STYLES[name].declare(dict(overrides))


def parse_layout(text: str) -> Placement:
    match = _LAYOUT_RE.match(text)
    if match is None:
        raise ValueError(f"not a layout: {text!r} (use 'replicate' or 'shard(DIM)')")
    return Replicate() if match.group(1) is None else Shard(int(match.group(1)))


def format_layout(placement: Any) -> str:
    """A layout as a plan writes it: ``shard(1)``, ``[shard(1), null]``, ``{x: replicate}``."""
    if isinstance(placement, tuple) and all(isinstance(p, tuple) for p in placement):  # keyword layouts
        return "{" + ", ".join(f"{k}: {format_layout(v)}" for k, v in placement) + "}"
    if isinstance(placement, tuple):
        return "[" + ", ".join("null" if p is None else format_layout(p) for p in placement) + "]"
    if placement is None:
        return "-"
    if isinstance(placement, Shard):
        return f"shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "replicate"
    return str(placement).lower()


def style_layouts(choice: StyleChoice) -> Layouts:
    """What the style of a plan's choice does to its module, from its declaration alone (no
    torch object is built): the placements the checks reason with. One ``Layouts`` per
    declaration (declarations are interned by ``_declared``; the checks ask per module, per
    layout: hundreds of thousands of times in a ``plancc suggest`` search)."""
    decl = declared(choice)
    found = _LAYOUTS.get(id(decl))
    if found is None:
        found = _LAYOUTS[id(decl)] = decl.layouts()
    return found


_LAYOUTS: dict[int, Layouts] = {}  # id of an interned declaration -> its layouts


def default_layouts(name: str) -> Layouts:
    """What a style does with its defaults (the ``plancc styles`` table)."""
    return _declared(canonical_style(name).name, ()).layouts()
