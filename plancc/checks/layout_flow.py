"""The layout trace (``checks.layout_trace``) as problems, each at the rule to blame.

A conflict is found where a value is read; the mistake may be upstream (``o_proj: colwise``
makes its own input the problem, ``up_proj: rowwise`` makes ``down_proj``'s). The rule named is
the one whose change alone clears the conflict without making another: every rule of the plan
(and a rule for an unstyled module in the conflict) is tried at each style its modules take,
the trace re-run. Where one rule fixes it the problem stands at that rule's line; where several
do, each is named. ``layout-pairing`` (via ``pairing``), ``mixed-shards`` and ``dtensor-output``
(via ``sharded_reads``) report these problems; ``sharded-region-params`` leaves alone what
reads a value downstream of one.

The trace runs at any tp (a plan's styles mean the same at tp=2 and tp=64): ``plancc validate``
without ``--tp`` checks the layouts the plan would run with at tp > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..compiler.globs import generalize
from ..compiler.plan import Rule
from ..compiler.styles import Layouts, ModuleKind, module_kind, style_layouts
from ..errors import Severity, SourceLoc
from ..models import transforms_logits
from .context import CheckContext, Problem, flow_of
from .layout_trace import Conflict, LayoutTrace, Repair, repairs, trace_layouts
from .per_head_outputs import per_head_reducers

_LINEAR = ("colwise", "colwise_rep", "rowwise", "rowwise_rep")
_LINEAR_SP = ("colwise_seq", "rowwise_seq")
_CANDIDATES: dict[ModuleKind, tuple[str, ...]] = {
    ModuleKind.LINEAR: _LINEAR,
    ModuleKind.EMBEDDING: ("embedding_rowwise", "colwise_rep"),
    ModuleKind.NORM: ("qk_norm",),
    ModuleKind.ROTARY: (),
    ModuleKind.EXPERTS: (),
    ModuleKind.OTHER: ("shared_input",),
}
_CANDIDATES_SP: dict[ModuleKind, tuple[str, ...]] = {
    ModuleKind.LINEAR: _LINEAR_SP,
    ModuleKind.EMBEDDING: ("embedding_seq",),
    ModuleKind.NORM: ("sequence_parallel",),
    ModuleKind.ROTARY: ("rotary_sp",),
    ModuleKind.OTHER: ("gather_seq_input",),
}
_LOGITS = ("colwise_logits", "colwise_logits_seq")


@dataclass(frozen=True, kw_only=True, slots=True)
class FlowReport:
    trace: LayoutTrace
    problems: tuple[tuple[str, Problem], ...]  # (conflict kind, problem)


_MEMO: list[tuple[CheckContext, FlowReport | None]] = []  # the last contexts' reports (rules ask in turn)


def flow_report(ctx: CheckContext) -> FlowReport | None:
    """The trace of ``ctx``'s plan and its problems, once per context (``None``: no wiring)."""
    for seen, report in _MEMO:
        if seen is ctx:
            return report
    report = _report(ctx)
    _MEMO.append((ctx, report))
    del _MEMO[:-4]
    return report


def flow_problems(ctx: CheckContext, *kinds: str) -> list[Problem]:
    report = flow_report(ctx)
    return [] if report is None else [p for kind, p in report.problems if kind in kinds]


def in_conflict(ctx: CheckContext, name: str) -> bool:
    """Whether ``name`` is where a reported conflict stands, or reads what one made unknown:
    another rule's problem there is this one's consequence."""
    report = flow_report(ctx)
    if report is None:
        return False
    trace = report.trace
    read = trace.inputs.get(name)
    return (read is not None and read.kind == "unknown") or any(c.consumer == name for c in trace.conflicts)


def reads_head_shards(ctx: CheckContext, name: str) -> bool:
    """Whether ``name`` reads a shard of heads (a per-head norm after colwise q/k): a style that
    sums its weight gradients over tp is right there whatever dim it declares."""
    report = flow_report(ctx)
    read = report.trace.inputs.get(name) if report is not None else None
    return read is not None and read.kind == "features"


def _style_of(ctx: CheckContext) -> dict[str, Layouts]:
    return {
        name: style_layouts(rule.style) for name, rule in (ctx.resolved.assignments.items() if ctx.resolved else ())
    }


