"""sharded-region-params: a module with parameters that reads a tp-sharded activation must
sum its gradients over tp.

Between a colwise projection and the rowwise one that reduces its output, each tp rank holds
only its shard of the features (or heads). A module left whole in that region -- an
activation with learnable parameters (Apertus' xIELU), a per-head norm (Qwen3's q_norm), a
bias added by hand -- computes on every rank with the same weights but from a different
shard, so each rank's gradient of those weights is a partial sum: the replicas drift apart
and nothing fails. Its weights must be replicated with their gradients all-reduced
(``replicated_with_grad_allreduce``, alias of ``qk_norm``), or the activation gathered first.

Which module reads which output is in the model's forward, not its tree: the rule reads the
wiring recorded by ``plancc.dataflow`` (one forward on the meta device; shipped with the
presets' skeletons).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.globs import generalize
from ..compiler.kinds import ModuleKind
from ..compiler.plain_placements import Shard
from ..compiler.styles import canonical_style, style_layouts
from ..errors import Severity
from .context import CheckContext, Problem, flow_of, head_counts, kind_of
from .example import Example
from .layout_flow import in_conflict

ID = "sharded-region-params"

EXAMPLES = (
    Example(verdict="PASS", text="q_proj: colwise, q_norm: qk_norm (gradients summed over tp)", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="q_proj: colwise and q_norm left whole -> its weight's gradient is one rank's heads only",
        args={"tp": 2},
        edits=(
            ("tensor_parallel", "model.layers.*.self_attn.q_norm", None),
            ("tensor_parallel", "model.layers.*.self_attn.k_norm", None),
        ),
    ),
)


def _shards_features(ctx: CheckContext, name: str) -> bool:
    """Whether the style of ``name`` hands on a local shard of features or heads (colwise)."""
    rule = ctx.rule_for(name)
    if rule is None:
        return False
    out = style_layouts(rule.style).output
    return isinstance(out, Shard) and out.dim != 1  # Shard(1) is the sequence: SP's business


def _left_whole(ctx: CheckContext, name: str) -> bool:
    rule = ctx.rule_for(name)
    return rule is None or canonical_style(rule.style.name).name == "replicate"


def _params_whole(ctx: CheckContext, name: str) -> bool:
    """Whether the style of ``name`` leaves its own parameters whole: none, or one that lays out
    its input alone (``shared_input`` on an attention block holding per-head sinks)."""
    rule = ctx.rule_for(name)
    if rule is None:
        return True
    weight = style_layouts(rule.style).weight
    return weight is None or not any(isinstance(p, Shard) for p in weight.values())


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None or ctx.tp == 1:
        return
    flow = flow_of(ctx)
    if isinstance(flow, str):
        yield Problem(
            loc=ctx.plan.loc,
            severity=Severity.WARNING,
            message=f"the model's forward could not be traced on the meta device ({flow}), so parameters "
            "reading tp-sharded activations were not checked",
            fix="check that modules with parameters between colwise and rowwise projections have "
            "replicated_with_grad_allreduce",
        )
        return
    origin: dict[str, str] = {}  # leaf call whose output is tp-sharded -> the colwise module it comes from
    modules = ctx.modules
    reported: set[str] = set()

    def problem(owner: str, params: list[str], sources: list[str]) -> Iterator[Problem]:
        key = generalize(owner)
        if key in reported or in_conflict(ctx, owner):  # a layout problem there is reported as such
            return
        reported.add(key)
        producer = origin[sources[0]]
        rule = ctx.rule_for(producer)
        assert rule is not None  # origins are styled modules
        kind = type(modules[owner]).__name__ if owner in modules else "module"
        heads = head_counts(ctx.config)
        # a norm's weight is one per feature, whatever its length: a qk-norm over head_dim 8 beside
        # 8 heads (Doge's tiny config) is no per-head parameter
        per_head = (
            owner in modules
            and kind_of(modules[owner]) is not ModuleKind.NORM
            and all(
                getattr(modules[owner], p).dim() >= 1 and getattr(modules[owner], p).shape[0] in heads for p in params
            )
        )
        yield Problem(
            loc=rule.loc,
            message=f"{key} ({kind}) has parameters {', '.join(params)} and reads the tp-sharded "
            f"output of {generalize(producer)} ({rule.style.name}): each rank would form their gradients from its "
            "own shard, so the tp replicas drift apart",
            fix=f"add '{key}: per_head_params' (one entry per head: sharded with the heads)"
            if per_head
            else f"add '{key}: replicated_with_grad_allreduce' (weights replicated, gradients summed over tp)",
            suggestion={key: "per_head_params" if per_head else "replicated_with_grad_allreduce"},
        )

    for call in flow.calls:
        fed = sorted(s for s in call.sources if s in origin)
        if _shards_features(ctx, call.reader):
            origin[call.reader] = call.reader
        elif fed and _left_whole(ctx, call.reader):
            origin[call.reader] = origin[fed[0]]  # a whole module on a shard hands on a shard
            if call.params:
                yield from problem(call.reader, list(call.params), fed)
    for use in flow.param_uses:
        fed = sorted(s for s in use.sources if s in origin)
        owner, _, param = use.reader.rpartition(".")
        if fed and _params_whole(ctx, owner):
            yield from problem(owner, [param], fed)
