"""The (dp, cp, tp) device mesh of a ``Layout``.

``build_mesh`` turns a layout into a ``DeviceMesh`` whose axes are always named ``dp``,
``cp``, ``tp`` (size-1 axes included, so code never branches on which axes exist), plus a
flattened ``dp_cp`` axis that FSDP shards over: context-parallel ranks hold the same
parameters. It is the one conversion from a layout to a mesh, made once at the edge (a job's
worker, ``Policy``, a user's own loop); the mesh carries its layout from there on.

With HSDP (``Layout.dp_replicate > 1``) the mesh's outer axes are torchtitan's ``dp_replicate`` and
``dp_shard``, flattened into the same ``dp`` (so every slice by ``dp`` reads as before), and FSDP
shards over the 2-D ``(dp_replicate, dp_shard_cp)`` mesh (``fsdp_mesh``): sharded within a replica,
replicated across them. Without HSDP the mesh is the (dp, cp, tp) one it always was.

With expert parallelism a second mesh over the same ranks, ``(edp, ep, tp)``, carries the
experts: ``build_expert_mesh`` (``plancc.layout`` says how ep borrows from dp).

``ParallelMesh`` holds all of it as one frozen value -- the ``Layout`` (sizes, ep, sequence
parallelism), the device mesh and the expert mesh -- and is what ``build_mesh`` returns and what
every runtime call takes (torchtitan's ``ParallelDims`` is the model). ``mesh["tp"]`` and the
other sub-meshes read off it as off a ``DeviceMesh``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout import AXES, Layout, LayoutError


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Set by plancc's launcher when it chose OMP_NUM_THREADS=1 itself (torchrun would print a warning
# otherwise): the workers then share the cores out (init_process_group) as if it were unset.
THREADS_UNSET_BY_USER = "PLANCC_THREADS_UNSET_BY_USER"


def init_process_group(device: str, timeout_s: float) -> None:
    """The default process group of a torchrun job, once (nccl on CUDA, gloo on the CPU): the one
    init ``plancc.Policy`` and ``plancc apply`` share. On the CPU each local rank gets an equal
    share of the cores, unless the user chose ``OMP_NUM_THREADS``."""
    if dist.is_initialized():
        return
    from datetime import timedelta

    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    user_chose = "OMP_NUM_THREADS" in os.environ and THREADS_UNSET_BY_USER not in os.environ
    if device == "cpu" and not user_chose:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@dataclass(frozen=True, slots=True)
class ParallelMesh:
    """The parallel layout of a job and its device meshes, as one value.

    ``layout``: the sizes, ep and sequence parallelism. ``device_mesh``: the (dp, cp, tp) mesh
    (with its flattened ``dp_cp`` axis). ``expert_mesh``: the (edp, ep, tp) mesh of the same ranks
    when ``layout.ep > 1``, else None. Indexing (``pm["tp"]``, ``pm["dp", "cp"]``) goes to
    ``device_mesh``; anything else a ``DeviceMesh`` answers is asked of ``pm.device_mesh``.
    """

    layout: Layout
    device_mesh: DeviceMesh
    expert_mesh: DeviceMesh | None = None

    def __getitem__(self, axes: str | tuple[str, ...]) -> DeviceMesh:
        return sliced(self.device_mesh, axes)

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def dp_cp(self) -> DeviceMesh:
        """The flattened (dp, cp) axis: every rank that holds other rows or other positions."""
        return dp_cp_mesh(self.device_mesh)

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP shards parameters over: ``dp_cp``, or under HSDP the 2-D
        ``(dp_replicate, dp_shard_cp)`` mesh."""
        return fsdp_mesh(self.device_mesh)

    def to_json(self) -> dict[str, Any]:
        """The serialised form (the layout: a mesh is rebuilt from it, once, on every rank)."""
        return self.layout.to_json()


# What the runtime's collective helpers take: the ParallelMesh, or one of its sub-meshes
# (a context-parallel evaluator is handed ``mesh["cp"]``).
MeshLike = ParallelMesh | DeviceMesh


def _with_experts(layout: Layout, mesh: DeviceMesh) -> ParallelMesh:
    expert_mesh = build_expert_mesh(mesh, layout) if layout.ep > 1 else None
    return ParallelMesh(layout=layout, device_mesh=mesh, expert_mesh=expert_mesh)


def build_mesh(
    layout: Layout | None = None,
    *,
    dp: int | None = None,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    device_type: str | None = None,
    dp_replicate: int = 1,
) -> ParallelMesh:
    """The ``ParallelMesh`` of ``layout`` (or of sizes, dp inferred from the world size) over the
    default process group (initialized by the caller or by torchrun's environment): the (dp, cp,
    tp) device mesh with its flattened ``dp_cp`` axis, and the expert mesh when ep > 1.
    Collective: every rank calls it alike."""
    if not dist.is_initialized():
        raise LayoutError.from_message(
            "torch.distributed is not initialized",
            "launch with `plancc apply`/torchrun or call torch.distributed.init_process_group first",
        )
    world = dist.get_world_size()
    if layout is None:
        layout = Layout.infer(
            world_size=world, dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=sequence_parallel, dp_replicate=dp_replicate
        )
    elif layout.world_size != world:
        raise LayoutError.from_message(
            f"the layout {layout.describe()} has {layout.world_size} ranks, the process group {world}",
            "build the layout with Layout.infer",
        )
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    # pipeline ranks outermost (their traffic is the lightest: one activation a microbatch);
    # within a stage the (dp, cp, tp) mesh every other part of plancc slices by name
    sizes: tuple[int, ...] = (layout.dp, layout.cp, layout.tp)
    names: tuple[str, ...] = AXES
    if layout.dp_replicate > 1:  # HSDP: dp split in two, replicas outermost (their all-reduce is rarest)
        sizes, names = (layout.dp_replicate, layout.dp_shard, *sizes[1:]), (*HSDP_AXES, *names[1:])
    if layout.pp > 1:
        sizes, names = (layout.pp, *sizes), ("pp", *names)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if layout.dp_replicate > 1:
        mesh[HSDP_AXES]._flatten("dp")  # the same dp every other part of plancc slices by name
    # create the flattened axes on every rank now: it is collective
    dp_cp_mesh(mesh)
    fsdp_mesh(mesh)
    return _with_experts(layout, mesh)


