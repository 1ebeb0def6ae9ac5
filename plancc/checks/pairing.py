"""layout-pairing: a module that leaves its output sharded must feed one that accepts it.

Inside an attention or MLP block, colwise projections leave a feature-sharded local
tensor (Shard(-1)); the block's output projection must be rowwise (input Shard(-1)) to
reduce it. Under sequence parallelism the residual stream between blocks is a sequence
shard (Shard(1)); a projection reading it with a replicated-input style needs the shard
gathered first, by its block (``gather_seq_input`` on ``self_attn``/``mlp``) or by itself
(``colwise_seq``): a plain tensor carries no layout, and torch would silently treat the
shard as the whole sequence.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..compiler.declarations import positional_count
from ..compiler.globs import generalize
from ..compiler.placements import Replicate, Shard
from ..compiler.plan import Rule
from ..compiler.styles import ModuleKind, declared, style_layouts
from .context import CheckContext, Problem, flow_of, kind_of
from .example import Example

ID = "layout-pairing"

_FEATURES = Shard(-1)
_SEQUENCE = Shard(1)


_BATCH_SHARDED_GATE = {"style": "colwise", "output_layouts": "shard(0)"}

EXAMPLES = (
    Example(verdict="PASS", text="q/k/v_proj: colwise, o_proj: rowwise", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="q/k/v_proj: colwise, o_proj left out -> o_proj gets heads/tp features, a shape error",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn.o_proj", None),),
    ),
    Example(
        verdict="FAIL",
        text="gate_proj: {style: colwise, output_layouts: shard(0)} -> a batch shard, read by up_proj's "
        "product and down_proj as features (a shape error at run time)",
        args={"tp": 2},
        edits=(
            ("tensor_parallel", "model.layers.*.mlp.gate_proj", {"style": "colwise", "output_layouts": "shard(0)"}),
        ),
    ),
    Example(
        verdict="FAIL",
        text="self_attn: prepare_input -> HF calls attention with hidden_states= only: torch's PrepareModuleInput "
        "lays out positional inputs (failed at the first call before this rule)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn", "prepare_input"),),
    ),
    Example(
        verdict="FAIL",
        text="under SP: input_layernorm: sequence_parallel, q_proj: colwise, and self_attn not gathered",
        args={"tp": 2, "sequence_parallel": True},
        edits=(("sequence_parallel", "model.layers.*.self_attn", None),),
    ),
)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _block(name: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'model.layers.3' (the repeated decoder block)."""
    match = re.match(r"^(.*?\.\d+)(?:\.|$)", name)
    return match.group(1) if match else ""


Named = tuple[str, Rule]  # a module name and the rule that styled it


@dataclass(kw_only=True, slots=True)
class _Flow:
    """Who hands on and who accepts a sharded activation, per parent module."""

    producers: dict[str, list[Named]] = field(default_factory=lambda: defaultdict(list))  # leave Shard(-1)
    consumers: dict[str, list[Named]] = field(default_factory=lambda: defaultdict(list))  # read Shard(-1)
    seq_blocks: set[str] = field(default_factory=set)  # blocks whose output is a sequence shard
    replicated_readers: list[Named] = field(default_factory=list)  # linear layers reading a whole input
    reported: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def of(cls, ctx: CheckContext) -> _Flow:
        flow = cls()
        for name, module, rule, lay in ctx.assigned():
            if lay.output == _FEATURES and lay.local_output:
                flow.producers[_parent(name)].append((name, rule))
            if lay.input == _FEATURES and lay.weight is not None:
                flow.consumers[_parent(name)].append((name, rule))
            if lay.output == _SEQUENCE and _block(name):
                flow.seq_blocks.add(_block(name))
            if (
                lay.input == Replicate()
                and lay.weight is not None
                and kind_of(module) is ModuleKind.LINEAR
                and _block(name)
            ):
                flow.replicated_readers.append((name, rule))
        return flow

    def once(self, rule: Rule, key: str) -> bool:
        """Report a rule's problem of one kind once, not once per layer."""
        token = (rule.pattern, key)
        if token in self.reported:
            return False
        self.reported.add(token)
        return True


def _unconsumed(ctx: CheckContext, flow: _Flow) -> Iterator[Problem]:
    modules = ctx.modules
    for parent, made in flow.producers.items():
        if flow.consumers.get(parent):
            continue
        name, rule = made[0]
        whole = [
            n
            for n, m in modules.items()
            if _parent(n) == parent and kind_of(m) is ModuleKind.LINEAR and ctx.rule_for(n) is None
        ]
        if not flow.once(rule, "producer"):
            continue
        if not parent:  # a top-level module (lm_head): its output is the model's output
            yield Problem(
                loc=rule.loc,
                message=f"{name} hands the model's output back as plain tensors sharded on features "
                "(shard(-1)): the loss would read one rank's slice of the vocabulary as if it were all of it",
                fix=f"make {name} colwise_logits (vocab-parallel logits that plancc's loss and log-probs "
                "combine), or colwise_rep to gather them",
            )
            continue
        reader = _reading_projection(ctx, name) or (whole[0] if whole else None)
        yield Problem(
            loc=rule.loc,
            message=f"{name} leaves its output sharded on features (shard(-1)) but no module of "
            f"{parent} accepts that layout"
            + (f"; {', '.join(w.rpartition('.')[2] for w in whole)} left whole" if whole else ""),
            fix=(
                f"add '{_glob(reader)}: rowwise'"
                if reader
                else f"make {name.rpartition('.')[2]} colwise_rep to gather its output"
            ),
        )


