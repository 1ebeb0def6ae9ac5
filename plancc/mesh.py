"""The (dp, cp, tp) device mesh.

``MeshSpec`` cannot exist with sizes that do not multiply to the world size; ``build_mesh``
turns a valid spec into a ``DeviceMesh`` whose axes are always named ``dp``, ``cp``, ``tp``
(size-1 axes included, so code never branches on which axes exist), plus a flattened
``dp_cp`` axis that FSDP shards over: context-parallel ranks hold the same parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("dp", "cp", "tp")


class MeshError(ValueError):
    """Mesh sizes that cannot describe this job (a usage error)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSpec:
    dp: int
    cp: int
    tp: int

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"{axis} must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    @classmethod
    def infer(cls, *, world_size: int, dp: int | None = None, cp: int = 1, tp: int = 1) -> "MeshSpec":
        """Fill in dp from the world size; refuse sizes that do not multiply to it."""
        if cp < 1 or tp < 1:
            raise MeshError(f"cp and tp must be >= 1, got cp={cp} tp={tp}")
        if dp is None:
            if world_size % (cp * tp):
                divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
                raise MeshError(
                    f"world size {world_size} is not a multiple of cp*tp={cp * tp}; "
                    f"cp*tp must be one of {divisors}"
                )
            dp = world_size // (cp * tp)
        spec = cls(dp=dp, cp=cp, tp=tp)
        if spec.world_size != world_size:
            raise MeshError(
                f"dp={dp} x cp={cp} x tp={tp} = {spec.world_size} ranks, but the world size is {world_size}; "
                "omit dp to infer it"
            )
        return spec


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(*, dp: int | None = None, cp: int = 1, tp: int = 1, device_type: str | None = None) -> DeviceMesh:
    """A (dp, cp, tp) mesh over the default process group (initialized by the caller or by
    torchrun's environment). The flattened ``dp_cp`` axis always exists."""
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialized: launch with `plancc apply`/torchrun "
                        "or call torch.distributed.init_process_group first")
    spec = MeshSpec.infer(world_size=dist.get_world_size(), dp=dp, cp=cp, tp=tp)
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    mesh = init_device_mesh(device_type, (spec.dp, spec.cp, spec.tp), mesh_dim_names=AXES)
    # Keep the flattened mesh itself: slicing a flattened axis back out of the root mesh is
    # deprecated in torch 2.11+.
    _FLATTENED[id(mesh)] = mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


_FLATTENED: dict[int, DeviceMesh] = {}


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened (dp, cp) axis FSDP shards over."""
    flat = _FLATTENED.get(id(mesh))
    if flat is None:
        flat = _FLATTENED[id(mesh)] = mesh["dp", "cp"]._flatten("dp_cp")
    return flat
