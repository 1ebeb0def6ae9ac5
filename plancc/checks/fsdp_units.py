"""fsdp-units: every FSDP unit must be a module that runs (has its own ``forward``).

``fully_shard`` hooks a unit's forward to gather its parameters just in time; a container
(``ModuleList``, ``ModuleDict``) is never called, so torch refuses it ("does not support
containers that do not implement forward") -- inside every worker, after launch. A glob
such as ``**`` or ``model.layers`` catches containers without meaning to.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .context import CheckContext, Problem
from .example import Example

ID = "fsdp-units"

EXAMPLES = (
    Example(verdict="PASS", text="fsdp: {units: [model.layers.*]}  (each decoder layer)", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="fsdp: {units: [model.layers]}  (the ModuleList holding them)",
        args={"tp": 2},
        edits=(("fsdp", "units", ["model.layers"]),),
    ),
    Example(
        verdict="FAIL",
        text="fsdp: {units: ['**']}  (every module, containers included)",
        args={"tp": 2},
        edits=(("fsdp", "units", ["**"]),),
    ),
)


def _runs(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward  # nn.Module's own forward only raises


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None:
        return
    modules = dict(ctx.model.named_modules())
    containers = [name for name in ctx.resolved.fsdp_units if not _runs(modules[name])]
    if not containers:
        return
    plan = ctx.plan.fsdp_units
    loc = plan.locs[0] if plan.locs else ctx.plan.loc
    shown = ", ".join(containers[:3]) + (f" and {len(containers) - 3} more" if len(containers) > 3 else "")
    yield Problem(
        loc=loc,
        message=f"FSDP unit {shown} is a {type(modules[containers[0]]).__name__}, a container that is never "
        "called: fully_shard cannot hook it",
        fix="name the modules inside it, e.g. 'model.layers.*' instead of 'model.layers'",
    )
