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
from torch.distributed.tensor import DTensor, distribute_tensor


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
    """Collective: fill a materialized, parallelized model from an HF folder read on rank 0."""
    from safetensors import safe_open

    folder = Path(folder)
    rank = dist.get_rank()
    names = [list(_files(folder))] if rank == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    available = set(names[0])
    files = _files(folder) if rank == 0 else {}
    handles: dict[Path, object] = {}
    state = model.state_dict()
    with torch.no_grad():
        for name, target in state.items():
            if name not in available:
                continue  # tied weights (lm_head) are absent from HF files; they share storage
            if rank == 0:
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                full = handles[path].get_tensor(name)
            if isinstance(target, DTensor):
                device = target.to_local().device
                source = full.to(device=device, dtype=target.dtype) if rank == 0 else \
                    torch.empty(target.shape, dtype=target.dtype, device=device)
                shard = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=0)
                target.to_local().copy_(shard.to_local())
            else:
                buf = full.to(device=target.device, dtype=target.dtype) if rank == 0 else torch.empty_like(target)
                dist.broadcast(buf, src=0)
                target.copy_(buf)



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
