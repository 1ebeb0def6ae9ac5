"""Reading a DCP checkpoint without executing anything from its folder.

DCP's ``.metadata`` is a pickle and its non-tensor items are ``torch.load``ed with
``weights_only=False``; a checkpoint shared between people must not run code on resume. The
reader here admits DCP's own metadata classes only, checks the metadata's types and the shards
it names before any of them is read, and loads non-tensor items with ``weights_only=True``.
It imports DCP; ``checkpoint``, whose folder checks the launcher runs, does not.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from .checkpoint_error import is_int as _is_int
from .checkpoint_error import refusal as _error


class _MetadataUnpickler(pickle.Unpickler):
    """Admits what DCP writes into ``.metadata`` and nothing else: a pickle naming any other
    global (``os.system``, ``builtins.eval``, ...) is refused before it is called."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"the checkpoint metadata names {module}.{name}, which a DCP checkpoint never holds"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted metadata unpickler and shard paths kept inside
    the checkpoint folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, MemoryError) as exc:
            raise _error(path, f"cannot read checkpoint metadata: {exc}", "resume from another step") from None
        except Exception as exc:  # noqa: BLE001 - whatever a damaged or crafted pickle raises, DCP's own setstate included
            raise _error(
                path,
                f"refused checkpoint metadata: {str(exc)[:200]}",
                "resume only from checkpoints plancc saved; this file is damaged or was crafted",
            ) from None
        if not isinstance(metadata, Metadata):
            raise _error(
                path,
                f"checkpoint metadata is a {type(metadata).__name__}, not DCP metadata",
                "resume only from checkpoints plancc saved",
            )
        wrong = _metadata_problem(metadata)
        if wrong:
            raise _error(
                path,
                f"checkpoint metadata is not what DCP writes: {wrong}",
                "resume only from checkpoints plancc saved; this file is damaged or was crafted",
            )
        _check_shards(path, metadata)
        # what FileSystemReader.read_metadata does after unpickling
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def _is_shape(value: Any, rank: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size)
        and all(isinstance(d, int) and d >= 0 for d in value)
        and (rank is None or len(value) == rank)
    )


def _metadata_problem(metadata: Metadata) -> str | None:
    """What in an unpickled ``.metadata`` has another type or shape than DCP writes (a list
    for a mapping, an offset that is no integer, a chunk outside its tensor), or None: the
    unpickler admits DCP's classes, this admits only what they hold when DCP made them."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return f"state_dict_metadata is {type(entries).__name__}, not a mapping"
    for name, entry in entries.items():
        if not isinstance(name, str):
            return f"an entry is named {name!r}, not a string"
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"{name} is {type(entry).__name__}, neither tensor nor bytes metadata"
        props = entry.properties
        if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
            return f"{name} has no tensor properties with a dtype"
        if not _is_shape(entry.size) or not isinstance(entry.chunks, list):
            return f"{name} has no size or no list of chunks"
        for chunk in entry.chunks:
            rank = len(entry.size)
            if not isinstance(chunk, ChunkStorageMetadata) or not (
                _is_shape(chunk.offsets, rank) and _is_shape(chunk.sizes, rank)
            ):
                return f"{name} has a chunk that is not an offset and size of its {rank} dims"
            if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
                return f"{name} has a chunk beyond its size {tuple(entry.size)}"
    if metadata.storage_data is not None and not isinstance(metadata.storage_data, dict):
        return f"storage_data is {type(metadata.storage_data).__name__}, not a mapping"
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"storage_data is keyed by {type(index).__name__}, not by tensor index"
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            return f"{index.fqn}'s storage has no file name"
        if not (_is_int(info.offset, 0) and _is_int(info.length, 0)):
            return f"{index.fqn}'s storage has offset {info.offset!r} and length {info.length!r}, not byte counts"
    if metadata.planner_data is not None and not isinstance(metadata.planner_data, dict):
        return f"planner_data is {type(metadata.planner_data).__name__}, not a mapping"
    return None


def _check_shards(path: Path, metadata: Metadata) -> None:
    """Every byte range the metadata names lies inside a shard file of the folder: a path
    outside the folder is refused, and a truncated shard is named before DCP reads it."""
    folder = path.parent.resolve()
    needed: dict[Path, int] = {}
    for info in (metadata.storage_data or {}).values():
        shard = (folder / info.relative_path).resolve()
        if shard.parent != folder:
            raise _error(
                path,
                f"checkpoint metadata points at {shard}, outside the checkpoint folder",
                "resume only from checkpoints plancc saved",
            )
        end = info.offset + info.length
        needed[shard] = max(needed.get(shard, 0), end)
    for shard, end in needed.items():
        size = shard.stat().st_size if shard.is_file() else -1
        if size < end:
            state = "is missing" if size < 0 else f"holds {size} bytes, the metadata needs {end}"
            raise _error(
                shard,
                f"checkpoint shard {shard.name} {state}: the checkpoint is damaged",
                "resume from another step, or copy the checkpoint folder again",
            )


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyper-parameters) loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # weights_only refuses any global it does not know
            raise _error(
                read_item.dest_index.fqn,
                f"refused a non-tensor checkpoint item: {str(exc)[:200]}",
                "resume only from checkpoints plancc saved",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
