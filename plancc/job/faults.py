"""Fault injection for the reliability tests (and for rehearsing failures on a real cluster).

``PLANCC_FAULT`` holds ``POINT:ACTION@RANK[#STEP]`` entries, comma separated:

- POINT: ``train`` (before a training step) or ``save`` (after the checkpoint's shards are
  written, before the checkpoint is made visible)
- ACTION: ``raise`` (an exception: a failing rank) or ``kill`` (SIGKILL: a lost process)
- RANK: the global rank that fails; STEP (train only): the 1-based step

Unset, it costs one environment lookup per call.
"""

from __future__ import annotations

import os
import signal


def inject(point: str, *, rank: int, step: int | None = None) -> None:
    spec = os.environ.get("PLANCC_FAULT")
    if not spec:
        return
    for entry in spec.split(","):
        where, _, target = entry.strip().partition("@")
        f_point, _, action = where.partition(":")
        f_rank, _, f_step = target.partition("#")
        if f_point != point or int(f_rank) != rank or (f_step and step is not None and int(f_step) != step):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(
            f"injected failure ({entry.strip()}) on rank {rank}" + (f" at step {step}" if step is not None else "")
        )
