"""mesh-sizes: the mesh axes must multiply to the world size.

PASS  --world-size 16 --tp 8            (dp inferred as 2)
FAIL  --world-size 12 --tp 8            12 ranks cannot hold tp=8 groups
FAIL  --world-size 16 --tp 4 --dp 2     4*1*2 = 8, not 16
"""

from __future__ import annotations

from typing import Iterator

from ..errors import Diagnostic
from .context import CheckContext

ID = "mesh-sizes"


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    m = ctx.mesh
    loc = ctx.plan.loc
    if m.world_size is None:
        return
    if m.dp is None or m.dp * m.cp * m.tp != m.world_size:
        inner = m.tp * m.cp
        valid = [d for d in range(1, m.world_size + 1) if m.world_size % d == 0]
        shown = f"dp={m.dp} x " if m.dp is not None else ""
        yield Diagnostic(
            rule=ID,
            loc=loc,
            message=f"{shown}cp={m.cp} x tp={m.tp} does not fit world size {m.world_size}"
            + ("" if m.dp is not None else f" ({m.world_size} is not a multiple of cp*tp={inner})"),
            fix=f"choose cp*tp among the divisors of {m.world_size}: {valid}"
            + (", or drop --dp to infer it" if m.dp_given else ""),
        )
