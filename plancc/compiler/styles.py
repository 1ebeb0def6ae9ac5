"""The style vocabulary: the one table mapping a style name to a torch ``ParallelStyle``.

Every style is declared once as a torch class plus keyword defaults, so the placements that
``plancc styles`` documents are read off the very objects the compiler builds; they cannot
drift apart (a property test builds every style and compares).

Conventions shared by the whole vocabulary (they are what makes styles compose):
- Between modules, activations are plain local tensors (``use_local_output=True``), except
  the logits styles, which hand the vocab-sharded DTensor to the logprob evaluator. transformers
  5.x mixes module outputs with plain tensors (residual adds, masks, rotary cos/sin), so a
  DTensor escaping a module fails with "mixed torch.Tensor and DTensor".
- Sequence-parallel regions hold ``Shard(1)`` local shards; a consumer of a sequence-sharded
  activation must declare ``Shard(1)`` input (``colwise_seq``, ``sequence_parallel``,
  ``gather_seq_input``), because a plain tensor carries no layout for torch to redistribute.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .attention_styles import LatentKeyValueProjection, PerHeadParameters
from .expert_styles import ExpertsOverTensorParallel, is_experts_module
from .packed_styles import PackedColwise, PackedRowwise


class ModuleKind(StrEnum):
    LINEAR = "linear"
    EMBEDDING = "embedding"
    NORM = "norm"
    ROTARY = "rotary"
    EXPERTS = "experts"  # transformers' fused experts of a mixture-of-experts layer
    OTHER = "other"


def module_kind(module: nn.Module) -> ModuleKind:
    if isinstance(module, nn.Linear):
        return ModuleKind.LINEAR
    if isinstance(module, nn.Embedding):
        return ModuleKind.EMBEDDING
    name = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm")):
        return ModuleKind.NORM
    if name.endswith("RotaryEmbedding"):
        return ModuleKind.ROTARY
    if is_experts_module(module):
        return ModuleKind.EXPERTS
    return ModuleKind.OTHER


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


class GatherSequenceInput(ParallelStyle):
    """All-gather a sequence-sharded input (``Shard(1)``) into the whole sequence.

    Put on a block (``self_attn``, ``mlp``) rather than on its projections: HF attention
    reshapes q/k/v with its *input's* sequence length, so the block itself must see the
    full sequence; one all-gather then serves q, k and v. The input is the first positional
    argument or, as HF decoder layers pass it to attention, the ``hidden_states`` keyword.
    In backward the projections' partial input gradients are all-reduced by their own
    styles, and this style keeps this rank's sequence slice of the sum.
    """

    def __init__(self, *, use_local_output: bool = True):
        self.input_layouts = (Shard(1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _gather(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        x = x.redistribute(placements=self.desired_input_layouts)
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor):
                args = (self._gather(args[0], device_mesh), *args[1:])
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                kwargs = {**kwargs, "hidden_states": self._gather(kwargs["hidden_states"], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


@dataclass(frozen=True, kw_only=True, slots=True)
class StyleSpec:
    """One row of the vocabulary."""

    name: str
    summary: str
    factory: type[ParallelStyle]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    module_kinds: frozenset[ModuleKind] = frozenset(ModuleKind)
    # Override keys a plan may set in the mapping form for this style.
    overridable: frozenset[str] = frozenset()
    aliases: tuple[str, ...] = ()

    def build(self, overrides: Mapping[str, Any] | None = None) -> ParallelStyle:
        return self.factory(**{**self.defaults, **(overrides or {})})

    @property
    def fits_any_module(self) -> bool:
        return self.module_kinds == frozenset(ModuleKind)


_LINEAR_OVERRIDES = frozenset({"input_layouts", "output_layouts", "use_local_output"})
_LINEAR_LIKE = frozenset({ModuleKind.LINEAR, ModuleKind.EMBEDDING})

_SPECS: tuple[StyleSpec, ...] = (
    StyleSpec(
        name="colwise",
        summary="shard the output features; output stays sharded for a rowwise consumer",
        factory=ColwiseParallel,
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_rep",
        summary="colwise, then all-gather the output features",
        factory=ColwiseParallel,
        defaults={"output_layouts": Replicate()},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
        aliases=("colwise_gather_output",),
    ),
    StyleSpec(
        name="colwise_seq",
        summary="colwise whose input is sequence-sharded (all-gathered on the sequence first)",
        factory=ColwiseParallel,
        defaults={"input_layouts": Shard(1)},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_logits",
        summary="lm_head: vocab-sharded logits kept as a DTensor for the logprob evaluator",
        factory=ColwiseParallel,
        defaults={"output_layouts": Shard(-1), "use_local_output": False},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="colwise_logits_seq",
        summary="colwise_logits whose input is sequence-sharded (lm_head under SP)",
        factory=ColwiseParallel,
        defaults={"input_layouts": Shard(1), "output_layouts": Shard(-1), "use_local_output": False},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="rowwise",
        summary="shard the input features; partial outputs are all-reduced",
        factory=RowwiseParallel,
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="rowwise_rep",
        summary="rowwise whose input is replicated (each rank slices its part locally)",
        factory=RowwiseParallel,
        defaults={"input_layouts": Replicate()},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
        aliases=("rowwise_split_input",),
    ),
    StyleSpec(
        name="rowwise_seq",
        summary="rowwise with a reduce-scatter onto the sequence dim (closes a TP region under SP)",
        factory=RowwiseParallel,
        defaults={"output_layouts": Shard(1)},
        module_kinds=_LINEAR_LIKE,
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="packed_colwise",
        summary="colwise for a fused projection whose output holds `blocks` projections (gate_up_proj): "
        "each rank gets its 1/tp of every block (one all-to-all of the output)",
        factory=PackedColwise,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"blocks", "input_layouts"}),
    ),
    StyleSpec(
        name="packed_rowwise",
        summary="rowwise whose input comes per block from a packed_colwise producer, unsplit",
        factory=PackedRowwise,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"blocks", "output_layouts"}),
    ),
    StyleSpec(
        name="embedding_rowwise",
        summary="vocab-parallel embedding: rows (vocab) sharded, lookups all-reduced",
        factory=RowwiseParallel,
        defaults={"input_layouts": Replicate()},
        module_kinds=frozenset({ModuleKind.EMBEDDING}),
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="embedding_seq",
        summary="vocab-parallel embedding reduce-scattered onto the sequence dim (opens SP)",
        factory=RowwiseParallel,
        defaults={"input_layouts": Replicate(), "output_layouts": Shard(1)},
        module_kinds=frozenset({ModuleKind.EMBEDDING}),
        overridable=_LINEAR_OVERRIDES,
    ),
    StyleSpec(
        name="sequence_parallel",
        summary="norm on a sequence shard; weights replicated, gradients summed over tp",
        factory=SequenceParallel,
        defaults={"use_local_output": True},
        module_kinds=frozenset({ModuleKind.NORM, ModuleKind.OTHER}),
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="qk_norm",
        summary="weights replicated, gradients summed over tp: a module with parameters inside a tp "
        "region (per-head q/k norms, learnable activations)",
        factory=SequenceParallel,
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
        factory=ExpertsOverTensorParallel,
        module_kinds=frozenset({ModuleKind.EXPERTS}),
    ),
    StyleSpec(
        name="per_head_params",
        summary="an attention block's own per-head parameters (learned sinks) sharded with its heads "
        "(shard(0) over tp), the block computing with this rank's entries",
        factory=PerHeadParameters,
        module_kinds=frozenset({ModuleKind.OTHER}),
        aliases=("local_params",),
    ),
    StyleSpec(
        name="mla_kv_a_proj",
        summary="multi-head latent attention's kv_a_proj_with_mqa: whole, the gradient of its rotary "
        "key (last rope_dim outputs, shared by every head) summed over tp",
        factory=LatentKeyValueProjection,
        module_kinds=frozenset({ModuleKind.LINEAR}),
        overridable=frozenset({"rope_dim"}),
    ),
    StyleSpec(
        name="rotary_sp",
        summary="rotary embedding under SP: plain tensors in and out, global position ids required",
        factory=RotaryUnderSequenceParallel,
        module_kinds=frozenset({ModuleKind.ROTARY}),
    ),
    StyleSpec(
        name="replicate",
        summary="explicitly left whole on every tp rank",
        factory=LeaveWhole,
    ),
    StyleSpec(
        name="shard_seq_output",
        summary="adapter: slice a replicated output onto the sequence dim (opens SP)",
        factory=PrepareModuleOutput,
        defaults={
            "output_layouts": Replicate(),
            "desired_output_layouts": Shard(1),
            "use_local_output": True,
        },
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="gather_seq_input",
        summary="adapter: all-gather a sequence-sharded input (attention/MLP blocks under SP, closes SP)",
        factory=GatherSequenceInput,
        overridable=frozenset({"use_local_output"}),
    ),
    StyleSpec(
        name="prepare_input",
        summary="adapter: redistribute inputs from input_layouts to desired_input_layouts",
        factory=PrepareModuleInput,
        defaults={"input_layouts": Replicate(), "desired_input_layouts": Replicate(), "use_local_output": True},
        overridable=frozenset({"input_layouts", "desired_input_layouts", "use_local_output"}),
    ),
    StyleSpec(
        name="prepare_output",
        summary="adapter: redistribute outputs from output_layouts to desired_output_layouts",
        factory=PrepareModuleOutput,
        defaults={"output_layouts": Replicate(), "desired_output_layouts": Replicate(), "use_local_output": True},
        overridable=frozenset({"output_layouts", "desired_output_layouts", "use_local_output"}),
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


def built_style(choice: StyleChoice) -> ParallelStyle:
    """The torch style object of a plan's style choice, built once per distinct choice.

    torch's styles keep no per-module state (``_apply`` only registers hooks that read the
    style's layouts), so one object serves every module of a rule: a 1000-layer plan builds
    a few dozen objects instead of thousands.
    """
    return _build(canonical_style(choice.name).name, tuple(sorted(choice.overrides.items())))


@cache
def _build(name: str, overrides: tuple[tuple[str, Any], ...]) -> ParallelStyle:
    return STYLES[name].build(dict(overrides))


def parse_layout(text: str) -> Placement:
    match = _LAYOUT_RE.match(text)
    if match is None:
        raise ValueError(f"not a layout: {text!r} (use 'replicate' or 'shard(DIM)')")
    return Replicate() if match.group(1) is None else Shard(int(match.group(1)))


def format_layout(placement: Placement | None) -> str:
    if placement is None:
        return "-"
    if isinstance(placement, Shard):
        return f"shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "replicate"
    return str(placement).lower()


@dataclass(frozen=True, kw_only=True, slots=True)
class Layouts:
    """What a built style does to its module's input, output and weight."""

    input: Placement | None
    output: Placement | None
    local_output: bool | None
    # weight placement on the tp axis per module kind; None where the style does not touch it
    weight: Mapping[ModuleKind, Placement] | None


