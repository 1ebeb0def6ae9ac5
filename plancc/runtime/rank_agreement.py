"""Failures every rank agrees on: a problem on any rank is raised on every rank, at once.

A job's ranks meet in collectives. A rank that leaves on an exception of its own -- rank 0's
disk is full while it publishes a checkpoint, an export folder is read-only, a consumer of
streamed weights raised -- leaves its peers inside the next collective (a barrier, a gather)
until the process group's timeout, minutes later, with an error that names nothing, and only
the failing rank says why. So work that one rank does alone ends in one small all-reduce of a
flag instead of a barrier: when the flag is set, the problem's words are gathered and every
rank raises the same error, and every rank leaves at the same point (the next collective call
of every rank is then the same one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def group_device() -> str:
    """Where the default group's collectives take their tensors: CUDA under nccl, else the CPU."""
    return "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"


def first_problem(problem: str, device: str | None = None, *, at: int = 0) -> tuple[int, str] | None:
    """Collective: (rank, problem) of the earliest problem any rank has (``at``: where it arose,
    a bucket; ties go to the lowest rank), or None when no rank has one. One all-reduce when
    none does; the problems are gathered only when one does. Every rank gets the same answer, so
    every rank raises the same error, and none goes on to a collective the others skip."""
    if dist.get_world_size() == 1:  # a group of one agrees with itself: no collective, no device read
        return (0, problem) if problem else None
    flag = torch.tensor([int(bool(problem))], device=device or group_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    said: list[tuple[int, str]] = [(0, "")] * dist.get_world_size()
    dist.all_gather_object(said, (at, problem))
    _, rank, first = min((when, rank, what) for rank, (when, what) in enumerate(said) if what)
    return rank, first


def said(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def agreed(action: Callable[[], T], *, fail: Callable[[str], BaseException]) -> T:
    """Collective: ``action()`` on this rank, then every rank learns whether any rank's raised;
    when one did, every rank raises ``fail("rank R: <what it raised>")`` (the lowest such rank).
    Replaces the barrier that would follow such work: the agreement is one."""
    result: T | None = None
    problem = ""
    try:
        result = action()
    except Exception as exc:  # any failure of the file system or of the caller's work
        problem = said(exc)
    found = first_problem(problem)
    if found is not None:
        raise fail(f"rank {found[0]}: {found[1]}")
    return result  # type: ignore[return-value]  # set: the action raised on no rank


def on_rank0(action: Callable[[], T], *, fail: Callable[[str], BaseException]) -> T | None:
    """``agreed`` with ``action()`` on rank 0 alone (file work: publishing, pruning, writing an
    export). Returns rank 0's result there, None elsewhere."""
    return agreed(action if dist.get_rank() == 0 else lambda: None, fail=fail)
