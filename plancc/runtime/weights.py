"""Hugging Face weights in and out of a parallelized model.

Loading: rank 0 alone reads the safetensors files. Every rank works out the slice of each
tensor it holds (torch's ``compute_local_shape_and_global_offset``, the rule DCP uses) and
rank 0 sends each rank exactly that slice, point to point, instead of the whole tensor that
``set_model_state_dict(broadcast_from_rank0=True)`` broadcasts. ``bench/loading.py``
measures the bytes.

Export: the full state dict gathered on rank 0 and written with ``save_pretrained``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PretrainedConfig

from ..errors import Diagnostic, PlanError, quiet_logger
from ..models import build_model
from .hf_folder import check_export_target, check_folder, has_weights, read_folder


def has_safetensors(folder: str | Path) -> bool:
    return has_weights(folder)


def _files(folder: Path) -> dict[str, Path]:
    """tensor name -> the file that holds it (the folder checked as ``check_folder`` does)."""
    return {name: entry.file for name, entry in read_folder(folder).items()}


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
    # rank 0 checks the folder against the model: every rank stops on one verdict, before a byte is sent
    verdict: list[list[Diagnostic] | None] = [check_folder(folder, model) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise PlanError(verdict[0])
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


# What a model folder holds besides weights and config that a user of the export needs:
# tokenizer (Hugging Face and sentencepiece), chat template, generation defaults.
_COMPANIONS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
)


def export_hf(
    model: torch.nn.Module, config: PretrainedConfig, folder: str | Path, *, source: str | Path | None = None
) -> None:
    """Collective: write the model's full weights as a ``save_pretrained`` folder (rank 0),
    with the tokenizer and generation files of ``source`` (the folder the model came from).

    The folder is written beside its destination and moved into place whole: an earlier
    export there is replaced only once the new one is complete, and no shard of it (nor its
    index) survives to be mixed with the new one.
    """
    problems = check_export_target(folder, source)
    if problems:
        raise PlanError(problems)
    # gathering strided TP x FSDP shards makes torch log a "suboptimal redistribute" warning per
    # tensor on every rank: an accepted cost of a one-off export, not news for the user
    with quiet_logger("torch.distributed.tensor"):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        target = Path(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".partial-{target.name}-", dir=target.parent))
        plain: Any = build_model(config, device="cpu")  # a transformers PreTrainedModel
        plain.load_state_dict(state, strict=False)
        with _no_progress_bars():  # the CLI says what was exported, in one line
            plain.save_pretrained(str(partial))
        _copy_companions(source, partial)
        aside = target.parent / f".replaced-{partial.name}" if target.exists() else None
        if aside is not None:
            os.rename(target, aside)
        os.rename(partial, target)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    dist.barrier()


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _copy_companions(source: str | Path | None, destination: Path) -> None:
    if source is None or not Path(source).is_dir():
        return
    for name in _COMPANIONS:
        if (Path(source) / name).is_file() and not (destination / name).exists():
            shutil.copy2(Path(source) / name, destination / name)
