"""compile: the plan's ``compile:`` section (each decoder block ``torch.compile``d, as torchtitan
does) at a layout whose compiled blocks run exactly as the eager ones.

Compiled blocks run under FSDP2 (dp), tensor parallelism with and without SP (the plan's
styles' DTensors traced into each block's graph), context parallelism, and inside pipeline
stages with GPipe, 1F1B and Interleaved 1F1B, exact against the unsharded eager model
(``apply --verify``). Refused, with the reason, where they do not run yet or are known not to:
expert parallelism (its all-to-all hooks inside a block are untested), LoRA (its adapters inside
a compiled block are untested), and the zero-bubble and V schedules, whose split backward torch
does not run compiled (pytorch#161904).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.plan import PipelineSpec
from ..errors import SourceLoc
from .context import CheckContext, Problem
from .example import Example

ID = "compile"

EXAMPLES = (
    Example(
        verdict="PASS",
        text="compile: true at dp=4 x tp=2 (FSDP2 around compiled blocks of TP styles)",
        edits=(("compile", None, True),),
        args={"tp": 2, "world_size": 8},
    ),
    Example(
        verdict="FAIL",
        text="compile: true with the zbv schedule at pp=2: torch runs its split backward uncompiled only",
        edits=(("compile", None, True), ("pipeline", None, {"schedule": "zbv", "virtual_stages_per_rank": 2})),
        args={"pp": 2, "world_size": 8},
    ),
)

_SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


def with_lora(loc: SourceLoc, given: str) -> Problem:
    """The one answer to compiled blocks with adapters, whichever way the adapters came (the plan's
    ``lora:``, ``--lora-*``, ``Policy(lora=...)``)."""
    return Problem(
        loc=loc,
        message=f"compiled blocks with LoRA adapters ({given}): not yet (adapters inside a compiled block)",
        fix="drop compile: from the plan, or the adapters",
    )


def check(ctx: CheckContext) -> Iterator[Problem]:
    spec = ctx.plan.compile
    if spec is None:
        return
    layout = ctx.layout
    if layout.ep > 1:
        yield Problem(
            loc=spec.loc,
            message=f"compiled blocks at ep={layout.ep}: not yet (the experts' all-to-all hooks inside a compiled "
            "block are untested)",
            fix="drop compile: for this layout, or --ep 1",
        )
    if ctx.plan.lora is not None:
        yield with_lora(spec.loc, "the plan's lora: section")
    schedule = (ctx.plan.pipeline or PipelineSpec()).schedule
    if layout.pp > 1 and schedule in _SPLIT_BACKWARD:
        yield Problem(
            loc=spec.loc,
            message=f"compiled blocks with the {schedule} schedule: torch splits its backward into input and weight "
            "passes, which it does not run compiled (pytorch#161904)",
            fix="schedule: 1f1b or interleaved_1f1b, or drop compile:",
        )
