"""Every activation's tp layout, followed through the model's recorded wiring from the plan's styles.

The checks' dataflow: an abstract run of the forward over layouts instead of values. Each leaf
module's output gets what its style makes of its input (``Layouts``), each value a module reads
is the meeting of the outputs it was computed from (``plancc.dataflow``: the wiring, recorded
on the real model), and a block style (``shared_input``, ``gather_seq_input``) hands its
children the input it laid out. What a value can be on the tp axis:

- ``whole``: every rank holds all of it, a plain tensor (replicated);
- ``features``: each rank holds its shard of the last dim (heads), plain: between a colwise
  projection and the rowwise one that reduces it;
- ``sequence``: each rank holds its shard of the sequence (dim 1), plain: SP's residual stream;
- ``dtensor``: a DTensor with its placement (the logits styles, the block-input styles);
- ``positions``: cos/sin and the like, which carry no features and meet any layout;
- ``unknown``: what the trace cannot model (an earlier conflict's output: nothing downstream of
  a problem is reported again).

A plain tensor carries no layout: torch's styles take it *as* the layout they declare. A
consumer whose declared input is not what it receives is a ``Conflict`` -- a shape error at run
time, or, where widths happen to fit, a model that trains wrong without a word -- and so are
two branches that meet in different layouts (gate x up, q/k/v into attention, a residual add).
``repairs`` finds the one-rule edits of the plan that clear a conflict: the culprit to name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from ..compiler.plain_placements import Placement, Replicate, Shard
from ..compiler.styles import Layouts, ModuleKind, default_layouts, module_kind
from ..dataflow import Flow

Kind = Literal["whole", "features", "sequence", "dtensor", "positions", "unknown"]


@dataclass(frozen=True, slots=True)
class Value:
    """One activation's layout on the tp axis, and the modules whose styles made it so."""

    kind: Kind
    placement: Placement | None = None  # a DTensor's
    makers: frozenset[str] = frozenset()  # styled modules that last set this layout
    width: int | None = None  # the whole last dim of a feature shard (its projection's out_features)

    def describe(self) -> str:
        if self.kind == "dtensor":
            return f"a DTensor ({_placement_text(self.placement)})"
        return {
            "whole": "a whole (replicated) tensor",
            "features": "a plain tensor sharded on features (shard(-1))",
            "sequence": "a plain tensor sharded on the sequence (shard(1))",
            "positions": "positions",
            "unknown": "an unknown layout",
        }[self.kind]


def _placement_text(p: Placement | None) -> str:
    return "replicate" if isinstance(p, Replicate) else f"shard({p.dim})" if isinstance(p, Shard) else "none"


def _kind_of(p: Placement | None) -> Kind:
    if isinstance(p, Replicate):
        return "whole"
    if isinstance(p, Shard):
        if p.dim in (-1, 2):  # features of [b, s, f], or heads of [b, s, h, d] (qk_norm)
            return "features"
        if p.dim in (1, -2):
            return "sequence"
    return "unknown"  # a batch shard: layout-pairing's off-axis rule says so


_WANTED: dict[Kind, str] = {
    "whole": "a whole (replicated) input",
    "features": "an input sharded on features (shard(-1))",
    "sequence": "an input sharded on the sequence (shard(1))",
}


@dataclass(frozen=True, slots=True)
class Conflict:
    """``consumer`` cannot take what it reads. ``kind``: ``pairing`` (its style, or its whole
    weight, wants another layout than it gets), ``mixed`` (what it reads was computed from
    values in different layouts), ``dtensor`` (a DTensor reaches a module that takes plain
    tensors), ``output`` (the model's output is a shard nothing combines)."""

    kind: Literal["pairing", "mixed", "dtensor", "output"]
    consumer: str  # a module name ("" for the model's output)
    found: tuple[Value, ...]  # what it reads (several for ``mixed``)
    wanted: str  # what it takes, in words

    @property
    def makers(self) -> frozenset[str]:
        return frozenset().union(*(v.makers for v in self.found))


@dataclass(kw_only=True, slots=True)
class LayoutTrace:
    values: dict[str, Value] = field(default_factory=dict)  # leaf -> its output's layout
    conflicts: list[Conflict] = field(default_factory=list)
    prepared: dict[str, Value] = field(default_factory=dict)  # styled block -> what its children get
    inputs: dict[str, Value] = field(default_factory=dict)  # leaf -> what it read
    # (reader, makers): a rowwise_rep reading what colwise_rep modules gathered (exact, wasteful)
    gathered_then_sliced: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    # whether plancc's log-probs read the lm_head's weight (the fused path), not its logits alone
    fused_head: bool = True


