"""Global gradient norm and clipping across every mesh axis a gradient is sharded on.

After TP + FSDP2, gradients live on different meshes: 2-D (dp_cp, tp) for TP-sharded
weights, 1-D dp_cp for weights TP left whole. torch's ``clip_grad_norm_`` wants one mesh;
here each gradient's local sum of squares is summed over exactly the axes it is sharded on
(replicated axes already hold the same values and must not be counted twice).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter], local_grads: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The L2 norm of all gradients, as if the model were unsharded (fp32). ``local_grads``:
    their ``local_gradients``, when the caller has found them already."""
    params = [p for p in parameters if p.grad is not None]
    locals_ = local_grads if local_grads is not None else local_gradients(params)
    # (mesh, axes the gradient is sharded on) -> this rank's local gradients of that kind
    buckets: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    device = None
    for p, local in zip(params, locals_, strict=True):
        g = p.grad
        mesh: DeviceMesh | None = None
        axes: tuple[int, ...] = ()
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            # FSDP2 over a dim TP already shards places a _StridedShard on the dp axis, which in
            # torch 2.13 is no Shard (and says is_shard() False): missing it undercounted every
            # such gradient dp times, and clipping at dp x tp scaled the step wrongly
            axes = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, (Shard, _StridedShard)))
        # where the sums meet: the collective's device (a CPU-offloaded gradient's shard is in
        # host memory while NCCL reduces on the GPU)
        device = torch.device(mesh.device_type) if mesh is not None and mesh.device_type != "cpu" else local.device
        buckets.setdefault((mesh, axes), []).append(local.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (mesh, axes), grads in buckets.items():
        # one kernel a bucket for every norm, not one a parameter; accumulated in fp64 whatever
        # the gradients' dtype: fp32 sums of a million squares miss the fp64 norm by ~5e-5
        # relative (bf16 gradients: NeMo-RL's precision test asks 1e-6); the kernel reads
        # what it reads either way, so the wider sum costs no memory traffic
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum().to(total.device)
        for axis in axes:  # replicated axes already hold the same values: not summed again
            assert mesh is not None
            dist.all_reduce(sq, group=mesh.get_group(axis))
        total = total + sq
    return total.sqrt().to(torch.float32)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the
    norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params)
    scale_to_norm_(params, float(norm), max_norm)
    return norm


def scale_to_norm_(params: Iterable[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale the gradients (whose global norm is ``norm``) in place to a norm of at most
    ``max_norm`` (torch's rule: by ``max_norm / (norm + 1e-6)`` when that is below 1)."""
    scale_local_to_norm_(local_gradients(params), norm, max_norm)


def local_gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each gradient's storage on this rank (a DTensor's local tensor): what clipping scales --
    the scale is the same on every shard, and a DTensor's own ``mul_`` would go through
    DTensor's dispatch once a tensor. Found before the norm is read, this host work (tens of
    microseconds a gradient) runs while the device still computes the backward."""
    grads = [p.grad for p in params if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def scale_local_to_norm_(local_grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """``scale_to_norm_`` on ``local_gradients`` found already."""
    if not (math.isfinite(max_norm) and max_norm > 0):
        return
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(local_grads, coef)
