"""Rows of integers (token ids, loss masks) kept in a file and read through a memory map: a
dataset larger than memory is read, checked and handed to the workers row by row, and only
each row's offset (8 bytes) stays in memory.

``RowsWriter`` appends rows to a file of its own (in a temporary folder removed with the rows);
``TokenRows`` is the read-only sequence of them: ``rows[i]`` is a tuple, ``len(rows)`` the count,
``rows.lengths()`` every row's length without reading one. The same layout, with a header, is the file
a launcher hands its workers (``job.data.write_tokens``), which they map in place.
"""

from __future__ import annotations

import mmap
import shutil
import tempfile
import weakref
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, overload

FLUSH = 1 << 20  # values buffered before they go to the file


class TokenRows(Sequence[Any]):
    """Rows ``offsets[i]:offsets[i+1]`` of a flat array of ``code`` (``q``: int64, ``b``: int8)
    values at ``start`` bytes into ``path``. ``present``: per row, 0 where the row is None (a
    record without a loss mask), or None when every row is there."""

    def __init__(self, path: Path, offsets: array, code: str, *, start: int = 0, present: array | None = None) -> None:
        self.path, self.offsets, self.code, self.start, self.present = path, offsets, code, start, present
        self._view: memoryview | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if self.present is not None and not self.present[index]:
            return None
        return tuple(self._values()[self.offsets[index] : self.offsets[index + 1]])

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Rows equal a tuple (or list) of the same rows, as the tuples they stand for."""
        if isinstance(other, (tuple, list, TokenRows)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a view of a file, compared by value: not a key

    def lengths(self) -> Iterator[int]:
        return (self.offsets[i + 1] - self.offsets[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] * array(self.code).itemsize

    def fold_into(self, digest: Any) -> None:
        """Every row's values and bounds into a ``hashlib`` digest (the file read in pieces)."""
        digest.update(self.offsets.tobytes())
        if self.present is not None:
            digest.update(self.present.tobytes())
        self.copy_to(SimpleNamespace(write=digest.update))

    def copy_to(self, out: Any) -> None:
        """The flat values, written to an open binary file (in pieces: never all in memory)."""
        with open(self.path, "rb") as f:
            f.seek(self.start)
            left = self.nbytes
            while left:
                piece = f.read(min(left, 16 << 20))
                out.write(piece)
                left -= len(piece)

    def _values(self) -> memoryview:
        if self._view is None:
            if self.nbytes == 0:
                self._view = memoryview(array(self.code))
            else:
                with open(self.path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._view = memoryview(mapped)[self.start : self.start + self.nbytes].cast(self.code)  # type: ignore[call-overload]
        return self._view


class RowsWriter:
    """Appends rows to a file of its own; ``finish()`` gives them as ``TokenRows``."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.folder = Path(tempfile.mkdtemp(prefix="plancc-rows-"))
        self.path = self.folder / "rows"
        self._file = open(self.path, "wb")  # noqa: SIM115  # closed by finish()
        self._buffer = array(code)
        self.offsets = array("q", [0])
        self.present = array("b")
        self._count = 0  # values appended

    def append(self, values: Sequence[int] | None) -> None:
        """One row (None: a row that is not there, as a record without a mask)."""
        self.present.append(values is not None)
        if values is not None:
            self._buffer.extend(values)
            self._count += len(values)
        self.offsets.append(self._count)
        if len(self._buffer) >= FLUSH:
            self._flush()

    def _flush(self) -> None:
        self._buffer.tofile(self._file)
        self._buffer = array(self.code)

    def finish(self, *, keep_absent: bool = False) -> TokenRows:
        self._flush()
        self._file.close()
        rows = TokenRows(self.path, self.offsets, self.code, present=self.present if keep_absent else None)
        weakref.finalize(rows, shutil.rmtree, self.folder, True)  # the file goes with the rows
        return rows

    def discard(self) -> None:
        self._file.close()
        shutil.rmtree(self.folder, ignore_errors=True)
