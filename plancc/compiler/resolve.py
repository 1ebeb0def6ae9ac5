"""Globs -> concrete module names of a (meta-device) model.

torch's ``parallelize_module`` matches globs itself and only *warns* when one matches
nothing, so a typo silently leaves a layer unsharded. We resolve every glob here, make a
miss an error (``glob-no-match``) and hand torch concrete names only.

Glob syntax and matching: ``plancc.compiler.globs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from torch import nn

from ..errors import Diagnostic, SourceLoc, raise_if_errors
from .globs import ModuleTree, glob_matches, glob_problem
from .plan import Plan, Rule, StyleRef, TargetList

__all__ = [
    "ModuleTree",
    "ResolvedPlan",
    "ResolvedRule",
    "glob_matches",
    "glob_problem",
    "inner_first",
    "resolve_plan",
    "resolve_sections",
]


def no_match(pattern: str, loc: SourceLoc, tree: ModuleTree, what: str) -> Diagnostic:
    near = tree.suggest(pattern)
    return Diagnostic(
        rule="glob-no-match",
        loc=loc,
        message=f"{what} {pattern!r} matches no module of the model"
        + (f"; closest: {', '.join(near)}" if near else ""),
        fix=(f"did you mean {near[0]!r}? " if near else "")
        + "or mark the rule 'optional: true' if only some architectures have this module",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedRule:
    rule: Rule
    modules: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedPlan:
    """A plan bound to one model: concrete names for every rule, list and unit."""

    plan: Plan
    sequence_parallel: bool
    rules: tuple[ResolvedRule, ...]
    # module name -> the rule that decides its style (SP overlay already merged)
    assignments: Mapping[str, Rule] = field(default_factory=dict)
    fsdp_units: tuple[str, ...] = ()
    activation_checkpointing: tuple[str, ...] = ()
    # selective targets only: module name -> operator groups whose outputs are kept
    checkpoint_saves: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # parameter name -> the dim FSDP shards it on, where the plan says another than 0
    fsdp_shard_dims: Mapping[str, int] = field(default_factory=dict)


def _target_hits(targets: TargetList, tree: ModuleTree, what: str, problems: list[Diagnostic]) -> list[tuple[str, ...]]:
    """The module names each pattern of ``targets`` matches (invalid or unmatched patterns
    are reported and match nothing)."""
    hits: list[tuple[str, ...]] = []
    for pattern, loc in zip(targets.patterns, targets.locs):
        if (why := glob_problem(pattern)) is not None:
            problems.append(_invalid_glob(pattern, why, loc))
            hits.append(())
            continue
        found = tree.match(pattern)
        if not found:
            problems.append(no_match(pattern, loc, tree, what))
        hits.append(found)
    return hits


def _resolve_targets(targets: TargetList, tree: ModuleTree, what: str, problems: list[Diagnostic]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for found in _target_hits(targets, tree, what, problems) for n in found))


def _resolve_checkpointing(
    targets: TargetList, tree: ModuleTree, problems: list[Diagnostic]
) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(checkpointed modules, module -> operator groups whose outputs it keeps). Two entries
    that match one module with different ``save`` lists are an error (which one would win is
    a guess)."""
    hits = _target_hits(targets, tree, "activation_checkpointing target", problems)
    saves = targets.saves or ((),) * len(targets.patterns)
    chosen: dict[str, int] = {}  # module -> index of the first entry that matched it
    for i, found in enumerate(hits):
        for name in found:
            first = chosen.setdefault(name, i)
            if saves[first] != saves[i]:
                problems.append(
                    Diagnostic(
                        rule="rule-conflict",
                        loc=targets.locs[i],
                        message=f"{name} is checkpointed by {targets.patterns[i]!r} saving {_saves(saves[i])} and by "
                        f"{targets.patterns[first]!r} (line {targets.locs[first].line}) saving "
                        f"{_saves(saves[first])}",
                        fix="narrow one of the globs so each module is checkpointed one way",
                    )
                )
                break
    return tuple(chosen), {name: saves[i] for name, i in chosen.items() if saves[i]}


def _saves(save: tuple[str, ...]) -> str:
    return "[" + ", ".join(save) + "]" if save else "nothing (full recompute)"


