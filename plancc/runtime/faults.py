"""Fault injection for the reliability tests (and for rehearsing failures on a real cluster).

``PLANCC_FAULT`` holds ``POINT:ACTION@RANK[#STEP]`` entries, comma separated:

- POINT: ``train`` (before a training step), ``loss`` (the loss a step computed), ``save``
  (after a checkpoint's shards are written, before it is made visible), ``meta`` (writing
  its plancc.json), ``publish`` (after an existing copy of the same step was moved aside,
  before the new one is moved in), ``latest`` (after the new ``latest`` is written to a
  temporary file, before it replaces the old one), ``prune`` (before an old step beyond
  ``--keep`` is removed), ``export`` (before an export's files are written), ``gather`` (before a bucket of weights is
  gathered for the rollout engine), ``send`` (before a bucket -- resharded: a transfer -- goes
  over a weight channel) or
  ``pack`` (before a bucket is packed for a colocated consumer)
- ACTION: ``raise`` (an exception: a failing rank), ``readonly`` (the ``OSError`` a read-only
  or full file system gives, EROFS), ``kill`` (SIGKILL: a lost process),
  ``stop`` (SIGSTOP: a frozen process, as a stuck host or a debugger leaves it; SIGCONT resumes
  it), ``hog`` (allocate host memory until the kernel's OOM killer ends the process; only
  inside a memory cgroup limited below ``HOG_LIMIT``, never on a whole machine) or, at
  ``loss`` only, ``nan`` (the loss becomes NaN: a diverging run)
- RANK: the global rank that fails; STEP (train, loss, gather, send, pack only): the 1-based
  step (gather, send, pack: the bucket; a resharded send: the transfer)

Unset, it costs one environment lookup per call.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator

from .rank_memory import memory_limit


def _entries(point: str, rank: int, step: int | None) -> Iterator[tuple[str, str]]:
    """(action, entry) of every fault aimed at this point, rank and step."""
    spec = os.environ.get("PLANCC_FAULT")
    if not spec:
        return
    for entry in spec.split(","):
        where, _, target = entry.strip().partition("@")
        f_point, _, action = where.partition(":")
        f_rank, _, f_step = target.partition("#")
        if f_point == point and int(f_rank) == rank and not (f_step and step is not None and int(f_step) != step):
            yield action, entry.strip()


def inject(point: str, *, rank: int, step: int | None = None) -> None:
    for action, entry in _entries(point, rank, step):
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if action == "hog":
            _hog(entry)
        if action == "readonly":
            raise OSError(errno.EROFS, f"Read-only file system (injected: {entry})")
        if action == "raise":
            raise RuntimeError(
                f"injected failure ({entry}) on rank {rank}" + (f" at step {step}" if step is not None else "")
            )


HOG_LIMIT = 8 << 30


def _hog(entry: str) -> None:
    """Touch 64 MiB after 64 MiB until the OOM killer ends this process -- refused (raised)
    unless a memory cgroup below ``HOG_LIMIT`` bounds it."""
    limit = memory_limit()
    if limit is None or limit >= HOG_LIMIT:
        raise RuntimeError(f"{entry}: refused outside a memory cgroup limited below {HOG_LIMIT >> 30} GiB")
    held = []
    while True:
        block = bytearray(64 << 20)  # zero pages the kernel has not given yet: each page written
        block[::4096] = b"\1" * len(range(0, len(block), 4096))
        held.append(block)


def poisoned(point: str, *, rank: int, step: int | None = None) -> bool:
    """Whether a ``nan`` fault is aimed here (the caller makes its value NaN)."""
    return any(action == "nan" for action, _ in _entries(point, rank, step))
