"""activation-checkpointing: checkpoint targets must not nest.

A checkpointed module keeps only its inputs and recomputes its forward in backward. A target
inside another target is recomputed by its own checkpoint and again by the recompute of the
targets around it: ``activation_checkpointing: ['**']`` checkpoints the decoder, each layer,
each block and each projection, and a Qwen3 projection then runs its forward 4 times per step
(2 with one level of targets; counted in tests/test_checks.py), while the memory kept is what
the outermost target alone keeps. The training is still exact, which is why nothing else
notices; no plan wants it. Checkpoint one
level (``model.layers.*``, or the blocks inside them), or the outer one with ``save:`` to keep
the expensive outputs (selective checkpointing).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.globs import glob_matches
from .context import CheckContext, Problem
from .example import Example

ID = "activation-checkpointing"

EXAMPLES = (
    Example(verdict="PASS", text="activation_checkpointing: [model.layers.*.mlp]", args={"tp": 2}),
    Example(
        verdict="FAIL",
        text="activation_checkpointing: ['**'] -> the decoder, every layer, block and projection checkpointed "
        "inside each other: a projection's forward runs 4 times per step instead of 2",
        args={"tp": 2},
        edits=(("activation_checkpointing", None, ["**"]),),
    ),
)


def _enclosing(name: str, targets: set[str]) -> list[str]:
    """The targets that contain ``name``, innermost first."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:cut]) for cut in range(len(parts) - 1, 0, -1)) if p in targets]


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.resolved is None or not ctx.resolved.activation_checkpointing:
        return
    targets = set(ctx.resolved.activation_checkpointing)
    nested = {name: outer for name in ctx.resolved.activation_checkpointing if (outer := _enclosing(name, targets))}
    if not nested:
        return
    written = ctx.plan.activation_checkpointing
    for pattern, loc in zip(written.patterns, written.locs):
        inner = next((name for name in nested if glob_matches(pattern, name)), None)
        if inner is None:
            continue
        chain = " inside ".join([inner, *nested[inner]])
        yield Problem(
            loc=loc,
            message=f"activation checkpointing target {pattern!r} nests: {chain}; in backward the recompute of the "
            "targets around a module runs its forward again (with '**' a projection's forward runs 4 times per "
            "step instead of 2), for no memory beyond what the outermost target saves",
            fix="checkpoint one level, e.g. 'model.layers.*' (or its blocks), and keep expensive outputs "
            "with {module: GLOB, save: [matmul, attention, collectives]}",
        )
