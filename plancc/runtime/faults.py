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
  it) or, at ``loss`` only, ``nan`` (the loss becomes NaN: a diverging run)
- RANK: the global rank that fails; STEP (train, loss, gather, send, pack only): the 1-based
  step (gather, send, pack: the bucket; a resharded send: the transfer)

Unset, it costs one environment lookup per call.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator


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
        if action == "readonly":
            raise OSError(errno.EROFS, f"Read-only file system (injected: {entry})")
        if action == "raise":
            raise RuntimeError(
                f"injected failure ({entry}) on rank {rank}" + (f" at step {step}" if step is not None else "")
            )


def poisoned(point: str, *, rank: int, step: int | None = None) -> bool:
    """Whether a ``nan`` fault is aimed here (the caller makes its value NaN)."""
    return any(action == "nan" for action, _ in _entries(point, rank, step))
