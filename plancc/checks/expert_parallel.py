"""expert-parallel: with ``--ep``, the plan must spread experts, and they must split over ep*tp ranks.

Expert parallelism borrows ``ep`` data-parallel ranks for each layer's experts, with the tp
ranks inside each (``plancc.layout``): every ``moe_experts`` module's expert count must be a
multiple of ``ep * tp``, or some rank would hold a fraction of an expert. An ``--ep`` with no
``moe_experts`` rule in the plan (a dense model, or experts left whole) would borrow ranks for
nothing: it is an error too, rather than a silent no-op.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.kinds import expert_count
from ..compiler.styles import canonical_style
from .context import CheckContext, Problem
from .example import Example

ID = "expert-parallel"

EXAMPLES = (
    Example(
        verdict="PASS",
        text="qwen3-30b-a3b (128 experts) --tp 4 --ep 8   (32 ranks: 4 experts each)",
        plan="qwen3_moe.yaml",
        model="qwen3-30b-a3b",
        args={"tp": 4, "ep": 8},
    ),
    Example(
        verdict="FAIL",
        text="qwen3-30b-a3b (128 experts) --tp 4 --ep 3   (128 experts over 12 ranks)",
        plan="qwen3_moe.yaml",
        model="qwen3-30b-a3b",
        args={"tp": 4, "ep": 3},
    ),
    Example(
        verdict="FAIL",
        text="qwen3-0.6b (dense) with the qwen3 plan --ep 2   (no experts to spread)",
        plan="qwen3.yaml",
        model="qwen3-0.6b",
        args={"ep": 2},
    ),
)


def _ep_options(count: int, tp: int, limit: int = 64) -> list[int]:
    return [e for e in range(1, limit + 1) if count % (e * tp) == 0]


def check(ctx: CheckContext) -> Iterator[Problem]:
    ep, tp = ctx.layout.ep, ctx.tp
    if ep == 1 or ctx.resolved is None:
        return
    spread = [
        (name, module, rule)
        for name, module, rule, _ in ctx.assigned()
        if canonical_style(rule.style.name).name == "moe_experts"
    ]
    if not spread:
        yield Problem(
            loc=ctx.plan.loc,
            message=f"ep={ep} but no module has the 'moe_experts' style: there are no experts to spread over ep",
            fix="drop --ep (it borrows data-parallel ranks for experts), or give the experts 'moe_experts'",
        )
        return
    reported: set[str] = set()
    for name, module, rule in spread:
        count = expert_count(module)
        if count % (ep * tp) == 0 or rule.pattern in reported:
            continue
        reported.add(rule.pattern)
        options = _ep_options(count, tp)
        yield Problem(
            loc=rule.loc,
            message=f"{name}: {count} experts do not split over ep={ep} x tp={tp} = {ep * tp} ranks "
            "(each rank holds whole experts)",
            fix=f"use --ep in {{{', '.join(map(str, options))}}} at tp={tp}"
            if options
            else f"no ep fits {count} experts at tp={tp}: change --tp",
        )
