"""sequence-parallel: SP needs tp > 1 and a plan with a sequence_parallel overlay, and a
style that shards the sequence needs SP.

Without ``--sp`` the residual stream is the whole sequence on every tp rank, and plancc
passes the model no global positions or masks for a sequence shard. A style that reads its
input as a sequence shard (``sequence_parallel`` on a norm, ``gather_seq_input``,
``colwise_seq``, ``rotary_sp``, ``prepare_input`` from ``shard(1)``) then takes the whole
sequence for one rank's shard: it is gathered tp times longer (a shape error), or a norm's
weight gradient is summed over tp ranks that each saw every token (tp times too large, and
nothing fails). A style that hands on a sequence shard (``embedding_seq``, ``rowwise_seq``,
``output_layouts: shard(1)``) leaves every module after it one rank's slice of the sequence.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.plain_placements import Shard
from ..compiler.styles import ModuleKind
from ..errors import Severity
from .context import CheckContext, Problem, kind_of
from .example import Example
from .layout_flow import reads_head_shards

ID = "sequence-parallel"

_SEQUENCE = Shard(1)


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
        text="--tp 2 without --sp, norms given 'sequence_parallel' in tensor_parallel: their weight "
        "gradients summed over tp ranks that each saw the whole sequence (2x, silently)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.layers.*.input_layernorm", "sequence_parallel"),),
    ),
    Example(
        verdict="FAIL",
        text="--tp 2 without --sp, embed_tokens: embedding_seq (hands on a sequence shard)",
        args={"tp": 2},
        edits=(("tensor_parallel", "model.embed_tokens", "embedding_seq"),),
    ),
    Example(
        verdict="FAIL",
        text="--tp 2 --sp with a plan that has no 'sequence_parallel:' section",
        args={"tp": 2, "sequence_parallel": True},
        edits=(("sequence_parallel", None, None),),
    ),
)


# what a sequence-sharding style is without SP, where the vocabulary has it
_WITHOUT_SP = {
    "embedding_seq": "embedding_rowwise",
    "rowwise_seq": "rowwise",
    "colwise_seq": "colwise",
    "colwise_logits_seq": "colwise_logits",
}


def _sequence_styles_without_sp(ctx: CheckContext) -> Iterator[Problem]:
    reported: set[str] = set()
    for name, module, rule, lay in ctx.assigned():
        reads, hands_on = lay.input == _SEQUENCE, lay.output == _SEQUENCE and lay.local_output is not False
        if not (reads or hands_on) or rule.pattern in reported or reads_head_shards(ctx, name):
            continue
        reported.add(rule.pattern)
        if reads:
            what = "takes its input as one rank's sequence shard (shard(1))"
            if kind_of(module) is ModuleKind.ROTARY:
                then = "it refuses the whole-sequence positions it is given, at run time"
            elif lay.output == _SEQUENCE:  # a norm under SP: weights replicated, gradients summed over tp
                then = (
                    "its weight gradients would be summed over tp ranks that each saw every token: "
                    "tp times too large, and nothing fails"
                )
            else:
                then = "it would gather the whole sequence tp times over (a shape error at run time)"
        else:
            what = "hands on one rank's sequence shard (shard(1))"
            then = "every module after it would take that slice for the whole sequence"
        plain = _WITHOUT_SP.get(rule.style.name)
        yield Problem(
            loc=rule.loc,
            message=f"{rule.pattern} ({rule.style.describe()}) {what}, but sequence parallelism is off (no --sp): "
            f"the residual stream is the whole sequence on every tp rank, so {then}",
            fix=(f"use '{plain}' here" if plain else "remove this rule from tensor_parallel")
            + " (sequence sharding belongs in the sequence_parallel overlay), or run with --sp",
        )


def check(ctx: CheckContext) -> Iterator[Problem]:
    if not ctx.sequence_parallel:
        if ctx.tp > 1 and ctx.resolved is not None:
            yield from _sequence_styles_without_sp(ctx)
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
