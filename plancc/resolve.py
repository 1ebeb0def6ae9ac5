"""Globs -> concrete module names of a (meta-device) model.

torch's ``parallelize_module`` matches globs itself and only *warns* when one matches
nothing, so a typo silently leaves a layer unsharded. We resolve every glob here, make a
miss an error (``glob-no-match``) and hand torch concrete names only.

Glob syntax: a dotted path; within a segment the shell wildcards ``* ? [..]`` apply
(``*`` never crosses a dot); a whole segment ``**`` matches any number of segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Iterable, Mapping

from torch import nn

from .errors import Diagnostic, SourceLoc, closest, raise_if_errors
from .plan import Plan, Rule, StyleRef, TargetList


def _segment_ok(segment: str) -> bool:
    depth = 0
    for ch in segment:
        if ch == "[":
            if depth:
                return False
            depth = 1
        elif ch == "]":
            depth = 0
    return depth == 0 and not ("**" in segment and segment != "**")


def glob_problem(pattern: str) -> str | None:
    """Why a glob is malformed, or None. (The schema catches characters; this, structure.)"""
    segments = pattern.split(".")
    if any(not s for s in segments):
        return "has an empty path segment"
    for s in segments:
        if not _segment_ok(s):
            return f"segment {s!r} has an unclosed '[' or a '**' that is not a whole segment"
    return None


@lru_cache(maxsize=4096)
def _match(pattern: tuple[str, ...], name: tuple[str, ...]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _match(rest, name[1:])


def glob_matches(pattern: str, name: str) -> bool:
    return _match(tuple(pattern.split(".")), tuple(name.split(".")))


def _generalize(name: str) -> str:
    """'model.layers.11.mlp' -> 'model.layers.*.mlp', the shape users write globs in."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def no_match(pattern: str, loc: SourceLoc, names: Iterable[str], what: str) -> Diagnostic:
    shapes = sorted({_generalize(n) for n in names})
    near = closest(pattern, shapes, n=3)
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


def _target_hits(targets: TargetList, names: list[str], what: str,
                 problems: list[Diagnostic]) -> list[tuple[str, ...]]:
    """The module names each pattern of ``targets`` matches (invalid or unmatched patterns
    are reported and match nothing)."""
    hits: list[tuple[str, ...]] = []
    for pattern, loc in zip(targets.patterns, targets.locs):
        if (why := glob_problem(pattern)) is not None:
            problems.append(_invalid_glob(pattern, why, loc))
            hits.append(())
            continue
        found = tuple(n for n in names if glob_matches(pattern, n))
        if not found:
            problems.append(no_match(pattern, loc, names, what))
        hits.append(found)
    return hits


def _resolve_targets(targets: TargetList, names: list[str], what: str, problems: list[Diagnostic]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for found in _target_hits(targets, names, what, problems) for n in found))


def _resolve_checkpointing(targets: TargetList, names: list[str],
                           problems: list[Diagnostic]) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(checkpointed modules, module -> operator groups whose outputs it keeps). Two entries
    that match one module with different ``save`` lists are an error (which one would win is
    a guess)."""
    hits = _target_hits(targets, names, "activation_checkpointing target", problems)
    saves = targets.saves or ((),) * len(targets.patterns)
    chosen: dict[str, int] = {}  # module -> index of the first entry that matched it
    for i, found in enumerate(hits):
        for name in found:
            first = chosen.setdefault(name, i)
            if saves[first] != saves[i]:
                problems.append(Diagnostic(
                    rule="rule-conflict", loc=targets.locs[i],
                    message=f"{name} is checkpointed by {targets.patterns[i]!r} saving {_saves(saves[i])} and by "
                            f"{targets.patterns[first]!r} (line {targets.locs[first].line}) saving "
                            f"{_saves(saves[first])}",
                    fix="narrow one of the globs so each module is checkpointed one way"))
                break
    return tuple(chosen), {name: saves[i] for name, i in chosen.items() if saves[i]}


def _saves(save: tuple[str, ...]) -> str:
    return "[" + ", ".join(save) + "]" if save else "nothing (full recompute)"


def inner_first(units: tuple[str, ...]) -> tuple[str, ...]:
    """FSDP2 units in an order ``fully_shard`` accepts: every unit after the units inside it
    (a parent wrapped first would already own its children's parameters), otherwise as
    written, so the last unit stays the last one forward runs.
    ``units: [model.layers.*, model.layers.*.mlp]`` -> layers.0.mlp, layers.0, layers.1.mlp, ..."""
    ordered: list[str] = []
    placed: set[str] = set()

    def place(unit: str) -> None:
        if unit in placed:
            return
        placed.add(unit)
        for inner in units:
            if inner.startswith(unit + "."):
                place(inner)
        ordered.append(unit)

    for unit in units:
        place(unit)
    return tuple(ordered)


def _invalid_glob(pattern: str, why: str, loc: SourceLoc) -> Diagnostic:
    return Diagnostic(
        rule="invalid-glob",
        loc=loc,
        message=f"{pattern!r} is not a valid module glob: it {why}",
        fix="write a dotted module path such as 'model.layers.*.mlp.up_proj'",
    )


def same_style(a: StyleRef, b: StyleRef) -> bool:
    return a.name == b.name and dict(a.overrides) == dict(b.overrides)


def resolve_plan(plan: Plan, model: nn.Module, *, sequence_parallel: bool = False) -> ResolvedPlan:
    """Bind every glob of ``plan`` to module names of ``model``; raise ``PlanError`` on misses
    and on two rules of one section that give one module different styles."""
    names = [n for n, _ in model.named_modules() if n]
    problems: list[Diagnostic] = []
    resolved: list[ResolvedRule] = []
    assignments: dict[str, Rule] = {}
    sections = [plan.tensor_parallel] + ([plan.sequence_parallel] if sequence_parallel else [])
    for section in sections:
        claimed: dict[str, Rule] = {}
        for rule in section:
            if (why := glob_problem(rule.pattern)) is not None:
                problems.append(_invalid_glob(rule.pattern, why, rule.loc))
                continue
            hits = tuple(n for n in names if glob_matches(rule.pattern, n))
            if not hits and not rule.optional:
                problems.append(no_match(rule.pattern, rule.loc, names, "rule"))
            for name in hits:
                first = claimed.get(name)
                if first is not None and not same_style(first.style, rule.style):
                    problems.append(
                        Diagnostic(
                            rule="rule-conflict",
                            loc=rule.loc,
                            message=f"{name!r} is claimed by {rule.pattern!r} as {rule.style.describe()} "
                            f"and by {first.pattern!r} (line {first.loc.line}) as {first.style.describe()}",
                            fix="narrow one of the globs so each module gets one style "
                            "(the sequence_parallel overlay may override tensor_parallel)",
                        )
                    )
                    continue
                claimed[name] = rule
            resolved.append(ResolvedRule(rule=rule, modules=hits))
        assignments.update(claimed)  # a later section (the SP overlay) wins
    fsdp_units = inner_first(_resolve_targets(plan.fsdp_units, names, "fsdp unit", problems))
    ac, saves = _resolve_checkpointing(plan.activation_checkpointing, names, problems)
    raise_if_errors(problems)
    ordered = {n: assignments[n] for n in names if n in assignments}
    return ResolvedPlan(
        plan=plan,
        sequence_parallel=sequence_parallel,
        rules=tuple(resolved),
        assignments=ordered,
        fsdp_units=fsdp_units,
        activation_checkpointing=ac,
        checkpoint_saves=saves,
    )
