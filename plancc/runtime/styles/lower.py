"""Lowering: a resolved plan -> ``{module name: ParallelStyle}`` for torch.

Keys are concrete module names, never globs, so torch's own glob matching (which skips
misses with a warning) never runs on a plancc plan. The compiler hands over declarations
(``compiler.styles.declared``); this is where they become torch objects.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ...compiler.plan import Plan
from ...compiler.resolve import ResolvedPlan, resolve_plan
from ...compiler.styles import declared
from .to_torch import torch_style


def lower(resolved: ResolvedPlan) -> dict[str, ParallelStyle]:
    return {name: torch_style(declared(rule.style)) for name, rule in resolved.assignments.items()}


def compile_plan(
    plan: Plan, model: nn.Module, *, tp_size: int, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The torch TP/SP plan of ``plan`` for ``model`` at ``tp_size`` ranks.

    ``model`` may live on the meta device. Raises ``PlanError`` for globs that match nothing
    and for conflicting rules. At ``tp_size == 1`` there is nothing to shard and the result
    is empty, but the plan is still resolved (so typos are still errors).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    resolved = resolve_plan(plan, model, sequence_parallel=sequence_parallel)
    return lower(resolved) if tp_size > 1 else {}
