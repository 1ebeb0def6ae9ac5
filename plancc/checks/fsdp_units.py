"""fsdp-units: every FSDP unit must be a module that runs (has its own ``forward``), and a
unit that shares a weight with a module outside it is not sharded on its own.

``fully_shard`` hooks a unit's forward to gather its parameters just in time; a container
(``ModuleList``, ``ModuleDict``) is never called, so torch refuses it ("does not support
containers that do not implement forward") -- inside every worker, after launch. A glob
such as ``**`` or ``model.layers`` catches containers without meaning to.

A tied weight (``tie_word_embeddings``: the input embedding's weight is the lm_head's) is
swapped by FSDP2 only on the modules inside its unit; the outside user would keep a
separate copy, trained on its own. plancc leaves such a unit to the root. That is what the
shipped plans expect of ``model.embed_tokens`` on tied models (nothing else in that unit);
a unit with more in it, such as the whole decoder, is reported, as it no longer is one.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from ..compiler.resolve import outside_users
from ..errors import Severity, SourceLoc
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
        verdict="PASS",
        text="qwen3-0.6b (tied) with units [model.embed_tokens, model.layers.*]: the embedding stays in the root",
        model="qwen3-0.6b",
        args={"tp": 2},
    ),
    Example(
        verdict="WARN",
        text="qwen3-0.6b (tied) with units [model.layers.*, model]: the decoder holds the lm_head's weight",
        model="qwen3-0.6b",
        args={"tp": 2},
        edits=(("fsdp", "units", ["model.layers.*", "model"]),),
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
    plan = ctx.plan.fsdp_units
    loc = plan.locs[0] if plan.locs else ctx.plan.loc
    modules = ctx.modules
    yield from _tied_units(ctx, loc)
    containers = [name for name in ctx.resolved.fsdp_units if not _runs(modules[name])]
    if not containers:
        return
    shown = ", ".join(containers[:3]) + (f" and {len(containers) - 3} more" if len(containers) > 3 else "")
    yield Problem(
        loc=loc,
        message=f"FSDP unit {shown} is a {type(modules[containers[0]]).__name__}, a container that is never "
        "called: fully_shard cannot hook it",
        fix="name the modules inside it, e.g. 'model.layers.*' instead of 'model.layers'",
    )


def _tied_units(ctx: CheckContext, loc: SourceLoc) -> Iterator[Problem]:
    """Units left to the root because a module outside them uses one of their weights, when
    that changes more than where the tied weight lives (the unit holds other parameters)."""
    assert ctx.resolved is not None
    shared = outside_users(ctx.model, ctx.resolved.fsdp_units)
    for unit, users in shared.items():
        module = ctx.model.get_submodule(unit)
        outside = {id(p) for user in users for p in ctx.model.get_submodule(user).parameters(recurse=False)}
        if all(id(p) in outside for p in module.parameters()):
            continue  # only the tied weight: the root holds it, as without the unit
        yield Problem(
            loc=loc,
            severity=Severity.WARNING,
            message=f"FSDP unit {unit} shares a weight with {', '.join(users)} outside it (tied weights): "
            "plancc leaves it to the root unit, so it is not gathered or freed on its own, and calling it "
            "directly fails",
            fix=f"drop '{unit}' from fsdp.units, or name units inside it that hold no tied weight",
        )
