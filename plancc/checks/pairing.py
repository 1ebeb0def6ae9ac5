"""layout-pairing: what a module reads must be in the layout its style (or its whole weight) takes.

Every activation's layout is followed from the plan's styles through the model's recorded
wiring (``checks.layout_trace``): colwise projections leave a feature-sharded local tensor that
only a rowwise reader (input shard(-1)) takes; under sequence parallelism the residual stream
is a sequence shard that a replicated-input projection may read only once its block gathers it
(``gather_seq_input``) or it gathers itself (``colwise_seq``). A plain tensor carries no layout:
torch takes it as the layout declared, so a mismatch is a shape error at the first step, or,
where the widths happen to fit, a model that trains wrong. The problem stands at the rule whose
change alone fixes it (``checks.layout_flow``), naming the modules that made what was read.

``redundant-gather`` (a warning): a ``colwise_rep`` that all-gathers what a ``rowwise_rep``
reader cuts back out is exact and slower than ``colwise`` then ``rowwise``.

The layouts a style declares are also held to a [batch, sequence, features] activation
(a shard of another dim is taken for whole rows) and to how the module is called (torch's
``PrepareModuleInput`` lays out positional inputs, one layout each).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.declarations import positional_count
from ..compiler.plain_placements import Shard
from ..compiler.styles import declared
from .context import CheckContext, Problem, flow_of
from .example import Example
from .layout_flow import flow_problems

IDS = ("layout-pairing", "redundant-gather")


_GATHERED = tuple(
    ("tensor_parallel", f"model.layers.*.self_attn.{p}", "colwise_rep") for p in ("q_proj", "k_proj", "v_proj")
)

EXAMPLES = (
    Example(verdict="PASS", text="q/k/v_proj: colwise, o_proj: rowwise", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="o_proj: colwise -> it reads q/k/v's head shards as whole (blamed on o_proj, fix: rowwise)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn.o_proj", "colwise"),),
    ),
    Example(
        verdict="WARN",
        text="llama: q/k/v_proj: colwise_rep, o_proj: rowwise_rep -> exact, but gathered to be sliced again",
        plan="llama.yaml",
        model="llama-3.1-8b",
        args={"tp": 2},
        edits=(*_GATHERED, ("tensor_parallel", "model.layers.*.self_attn.o_proj", "rowwise_rep")),
    ),
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
    if ctx.resolved is None:
        return
    if ctx.tp > 1:
        yield from _off_axis_layouts(ctx)
        yield from _prepare_arity(ctx)
    # what each module reads, followed from the plan's styles (checks.layout_flow): at any tp,
    # as a plan's styles mean the same at every tp > 1
    yield from flow_problems(ctx, "pairing", "output", "waste")