StyleOf = Callable[[str], Layouts | None]  # module name -> its style's layouts (None: no style)

_WHOLE = Value("whole")
_UNKNOWN = Value("unknown")


class _Tracer:
    def __init__(self, flow: Flow, modules: Mapping[str, nn.Module], style_of: StyleOf, fused_head: bool):
        self.flow = flow
        self.modules = modules
        self.style_of = style_of
        self.trace = LayoutTrace(fused_head=fused_head)
        self.sliced = {leaf for leaf, _ in flow.splits}

    def run(self) -> LayoutTrace:
        for call in self.flow.calls:
            value = self.read(call.reader, call.sources)
            self.trace.inputs[call.reader] = value
            self.trace.values[call.reader] = value if value.kind == "unknown" else self.through(call.reader, value)
        model = self.flow.signature("")
        if model is not None:
            out = self.meet("", [self.trace.values.get(s, _UNKNOWN) for s in model.output_sources])
            if out.kind in ("features", "sequence"):
                self.conflict("output", "", (out,), "whole logits, or a DTensor (colwise_logits)")
            elif self.trace.fused_head and any(self._rows_split(m) for m in out.makers):
                # plancc's log-probs read the lm_head weight a vocabulary shard at a time (fused path;
                # a model that transforms its logits is read through them, whatever the split)
                self.conflict("output", "", (out,), "an lm_head whose weight is split by vocabulary rows or whole")
        return self.trace

    def _rows_split(self, name: str) -> bool:
        """A linear layer whose style splits its weight's input features (rowwise kinds)."""
        lay, module = self.style_of(name), self.modules.get(name)
        if lay is None or lay.weight is None or module is None or module_kind(module) is not ModuleKind.LINEAR:
            return False
        return lay.weight.get(ModuleKind.LINEAR) == Shard(1)

    def conflict(
        self,
        kind: Literal["pairing", "mixed", "dtensor", "output"],
        consumer: str,
        found: tuple[Value, ...],
        wanted: str,
    ) -> Value:
        self.trace.conflicts.append(Conflict(kind=kind, consumer=consumer, found=found, wanted=wanted))
        return _UNKNOWN

    # -- what a module reads ---------------------------------------------------------------

    def read(self, reader: str, sources: Iterable[str]) -> Value:
        sources = sorted(sources)
        if not sources:
            is_embedding = reader in self.modules and module_kind(self.modules[reader]) is ModuleKind.EMBEDDING
            return _WHOLE if is_embedding else Value("positions")  # token ids are whole on every rank
        return self.meet(reader, [self.source_value(reader, s) for s in sources])

    def source_value(self, reader: str, source: str) -> Value:
        """``source``'s output as ``reader`` gets it: through the style of a block around the
        reader whose input it is."""
        block = reader.rpartition(".")[0]
        while block:
            lay = self.style_of(block)
            if lay is not None and lay.input is not None and block in self.modules:
                call = self.flow.signature(block)
                if call is not None and source in call.input_sources:
                    return self.prepare(block, lay, call.input_sources)
            block = block.rpartition(".")[0]
        return self.trace.values.get(source, _UNKNOWN)

    def prepare(self, block: str, lay: Layouts, inputs: frozenset[str]) -> Value:
        if block in self.trace.prepared:
            return self.trace.prepared[block]
        got = self.meet(block, [self.trace.values.get(s, _UNKNOWN) for s in sorted(inputs)])
        value = self.accept(block, got, lay)
        if value.kind != "unknown":
            value = self.made(block, lay, value)
        self.trace.prepared[block] = value
        return value

    def meet(self, reader: str, values: list[Value]) -> Value:
        values = [v for v in values if v.kind != "positions"]
        if not values:
            return Value("positions")
        if any(v.kind == "unknown" for v in values):
            return _UNKNOWN
        layouts = {(v.kind, v.placement) for v in values}
        if len(layouts) == 1:
            makers = frozenset().union(*(v.makers for v in values))
            widths = {v.width for v in values}
            return Value(values[0].kind, values[0].placement, makers, widths.pop() if len(widths) == 1 else None)
        merged: dict[tuple[Kind, Placement | None], frozenset[str]] = {}
        for v in values:
            merged[(v.kind, v.placement)] = merged.get((v.kind, v.placement), frozenset()) | v.makers
        distinct = tuple(Value(kind, placement, makers) for (kind, placement), makers in merged.items())
        if any(v.kind == "dtensor" for v in distinct):
            return self.conflict("dtensor", reader, distinct, "plain tensors alike (transformers mixes them)")
        return self.conflict("mixed", reader, distinct, "values in one layout")

    # -- what a module makes of it ---------------------------------------------------------

    def through(self, name: str, value: Value) -> Value:
        lay = self.style_of(name)
        module = self.modules.get(name)
        if lay is None or (lay.input is None and lay.output is None):
            return self.whole_module(name, module, value)
        value = self.accept(name, value, lay)
        if value.kind == "unknown":
            return value
        if self._slices_a_gather(lay, module, value):
            self.trace.gathered_then_sliced.append((name, value.makers))
        if module is not None and module_kind(module) is ModuleKind.ROTARY:
            return Value("positions")  # cos/sin: positions whatever layout the rotary read them from
        return self.made(name, lay, value, module)

    def accept(self, name: str, value: Value, lay: Layouts) -> Value:
        """``value`` as a style that declares ``lay.input`` takes it."""
        if value.kind in ("dtensor", "positions", "unknown") or lay.input is None:
            return value  # a DTensor is laid out by torch from its own placement
        wanted = _kind_of(lay.input)
        if wanted == "sequence" and value.kind == "features" and self._per_token_norm_of_heads(name, lay, value):
            return value  # shard(1) of [batch, seq, heads, head_dim]: any dim but the normalized one holds
        if wanted != "unknown" and value.kind != wanted:
            return self.conflict("pairing", name, (value,), _WANTED[wanted])
        return value

    def _per_token_norm_of_heads(self, name: str, lay: Layouts, value: Value) -> bool:
        """A norm of one head at a time, its weights replicated and gradients summed over tp
        (``sequence_parallel`` on q_norm): the heads' shard it reads is as good as a sequence shard."""
        module = self.modules.get(name)
        if module is None or module_kind(module) is not ModuleKind.NORM or lay.weight is None:
            return False
        return (
            lay.input == lay.output and lay.weight.get(ModuleKind.NORM) == Replicate() and self._per_head(module, value)
        )

    def made(self, name: str, lay: Layouts, value: Value, module: nn.Module | None = None) -> Value:
        if lay.output is None:
            return value
        kind = _kind_of(lay.output)
        sharded = (
            lay.weight is not None and module is not None and isinstance(lay.weight.get(module_kind(module)), Shard)
        )
        keeps = kind == value.kind or lay.input == lay.output  # a style that lays out as it was handed
        if keeps and not sharded and lay.local_output is not False:
            return value  # a norm that keeps the layout (qk_norm, sequence_parallel): the shard is its makers'
        width = _out_width(module)
        if lay.local_output is False:
            return Value("dtensor", lay.output, frozenset({name}), width)
        return Value(kind, None, frozenset({name}), width if kind == "features" else None)

    def whole_module(self, name: str, module: nn.Module | None, value: Value) -> Value:
        """A module left whole: its own code on whatever it reads."""
        if module is None:
            return value
        kind = module_kind(module)
        if kind is ModuleKind.ROTARY:
            # under SP left whole, it would count positions from the shard's length, but
            # plancc.parallelize passes position ids (the sequence-parallel rule warns)
            return Value("positions")
        owns = any(True for _ in module.parameters(recurse=False))
        if not owns or value.kind == "positions":
            return value  # an activation, a dropout: elementwise on any layout
        if value.kind == "dtensor":
            self.conflict("dtensor", name, (value,), "a plain tensor (its weights are whole)")
            # had it been handed the plain tensor: what it makes of a replicated one is whole, and
            # where that meets a shard downstream is a problem of its own
            return Value("whole", None, frozenset({name})) if value.placement == Replicate() else _UNKNOWN
        if value.kind == "features" and not self._per_head(module, value):
            return self.conflict("pairing", name, (value,), _WANTED["whole"] + " (its weights are whole)")
        if value.kind == "sequence":  # right values, but each rank's gradient covers its tokens alone
            return self.conflict(
                "pairing",
                name,
                (value,),
                "a whole input, or a style that sums its gradients over tp (sequence_parallel)",
            )
        # a per-head module hands on the shard of its makers; a whole one makes a whole value
        return value if value.kind == "features" else Value(value.kind, None, frozenset({name}))

    def _slices_a_gather(self, lay: Layouts, module: nn.Module | None, value: Value) -> bool:
        if value.kind != "whole" or not value.makers or module is None or lay.weight is None:
            return False
        if lay.input != Replicate() or lay.weight.get(module_kind(module)) != Shard(1):
            return False  # not rowwise_rep
        if any(m in self.sliced for m in value.makers):
            return False  # sliced by global sizes as it comes out (Phi-3's qkv): no rank can hold a shard
        return all(gathers_whole(self.style_of(m), self.modules.get(m)) for m in value.makers)

    @staticmethod
    def _per_head(module: nn.Module, value: Value) -> bool:
        """A norm (or other module) whose weights span less than the features it reads: it
        works a head at a time (Qwen3's q_norm), which a shard of whole heads keeps."""
        if module_kind(module) is ModuleKind.LINEAR:
            return False
        widths = [int(p.shape[-1]) for p in module.parameters(recurse=False) if p.dim() >= 1]
        return value.width is not None and bool(widths) and all(w < value.width for w in widths)


