"""mixed-shards, dtensor-output: what a module reads must be in one layout.

Read from the model's recorded wiring (``plancc.dataflow``: which leaf modules' outputs each
module's input was computed from).

``mixed-shards``: inside an attention or MLP block, every projection whose outputs meet before
the block's output projection must be split over tp the same way. Leaving one whole -- ``v_proj``
beside colwise ``q_proj``/``k_proj``, or ``up_proj`` beside a colwise ``gate_proj`` -- has each rank
combine its share of one projection's heads or features with all of the other's: a shape error,
or, where the shapes happen to broadcast, a model that trains wrong without a word.

``shared-input`` (a warning): a block whose input several colwise projections read (q/k/v,
gate/up) and that has no block style sends one all-reduce of its input gradient per projection
in backward, where ``shared_input`` on the block sums them first and sends one: the fix is
that rule (``import-hf`` writes it).

``dtensor-output``: between modules plancc passes plain tensors, because transformers mixes
every module's output with plain tensors (residual adds, masks, activations). A style that
hands on a DTensor (``use_local_output: false``) may only feed modules whose own style takes a
DTensor input (a declared input layout); anything else fails with "mixed torch.Tensor and
DTensor", or computes on the DTensor's global view.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from ..compiler.globs import generalize
from ..compiler.plain_placements import Replicate, Shard
from ..compiler.styles import style_layouts
from ..dataflow import Flow
from ..errors import Severity
from .context import CheckContext, Problem, flow_of, kind_of
from .example import Example
from .layout_flow import flow_problems

IDS = ("mixed-shards", "dtensor-output", "shared-input")

EXAMPLES = (
    Example(
        verdict="PASS", text="q/k/v_proj: colwise, o_proj: rowwise (every head split the same way)", args={"tp": 2}
    ),
    Example(
        verdict="FAIL",
        text="q_proj, k_proj: colwise, v_proj left whole, o_proj: rowwise -> each rank meets its q heads with "
        "every head of v (trained wrong, exit 0, before this rule)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn.v_proj", None),),
    ),
    Example(
        verdict="WARN",
        text="self_attn without shared_input: q/k/v_proj each all-reduce their input gradient (3 where 1 is enough)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn", None),),
    ),
    Example(
        verdict="FAIL",
        text="gate_proj: {style: colwise, use_local_output: false} -> a DTensor multiplied by up_proj's plain "
        "output ('mixed torch.Tensor and DTensor')",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.mlp.gate_proj", {"style": "colwise", "use_local_output": False}),),
    ),
)


def _readers_of(flow: Flow, name: str, leaf: bool) -> list[str]:
    """The leaf modules that read ``name``'s output: directly for a leaf; for a block with an
    input adapter, the leaves inside it that read the block's (main) input."""
    if leaf:
        return list(flow.readers(name))
    known = flow._index.setdefault("block readers", {})  # the same blocks are asked at every layout
    if name not in known:
        call = flow.signature(name)
        inside = name + "."
        known[name] = (
            []
            if call is None or not call.input_sources
            else [c.reader for c in flow.calls if c.reader.startswith(inside) and c.sources & call.input_sources]
        )
    return list(known[name])


def _dtensor_outputs(ctx: CheckContext, flow: Flow) -> Iterator[Problem]:
    modules = ctx.modules
    reported: set[str] = set()
    for name, module, rule, lay in ctx.assigned():
        if lay.local_output is not False or lay.output is None or rule.pattern in reported:
            continue
        leaf = next(module.children(), None) is None
        call = flow.signature(name)
        if not leaf and call is not None and call.output_sources & call.input_sources:
            reported.add(rule.pattern)
            yield Problem(
                rule="dtensor-output",
                loc=rule.loc,
                message=f"{rule.pattern} ({rule.style.describe()}) hands its input on as a DTensor, but the block's "
                "own code adds that input to what it computes (a residual inside the block): transformers mixes it "
                "with plain tensors ('mixed torch.Tensor and DTensor')",
                fix="put the style on the attention and MLP blocks inside it, whose input only their projections read",
            )
            continue
        for reader in _readers_of(flow, name, leaf):
            taken = ctx.rule_for(reader)
            if taken is not None and style_layouts(taken.style).input is not None:
                continue  # its style takes a DTensor input and lays it out
            reported.add(rule.pattern)
            what = type(modules[reader]).__name__ if reader in modules else "module"
            yield Problem(
                rule="dtensor-output",
                loc=rule.loc,
                message=f"{rule.pattern} ({rule.style.describe()}) hands on a DTensor, but {generalize(reader)} "
                f"({what}, {'no style' if taken is None else taken.style.name}) reads it as a plain tensor: "
                "transformers mixes it with plain tensors ('mixed torch.Tensor and DTensor')",
                fix="remove use_local_output: false (plain local tensors between modules), or give "
                f"{generalize(reader)} a style that takes the DTensor",
            )
            break


