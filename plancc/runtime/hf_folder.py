"""A Hugging Face model folder, read and checked before any weight is loaded.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that
names every tensor with its dtype, shape and byte range, so the whole folder can be checked
in milliseconds without reading a weight: every file the index names exists inside the
folder, every header fits its file, every tensor's bytes are in the file, and every
parameter and persistent buffer of the model is there exactly once with its exact shape.
A folder that fails is a list of diagnostics naming the file and the tensor, before any
process starts; a folder that passes loads without surprises (no uninitialized memory, no
silently sliced tensor, no worker aborting in the middle of a copy).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import Diagnostic, PlanError, SourceLoc
from .lora import adapters_of

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # safetensors itself refuses headers above 100 MB
# More tensors than any model holds (DeepSeek-V3's 671B parameters are ~92k tensors in 163 files)
_MAX_TENSORS = 200_000
_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_OTHER_FORMATS = (
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "model.pt",
    "model.pth",
    "tf_model.h5",
    "flax_model.msgpack",
    "consolidated.00.pth",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors' name: F32, BF16, I64, ...
    shape: tuple[int, ...]


def _problem(path: Path | str, message: str, fix: str, rule: str = "weights") -> Diagnostic:
    return Diagnostic(rule=rule, loc=SourceLoc(path=str(path)), message=message, fix=fix)


_REWRITE = "re-export the folder with save_pretrained(..., safe_serialization=True)"


def has_weights(folder: str | Path) -> bool:
    """Whether the folder names weights (a weights file that is a folder or a pipe counts: it is
    refused by ``check_folder``, never taken for "no weights, random init")."""
    folder = Path(folder)
    return (folder / SINGLE).exists() or (folder / INDEX).exists()


def other_weight_files(folder: str | Path) -> list[str]:
    """Weight files in formats plancc does not load (a folder holding only these would
    otherwise train from random init without a word)."""
    return [name for name in _OTHER_FORMATS if (Path(folder) / name).exists()]


def _header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares, with every byte range checked against the
    file's size; raises PlanError naming the file (and the tensor) otherwise."""
    try:
        info = path.stat()  # a symbolic link to a file is fine (the hub's cache is made of them)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a plain file (a pipe or a device)"
            raise PlanError([_problem(path, f"the weights file is {what}", _REWRITE)])
        size = info.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 0:
                raise PlanError(
                    [_problem(path, f"the file is {size} bytes: too short for a safetensors header", _REWRITE)]
                )
            if length > min(size - 8, _MAX_HEADER):
                raise PlanError(
                    [
                        _problem(
                            path,
                            f"the header claims {length} bytes but the file has {size - 8} "
                            "after its length: truncated or not a safetensors file",
                            _REWRITE,
                        )
                    ]
                )
            raw = f.read(length)
    except OSError as exc:
        raise PlanError(
            [
                _problem(
                    path,
                    f"cannot read the weights file: {exc.strerror or exc}",
                    "check the folder's files and permissions",
                )
            ]
        ) from None
    entries_named = raw.count(b'"data_offsets"')  # before parsing: a million entries take seconds to parse
    if entries_named > _MAX_TENSORS:
        raise PlanError(
            [_problem(path, f"the header names {entries_named} tensors; plancc reads at most {_MAX_TENSORS}", _REWRITE)]
        )
    repeated: list[str] = []
    try:
        header = json.loads(raw, object_pairs_hook=lambda pairs: _mapping(pairs, repeated))
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise PlanError(
            [_problem(path, "the safetensors header is not a JSON object: not a safetensors file", _REWRITE)]
        )
    if repeated:  # JSON keeps the last of two equal names; safetensors refuses them
        raise PlanError([_problem(path, f"the header names {repeated[0]!r} twice", _REWRITE)])
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise PlanError([_problem(path, "the header's __metadata__ is not a mapping of strings to strings", _REWRITE)])
    data_bytes = size - 8 - length
    entries: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        entries[name], span = _entry(path, name, meta, data_bytes)
        spans.append((*span, name))
    _check_tiling(path, sorted(spans), data_bytes)
    return entries


