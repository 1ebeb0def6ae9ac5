"""sequence-length: sequence lengths that shard evenly over cp (and tp under sequence
parallelism).

Context parallelism gives each rank two of 2*cp equal chunks of every sequence, so the
length must be a multiple of 2*cp; with sequence parallelism on top each cp shard is split
again over tp (a multiple of 2*cp*tp). Without cp, SP needs a multiple of tp.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import SourceLoc
from .context import CheckContext, Problem
from .example import Example

ID = "sequence-length"

EXAMPLES = (
    Example(verdict="PASS", text="--cp 2 --seq-len 4096", args={"cp": 2, "seq_len": 4096}),
    Example(verdict="FAIL", text="--cp 2 --seq-len 4098 (pad by 2 to 4100)", args={"cp": 2, "seq_len": 4098}),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    seq = ctx.seq_len
    if seq is None:  # no length given: nothing to check (and no layout value read)
        return
    cp, tp = ctx.layout.cp, ctx.layout.tp
    sp = tp > 1 and ctx.sequence_parallel
    multiple = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    if multiple > 1 and seq % multiple:
        pad = (-seq) % multiple
        why = " x ".join(
            w for w in [f"2*cp={2 * cp}" if cp > 1 else "", f"tp={tp} (sequence parallel)" if sp else ""] if w
        )
        yield Problem(
            loc=SourceLoc(path=ctx.plan.path),  # a command-line value: the plan as a whole, no line of it
            message=f"sequence length {seq} is not a multiple of {multiple} ({why}); it would be padded by {pad} "
            f"to {seq + pad}",
            fix=f"use --seq-len {seq + pad} (or pad with plancc.cp.pad_to_multiple)",
        )