def inner_first(units: tuple[str, ...]) -> tuple[str, ...]:
    """FSDP2 units in an order ``fully_shard`` accepts: every unit after the units inside it
    (a parent wrapped first would already own its children's parameters), otherwise as
    written, so the last unit stays the last one forward runs.
    ``units: [model.layers.*, model.layers.*.mlp]`` -> layers.0.mlp, layers.0, layers.1.mlp, ..."""
    written = set(units)
    inside: dict[str, list[str]] = {}  # unit -> the units nested in it, as written
    for unit in units:
        parts = unit.split(".")
        for cut in range(1, len(parts)):  # each enclosing path: linear in depth, not in units
            outer = ".".join(parts[:cut])
            if outer in written:
                inside.setdefault(outer, []).append(unit)
    ordered: list[str] = []
    placed: set[str] = set()

    def place(unit: str) -> None:
        if unit in placed:
            return
        placed.add(unit)
        for inner in inside.get(unit, ()):
            place(inner)
        ordered.append(unit)

    for unit in units:
        place(unit)
    return tuple(ordered)


def tied_parameter_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that share one Parameter object."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, p_name))
    return [group for group in owners.values() if len(group) > 1]


def outside_users(model: nn.Module, units: Iterable[str]) -> dict[str, list[str]]:
    """For each unit some of whose parameters a module outside it also uses (tied embeddings:
    the input embedding's weight is also the lm_head's): those outside modules.

    FSDP2 swaps a unit's parameters only on the modules inside the unit, so such a weight
    would silently split in two -- an FSDP parameter for the unit and a separate one for
    its other user, each trained on its own half of the gradient. The runtime leaves such
    a unit to the root, which holds every user (``units_without_outside_users``)."""
    holders = [[mod_name for mod_name, _ in group] for group in tied_parameter_groups(model)]
    found: dict[str, list[str]] = {}
    for unit in units:
        prefix = f"{unit}."

        def inside(name: str, unit: str = unit, prefix: str = prefix) -> bool:
            return name == unit or name.startswith(prefix)

        outside = {name for group in holders if any(map(inside, group)) for name in group if not inside(name)}
        if outside:
            found[unit] = sorted(outside)
    return found


def units_without_outside_users(model: nn.Module, units: Iterable[str]) -> list[str]:
    """The units FSDP may shard on their own: none of their parameters is used outside them.
    So a plan may name the input embedding as a unit -- its gathered copy is then freed during
    the decoder, as torchtitan does -- and stay right on the tied variants of the family."""
    unit_list = list(units)
    shared = outside_users(model, unit_list)
    return [unit for unit in unit_list if unit not in shared]


def _invalid_glob(pattern: str, why: str, loc: SourceLoc) -> Diagnostic:
    return Diagnostic(
        rule="invalid-glob",
        loc=loc,
        message=f"{pattern!r} is not a valid module glob: it {why}",
        fix="write a dotted module path such as 'model.layers.*.mlp.up_proj'",
    )


def same_style(a: StyleRef, b: StyleRef) -> bool:
    return a.name == b.name and dict(a.overrides) == dict(b.overrides)


def _resolve_section(
    section: tuple[Rule, ...], tree: ModuleTree, problems: list[Diagnostic]
) -> tuple[list[ResolvedRule], dict[str, Rule]]:
    """Each rule's modules, and module -> deciding rule; two rules that give one module
    different styles are a ``rule-conflict``."""
    resolved: list[ResolvedRule] = []
    claimed: dict[str, Rule] = {}
    for rule in section:
        if (why := glob_problem(rule.pattern)) is not None:
            problems.append(_invalid_glob(rule.pattern, why, rule.loc))
            continue
        hits = tree.match(rule.pattern)
        if not hits and not rule.optional:
            problems.append(no_match(rule.pattern, rule.loc, tree, "rule"))
        for name in hits:
            first = claimed.get(name)
            if first is not None and not same_style(first.style, rule.style):
                problems.append(_conflict(name, rule, first))
                continue
            claimed[name] = rule
        resolved.append(ResolvedRule(rule=rule, modules=hits))
    return resolved, claimed


def _conflict(name: str, rule: Rule, first: Rule) -> Diagnostic:
    return Diagnostic(
        rule="rule-conflict",
        loc=rule.loc,
        message=f"{name!r} is claimed by {rule.pattern!r} as {rule.style.describe()} "
        f"and by {first.pattern!r} (line {first.loc.line}) as {first.style.describe()}",
        fix="narrow one of the globs so each module gets one style "
        "(the sequence_parallel overlay may override tensor_parallel)",
    )