def _mapping(pairs: list[tuple[str, Any]], repeated: list[str]) -> dict[str, Any]:
    """A JSON object as a dict, its first name given twice noted in ``repeated``."""
    found: dict[str, Any] = {}
    for name, value in pairs:
        if name in found and not repeated:
            repeated.append(name)
        found[name] = value
    return found


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The tensors' byte ranges cover the data exactly, in order, as safetensors writes them:
    a gap or an overlap means two tensors share bytes or bytes belong to none, and bytes after
    the last tensor are not weights."""
    at = 0
    for start, end, name in spans:
        if start != at:
            how = "overlaps the tensor before it" if start < at else f"leaves bytes {at}..{start} to no tensor"
            raise PlanError([_problem(path, f"tensor {name!r} (bytes {start}..{end}) {how}", _REWRITE)])
        at = end
    if at != data_bytes:
        raise PlanError(
            [
                _problem(
                    path,
                    f"the file holds {data_bytes - at} bytes after its last tensor: damaged or not one file",
                    _REWRITE,
                )
            ]
        )


def _entry(path: Path, name: str, meta: object, data_bytes: int) -> tuple[TensorEntry, tuple[int, int]]:
    ok = isinstance(meta, dict) and isinstance(meta.get("shape"), list) and isinstance(meta.get("data_offsets"), list)
    shape = tuple(meta["shape"]) if ok and isinstance(meta, dict) else ()
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    if (
        not ok
        or dtype not in _BYTES
        or not all(isinstance(d, int) and d >= 0 for d in shape)
        or not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets))
    ):
        raise PlanError([_problem(path, f"tensor {name!r} has a malformed header entry", _REWRITE)])
    start, end = offsets
    count = 1
    for d in shape:
        count *= d
    if not 0 <= start <= end <= data_bytes or end - start != count * _BYTES[str(dtype)]:
        raise PlanError(
            [
                _problem(
                    path,
                    f"tensor {name!r} needs bytes {start}..{end} but the file holds {data_bytes}"
                    " bytes of data: truncated or damaged",
                    "copy the file again, or re-export the folder",
                )
            ]
        )
    return TensorEntry(file=path, dtype=str(dtype), shape=shape), (start, end)


def _inside(folder: Path, name: object, index: Path) -> Path:
    """A file named by the index, refused unless it resolves to a file inside the folder."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise PlanError(
            [
                _problem(
                    index,
                    f"the weight map names {name!r}, not a file of this folder",
                    "the index may name only files next to it",
                )
            ]
        )
    path = (folder / name).resolve()
    if path.parent != folder.resolve():
        raise PlanError(
            [
                _problem(
                    index,
                    f"the weight map names {name!r}, outside the model folder",
                    "the index may name only files next to it; this folder was damaged or crafted",
                )
            ]
        )
    return folder / name


def read_folder(folder: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a model folder's safetensors files: name -> file, dtype, shape."""
    folder = Path(folder)
    index = folder / INDEX
    if not index.is_file():
        return _header(folder / SINGLE)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as exc:
        raise PlanError([_problem(index, f"the index is not readable JSON: {str(exc)[:200]}", _REWRITE)]) from None
    if not isinstance(weight_map, dict):
        raise PlanError([_problem(index, "the index has no 'weight_map' object", _REWRITE)])
    headers: dict[Path, dict[str, TensorEntry]] = {}
    found: dict[str, TensorEntry] = {}
    for name, file in weight_map.items():
        path = _inside(folder, file, index)
        if path not in headers:
            if not path.is_file():
                raise PlanError(
                    [
                        _problem(
                            path,
                            f"the index names {file!r} for {name!r}, and it does not exist",
                            "copy the missing shard into the folder",
                        )
                    ]
                )
            headers[path] = _header(path)
        if name not in headers[path]:
            raise PlanError(
                [_problem(path, f"the index puts tensor {name!r} in {file}, which does not hold it", _REWRITE)]
            )
        found[name] = headers[path][name]
    return found


def expected_tensors(model: nn.Module) -> list[tuple[str, ...]]:
    """What a folder must hold for ``model``: groups of state-dict names that are one tensor
    (tied weights; a folder holds one name of each group), persistent buffers included; LoRA
    adapters are not the folder's (they start from their own initialization)."""
    adapters = adapters_of(model)
    own = set(adapters.parameter_names()) if adapters is not None else set()
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in own:
            groups.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in groups.values()]


