"""sequence-parallel: SP needs tp > 1 and a plan with a sequence_parallel overlay.

PASS  --tp 2 --sp with plans/qwen3.yaml
WARN  --tp 1 --sp: there is no tp group to shard the sequence over; SP does nothing
WARN  an SP overlay that leaves the rotary embedding without rotary_sp: transformers derives
      position ids from the local sequence shard unless they are passed, so outside
      plancc.parallelize (which passes them) every rank would rotate from position 0
FAIL  --tp 2 --sp with a plan that has no 'sequence_parallel:' section
"""

from __future__ import annotations

from typing import Iterator

from ..errors import Diagnostic, Severity
from ..styles import ModuleKind
from .context import CheckContext, kind_of

ID = "sequence-parallel"


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    if not ctx.sequence_parallel:
        return
    if not ctx.plan.sequence_parallel:
        yield Diagnostic(
            rule=ID,
            loc=ctx.plan.loc,
            message=f"sequence parallelism was requested but plan {ctx.plan.name!r} has no "
            "'sequence_parallel' overlay",
            fix="add a sequence_parallel section (see plans/qwen3.yaml) or drop --sp",
        )
    elif ctx.tp > 1 and ctx.resolved is not None:
        for name, module in ctx.model.named_modules():
            rule = ctx.rule_for(name)
            if kind_of(module) is ModuleKind.ROTARY and (rule is None or rule.style.name != "rotary_sp"):
                yield Diagnostic(
                    rule=ID,
                    severity=Severity.WARNING,
                    loc=rule.loc if rule else ctx.plan.loc,
                    message=f"{name} is not marked rotary_sp: under SP transformers derives position ids from "
                    "the local sequence shard unless they are passed (plancc.parallelize passes them; "
                    "torch's parallelize_module alone does not)",
                    fix=f"add '{name}: rotary_sp' to the sequence_parallel overlay",
                )
    if ctx.plan.sequence_parallel and ctx.tp == 1:
        yield Diagnostic(
            rule=ID,
            severity=Severity.WARNING,
            loc=ctx.plan.loc,
            message="sequence parallelism with tp=1 does nothing (the sequence is sharded over tp)",
            fix="use --tp 2 or more, or drop --sp",
        )
