"""What ``plancc.Policy``'s constructor options mean: the layout (given one way: a ``Layout`` or
a built mesh; plancc 0.x's keywords deprecated), the optimizer and the learning-rate schedule (a
callable, or a class named by its dotted path with kwargs)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout, LayoutError
from ..runtime.mesh import ParallelMesh, build_mesh

OptimizerSpec = Callable[[Any], torch.optim.Optimizer] | Mapping[str, Any] | None
SchedulerSpec = Callable[[torch.optim.Optimizer], Any] | Mapping[str, Any] | None


# plancc 0.x's ways to give the layout, accepted for one release with a DeprecationWarning
LEGACY_LAYOUT_KEYWORDS = ("tp", "cp", "ep", "dp", "sp", "pp", "mesh")


def legacy_layout_keywords(given: Mapping[str, Any]) -> dict[str, Any]:
    """The deprecated layout keywords among ``Policy``'s keyword arguments (anything else is a
    ``TypeError``, as a misspelt keyword is for any function)."""
    unknown = sorted(set(given) - set(LEGACY_LAYOUT_KEYWORDS))
    if unknown:
        raise TypeError(f"Policy() got an unexpected keyword argument {unknown[0]!r}")
    return dict(given)


def policy_layout(layout: Layout | ParallelMesh | None, legacy: Mapping[str, Any]) -> Layout | ParallelMesh:
    """The one layout of ``Policy(layout=...)``: a ``Layout`` or a mesh built by
    ``plancc.build_mesh``; None: every rank data-parallel. The keywords of plancc 0.x (``tp=``,
    ``cp=``, ``ep=``, ``dp=`` (inferred), ``sp=``, ``pp=``, ``mesh=``) still work for one release,
    with a ``DeprecationWarning``; two ways that disagree are a ``LayoutError`` naming both, never
    a silent choice. Inferring sizes needs the default process group (``Policy`` starts it)."""
    legacy = dict(legacy)
    if legacy:
        warnings.warn(
            f"Policy({', '.join(f'{k}=' for k in legacy)}) is deprecated and goes in the next release: "
            "pass layout=plancc.Layout(...) (or a mesh from plancc.build_mesh)",
            DeprecationWarning,
            stacklevel=3,
        )
    mesh = legacy.pop("mesh", None)
    given = [g for g in (layout, mesh) if g is not None]
    if len(given) == 2 and the_layout(given[0]) != the_layout(given[1]):
        raise LayoutError.from_message(
            f"Policy got layout={the_layout(given[0]).describe()} and mesh={the_layout(given[1]).describe()}",
            "give the layout one way: layout=plancc.Layout(...) or a mesh from plancc.build_mesh",
        )
    sizes = {"tp": 1, "cp": 1, "ep": 1, "dp": None, "sp": False, "pp": 1}
    shorthand = {k: v for k, v in legacy.items() if v != sizes[k]}
    if not given:
        chosen = {**sizes, **legacy}
        sp = chosen.pop("sp")
        return Layout.infer(world_size=dist.get_world_size(), sequence_parallel=sp, **chosen)
    first = the_layout(given[0])
    named = {"tp": first.tp, "cp": first.cp, "ep": first.ep, "dp": first.dp, "sp": first.sequence_parallel}
    named["pp"] = first.pp
    conflicts = [f"{k}={v!r} (the layout has {named[k]!r})" for k, v in shorthand.items() if named[k] != v]
    if conflicts:
        raise LayoutError.from_message(
            f"Policy got a layout ({first.describe()}) and shorthand sizes that disagree with it: "
            + ", ".join(conflicts),
            "give the layout one way: layout=plancc.Layout(...) (or a built mesh)",
        )
    return given[0]


def policy_mesh(layout: Layout | ParallelMesh | None, legacy: Mapping[str, Any], *, device: str) -> ParallelMesh:
    """``Policy``'s layout converted once, at the edge: a ``Layout`` in (``policy_layout``), the
    mesh the model is laid out on out (a mesh given built is used as it is)."""
    chosen = policy_layout(layout, legacy)
    return chosen if isinstance(chosen, ParallelMesh) else build_mesh(chosen, device_type=device)


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
