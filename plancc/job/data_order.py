"""The order a training run reads its ``--data`` rows in: epoch after epoch, each epoch every
row once, shuffled by ``--seed`` (or in file order with ``--no-shuffle``).

The row a step reads is a pure function of (seed, step): the global batch of step ``s`` is
positions ``s*B ... s*B+B-1`` of the endless sequence epoch 0, epoch 1, ..., and epoch ``e``'s
order is a permutation drawn from a generator seeded with (seed, e). So a resumed run needs no
saved sampler state to read what the uninterrupted run would have read, on any layout (the
global batch is cut over dp ranks after it is chosen), and packing or a token budget cut the
shuffled batch as they would have cut it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

_EPOCH_SEED = 1_000_003  # keeps (seed, epoch) pairs apart: seed 0's epoch 1 is not seed 1's epoch 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RowOrder:
    """Which dataset row each position of the run's stream of rows is."""

    rows: int  # rows in one epoch (the dataset's)
    seed: int = 0
    shuffle: bool = True

    def row(self, position: int) -> int:
        epoch, index = divmod(position, self.rows)
        if not self.shuffle:
            return index
        return int(_permutation(self.rows, self.seed, epoch)[index])

    def batch(self, step: int, batch_size: int) -> list[int]:
        """The rows of step ``step``'s global batch (0-based step)."""
        return [self.row(step * batch_size + i) for i in range(batch_size)]

    def epoch_of(self, step: int, batch_size: int) -> float:
        """How many epochs the run has read after ``step`` steps (1.5: half way through the second)."""
        return step * batch_size / self.rows


def steps_for_epochs(epochs: float, *, rows: int, batch_size: int) -> int:
    """The steps that read ``epochs`` passes over ``rows`` rows, ``batch_size`` a step: the last
    step is whole (a global batch never shrinks: every layout's step is the same batch), so it may
    read up to ``batch_size - 1`` rows of the next epoch's order."""
    return max(1, math.ceil(epochs * rows / batch_size - 1e-9))


@lru_cache(maxsize=4)  # a step's batch spans at most a few epochs; a long run walks them in order
def _permutation(rows: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * _EPOCH_SEED + epoch)
    return torch.randperm(rows, generator=generator)
