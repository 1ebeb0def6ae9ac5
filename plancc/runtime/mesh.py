"""The (dp, cp, tp) device mesh of a ``Layout``.

``build_mesh`` turns a layout into a ``DeviceMesh`` whose axes are always named ``dp``,
``cp``, ``tp`` (size-1 axes included, so code never branches on which axes exist), plus a
flattened ``dp_cp`` axis that FSDP shards over: context-parallel ranks hold the same
parameters. ``layout_of`` reads the layout back off a mesh, so a mesh and its layout can
never disagree.

With expert parallelism a second mesh over the same ranks, ``(edp, ep, tp)``, carries the
experts: ``build_expert_mesh`` (``plancc.layout`` says how ep borrows from dp).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout import AXES, Layout, LayoutError

# Kept for code written against plancc 0.1: the layout used to be called MeshSpec.
MeshSpec = Layout
MeshError = LayoutError


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(
    layout: Layout | None = None, *, dp: int | None = None, cp: int = 1, tp: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A (dp, cp, tp) mesh over the default process group (initialized by the caller or by
    torchrun's environment): from ``layout``, or from sizes with dp inferred from the world
    size. The flattened ``dp_cp`` axis always exists."""
    if not dist.is_initialized():
        raise LayoutError.from_message(
            "torch.distributed is not initialized",
            "launch with `plancc apply`/torchrun or call torch.distributed.init_process_group first",
        )
    world = dist.get_world_size()
    if layout is None:
        layout = Layout.infer(world_size=world, dp=dp, cp=cp, tp=tp)
    elif layout.world_size != world:
        raise LayoutError.from_message(
            f"the layout {layout.describe()} has {layout.world_size} ranks, the process group {world}",
            "build the layout with Layout.infer",
        )
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    mesh = init_device_mesh(device_type, (layout.dp, layout.cp, layout.tp), mesh_dim_names=AXES)
    dp_cp_mesh(mesh)  # create the flattened axis on every rank now: it is collective
    return mesh


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened (dp, cp) axis FSDP shards over. torch keeps flattened axes on the root
    mesh (``_flatten`` returns the existing one), so there is nothing to cache here; slicing
    ``mesh["dp_cp"]`` off the root is deprecated since torch 2.11."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def layout_of(mesh: DeviceMesh, *, sequence_parallel: bool = False, ep: int = 1) -> Layout:
    """The layout a plancc mesh was built from (ep is not an axis of it: it borrows from dp)."""
    return Layout(
        dp=mesh["dp"].size(), cp=mesh["cp"].size(), tp=mesh["tp"].size(), ep=ep, sequence_parallel=sequence_parallel
    )


EXPERT_AXES = ("edp", "ep", "tp")


def build_expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``(edp, ep, tp)`` mesh of the same ranks as a plancc ``mesh``: each dp group of
    ``ep`` consecutive data-parallel ranks shares one layer's experts (``ep``, with ``tp``
    inside), and FSDP shards expert weights over ``edp`` (the ``dp / ep`` ranks left).
    Collective: every rank calls it, in the same order. Raises ``LayoutError`` when ep does
    not fit the mesh."""
    layout = layout_of(mesh, ep=ep)
    ranks = mesh.mesh.reshape(layout.expert_fsdp_size, ep, layout.tp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=EXPERT_AXES)


def require_plancc_axes(mesh: DeviceMesh) -> None:
    """A mesh from elsewhere (torchtitan's dp_shard/tp, a 1-D mesh) fails deep inside torch
    with a slicing error; say what is needed instead."""
    names = tuple(mesh.mesh_dim_names or ())
    if set(AXES) <= set(names):
        return
    got = f"axes {names} of sizes {tuple(mesh.shape)}" if names else f"an unnamed mesh of shape {tuple(mesh.shape)}"
    raise ValueError(
        f"plancc.parallelize needs a device mesh with axes named {AXES} (size 1 where unused); got {got}. "
        "Build it with plancc.build_mesh(dp=..., cp=..., tp=...)"
    )
