"""Hugging Face weights in and out of a parallelized model.

Loading: rank 0 alone reads the safetensors files. Every rank works out the slice of each
tensor it holds (torch's ``compute_local_shape_and_global_offset``, the rule DCP uses) and
rank 0 sends each rank exactly that slice, point to point, instead of the whole tensor that
``set_model_state_dict(broadcast_from_rank0=True)`` broadcasts. ``bench/loading.py``
measures the bytes.

Export (``plancc.engine.export``, written from the weights stream shard by shard) uses this
module's file work: the target checked, the folder published file by file, the companions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PretrainedConfig

from ..errors import Diagnostic, PlanError, SourceLoc
from .hf_folder import check_folder, has_weights, read_folder
from .lora import Adapters
from .non_finite import first_non_finite


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


def _send_slices(
    full: torch.Tensor, name: str, layouts: list[dict[str, Slice]], device: torch.device
) -> torch.Tensor | None:
    """Rank 0: send every other rank that holds ``name`` its slice of ``full``; return rank 0's
    own (None where it holds none: a pipeline rank holds its stages' tensors only)."""
    mine = None
    for dst, layout in enumerate(layouts):
        if name not in layout:
            continue
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


def load_hf_weights(
    model: torch.nn.Module,
    folder: str | Path,
    *,
    whole: torch.nn.Module | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Collective: fill a materialized, parallelized model from an HF folder read on rank 0.

    Every rank works out which slice of each tensor it holds (torch's own
    ``compute_local_shape_and_global_offset``, the rule DCP uses); rank 0 reads each tensor
    once and sends every rank exactly its slice, point to point. Ranks may hold different
    tensors (pipeline stages): rank 0 sends each tensor any rank holds. ``whole``: the whole
    model (meta will do) the folder is checked against, where ``model`` is a rank's part of it.
    ``aliases``: tensors of ``model`` read from another name of the folder (a tied lm_head's
    copy on the last pipeline stage, from the embedding the folder holds).
    """
    aliases = dict(aliases or {})
    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank 0 checks the folder against the model: every rank stops on one verdict, before a byte is sent
    verdict: list[list[Diagnostic] | None] = [check_folder(folder, whole or model) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise PlanError(verdict[0])
    files = _files(folder) if rank == 0 else {}
    names: list[list[str] | None] = [list(files)] if rank == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    available = set(names[0] or ())
    # tied weights (lm_head) are absent from HF files: they share the embedding's storage
    state = {k: v for k, v in model.state_dict().items() if aliases.get(k, k) in available}
    mine = {name: _local_slice(target) for name, target in state.items()}
    dtypes = {name: str(target.dtype).removeprefix("torch.") for name, target in state.items()}
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((mine, dtypes), gathered if rank == 0 else None, dst=0)
    layouts: list[dict[str, Slice]] | None = [g[0] for g in gathered] if rank == 0 else None
    # the order every rank walks: rank 0's tensors, then those only other ranks hold (a tensor's
    # dtype is its holders')
    wanted: dict[str, str] = {}
    for _, held in gathered:
        for name, dtype in held.items():
            wanted.setdefault(name, dtype)
    order: list[Any] = [list(wanted)]
    dist.broadcast_object_list(order, src=0)
    handles: dict[Path, Any] = {}
    loaded: dict[str, Any] = {}
    device = _device_of(state)
    with torch.no_grad():
        for name in order[0]:
            target = state.get(name)
            local_target = target.to_local() if isinstance(target, DTensor) else target
            if layouts is not None:
                stored = aliases.get(name, name)
                path = files[stored]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                dtype = getattr(torch, wanted[name])
                local = _send_slices(handles[path].get_tensor(stored).to(dtype), name, layouts, device)
            elif local_target is not None:
                local = _receive_slice(mine[name][0], local_target.dtype, local_target.device)
            else:
                continue
            if target is None or local is None:
                continue
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


def _device_of(state: dict[str, Any]) -> torch.device:
    """Where this rank's tensors live (rank 0 sends from there: its own or not)."""
    first = next(iter(state.values()), None)
    if isinstance(first, DTensor):
        return first.to_local().device
    return first.device if first is not None else torch.device("cpu")


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


# What an export wrote, kept in its folder: the next export into that folder removes the files
# of this one that it does not write again (an earlier export's extra shards and index), and
# never a file that no export wrote.
EXPORT_MANIFEST = ".plancc-export.json"


def write_adapter_config(folder: Path, adapters: Adapters, config: PretrainedConfig, source: str | Path | None) -> None:
    """PEFT's adapter_config.json for ``adapters`` (their tensors are written beside it)."""
    settings = adapters.spec.peft_config(adapters.modules)
    settings["base_model_name_or_path"] = str(source) if source is not None else config.name_or_path or None
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")


# Files an inference engine may load from a folder by their kind, not by name (vLLM reads every
# *.safetensors an index lists): left beside a new export, they would be mixed into it.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def publish_export(partial: Path, target: Path) -> None:
    """Move every file of ``partial`` into ``target`` (each atomically), then list them.

    A file the previous export listed and this one does not write again is removed (it was
    plancc's). A file no export listed that this one would overwrite, or a weight file (shard,
    index) that would be mixed with it, is moved, not removed, into a ``.plancc-superseded-N``
    folder inside ``target``: nothing a user put there is lost."""
    written = sorted(entry.name for entry in partial.iterdir() if entry.is_file())
    earlier = set(_exported_files(target))
    foreign = [
        entry
        for entry in sorted(target.iterdir())
        if entry.name not in earlier
        and (entry.is_file() or entry.is_symlink())
        and (entry.name in written or entry.name.endswith(_WEIGHT_SUFFIXES))
    ]
    if foreign:
        aside = _fresh_folder(target, ".plancc-superseded")
        for entry in foreign:
            os.replace(entry, aside / entry.name)
    for name in written:
        os.replace(partial / name, target / name)
    for name in sorted(earlier - set(written)):
        stale = target / name
        if stale.is_file() and not stale.is_symlink():
            stale.unlink()
    manifest = partial / EXPORT_MANIFEST
    manifest.write_text(json.dumps({"files": written}, indent=1) + "\n")
    os.replace(manifest, target / EXPORT_MANIFEST)


def _fresh_folder(parent: Path, prefix: str) -> Path:
    for n in range(1, 10_000):
        candidate = parent / f"{prefix}-{n}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=parent))


def _exported_files(folder: Path) -> list[str]:
    """The files the last export into ``folder`` wrote (none when it lists none, or not clearly)."""
    try:
        listed = json.loads((folder / EXPORT_MANIFEST).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    # plain names only: a tampered list must not reach outside the folder
    return [n for n in listed if isinstance(n, str) and n and "/" not in n and n not in (".", "..")]


def refuse_non_finite_weights(model: torch.nn.Module, *, what: str) -> None:
    """Collective: a ``PlanError`` on every rank when any rank's shard of any parameter holds a
    NaN or an infinity, naming the first such parameter: such weights are never saved."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    first = first_non_finite(model.named_parameters(), device)
    if first is None:
        return
    raise PlanError(
        [
            Diagnostic(
                rule="non-finite",
                loc=SourceLoc(path=first),
                message=f"the weights hold non-finite values (first: {first}); refused {what}, nothing written",
                fix="lower --lr (a finite, small learning rate) or check the data; resume from the last checkpoint",
            )
        ]
    )


def copy_companions(source: str | Path | None, destination: Path) -> None:
    if source is None or not Path(source).is_dir():
        return
    for name in _COMPANIONS:
        if (Path(source) / name).is_file() and not (destination / name).exists():
            shutil.copy2(Path(source) / name, destination / name)
