"""packed-projection: a fused projection is sharded per block, and only a fused one.

A packed Linear computes several projections at once (Phi-3's and GLM-4's ``gate_up_proj``)
and its consumer splits the output on its last dim (``gate, up = x.chunk(2, dim=-1)``). Plain
colwise gives each rank a contiguous ``1/tp`` of all the features -- at tp=2 rank 0 all of
gate, rank 1 all of up -- and each rank's ``chunk`` then pairs the wrong halves: the shapes fit,
the model trains wrong, nothing fails. ``packed_colwise`` gives each rank its ``1/tp`` of every
block. Consumers that slice the output with the model's global sizes (Phi-3's ``qkv``:
``qkv[..., :num_heads * head_dim]``) cannot take any shard: that module must be gathered
(``colwise_rep``). The converse mistake, ``packed_colwise`` on a module nobody splits (or a
``blocks`` count other than the split's), regroups features that belong together.

Which output is split how is in the model's forward: the wiring recorded by
``plancc.dataflow`` (skeletons of the presets ship it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..compiler.globs import generalize
from ..compiler.plain_placements import Shard
from ..compiler.styles import ModuleKind
from .context import CheckContext, Problem, flow_of, kind_of
from .example import Example

ID = "packed-projection"

EXAMPLES = (
    Example(
        verdict="PASS",
        text="tiny-phi3: gate_up_proj: packed_colwise (each rank its share of gate and of up)",
        plan="phi3.yaml",
        model="tiny-phi3",
        args={"tp": 2},
    ),
    Example(
        verdict="FAIL",
        text="tiny-phi3: gate_up_proj: colwise -> rank 0 holds all of gate, rank 1 all of up",
        plan="phi3.yaml",
        model="tiny-phi3",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.mlp.gate_up_proj", "colwise"),),
    ),
    Example(
        verdict="FAIL",
        text="qwen3-8b: q_proj: packed_colwise -> nothing splits q_proj's output",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.self_attn.q_proj", "packed_colwise"),),
    ),
)


def _features(module: nn.Module) -> int:
    """A Linear's output features (a skeleton's Linear carries its weight's shape only)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # kind_of said Linear
    return int(weight.shape[0])


def _split_fix(pattern: str, parts: tuple[int, ...]) -> str:
    if len(set(parts)) == 1:
        return f"'{pattern}: {{style: packed_colwise, blocks: {len(parts)}}}' (each rank its 1/tp of every block)"
    return f"'{pattern}: colwise_rep' (its consumer slices the whole output with the model's own sizes)"


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None or ctx.tp == 1:
        return
    flow = flow_of(ctx)
    if isinstance(flow, str):
        return  # sharded-region-params warns that the forward could not be traced
    styles = {name: rule.style.name for name, rule in ctx.resolved.assignments.items()}
    splits, feeds = dict(flow.splits), dict(flow.feeds)  # looked up once per module: dicts
    read_whole_by_packed_rowwise = {
        producer
        for reader, producers in feeds.items()
        if styles.get(reader) == "packed_rowwise"
        for producer in producers
    }
    reported: set[str] = set()
    for name, module, rule, lay in ctx.assigned():
        if rule.pattern in reported or kind_of(module) is not ModuleKind.LINEAR:
            continue
        style = rule.style.name
        parts = splits.get(name, ())
        shards_output = (
            lay.weight is not None
            and lay.weight.get(ModuleKind.LINEAR) == Shard(0)
            and isinstance(lay.output, Shard)
            and lay.output.dim != 1
        )
        found: Problem | None = None
        if style == "packed_colwise":
            blocks = int(rule.style.overrides.get("blocks", 2))
            if not parts and name not in read_whole_by_packed_rowwise:
                found = Problem(
                    loc=rule.loc,
                    message=f"{generalize(name)} has packed_colwise, but nothing splits its output: it is not a "
                    f"packed projection, and regrouping its features into {blocks} blocks scrambles them",
                    fix=f"'{rule.pattern}: colwise'",
                )
            elif parts and (len(set(parts)) > 1 or len(parts) != blocks):
                found = Problem(
                    loc=rule.loc,
                    message=f"{generalize(name)} has packed_colwise with {blocks} blocks, but its output is split "
                    f"into {len(parts)} parts of widths {list(parts)}",
                    fix=_split_fix(rule.pattern, parts),
                )
            elif _features(module) % (blocks * ctx.tp):
                block = _features(module) // blocks
                found = Problem(
                    loc=rule.loc,
                    message=f"{generalize(name)}: {blocks} blocks of {block} features do not split over tp={ctx.tp}",
                    fix=f"a tp that divides {block}, or '{rule.pattern}: colwise_rep'",
                )
        elif style == "packed_rowwise":
            if not any(styles.get(producer) == "packed_colwise" for producer in feeds.get(name, ())):
                found = Problem(
                    loc=rule.loc,
                    message=f"{generalize(name)} has packed_rowwise, but its input does not come from a "
                    "packed_colwise projection: regrouping it from blocks scrambles its features",
                    fix=f"'{rule.pattern}: rowwise'",
                )
        elif shards_output and len(parts) > 1:
            found = Problem(
                loc=rule.loc,
                message=f"{generalize(name)} ({style}) is a packed projection: its output is split into "
                f"{len(parts)} parts of widths {list(parts)}, but {style} gives each rank a contiguous 1/tp of "
                "all of them, so each rank would split the wrong features (no error, wrong numbers)",
                fix=_split_fix(rule.pattern, parts),
            )
        if found is not None:
            reported.add(rule.pattern)
            yield found