def _report(ctx: CheckContext) -> FlowReport | None:
    if ctx.resolved is None:
        return None
    flow = flow_of(ctx)
    if isinstance(flow, str):
        return None
    styles = _style_of(ctx)
    trace = trace_layouts(flow, ctx.modules, styles.get, fused_head=not transforms_logits(ctx.config))
    problems: list[tuple[str, Problem]] = []
    if trace.conflicts:
        rules = _editable_rules(ctx, trace.conflicts)
        found = repairs(flow, ctx.modules, styles.get, rules, lambda names: _candidates(ctx, names), trace)
        problems += _conflict_problems(ctx, trace, found)
    problems += [("waste", p) for p in _waste_problems(ctx, trace)]
    return FlowReport(trace=trace, problems=tuple(problems))


# -- the rules a repair may change -----------------------------------------------------------


def _editable_rules(ctx: CheckContext, conflicts: Iterable[Conflict]) -> dict[tuple[str, str], tuple[str, ...]]:
    """Every rule deciding a module's style (by section and glob), and a would-be rule for each
    unstyled module a conflict names: a plan may be missing the rule at fault."""
    assert ctx.resolved is not None
    rules: dict[tuple[str, str], list[str]] = {}
    for name, rule in ctx.resolved.assignments.items():
        rules.setdefault((rule.section, rule.pattern), []).append(name)
    for conflict in conflicts:
        if conflict.consumer and ctx.rule_for(conflict.consumer) is None:
            glob = generalize(conflict.consumer)
            names = [n for n in ctx.modules if generalize(n) == glob and ctx.rule_for(n) is None]
            rules.setdefault(("tensor_parallel", glob), names)
    return {key: tuple(names) for key, names in rules.items()}


def _candidates(ctx: CheckContext, names: tuple[str, ...]) -> list[str | None]:
    kinds = {module_kind(ctx.modules[n]) for n in names if n in ctx.modules}
    if len(kinds) != 1:
        return [None]
    kind = kinds.pop()
    leaf = all(next(ctx.modules[n].children(), None) is None for n in names if n in ctx.modules)
    if kind is ModuleKind.OTHER and leaf:
        return [None]  # an activation or a custom leaf: only its absence of a style is a repair
    options: list[str | None] = list(_CANDIDATES[kind])
    if ctx.sequence_parallel:
        options += _CANDIDATES_SP.get(kind, ())
    if kind is ModuleKind.LINEAR and any(n.rpartition(".")[2] == "lm_head" for n in names):
        options = [*_LOGITS, *options]  # vocab-parallel logits first: what plancc's loss combines
    return [*options, None]


# -- problems --------------------------------------------------------------------------------


_IDS = {"pairing": "layout-pairing", "output": "layout-pairing", "mixed": "mixed-shards", "dtensor": "dtensor-output"}


def _conflict_problems(ctx: CheckContext, trace: LayoutTrace, found: list[Repair]) -> list[tuple[str, Problem]]:
    groups: dict[tuple[str, str], list[int]] = {}
    for i, conflict in enumerate(trace.conflicts):
        groups.setdefault((conflict.kind, generalize(conflict.consumer)), []).append(i)
    out: list[tuple[str, Problem]] = []
    per_head = {name for name, _ in per_head_reducers(ctx)}  # per-head-output names those more closely
    for (kind, _glob), members in groups.items():
        conflict = trace.conflicts[members[0]]
        if conflict.makers & per_head:
            continue
        fixes = _fixes_for(found, set(members))
        loc = _culprit_loc(ctx, conflict, fixes)
        problem = Problem(
            rule=_IDS[kind],
            loc=loc,
            message=_message(ctx, conflict),
            fix=fix_text(lambda glob: _rule_at(ctx, glob) is not None, fixes),
            suggestion=dict(fixes) if len(fixes) == 1 and fixes[0][1] != "(no style)" else None,
        )
        out.append((kind, problem))
    return out


def _fixes_for(found: list[Repair], members: set[int]) -> list[tuple[str, str]]:
    """(glob, style) of each rule whose change alone clears every conflict of the group: the
    first style tried that does, per rule, in the plan's order."""
    fixes: dict[str, str] = {}
    for repair in found:
        if members <= repair.clears and repair.pattern not in fixes:
            fixes[repair.pattern] = repair.style or "(no style)"
    return list(fixes.items())


def _rule_at(ctx: CheckContext, pattern: str) -> Rule | None:
    assert ctx.resolved is not None
    return next((r.rule for r in ctx.resolved.rules if r.rule.pattern == pattern), None)