def _out_width(module: nn.Module | None) -> int | None:
    """The whole last dim a linear layer or embedding makes, read off its weight (a skeleton's
    modules have the weights' shapes, not the classes' attributes)."""
    weight = getattr(module, "weight", None)
    if module is None or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return None
    return int(weight.shape[1] if module_kind(module) is ModuleKind.EMBEDDING else weight.shape[0])


def gathers_whole(lay: Layouts | None, module: nn.Module | None) -> bool:
    """A colwise style on a linear layer that all-gathers its output (colwise_rep)."""
    if lay is None or module is None or lay.weight is None or module_kind(module) is not ModuleKind.LINEAR:
        return False
    return lay.output == Replicate() and lay.weight.get(ModuleKind.LINEAR) == Shard(0)


def trace_layouts(
    flow: Flow, modules: Mapping[str, nn.Module], style_of: StyleOf, *, fused_head: bool = True
) -> LayoutTrace:
    return _Tracer(flow, modules, style_of, fused_head).run()


@dataclass(frozen=True, slots=True)
class Repair:
    """Give the modules of one rule another style (``None``: no style) -- and the conflicts it clears."""

    pattern: str
    section: str
    style: str | None
    clears: frozenset[int]  # indexes into the trace's conflicts


def repairs(
    flow: Flow,
    modules: Mapping[str, nn.Module],
    style_of: StyleOf,
    rules: Mapping[tuple[str, str], tuple[str, ...]],
    candidates: Callable[[tuple[str, ...]], Iterable[str | None]],
    before: LayoutTrace,
) -> list[Repair]:
    """The one-rule edits (each rule -- ``(section, pattern)`` -> its modules -- to each of its
    ``candidates``) that clear conflicts of ``before`` and make none that were not there."""
    known = {_key(c): i for i, c in enumerate(before.conflicts)}
    at = {c.consumer for c in before.conflicts}  # another problem where one stood is no repair
    found: list[Repair] = []
    for (section, pattern), names in rules.items():
        decided = frozenset(names)
        for style in candidates(names):
            edited = default_layouts(style) if style is not None else None

            def edited_style(
                name: str, edited: Layouts | None = edited, decided: frozenset[str] = decided
            ) -> Layouts | None:
                return edited if name in decided else style_of(name)

            after = trace_layouts(flow, modules, edited_style, fused_head=before.fused_head)
            keys = {_key(c) for c in after.conflicts}
            if any(_moved(c, before, at, decided) for c in after.conflicts if _key(c) not in known):
                continue  # it moves the problem elsewhere (not merely uncovers one a conflict hid)
            cleared = frozenset(i for k, i in known.items() if k not in keys)
            if cleared:
                found.append(Repair(pattern=pattern, section=section, style=style, clears=cleared))
    return found


def _moved(new: Conflict, before: LayoutTrace, at: set[str], edited: frozenset[str]) -> bool:
    """Whether a conflict an edit makes is the old problem moved: not one that an earlier conflict
    hid downstream of it (where the edited modules made none of what is read)."""
    return not _masked(before, new.consumer) or new.consumer in at or bool(new.makers & edited)


def _masked(trace: LayoutTrace, consumer: str) -> bool:
    """Whether ``consumer`` read what an earlier conflict made unknown: its own problem, if any, was hidden."""
    read = trace.inputs.get(consumer)
    return read is not None and read.kind == "unknown"


def _key(c: Conflict) -> tuple[str, str]:
    return (c.kind, c.consumer)
