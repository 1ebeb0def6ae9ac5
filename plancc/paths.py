"""Which paths of one command may not meet: an output written over an input or another output.

A run names its inputs (the plan, ``--data``, the model folder, the checkpoint to resume) and
its outputs (``--save``, ``--export-hf``, ``--metrics``, ``--tensorboard``, ``--out``, ``plot
-o``). Two of them naming one file -- through any spelling, a symbolic link or a hard link --
means the run writes over what it reads or what it wrote a moment before, so it is refused
before anything starts. A folder output that the run fills with files of fixed names (the
export) may also neither hold nor lie inside another of the run's paths.

Pure path logic, no torch: the CLI calls it before a process starts, ``plot`` as well.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import Diagnostic, SourceLoc

RULE = "path-overlap"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPath:
    """One path a command names: the flag that names it, and whether the command writes it."""

    flag: str
    path: str
    output: bool
    encloses: bool = False  # an output folder whose files the run writes by fixed names


def _real(path: str) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _same(a: str, b: str) -> bool:
    if _real(a) == _real(b):
        return True
    try:  # hard links: two names of one inode
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(inner: str, outer: str) -> bool:
    return _real(outer) in _real(inner).parents


def loops(path: str | Path) -> bool:
    """Whether resolving ``path`` meets a symbolic-link loop (ELOOP), in it or in a folder above
    it: such a path names no file or folder (pathlib's ``resolve`` raises a RuntimeError on it)."""
    try:
        os.stat(os.path.expanduser(str(path)))
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def is_stdout(path: str | Path) -> bool:
    """Whether ``path`` is the file this process's stdout writes to (same device and inode:
    ``/dev/stdout``, or the file stdout is redirected to)."""
    try:
        named, ours = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):  # no such file; a stdout without a file descriptor
        return False
    return (named.st_dev, named.st_ino) == (ours.st_dev, ours.st_ino)


def _loop_problem(path: RunPath) -> Diagnostic:
    return Diagnostic(
        rule="path-loop",
        loc=SourceLoc(path=path.path),
        message=f"{path.flag} {path.path}: its symbolic links loop (ELOOP), so it names no file or folder",
        fix=f"give {path.flag} a path without a link that points back at itself (ls -l shows the links)",
    )


def _problem(out: RunPath, other: RunPath, how: str) -> Diagnostic:
    what = "output" if other.output else "input"
    return Diagnostic(
        rule=RULE,
        loc=SourceLoc(path=out.path),
        message=f"{out.flag} {out.path} {how} {other.flag} {other.path} (an {what} of this run): "
        "it would be written over",
        fix=f"give {out.flag} a path of its own, apart from every input and output of the run",
    )


def overlaps(paths: Iterable[RunPath], *, allowed: Iterable[tuple[str, str]] = ()) -> list[Diagnostic]:
    """One problem for each output that names, holds or (for enclosing folders) lies inside
    another path of the run; ``allowed`` pairs of flags (``("--save", "--resume")``: a run
    resumes from its own checkpoint folder) may name the same or nested paths."""
    named = [p for p in paths if p.path]
    exempt = {frozenset(pair) for pair in allowed}
    found: list[Diagnostic] = [_loop_problem(p) for p in named if loops(p.path)]
    if found:  # a looping path names nothing: comparing it with the others means nothing either
        return found
    reported: set[frozenset[str]] = set()
    for out in (p for p in named if p.output):
        for other in named:
            pair = frozenset((out.flag, other.flag))
            if other is out or pair in exempt or pair in reported:
                continue
            how = ""
            if _same(out.path, other.path):
                how = "names the same file as"
            elif out.encloses and _inside(other.path, out.path):
                how = "is a folder that holds"
            elif (out.encloses or other.encloses) and _inside(out.path, other.path):
                how = "lies inside"
            if how:
                reported.add(pair)
                found.append(_problem(out, other, how))
    return found
