"""sequence-parallel: SP needs tp > 1 and a plan with a sequence_parallel overlay."""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.styles import ModuleKind
from ..errors import Severity
from .context import CheckContext, Problem, kind_of
from .example import Example

ID = "sequence-parallel"


EXAMPLES = (
    Example(verdict="PASS", text="--tp 2 --sp with plans/qwen3.yaml", args={"tp": 2, "sequence_parallel": True}),
    Example(
        verdict="WARN",
        text="--tp 1 --sp: there is no tp group to shard the sequence over; SP does nothing",
        args={"tp": 1, "sequence_parallel": True},
    ),
    Example(
        verdict="WARN",
        text="an SP overlay that leaves the rotary embedding without rotary_sp: transformers "
        "derives position ids from the local sequence shard unless they are passed, so outside "
        "plancc.parallelize (which passes them) every rank would rotate from position 0",
        args={"tp": 2, "sequence_parallel": True},
        edits=(("sequence_parallel", "model.rotary_emb", None),),
    ),
    Example(
        verdict="FAIL",
        text="--tp 2 --sp with a plan that has no 'sequence_parallel:' section",
        args={"tp": 2, "sequence_parallel": True},
        edits=(("sequence_parallel", None, None),),
    ),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    if not ctx.sequence_parallel:
        return
    if not ctx.plan.sequence_parallel:
        yield Problem(
            loc=ctx.plan.loc,
            message=f"sequence parallelism was requested but plan {ctx.plan.name!r} has no 'sequence_parallel' overlay",
            fix="add a sequence_parallel section (see plans/qwen3.yaml) or drop --sp",
        )
    elif ctx.tp > 1 and ctx.resolved is not None:
        for name, module in ctx.model.named_modules():
            rule = ctx.rule_for(name)
            if kind_of(module) is ModuleKind.ROTARY and (rule is None or rule.style.name != "rotary_sp"):
                yield Problem(
                    severity=Severity.WARNING,
                    loc=rule.loc if rule else ctx.plan.loc,
                    message=f"{name} is not marked rotary_sp: under SP transformers derives position ids from "
                    "the local sequence shard unless they are passed (plancc.parallelize passes them; "
                    "torch's parallelize_module alone does not)",
                    fix=f"add '{name}: rotary_sp' to the sequence_parallel overlay",
                )
    if ctx.plan.sequence_parallel and ctx.tp == 1:
        yield Problem(
            severity=Severity.WARNING,
            loc=ctx.plan.loc,
            message="sequence parallelism with tp=1 does nothing (the sequence is sharded over tp)",
            fix="use --tp 2 or more, or drop --sp",
        )
