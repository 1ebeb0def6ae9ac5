"""Allocate a parallelized model built on the meta device, and fill it.

Kept apart from ``parallelize``: sharding decides where every parameter lives, this module
gives the shards storage and values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .parallelize import params_on_host


def materialize(
    model: nn.Module, device: torch.device | str, *, full_state_dict: dict[str, Any] | None = None
) -> nn.Module:
    """Allocate a (parallelized) meta model on ``device`` and fill it.

    With ``full_state_dict`` every rank passes the unsharded tensors and keeps its shards.
    Non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) are in no state
    dict: those built for real (``plancc.models.build_model``) are carried over, and those
    built on meta (``with torch.device("meta"): AutoModelForCausalLM.from_config(...)``)
    are recomputed by the model's own transformers initializer.
    """
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
    lost = [name for name, buf in model.named_buffers() if buf.is_meta and _is_non_persistent(model, name)]
    # offloaded shards are allocated in host memory (FSDP2 refuses them anywhere else); the
    # buffers (rotary frequencies) stay with the activations, on the device
    host = params_on_host(model)
    model.to_empty(device="cpu" if host else device)
    modules = dict(model.named_modules())
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        modules[owner]._buffers[attr] = value.to(device)
    if lost:
        _recompute_buffers(model, lost)
    if host:  # the buffers to_empty left on the host, and those recomputed there, to the device
        for module in modules.values():
            module._buffers.update({k: v.to(device) for k, v in module._buffers.items() if v is not None})
    if full_state_dict is not None:
        # a copy: torch 2.13's set_model_state_dict replaces the caller's full tensors with
        # this rank's DTensor shards in the dict it is given
        rest = dict(full_state_dict)
        uneven = _fill_uneven_strided(model, rest)
        if uneven:  # the rest loads unstrictly: what strict loading checks, checked here
            own = set(model.state_dict())
            missing, unexpected = own - set(full_state_dict), set(full_state_dict) - own
            if missing or unexpected:
                raise RuntimeError(f"state dict keys missing: {sorted(missing)}; unexpected: {sorted(unexpected)}")
        set_model_state_dict(model, rest, options=StateDictOptions(full_state_dict=True, strict=not uneven))
    return model


def _fill_uneven_strided(model: nn.Module, full: dict[str, Any]) -> list[str]:
    """Fill the parameters that FSDP shards over tp shards of the same dim (``_StridedShard``)
    where the rows do not split evenly over both -- Doge's ``A``, one per KV head, or gpt-oss's
    sinks at tp x fsdp beyond the head count -- and take them out of ``full``: torch 2.13's
    ``distribute_tensor`` asserts on them (it pads a strided shard's pieces and wants them equal),
    while a redistribution from a replicated tensor splits them as FSDP laid them out."""
    filled = []
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or name not in full:
            continue
        strided = [(i, p) for i, p in enumerate(param.placements) if isinstance(p, _StridedShard)]
        if not strided:
            continue
        dims = {p.dim for _, p in strided}
        shards = {
            d: math.prod(
                param.device_mesh.size(i)
                for i, p in enumerate(param.placements)
                if isinstance(p, (Shard, _StridedShard)) and p.dim == d
            )
            for d in dims
        }
        if all(param.shape[d] % n == 0 for d, n in shards.items()):
            continue
        whole = full.pop(name).to(device=param.device, dtype=param.dtype)
        replicated = distribute_tensor(
            whole, param.device_mesh, [Replicate()] * param.device_mesh.ndim, src_data_rank=None
        )
        with torch.no_grad():
            param.to_local().copy_(replicated.redistribute(param.device_mesh, param.placements).to_local())
        filled.append(name)
    return filled


def _is_non_persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner)._non_persistent_buffers_set


def _recompute_buffers(model: nn.Module, names: list[str]) -> None:
    """Recompute non-persistent buffers that were created on the meta device.

    Without this, ``to_empty`` leaves rotary frequencies as uninitialized memory and the
    model runs with silently wrong logits. transformers (5.x) builds its own models on meta
    and recomputes these buffers in ``_init_weights``; plancc calls it on the owning modules
    only, with the parameters swapped for meta stand-ins so that no weight is touched. A
    NaN sentinel shows any buffer the initializer does not know.
    """
    init = getattr(model, "_init_weights", None)

    def sentinel(buf: torch.Tensor) -> float | int:
        return float("nan") if buf.is_floating_point() else torch.iinfo(buf.dtype).min

    def untouched(buf: torch.Tensor) -> bool:
        return bool((buf.isnan() if buf.is_floating_point() else buf == sentinel(buf)).all())

    for name in names:
        buf = model.get_buffer(name)
        buf.fill_(sentinel(buf))
    for owner in dict.fromkeys(name.rpartition(".")[0] for name in names):
        module = model.get_submodule(owner)
        params = dict(module._parameters)
        module._parameters = {
            k: None if p is None else nn.Parameter(torch.empty(p.shape, device="meta")) for k, p in params.items()
        }
        try:
            if init is not None:
                init(module)
        finally:
            module._parameters = params
    unfilled = [name for name in names if untouched(model.get_buffer(name))]
    if unfilled:
        raise ValueError(
            f"buffers {', '.join(unfilled)} were created on the meta device, are in no state dict, and "
            f"{type(model).__name__} has no initializer that recomputes them; build the model with "
            "plancc.models.build_model(config, device='meta'), which keeps buffers real"
        )
