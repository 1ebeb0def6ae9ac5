"""per-head-output: a rowwise projection that makes one value per head must stay split by head.

Inside an attention block whose heads are split over tp (colwise q/k/v), each rank holds its
own heads. A rowwise projection there whose output has one feature per head (Doge's
``dt_proj``: from the values to one dynamic-mask entry per KV head) all-reduces by default:
every rank gets every head's entries and meets its own heads with them -- a shape error at
run time (``The size of tensor a (2) must match the size of tensor b (4)``), after a clean
``validate``. Its output must be reduce-scattered onto the heads instead
(``output_layouts: shard(-1)``), so each rank keeps its heads' entries.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.plain_placements import Replicate, Shard
from ..compiler.styles import ModuleKind
from .context import CheckContext, Problem, head_counts, kind_of
from .example import Example

ID = "per-head-output"

_FIXED_DT_PROJ = {"style": "rowwise", "output_layouts": "shard(-1)"}

EXAMPLES = (
    Example(
        verdict="PASS",
        text="tiny-doge: dt_proj: {style: rowwise, output_layouts: shard(-1)} (each rank its heads' entries)",
        plan="qwen3.yaml",
        model="tiny-doge",
        args={"tp": 2},
        edits=(
            ("tensor_parallel", "model.layers.*.self_attn.dt_proj", _FIXED_DT_PROJ),
            ("tensor_parallel", "model.layers.*.self_attn", "per_head_params"),
        ),
    ),
    Example(
        verdict="FAIL",
        text="tiny-doge: dt_proj: rowwise (transformers' plan) -> every head's mask on every rank",
        plan="qwen3.yaml",
        model="tiny-doge",
        args={"tp": 2},
        edits=(
            ("tensor_parallel", "model.layers.*.self_attn.dt_proj", "rowwise"),
            ("tensor_parallel", "model.layers.*.self_attn", "per_head_params"),
        ),
    ),
)


def _heads_split(ctx: CheckContext, block: str) -> bool:
    """Whether some direct child of ``block`` hands on a feature (head) shard: colwise q/k/v."""
    for name, _module, _rule, lay in ctx.assigned():
        if name.rpartition(".")[0] == block and isinstance(lay.output, Shard) and lay.output.dim != 1:
            return True
    return False


def per_head_reducers(ctx: CheckContext) -> Iterator[tuple[str, int]]:
    """(module, its outputs) of each rowwise projection that all-reduces one output per head
    inside a head-split attention block."""
    heads = head_counts(ctx.config)
    for name, module, _rule, lay in ctx.assigned():
        weight = getattr(module, "weight", None)  # a skeleton's Linear has its weight's shape only
        if kind_of(module) is not ModuleKind.LINEAR or weight is None:
            continue
        outputs = weight.shape[0]
        rowwise = lay.weight is not None and lay.weight.get(ModuleKind.LINEAR) == Shard(1)
        if rowwise and isinstance(lay.output, Replicate) and outputs in heads and _heads_split(ctx, _parent(name)):
            yield name, int(outputs)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def check(ctx: CheckContext) -> Iterator[Problem]:
    # at any tp, as the layout trace it shares its finding with (checks.layout_flow)
    reported: set[str] = set()
    for name, outputs in per_head_reducers(ctx):
        rule = ctx.rule_for(name)
        assert rule is not None  # assigned modules have their rule
        if rule.pattern in reported:
            continue
        reported.add(rule.pattern)
        yield Problem(
            loc=rule.loc,
            message=f"{name} ({rule.style.name}) makes {outputs} outputs, one per head, inside an "
            "attention block whose heads are split over tp; all-reduced, every rank would meet its own heads "
            "with every head's entries (a shape error at run time)",
            fix=f"'{rule.pattern}: {{style: rowwise, output_layouts: shard(-1)}}' (each rank keeps its heads' entries)",
            suggestion={rule.pattern: {"style": "rowwise", "output_layouts": "shard(-1)"}},
        )
