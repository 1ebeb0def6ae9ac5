"""compile: the plan's ``compile:`` section (each decoder block ``torch.compile``d, as torchtitan
does) at a layout whose compiled blocks run exactly as the eager ones.

Compiled blocks run under FSDP2 (dp) and inside pipeline stages with GPipe, 1F1B and
Interleaved 1F1B, exact against the unsharded eager model (``apply --verify``). Refused, with
the reason, where they do not run yet or are known not to: tensor parallelism (in torch 2.13 a
compiled block's gradient of its replicated DTensor input leaves the graph as a plain tensor,
and the TP styles' redistribution backward fails on it), context and expert parallelism (their
collectives inside a block are not traced yet), LoRA (its adapters inside a compiled block are
untested), and the zero-bubble and V schedules, whose split backward torch does not run compiled
(pytorch#161904).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.plan import PipelineSpec
from .context import CheckContext, Problem
from .example import Example

ID = "compile"

EXAMPLES = (
    Example(
        verdict="PASS",
        text="compile: true at dp=8 (FSDP2 around compiled blocks)",
        edits=(("compile", None, True),),
        args={"world_size": 8},
    ),
    Example(
        verdict="FAIL",
        text="compile: true at tp=2: a compiled block's DTensor input gradient leaves the graph plain (torch 2.13)",
        edits=(("compile", None, True),),
        args={"tp": 2, "world_size": 8},
    ),
)

_SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


def check(ctx: CheckContext) -> Iterator[Problem]:
    spec = ctx.plan.compile
    if spec is None:
        return
    layout = ctx.layout
    axes = [f"{axis}={size}" for axis, size in (("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep)) if size > 1]
    if axes:
        yield Problem(
            loc=spec.loc,
            message=f"compiled blocks at {' and '.join(axes)}: not yet (under tp a compiled block's gradient of its "
            "replicated DTensor input leaves the graph as a plain tensor in torch 2.13; cp's and ep's collectives "
            "inside a block are not traced yet)",
            fix="drop compile: for this layout, or train at dp (and pp) only",
        )
    if ctx.plan.lora is not None:
        yield Problem(
            loc=spec.loc,
            message="compiled blocks with the plan's lora: section: not yet (adapters inside a compiled block)",
            fix="drop compile: or lora:",
        )
    schedule = (ctx.plan.pipeline or PipelineSpec()).schedule
    if layout.pp > 1 and schedule in _SPLIT_BACKWARD:
        yield Problem(
            loc=spec.loc,
            message=f"compiled blocks with the {schedule} schedule: torch splits its backward into input and weight "
            "passes, which it does not run compiled (pytorch#161904)",
            fix="schedule: 1f1b or interleaved_1f1b, or drop compile:",
        )
