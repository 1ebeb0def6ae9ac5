"""What ``plancc.Policy``'s constructor options mean: the layout (given one way), the optimizer
and the learning-rate schedule (a callable, or a class named by its dotted path with kwargs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout, LayoutError
from ..runtime.mesh import ParallelMesh, build_mesh

OptimizerSpec = Callable[[Any], torch.optim.Optimizer] | Mapping[str, Any] | None
SchedulerSpec = Callable[[torch.optim.Optimizer], Any] | Mapping[str, Any] | None


def the_mesh(
    layout: Layout | ParallelMesh | None, mesh: ParallelMesh | None, sizes: dict[str, Any], *, device: str
) -> ParallelMesh:
    """The one layout of ``Policy(layout= | mesh= | tp=, cp=, ...)``; two ways that disagree are
    an error (a ``LayoutError`` naming both), never a silent choice."""
    shorthand = {k: v for k, v in sizes.items() if v != {"dp": None, "sp": False}.get(k, 1)}
    given = [g for g in (layout, mesh) if g is not None]
    if len(given) == 2 and the_layout(given[0]) != the_layout(given[1]):
        raise LayoutError.from_message(
            f"Policy got layout={the_layout(given[0]).describe()} and mesh={the_layout(given[1]).describe()}",
            "give the layout one way: layout=plancc.Layout(...) or a mesh from plancc.build_mesh",
        )
    if not given:
        infer = {k: v for k, v in sizes.items() if k != "sp"}
        built = Layout.infer(world_size=dist.get_world_size(), sequence_parallel=sizes["sp"], **infer)
        return build_mesh(built, device_type=device)
    chosen = the_layout(given[0])
    named = {"tp": chosen.tp, "cp": chosen.cp, "ep": chosen.ep, "dp": chosen.dp, "sp": chosen.sequence_parallel}
    conflicts = [f"{k}={v!r} (the layout has {named[k]!r})" for k, v in shorthand.items() if named[k] != v]
    if conflicts:
        raise LayoutError.from_message(
            f"Policy got a layout ({chosen.describe()}) and shorthand sizes that disagree with it: "
            + ", ".join(conflicts),
            "give the layout one way: layout= (or mesh=), or the tp=/cp=/ep=/dp=/sp= shorthand",
        )
    first = given[0]
    return first if isinstance(first, ParallelMesh) else build_mesh(first, device_type=device)


def the_layout(layout_or_mesh: Layout | ParallelMesh) -> Layout:
    """The sizes of a layout given either way (a ``Layout``, or a mesh built from one)."""
    return layout_or_mesh.layout if isinstance(layout_or_mesh, ParallelMesh) else layout_or_mesh


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"no such class: {name!r} (give a dotted path such as 'torch.optim.AdamW')") from None


def make_optimizer(spec: OptimizerSpec, params: Any) -> torch.optim.Optimizer:
    if spec is None:
        return torch.optim.AdamW(params)
    if isinstance(spec, Mapping):
        return _resolve(str(spec["name"]))(params, **dict(spec.get("kwargs", {})))
    return spec(params)


def make_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> Any:
    if spec is None:
        return None  # a constant learning rate
    if isinstance(spec, Mapping):
        return _resolve(str(spec["name"]))(optimizer, **dict(spec.get("kwargs", {})))
    return spec(optimizer)