HSDP_AXES = ("dp_replicate", "dp_shard")


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The axes a mesh can be sliced by: its dims and the flattened ones (``dp`` under HSDP)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    flattened = tuple(getattr(root, "_flatten_mapping", None) or {})
    return (*(mesh.mesh_dim_names or ()), *flattened)


def is_hsdp(mesh: DeviceMesh | ParallelMesh) -> bool:
    return HSDP_AXES[0] in (device_mesh_of(mesh).mesh_dim_names or ())


def fsdp_mesh(mesh: DeviceMesh | ParallelMesh) -> DeviceMesh:
    """The mesh FSDP shards parameters over: the flattened (dp, cp) axis, or under HSDP the
    2-D (dp_replicate, dp_shard_cp) mesh -- FSDP2 shards over its second dim and all-reduces
    over its first."""
    mesh = device_mesh_of(mesh)
    if not is_hsdp(mesh):
        return dp_cp_mesh(mesh)
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return sliced(mesh, ("dp_replicate", "dp_shard_cp"))


def sliced(mesh: DeviceMesh, axes: str | tuple[str, ...]) -> DeviceMesh:
    """``mesh[axes]``. Under HSDP ``dp`` is a flattened axis of the root mesh, which torch
    2.13 slices as asked but warns about on every slice (its future API keeps flattened meshes
    apart); plancc's flattened axes are made once, in ``build_mesh``, so the warning says
    nothing here and would flood every rank's log."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[axes]


def dp_cp_mesh(mesh: DeviceMesh | ParallelMesh) -> DeviceMesh:
    """The flattened (dp, cp) axis FSDP shards over. torch keeps flattened axes on the root
    mesh (``_flatten`` returns the existing one), so there is nothing to cache here; slicing
    ``mesh["dp_cp"]`` off the root is deprecated since torch 2.11."""
    return sliced(device_mesh_of(mesh), ("dp", "cp"))._flatten("dp_cp")


EXPERT_AXES = ("edp", "ep", "tp")


def build_expert_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The ``(edp, ep, tp)`` mesh of the same ranks as a plancc ``mesh``: each dp group of
    ``ep`` consecutive data-parallel ranks shares one layer's experts (``ep``, with ``tp``
    inside), and FSDP shards expert weights over ``edp`` (the ``dp / ep`` ranks left). Under
    pipeline stages the mesh is ``(pp, edp, ep, tp)``: each pipeline rank's experts spread over
    its own ranks (slice it by ``edp`` / ``("ep", "tp")`` as without stages).
    Collective: every rank calls it, in the same order (``layout``'s ep fits: ``Layout`` checked it)."""
    shape: tuple[int, ...] = (layout.expert_fsdp_size, layout.ep, layout.tp)
    names: tuple[str, ...] = EXPERT_AXES
    if layout.pp > 1:
        shape, names = (layout.pp, *shape), ("pp", *names)
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=names)


def device_mesh_of(mesh: DeviceMesh | ParallelMesh) -> DeviceMesh:
    """The torch ``DeviceMesh`` of a mesh given either way."""
    return mesh.device_mesh if isinstance(mesh, ParallelMesh) else mesh


def require_parallel_mesh(mesh: Any, caller: str) -> ParallelMesh:
    """``mesh`` when it is the ``ParallelMesh`` ``build_mesh`` returns. A bare ``DeviceMesh``
    (torchtitan's dp_shard/tp, a 1-D mesh, or plancc's own without its layout) says neither
    sequence nor expert parallelism and would fail deep inside torch: say what is needed."""
    if isinstance(mesh, ParallelMesh):
        return mesh
    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or ())
        got = (
            f"a DeviceMesh with axes {names} of sizes {tuple(mesh.shape)}"
            if names
            else (f"an unnamed DeviceMesh of shape {tuple(mesh.shape)}")
        )
    else:
        got = f"a {type(mesh).__name__}"
    raise ValueError(
        f"{caller} takes the mesh plancc.build_mesh returns (a ParallelMesh: its {AXES} device mesh and the "
        f"layout, sequence and expert parallelism included); got {got}. Build it with "
        "plancc.build_mesh(plancc.Layout(tp=..., sequence_parallel=...)) or plancc.build_mesh(dp=..., cp=..., tp=...)"
    )


def seed_data_shard_streams(mesh: ParallelMesh, seed: int) -> None:
    """The random numbers training draws (LoRA's dropout masks, a model's own dropout): one
    stream per data shard -- the same on the ranks of one tp group (they hold the same
    activations, and a replicated input must be dropped alike) and of one pipeline (its stages
    hold other modules), another on each dp and cp rank (other rows, other positions: a mask
    repeated on every dp rank is no dropout). The global generator, as torch's activation
    checkpointing saves and restores it: a recomputed forward draws the same masks."""
    names = axis_names(mesh.device_mesh)
    dp_rank = mesh["dp"].get_local_rank() if "dp" in names else 0
    cp_rank = mesh["cp"].get_local_rank() if "cp" in names else 0
    torch.manual_seed(seed * 1_000_003 + 0x5EED + dp_rank * mesh.layout.cp + cp_rank)