def _culprit_loc(ctx: CheckContext, conflict: Conflict, fixes: list[tuple[str, str]]) -> SourceLoc:
    """The line of the one rule to change; of the consumer's rule where several would do (or
    none alone); else of the first rule that made what it reads."""
    candidates = [fixes[0][0]] if len(fixes) == 1 else []
    consumer_rule = ctx.rule_for(conflict.consumer) if conflict.consumer else None
    if consumer_rule is not None:
        candidates.append(consumer_rule.pattern)
    candidates += sorted(r.pattern for m in conflict.makers if (r := ctx.rule_for(m)) is not None)
    for pattern in candidates:
        rule = _rule_at(ctx, pattern)
        if rule is not None:
            return rule.loc
    return ctx.plan.loc


def _named(ctx: CheckContext, name: str) -> str:
    rule = ctx.rule_for(name)
    what = rule.style.describe() if rule is not None else "left whole"
    return f"{generalize(name)} ({what})"


def _makers(ctx: CheckContext, names: Iterable[str]) -> str:
    return ", ".join(_named(ctx, n) for n in sorted(names)) or "the model's input"


def _message(ctx: CheckContext, c: Conflict) -> str:
    if c.kind == "output" and c.found[0].kind not in ("features", "sequence"):
        return (
            f"{_makers(ctx, c.makers)} splits the lm_head weight by its input features: plancc's log-probs and loss "
            f"take {c.wanted} (the run fails at the first step)"
        )
    if c.kind == "output":
        return (
            f"the model's output is {c.found[0].describe()}, made by {_makers(ctx, c.makers)}: the loss would read "
            "one rank's slice of the vocabulary as if it were all of it"
        )
    if c.kind == "mixed":
        parts = "; ".join(f"{v.describe()} from {_makers(ctx, v.makers)}" for v in c.found)
        return (
            f"{_named(ctx, c.consumer)} reads what its inputs compute together, but they are laid out differently "
            f"on the tp ranks ({parts}): a shape error, or where the shapes broadcast a model that trains wrong"
        )
    if c.kind == "dtensor":
        return (
            f"{_named(ctx, c.consumer)} reads {c.found[0].describe()} from {_makers(ctx, c.makers)} but takes "
            f"{c.wanted}: 'mixed torch.Tensor and DTensor' at the first step"
        )
    return (
        f"{_named(ctx, c.consumer)} takes {c.wanted} but reads {c.found[0].describe()} from "
        f"{_makers(ctx, c.makers)}: a plain tensor carries no layout, so torch takes it as the one declared "
        "(a shape error, or a model that trains wrong)"
    )


def fix_text(has_rule: Callable[[str], bool], fixes: list[tuple[str, str]]) -> str:
    """The fix line: each one-rule change that clears the problem alone (``make`` a rule the plan
    has, ``add`` one it lacks), or, with none, where to look."""
    if fixes:
        said = [
            f"remove '{glob}'" if style == "(no style)" else f"{'make' if has_rule(glob) else 'add'} '{glob}: {style}'"
            for glob, style in fixes
        ]
        return " or ".join(said[:3]) + (" (each alone fixes it)" if len(said) > 1 else "")
    return (
        "give the modules between a colwise projection and its rowwise reducer matching styles "
        "(`plancc explain` shows every module's layouts)"
    )


def _waste_problems(ctx: CheckContext, trace: LayoutTrace) -> list[Problem]:
    """colwise_rep gathers what a rowwise_rep reader then slices again: exact, and slower."""
    out: list[Problem] = []
    seen: set[str] = set()
    for consumer, makers in trace.gathered_then_sliced:
        rule = ctx.rule_for(consumer)
        glob = generalize(consumer)
        if rule is None or glob in seen:
            continue
        seen.add(glob)
        producers = sorted({generalize(m) for m in makers})
        out.append(
            Problem(
                rule="redundant-gather",
                severity=Severity.WARNING,
                loc=rule.loc,
                message=f"{', '.join(producers)} (colwise_rep) all-gather their outputs and {glob} (rowwise_rep) "
                "cuts its share back out: exact, but an all-gather per layer and the work between them done "
                "whole on every rank",
                fix=" and ".join(f"make '{p}: colwise'" for p in producers) + f" and '{glob}: rowwise' "
                "(the shard handed on as it is)",
            )
        )
    return out
