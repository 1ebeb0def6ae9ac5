"""The modules a ``lora:`` section's target globs name: the one matching of targets to module
names, which the checks (``checks.lora_targets``), the runtime (``runtime.lora``) and the
launcher's shape notes all read, so that what is checked is what gets adapters."""

from __future__ import annotations

from torch import nn

from ..errors import Diagnostic, SourceLoc
from .globs import ModuleTree, glob_problem
from .lora_spec import LoraSpec
from .resolve import no_match

RULE = "lora-targets"


def adapted_modules(model: nn.Module, spec: LoraSpec) -> tuple[dict[str, SourceLoc], list[Diagnostic]]:
    """The module names the spec's targets match (each with the place of the first target
    that matched it), and the globs' problems (a glob that is not one, or matches nothing)."""
    tree = ModuleTree.of(model)
    problems: list[Diagnostic] = []
    names: dict[str, SourceLoc] = {}
    for index, pattern in enumerate(spec.targets):
        loc = spec.target_loc(index)
        if (why := glob_problem(pattern)) is not None:
            problems.append(
                Diagnostic(rule=RULE, loc=loc, message=f"lora target {pattern!r}: {why}", fix="write a module glob")
            )
            continue
        found = tree.match(pattern)
        if not found:
            miss = no_match(pattern, loc, tree, "lora target")
            problems.append(Diagnostic(rule=RULE, loc=loc, message=miss.message, fix=miss.fix))
        for name in found:
            names.setdefault(name, loc)
    return names, problems
