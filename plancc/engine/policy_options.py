"""What ``plancc.Policy``'s constructor options mean: the layout (a ``Layout`` or a built mesh),
the optimizer and the learning-rate schedule (a callable, or a class named by its dotted path
with kwargs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout
from ..runtime.mesh import ParallelMesh, build_mesh

OptimizerSpec = Callable[[Any], torch.optim.Optimizer] | Mapping[str, Any] | None
SchedulerSpec = Callable[[torch.optim.Optimizer], Any] | Mapping[str, Any] | None


def policy_mesh(layout: Layout | ParallelMesh | None, *, device: str) -> ParallelMesh:
    """``Policy(layout=...)`` converted once, at the edge: a ``Layout`` (None: every rank
    data-parallel) to the mesh the model is laid out on; a mesh built by ``plancc.build_mesh``
    is used as it is. Inferring dp needs the default process group (``Policy`` starts it)."""
    if isinstance(layout, ParallelMesh):
        return layout
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(
            f"Policy(layout={layout!r}): a plancc.Layout or a mesh from plancc.build_mesh "
            "(the tp=/dp=/... keywords of plancc 0.x are gone: layout=plancc.Layout(tp=2, ...))"
        )
    return build_mesh(layout or Layout.infer(world_size=dist.get_world_size()), device_type=device)


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