def _resolve_shard_placement(plan: Plan, model: nn.Module, problems: list[Diagnostic]) -> dict[str, int]:
    """``fsdp.shard_placement``'s globs bound to parameter names, each dim checked against the
    parameter's rank (and made non-negative)."""
    if not plan.fsdp_shard_placement:
        return {}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tree = ModuleTree(shapes)
    found: dict[str, int] = {}
    for rule in plan.fsdp_shard_placement:
        if (why := glob_problem(rule.pattern)) is not None:
            problems.append(_invalid_glob(rule.pattern, why, rule.loc))
            continue
        hits = tree.match(rule.pattern)
        if not hits:
            near = tree.suggest(rule.pattern)
            problems.append(
                Diagnostic(
                    rule="glob-no-match",
                    loc=rule.loc,
                    message=f"fsdp shard_placement {rule.pattern!r} matches no parameter of the model"
                    + (f"; closest: {', '.join(near)}" if near else ""),
                    fix=f"did you mean {near[0]!r}?" if near else "name parameters in full: MODULE_GLOB.weight",
                )
            )
        wrong = [name for name in hits if not -len(shapes[name]) <= rule.dim < len(shapes[name])]
        if wrong:  # one problem per rule: a glob over 36 layers is one mistake
            shape = list(shapes[wrong[0]])
            more = f" (and {len(wrong) - 1} more it matches)" if len(wrong) > 1 else ""
            problems.append(
                Diagnostic(
                    rule="fsdp-shard-placement",
                    loc=rule.loc,
                    message=f"{wrong[0]}{more} has {len(shape)} dim(s) {shape}; shard({rule.dim}) is not one of them",
                    fix=f"use shard(0) .. shard({len(shape) - 1})" if shape else "leave this parameter out",
                )
            )
            continue
        found.update((name, rule.dim % len(shapes[name])) for name in hits)
    return found


def resolve_plan(
    plan: Plan,
    model: nn.Module | ModuleTree,
    *,
    sequence_parallel: bool = False,
    problems: list[Diagnostic] | None = None,
) -> ResolvedPlan:
    """Bind every glob of ``plan`` to module names of ``model``; raise ``PlanError`` on misses
    and on two rules of one section that give one module different styles. With a
    ``problems`` list they go there instead, and what could be bound is returned (``validate``
    checks the rest of a plan whose globs have a typo)."""
    tree = model if isinstance(model, ModuleTree) else ModuleTree.of(model)
    collect = problems is not None
    problems = problems if problems is not None else []
    resolved: list[ResolvedRule] = []
    assignments: dict[str, Rule] = {}
    sections = [plan.tensor_parallel] + ([plan.sequence_parallel] if sequence_parallel else [])
    for section in sections:
        rules, claimed = _resolve_section(section, tree, problems)
        resolved += rules
        assignments.update(claimed)  # a later section (the SP overlay) wins
    fsdp_units = inner_first(_resolve_targets(plan.fsdp_units, tree, "fsdp unit", problems))
    ac, saves = _resolve_checkpointing(plan.activation_checkpointing, tree, problems)
    shard_dims = _resolve_shard_placement(plan, model, problems) if isinstance(model, nn.Module) else {}
    if not collect:
        raise_if_errors(problems)
    return ResolvedPlan(
        plan=plan,
        sequence_parallel=sequence_parallel,
        rules=tuple(resolved),
        assignments={n: assignments[n] for n in ("", *tree.names) if n in assignments},  # "": the root
        fsdp_units=fsdp_units,
        activation_checkpointing=ac,
        checkpoint_saves=saves,
        fsdp_shard_dims=shard_dims,
    )


def resolve_sections(plan: Plan, model: nn.Module) -> tuple[list[ResolvedPlan], list[Diagnostic]]:
    """Resolve the TP section and, when the plan has one, the TP+SP overlay; collect every
    problem instead of raising (each problem once, though both resolutions may see it)."""
    tree = ModuleTree.of(model)
    resolved: list[ResolvedPlan] = []
    problems: list[Diagnostic] = []
    for sp in (False, True) if plan.sequence_parallel else (False,):
        found: list[Diagnostic] = []
        resolved.append(resolve_plan(plan, tree, sequence_parallel=sp, problems=found))
        problems += [d for d in found if d not in problems]
    shard_dims = _resolve_shard_placement(plan, model, problems)  # parameters: once, not per section
    return [replace(r, fsdp_shard_dims=shard_dims) for r in resolved], problems
