"""``--data`` as Hugging Face ``datasets`` read it: a parquet, arrow or JSON file, a folder of
them, or a dataset saved with ``save_to_disk``.

Files are read streaming (``load_dataset(..., streaming=True)``: rows come as they are read, the
file is never loaded whole); a saved dataset is memory-mapped (``load_from_disk``). Each row is a
record (``job.records``): its problems are reported at ``PATH:ROW``, the first ``MAX_REPORTED``
of them, as a JSONL file's are at its lines. Needs the ``datasets`` package (``pip install
'plancc[data]'``); a plain ``.jsonl`` file does not (``job.data.read_jsonl``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import Diagnostic, SourceLoc

# the builder of each kind of file (a folder: the one kind its files share)
KINDS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


def is_dataset(path: str | Path) -> bool:
    """Whether ``--data`` names what ``datasets`` reads (a plain ``.jsonl`` file, a pipe or any
    other file is read line by line as before)."""
    p = Path(path)
    return p.is_dir() or (p.is_file() and p.suffix.lower() in (".parquet", ".arrow", ".json"))


def dataset_rows(path: str | Path, split: str | None = None) -> Iterator[Any]:
    """The rows of the dataset at ``path``, one dict each, or a ``DatasetProblem``: of its
    ``split`` (``--eval-split``), or of the split a run trains on (``split_read``)."""
    try:
        import datasets  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise DatasetProblem(
            f"{path} is a dataset (parquet, arrow, JSON or a saved one); reading it needs the datasets package",
            "pip install 'plancc[data]' (or pip install datasets), or pass a .jsonl file",
        ) from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local path: never the hub
    datasets.disable_progress_bars()
    p = Path(path)
    try:
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[split_named(list(loaded), split) if split else split_read(list(loaded))]
            elif split:
                raise DatasetProblem(f"{path} is a dataset of one split: no {split} split", _ONE_SPLIT)
            yield from loaded
            return
        if split and p.is_file():
            raise DatasetProblem(f"{path} is one file: no {split} split", _ONE_SPLIT)
        files = [p] if p.is_file() else folder_split(p, split)[1]
        kinds = {KINDS[f.suffix.lower()] for f in files}
        if len(kinds) != 1:
            found = ", ".join(sorted(kinds)) or "none"
            raise DatasetProblem(
                f"{path} holds {len(files)} data files of kinds: {found}; a dataset is files of one kind",
                "put parquet, arrow or JSON files of one kind in the folder (or save_to_disk a dataset)",
            )
        stream = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train", streaming=True)
        yield from stream
    except DatasetProblem:
        raise
    except Exception as exc:  # whatever a damaged file or an unreadable folder raises inside datasets
        text = str(exc).strip().splitlines()
        raise DatasetProblem(
            f"datasets could not read {path}: {type(exc).__name__}: {text[0][:200] if text else ''}",
            "check the file (a damaged parquet footer, a JSON that is not one record per row)",
        ) from None


# the names datasets gives held-out splits: never trained on unasked
HELD_OUT = frozenset({"test", "validation", "valid", "eval", "evaluation", "dev"})


def split_read(names: list[str]) -> str:
    """The split of several a run trains on: ``train``, or the first where none is (a dataset
    of one split) -- unless that one is a held-out split (a folder of ``test-*.parquet`` alone):
    then a ``DatasetProblem``, as a run would train on the data meant to judge it."""
    split = "train" if "train" in names or not names else names[0]
    if split in HELD_OUT:
        raise DatasetProblem(
            f"the dataset holds the {split} split alone (no train split): a run would train on the rows held out "
            "to judge it",
            f"pass --data the train split; to train on these rows all the same, name them as such (rename "
            f"{split}-*.parquet or the {split}/ folder to train)",
        )
    return split


_ONE_SPLIT = "pass --eval-data the held-out rows' file, or --data a folder of splits (train-*.parquet, test-*.parquet)"


def split_named(names: list[str], split: str) -> str:
    """``split`` when the dataset holds it (``--eval-split``), else a ``DatasetProblem`` naming those it holds."""
    if split not in names:
        raise DatasetProblem(
            f"the dataset holds the splits {', '.join(sorted(names)) or 'none'}, not {split}",
            f"pass --eval-split one of {', '.join(sorted(names))}" if names else _ONE_SPLIT,
        )
    return split


def folder_split(folder: Path, split: str | None = None) -> tuple[str, list[Path], list[str]]:
    """(split, its data files, the other splits) of a folder of data files, by ``datasets``' own
    split naming -- ``train-00000-of-00002.parquet``, a ``train/`` folder: how the hub lays a
    dataset out -- the ``train`` split where several are named (a test split is never trained on);
    every data file where none is."""
    from datasets.data_files import DataFilesDict, get_data_patterns  # type: ignore[import-untyped,import-not-found,unused-ignore]

    try:
        named = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # no file datasets would read: every data file below, as before
        named = {"train": [str(f) for f in folder.rglob("*") if f.is_file()]}
    splits = {
        str(name): sorted(Path(f) for f in files if Path(f).suffix.lower() in KINDS) for name, files in named.items()
    }
    splits = {name: files for name, files in splits.items() if files}
    if len(splits) > 1 and "train" not in splits and not split:
        raise DatasetProblem(
            f"{folder} holds the splits {', '.join(sorted(splits))} and none named train",
            "pass --data the folder or files of the split to train on",
        )
    split = split_named(list(splits), split) if split else split_read(list(splits))
    return split, splits.get(split, []), sorted(name for name in splits if name != split)


def split_note(path: str | Path) -> str:
    """Which split of a folder a run reads, for the log's ``data:`` line ("" where it has one)."""
    p = Path(path)
    if not p.is_dir() or (p / "state.json").is_file():
        return ""
    try:
        if (p / "dataset_dict.json").is_file():  # a saved DatasetDict: dataset_rows reads train, or the first
            names = [str(n) for n in json.loads((p / "dataset_dict.json").read_text())["splits"]]
            split = split_read(names)
            others = [n for n in names if n != split]
        else:
            split, _, others = folder_split(p)
    except (OSError, ValueError, KeyError, IndexError, TypeError, ImportError, DatasetProblem):
        return ""  # the read itself reports what is wrong with the folder
    return f" (its {split} split; {', '.join(others)} left out)" if others else ""


class DatasetProblem(Exception):
    """The dataset as a whole cannot be read (``data-file``)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.message, self.fix = message, fix

    def diagnostic(self, path: str) -> Diagnostic:
        return Diagnostic(rule="data-file", loc=SourceLoc(path=path), message=self.message, fix=self.fix)