def layouts_of(style: ParallelStyle) -> Layouts:
    """Read the placements off a built torch style (the source of truth for the table)."""
    if isinstance(style, ColwiseParallel):
        return Layouts(
            input=style.input_layouts[0],
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            weight={ModuleKind.LINEAR: Shard(0), ModuleKind.EMBEDDING: Shard(1)},
        )
    if isinstance(style, RowwiseParallel):
        return Layouts(
            input=style.input_layouts[0],
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            weight={ModuleKind.LINEAR: Shard(1), ModuleKind.EMBEDDING: Shard(0)},
        )
    if isinstance(style, ExpertsOverTensorParallel):
        return Layouts(
            input=Replicate(),
            output=Replicate(),
            local_output=True,
            weight={ModuleKind.EXPERTS: Shard(0)},
        )
    if isinstance(style, PerHeadParameters):
        # the block's input and output are the residual stream; its own parameters follow the heads
        return Layouts(input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.OTHER: Shard(0)})
    if isinstance(style, LatentKeyValueProjection):
        return Layouts(
            input=Replicate(), output=Replicate(), local_output=True, weight={ModuleKind.LINEAR: Replicate()}
        )
    if isinstance(style, SequenceParallel):
        shard = style.sequence_sharding[0]
        return Layouts(
            input=shard,
            output=shard,
            local_output=style.use_local_output,
            weight={kind: Replicate() for kind in ModuleKind},
        )
    if isinstance(style, (PrepareModuleInput, GatherSequenceInput)):
        inputs, wanted = style.input_layouts, style.desired_input_layouts
        assert inputs is not None and wanted is not None  # every spec sets both
        return Layouts(
            input=inputs[0],
            output=wanted[0],
            local_output=style.use_local_output,
            weight=None,
        )
    if isinstance(style, PrepareModuleOutput):
        outputs, desired = style.output_layouts, style.desired_output_layouts
        assert outputs is not None and desired is not None  # every spec sets both
        return Layouts(
            input=outputs[0],
            output=desired[0],
            local_output=style.use_local_output,
            weight=None,
        )
    return Layouts(input=None, output=None, local_output=None, weight=None)
