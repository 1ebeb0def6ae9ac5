"""The learning rate of every step of a training run: linear warmup over ``--warmup-steps``, then
``--lr-schedule`` down to ``--min-lr`` at ``--schedule-steps`` (default: the run's total).

A function of the global step alone (``Policy.load`` restores the scheduler's position on
``--resume``), so a resumed run's rate at every step is the uninterrupted run's.

- ``constant``: the peak rate after warmup.
- ``linear``: straight down to the minimum.
- ``cosine``: half a cosine down to the minimum (the default, to 10% of ``--lr`` as before).
- ``wsd``: warmup-stable-decay (MiniCPM, torchtitan's ``decay_ratio``): the peak rate, then a
  linear decay to the minimum over the last ``WSD_DECAY`` of the steps after warmup.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine", "wsd"]
LR_SCHEDULES: tuple[LrSchedule, ...] = ("constant", "linear", "cosine", "wsd")
DEFAULT_MIN_RATIO = 0.1  # --min-lr unset: a decaying schedule ends at 10% of --lr
WSD_DECAY = 0.2  # wsd: the share of the post-warmup steps that decays


def lr_factor(step: int, *, schedule: LrSchedule, warmup: int, total: int, min_ratio: float) -> float:
    """The multiple of ``--lr`` at 0-based ``step`` (the rate the step's update uses)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        progress = max(0.0, (progress - (1 - WSD_DECAY)) / WSD_DECAY)
        schedule = "linear"
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def min_ratio_of(lr: float, min_lr: float | None) -> float:
    """``--min-lr`` as a multiple of ``--lr`` (unset: ``DEFAULT_MIN_RATIO``)."""
    if min_lr is None:
        return DEFAULT_MIN_RATIO
    return min_lr / lr if lr > 0 else 0.0


def describe(schedule: LrSchedule, *, lr: float, min_lr: float | None, warmup: int, total: int) -> str:
    """The schedule in one phrase of the run's log."""
    floor = lr * min_ratio_of(lr, min_lr)
    warm = f"warmup {warmup} step{'s' if warmup != 1 else ''}, " if warmup else ""
    if schedule == "constant":
        return f"lr {lr:g}: {warm}then constant"
    shape = f"wsd (stable, then linear over the last {WSD_DECAY:.0%})" if schedule == "wsd" else schedule
    return f"lr {lr:g}: {warm}then {shape} to {floor:.3g} at step {total}"
