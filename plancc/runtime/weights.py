"""Hugging Face weights in and out of a parallelized model.

Loading: rank 0 alone reads the safetensors files. Every rank works out the slice of each
tensor it holds (torch's ``compute_local_shape_and_global_offset``, the rule DCP uses) and
rank 0 sends each rank exactly that slice, point to point, instead of the whole tensor that
``set_model_state_dict(broadcast_from_rank0=True)`` broadcasts. ``bench/loading.py``
measures the bytes.

Export: the full state dict gathered on rank 0 and written with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PretrainedConfig

from ..models import build_model


def has_safetensors(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def _files(folder: Path) -> dict[str, Path]:
    """tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


Slice = tuple[tuple[int, ...], tuple[int, ...]]  # (local shape, global offset)


def _local_slice(target: torch.Tensor) -> Slice:
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return tuple(shape), tuple(offset)
    return tuple(target.shape), (0,) * target.dim()


def _send_slices(full: torch.Tensor, name: str, layouts: list[dict[str, Slice]], device: torch.device) -> torch.Tensor:
    """Rank 0: send every other rank its slice of ``full``; return rank 0's own."""
    mine = full
    for dst, layout in enumerate(layouts):
        shape, offset = layout[name]
        piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if dst == 0:
            mine = piece.to(device).contiguous()
        elif piece.numel():
            dist.send(piece.to(device).contiguous(), dst=dst)
    return mine


def _receive_slice(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    local = torch.empty(shape, dtype=dtype, device=device)
    if local.numel():
        dist.recv(local, src=0)
    return local


def load_hf_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Collective: fill a materialized, parallelized model from an HF folder read on rank 0.

    Every rank works out which slice of each tensor it holds (torch's own
    ``compute_local_shape_and_global_offset``, the rule DCP uses); rank 0 reads each tensor
    once and sends every rank exactly its slice, point to point.
    """
    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    files = _files(folder) if rank == 0 else {}
    names: list[list[str] | None] = [list(files)] if rank == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    available = set(names[0] or ())
    # tied weights (lm_head) are absent from HF files: they share the embedding's storage
    state = {k: v for k, v in model.state_dict().items() if k in available}
    mine = {name: _local_slice(target) for name, target in state.items()}
    layouts: list[dict[str, Slice]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, layouts, dst=0)
    handles: dict[Path, Any] = {}
    loaded: dict[str, Any] = {}
    with torch.no_grad():
        for name, target in state.items():
            local_target = target.to_local() if isinstance(target, DTensor) else target
            device, dtype = local_target.device, local_target.dtype
            if layouts is not None:
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                local = _send_slices(handles[path].get_tensor(name).to(dtype), name, layouts, device)
            else:
                local = _receive_slice(mine[name][0], dtype, device)
            loaded[name] = (
                DTensor.from_local(
                    local,
                    target.device_mesh,
                    target.placements,
                    shape=target.shape,
                    stride=target.stride(),
                    run_check=False,
                )
                if isinstance(target, DTensor)
                else local
            )
    # Through load_state_dict, not a copy into to_local(): FSDP2 keeps its own padded storage
    # for sharded parameters, which a raw copy could leave stale.
    set_model_state_dict(model, dict(loaded), options=StateDictOptions(strict=False))


def export_hf(model: torch.nn.Module, config: PretrainedConfig, folder: str | Path) -> None:
    """Collective: write the model's full weights as a ``save_pretrained`` folder (rank 0)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain: Any = build_model(config, device="cpu")  # a transformers PreTrainedModel
        plain.load_state_dict(state, strict=False)
        plain.save_pretrained(str(folder))
    dist.barrier()