def check_folder(folder: str | Path, model: nn.Module) -> list[Diagnostic]:
    """Every problem loading ``folder`` into ``model`` (a meta-device model will do) would hit."""
    folder = Path(folder)
    if not has_weights(folder):
        others = other_weight_files(folder)
        if others:
            return [
                _problem(
                    folder / others[0],
                    f"{others[0]} is a weight format plancc does not load (it reads "
                    "safetensors only: no pickle is ever loaded from a model folder)",
                    _REWRITE,
                )
            ]
        return []
    try:
        tensors = read_folder(folder)
    except PlanError as exc:
        return exc.diagnostics
    problems = []
    shapes = model.state_dict()
    for group in expected_tensors(model):
        present = [n for n in group if n in tensors]
        if not present:
            problems.append(
                _problem(
                    folder,
                    f"tensor {group[0]!r} of the model is in no weights file",
                    "export the complete model; a missing tensor would train from garbage",
                )
            )
            continue
        want = tuple(shapes[group[0]].shape)
        if len(present) > 1 and all(tensors[n].shape == want for n in present) and not _same_values(tensors, present):
            # transformers then unties them (lm_head keeps its own values); plancc's model is tied
            problems.append(
                _problem(
                    tensors[present[1]].file,
                    f"the config ties {present[1]!r} to {present[0]!r} (tie_word_embeddings), but the folder "
                    "holds both with different values: transformers would untie them, the tied model would "
                    "use only one",
                    "set tie_word_embeddings: false in config.json (the folder then loads as transformers "
                    f"loads it), or drop {present[1]!r} from the weights file",
                )
            )
            continue
        for name in present:
            entry = tensors[name]
            if entry.shape != want:
                problems.append(
                    _problem(
                        entry.file,
                        f"tensor {name!r} has shape {list(entry.shape)}, the model needs {list(want)}",
                        "load a folder saved from this model's config",
                    )
                )
            elif (entry.dtype in _FLOAT) != shapes[group[0]].is_floating_point():
                problems.append(
                    _problem(
                        entry.file,
                        f"tensor {name!r} is {entry.dtype}, the model holds {shapes[group[0]].dtype}",
                        "load a folder saved from this model's config",
                    )
                )
    return problems


def _same_values(tensors: dict[str, TensorEntry], names: list[str]) -> bool:
    """Whether tensors of a folder hold the same values (read: this runs only for a tied pair
    the folder holds twice)."""
    from safetensors import safe_open

    first = None
    for name in names:
        with safe_open(str(tensors[name].file), framework="pt") as f:
            value = f.get_tensor(name)
        if first is None:
            first = value
        elif value.dtype != first.dtype or not bool((value == first).all()):
            return False
    return True


def check_export_target(target: str | Path, source: str | Path | None = None) -> list[Diagnostic]:
    """Problems writing a Hugging Face folder to ``target`` (checked before a run starts):
    never over a file, never into the folder the model is read from, never over a folder
    that is not a model folder."""
    path, fix = Path(target), "pass a new folder (or an earlier export) to --export-hf"
    if path.exists() and not path.is_dir():
        return [_export_problem(path, "--export-hf names an existing file", fix)]
    if source is not None and Path(source).is_dir():
        src, dst = Path(source).resolve(), path.resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            return [
                _export_problem(path, f"--export-hf would write into the folder the model is read from ({src})", fix)
            ]
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").is_file():
        return [_export_problem(path, "--export-hf names a folder that is not empty and holds no model", fix)]
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK | os.X_OK):
        return [_export_problem(path, f"cannot write here ({probe} is not writable)", fix)]
    return []


def _export_problem(path: Path, message: str, fix: str) -> Diagnostic:
    return Diagnostic(rule="export-hf", loc=SourceLoc(path=str(path)), message=message, fix=fix)
