"""Model-aware checks: one module per rule, each ``check(ctx) -> Iterator[Diagnostic]``.

A rule's module docstring is its user documentation, with a passing and a failing example
(``plancc rules`` prints them). Checks yield every problem they see; nothing here raises for
a user mistake and nothing touches a process group.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ..errors import Diagnostic
from ..plan import Plan
from ..resolve import ResolvedPlan
from . import (
    architecture,
    context_parallel,
    heads,
    mesh_sizes,
    module_kinds,
    pairing,
    sequence_parallel,
    shapes,
    tied_embeddings,
)
from .context import CheckContext, MeshSizes

RULES = (mesh_sizes, architecture, heads, shapes, tied_embeddings, module_kinds, pairing, sequence_parallel,
         context_parallel)


def check_plan(
    plan: Plan,
    model_or_config,
    *,
    tp: int,
    cp: int = 1,
    dp: int | None = None,
    world_size: int | None = None,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    resolved: Iterable[ResolvedPlan] | None = None,
) -> list[Diagnostic]:
    """Every problem of ``plan`` on this model at this mesh, errors and warnings.

    Glob problems (``glob-no-match``, ``rule-conflict``) come from resolving and are
    included; rules whose globs failed are simply not checked further.
    """
    from ..models import build_meta_model
    from ..validate import resolve_both

    model = model_or_config if isinstance(model_or_config, nn.Module) else build_meta_model(model_or_config)
    found: list[Diagnostic] = []
    if resolved is None:
        resolved, found = resolve_both(plan, model)
    by_sp = {r.sequence_parallel: r for r in resolved}
    ctx = CheckContext(
        plan=plan,
        model=model,
        config=model.config,
        mesh=MeshSizes.infer(tp=tp, cp=cp, dp=dp, world_size=world_size),
        sequence_parallel=sequence_parallel,
        seq_len=seq_len,
        resolved=by_sp.get(sequence_parallel) or by_sp.get(False),
    )
    for rule in RULES:
        found.extend(rule.check(ctx))
    return found


__all__ = ["CheckContext", "MeshSizes", "RULES", "check_plan"]