def _takes_a_dtensor(ctx: CheckContext, name: str, module: nn.Module | None) -> bool:
    """Whether ``name``'s style takes a replicated DTensor input as it is (colwise kinds)."""
    rule = ctx.rule_for(name)
    if rule is None or module is None:
        return False
    lay = style_layouts(rule.style)
    weight = lay.weight.get(kind_of(module)) if lay.weight is not None else None
    return lay.input == Replicate() and isinstance(weight, Shard)


def _unshared_inputs(ctx: CheckContext, flow: Flow) -> Iterator[Problem]:
    if ctx.sequence_parallel:
        return  # the overlay's gather_seq_input is the block style under SP (layout-pairing asks for it)
    modules = ctx.modules
    blocks: dict[str, list[str]] = {}  # glob -> the blocks it names
    for block, module in modules.items():
        if block and next(module.children(), None) is not None:
            blocks.setdefault(generalize(block), []).append(block)

    def shares(block: str) -> list[str]:
        """The colwise readers of ``block``'s input, when two or more of its children read it, all
        take a DTensor, and nothing else in the block does (no residual add: the block's output
        carries none of its input)."""
        call = flow.signature(block)
        by_keyword = call is not None and not call.positional and "hidden_states" in call.keywords
        if call is None or not (call.positional or by_keyword) or call.output_sources & call.input_sources:
            return []
        readers = sorted(set(_readers_of(flow, block, leaf=False)))
        children = all(r.rpartition(".")[0] == block for r in readers)
        ok = len(readers) >= 2 and children and all(_takes_a_dtensor(ctx, r, modules.get(r)) for r in readers)
        return readers if ok else []

    for glob, named in blocks.items():
        rule = ctx.rule_for(named[0])
        sinks = rule is not None and rule.style.name == "per_head_params"
        if rule is not None and (not sinks or "input_layouts" in rule.style.overrides):
            continue
        found = [shares(block) for block in named]
        if not all(found):  # the rule would reach every block the glob names (MoE layers beside dense ones)
            continue
        readers = found[0]
        style: Any = {"style": "per_head_params", "input_layouts": "replicate"} if sinks else "shared_input"
        written = "{style: per_head_params, input_layouts: replicate}" if sinks else "shared_input"
        first_reader = ctx.rule_for(readers[0])
        assert first_reader is not None, "readers that take a DTensor are styled"
        yield Problem(
            rule="shared-input",
            severity=Severity.WARNING,
            loc=rule.loc if rule is not None else first_reader.loc,
            message=f"{', '.join(r.rpartition('.')[2] for r in readers)} read {glob}'s input and each all-reduces "
            f"its gradient in backward: {len(readers)} all-reduces of a [batch, sequence, hidden] gradient where "
            "one is enough",
            fix=f"add '{glob}: {written}' (the input handed to them as one DTensor: their gradients summed first)",
            suggestion={glob: style},
        )


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None:
        return
    flow = flow_of(ctx)
    if isinstance(flow, str):
        return  # sharded-region-params warns that the wiring could not be traced
    # values that meet in different layouts, found by following every layout (checks.layout_flow)
    yield from flow_problems(ctx, "mixed")
    found = list(_dtensor_outputs(ctx, flow))
    yield from found
    if not found:  # the trace's DTensor problems are the same mistakes, seen where they land
        yield from flow_problems(ctx, "dtensor")
    if ctx.tp > 1:
        yield from _unshared_inputs(ctx, flow)
