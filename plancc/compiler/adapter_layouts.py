"""How a low-rank adapter is laid out under tensor parallelism: a fact of the base layer's style
(read by the ``lora-targets`` check, the runtime that builds the adapters and ``explain``).

Exact with no collective of its own: under ``colwise`` A stays whole and B is sharded by
output rows; under ``rowwise`` A is sharded by input columns and B stays whole (its partial
output reduced with the base's); a layer the plan leaves whole (and every layer at tp = 1)
gets plain adapters.
"""

from __future__ import annotations

from typing import Literal

from . import declarations as d
from .plain_placements import Placement, Replicate, Shard
from .resolve import ResolvedPlan
from .styles import declared

Layout = Literal["colwise", "rowwise"]

# (A's, B's) tp placement under each base layout that carries adapters; a plain layer's are whole
ADAPTER_PLACEMENTS: dict[str | None, tuple[Placement, Placement]] = {
    "colwise": (Replicate(), Shard(0)),
    "rowwise": (Shard(1), Replicate()),
    None: (Replicate(), Replicate()),
}


def adapter_layout(name: str, resolved: ResolvedPlan | None, tp: int) -> Layout | str | None:
    """How the adapters of module ``name`` are laid out: like a ``colwise`` or ``rowwise``
    base, None for a plain layer, or the name of a style that cannot carry them."""
    rule = resolved.assignments.get(name) if resolved is not None and tp > 1 else None
    if rule is None:
        return None
    decl = declared(rule.style)
    if type(decl) is d.Colwise:
        return "colwise"
    if type(decl) is d.Rowwise:
        return "rowwise"
    if isinstance(decl, d.LeaveWhole):
        return None
    return rule.style.name
