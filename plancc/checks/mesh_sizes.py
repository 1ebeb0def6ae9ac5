"""mesh-sizes: the mesh axes must multiply to the world size.

The sizes are validated by ``plancc.layout.Layout`` (the one place that infers dp); this
rule reports its verdict at the plan, beside the other checks.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import SourceLoc
from .context import CheckContext, Problem
from .example import Example

ID = "mesh-sizes"


EXAMPLES = (
    Example(
        verdict="PASS", text="--world-size 16 --tp 8            (dp inferred as 2)", args={"world_size": 16, "tp": 8}
    ),
    Example(
        verdict="FAIL",
        text="--world-size 12 --tp 8            12 ranks cannot hold tp=8 groups",
        args={"world_size": 12, "tp": 8},
    ),
    Example(
        verdict="FAIL",
        text="--world-size 16 --tp 4 --dp 2     4*1*2 = 8, not 16",
        args={"world_size": 16, "tp": 4, "dp": 2},
    ),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    for problem in ctx.layout_problems:
        # the sizes come from the command line: the plan as a whole, no line of it
        yield Problem(
            loc=SourceLoc(path=ctx.plan.path), message=problem.message, fix=problem.fix, severity=problem.severity
        )