def _reading_projection(ctx: CheckContext, producer: str) -> str | None:
    """The linear layer, left whole, that reads ``producer``'s output (through norms and
    activations, by the recorded wiring): the one that should reduce it."""
    flow = flow_of(ctx)
    if isinstance(flow, str):
        return None
    modules = ctx.modules
    reach = {producer}
    for call in flow.calls:
        module = modules.get(call.reader)
        if not reach & call.sources or module is None or ctx.rule_for(call.reader) is not None:
            continue
        if kind_of(module) is ModuleKind.LINEAR:
            return call.reader
        reach.add(call.reader)
    return None


def _unproduced(flow: _Flow) -> Iterator[Problem]:
    for parent, used in flow.consumers.items():
        if flow.producers.get(parent):
            continue
        name, rule = used[0]
        if not flow.once(rule, "consumer"):
            continue
        yield Problem(
            loc=rule.loc,
            message=f"{name} expects feature-sharded input (shard(-1)) but no module of {parent} produces it",
            fix=f"make the projections feeding {name.rpartition('.')[2]} colwise, or use rowwise_rep",
        )


def _ungathered_sequence(ctx: CheckContext, flow: _Flow) -> Iterator[Problem]:
    for name, rule in flow.replicated_readers:
        if _block(name) in flow.seq_blocks and not _gathered_above(ctx, name) and flow.once(rule, "sequence"):
            yield Problem(
                loc=rule.loc,
                message=f"{name} reads the sequence-sharded residual stream of {_block(name)} "
                f"but its style {rule.style.name!r} declares a replicated input",
                fix=f"add '{_glob(_parent(name))}: gather_seq_input' to the sequence_parallel overlay",
            )


# An activation between modules is [batch, sequence, features]: a plain local tensor can stay
# sharded on its features (colwise -> rowwise) or, under SP, its sequence; nothing reads a
# shard of any other dim (a batch shard would be taken for whole rows).
_BETWEEN_MODULES = frozenset({-1, 2, 1, -2})


def _off_axis_layouts(ctx: CheckContext) -> Iterator[Problem]:
    reported: set[tuple[str, str]] = set()
    for _name, _module, rule, _lay in ctx.assigned():
        for key, value in rule.style.overrides.items():
            if not isinstance(value, Shard) or value.dim in _BETWEEN_MODULES or (rule.pattern, key) in reported:
                continue
            reported.add((rule.pattern, key))
            yield Problem(
                loc=rule.loc,
                message=f"{rule.pattern} ({rule.style.describe()}): {key} shard({value.dim}) shards dim "
                f"{value.dim} of a [batch, sequence, features] activation; between modules only the features "
                "(shard(-1)) or, under --sp, the sequence (shard(1)) stay sharded, and no module reads "
                f"a shard of dim {value.dim}",
                fix=f"remove {key}, or use shard(-1) (features) / shard(1) (sequence)",
            )


def _prepare_arity(ctx: CheckContext) -> Iterator[Problem]:
    """torch's PrepareModuleInput lays out the module's positional inputs, one layout each, and
    PrepareModuleOutput its outputs: a module called otherwise fails at its first call
    ("module inputs and input_layouts should have same length")."""
    flow = flow_of(ctx)
    if isinstance(flow, str):
        return
    reported: set[str] = set()
    for name, _module, rule, _lay in ctx.assigned():
        style = rule.style.name
        call = flow.signature(name)
        if style not in _PREPARES or call is None or rule.pattern in reported:
            continue
        takes = positional_count(getattr(declared(rule.style), "input_layouts", None))
        if style != "prepare_output" and takes and call.positional != takes:
            reported.add(rule.pattern)
            given = (
                f"only keyword arguments ({', '.join(f'{k}=' for k in call.keywords)})"
                if not call.positional
                else f"{call.positional} positional argument{'s' if call.positional > 1 else ''}"
            )
            yield Problem(
                loc=rule.loc,
                message=f"{rule.pattern} is called with {given}; {style} lays out {takes} positional "
                f"input{'s' if takes > 1 else ''}, so torch fails at the first call (module inputs and "
                "input_layouts should have same length)",
                fix="give one layout per positional input (null leaves one alone) and keyword inputs by "
                "input_kwarg_layouts; or 'shared_input'/'gather_seq_input', which take the block's first "
                "positional input or its hidden_states= keyword",
            )
        elif style != "prepare_input" and call.outputs != 1:
            reported.add(rule.pattern)
            yield Problem(
                loc=rule.loc,
                message=f"{rule.pattern} returns {call.outputs} values; {style} lays out exactly one output, "
                "so torch fails at the first call",
                fix="put the output layout on the submodule that makes the tensor (its projection), not on the block",
            )


_PREPARES = ("prepare_input", "prepare_output", "prepare_input_output")


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None or ctx.tp == 1:
        return
    yield from _off_axis_layouts(ctx)
    yield from _prepare_arity(ctx)
    flow = _Flow.of(ctx)
    yield from _unconsumed(ctx, flow)
    yield from _unproduced(flow)
    if ctx.resolved.sequence_parallel:
        yield from _ungathered_sequence(ctx, flow)


def _gathered_above(ctx: CheckContext, name: str) -> bool:
    """Whether an enclosing module inside the block gathers the sequence before ``name``."""
    block = _block(name)
    parent = _parent(name)
    while parent and parent != block:
        rule = ctx.rule_for(parent)
        if rule is not None:
            lay = style_layouts(rule.style)
            if lay.input == _SEQUENCE and lay.output == Replicate():
                return True
        parent = _parent(parent)
    return False


def _glob(name: str) -> str:
    return generalize(name)
