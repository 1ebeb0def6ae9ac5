"""Hugging Face weights in and out of a parallelized model.

Loading: rank 0 alone reads the safetensors files; each tensor is scattered with torch's
``distribute_tensor(src_data_rank=0)`` along the parameter's own placements, so a rank
receives its shard (plus, on 2-D meshes, the slice it forwards along the inner axis)
instead of the whole tensor that ``set_model_state_dict(broadcast_from_rank0=True)``
broadcasts. ``bench/loading.py`` measures the bytes.

Export: the full state dict gathered on rank 0 and written with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def has_safetensors(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def _files(folder: Path) -> dict[str, Path]:
    """tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_hf_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Collective: fill a materialized, parallelized model from an HF folder read on rank 0.

    Every rank works out which slice of each tensor it holds (torch's own
    ``compute_local_shape_and_global_offset``, the rule DCP uses); rank 0 reads each tensor
    once and sends every rank exactly its slice, point to point.
    """
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [list(_files(folder))] if rank == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    available = set(names[0])
    state = {k: v for k, v in model.state_dict().items() if k in available}
    # tied weights (lm_head) are absent from HF files: they share the embedding's storage
    mine = {}
    for name, target in state.items():
        if isinstance(target, DTensor):
            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                  target.placements)
            mine[name] = (tuple(shape), tuple(offset))
        else:
            mine[name] = (tuple(target.shape), (0,) * target.dim())
    layouts = [None] * world if rank == 0 else None
    dist.gather_object(mine, layouts, dst=0)
    files = _files(folder) if rank == 0 else {}
    handles: dict[Path, object] = {}
    loaded: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, target in state.items():
            local_target = target.to_local() if isinstance(target, DTensor) else target
            device, dtype = local_target.device, local_target.dtype
            if rank == 0:
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                full = handles[path].get_tensor(name).to(dtype)
                for dst in range(world):
                    shape, offset = layouts[dst][name]
                    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                    if dst == 0:
                        local = piece.to(device).contiguous()
                    elif piece.numel():
                        dist.send(piece.to(device).contiguous(), dst=dst)
            else:
                shape, _ = mine[name]
                local = torch.empty(shape, dtype=dtype, device=device)
                if local.numel():
                    dist.recv(local, src=0)
            if isinstance(target, DTensor):
                loaded[name] = DTensor.from_local(local, target.device_mesh, target.placements,
                                                  shape=target.shape, stride=target.stride(), run_check=False)
            else:
                loaded[name] = local
    # Through load_state_dict, not a copy into to_local(): FSDP2 keeps its own padded storage
    # for sharded parameters, which a raw copy could leave stale.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def export_hf(model: torch.nn.Module, config, folder: str | Path) -> None:
    """Collective: write the model's full weights as a ``save_pretrained`` folder (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .models import build_model

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain = build_model(config, device="cpu")
        plain.load_state_dict(state, strict=False)
        plain.save_pretrained(str(folder))
    dist.barrier()
