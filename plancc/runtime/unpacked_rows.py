"""transformers' packed-sequence check, answered from the host when plancc knows the answer.

Given no attention mask, transformers' mask builder asks whether the position ids hold several
documents packed into one row (``masking_utils.find_packed_sequence_indices``) and reads the
answer from the device: the host waits there for every kernel queued before it -- at the start
of each forward, while the last step's optimizer may still run -- and the device then idles while
the host catches up. When plancc calls a model with no position ids and no context parallelism,
the model (or the sequence-parallel pre-hook) makes them ``arange(seq)`` for every row, whose
answer is known: not packed, the value transformers' check returns for them. Inside
``unpacked_rows`` that answer is given without the read; everywhere else transformers' own check
runs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers import masking_utils

from .cp_context import context_of

_KNOWN_UNPACKED: ContextVar[bool] = ContextVar("plancc_known_unpacked", default=False)


@contextmanager
def unpacked_rows(model: nn.Module, inputs: Mapping[str, Any]) -> Iterator[None]:
    """A forward of ``model`` on ``inputs`` in which transformers takes its rows as not packed
    without reading the device -- when that is what its check would find: no position ids
    given (each row's are made ``0 .. seq - 1``) and no cp context (whose pre-hook hands the
    model a shard's positions)."""
    known = inputs.get("position_ids") is None and inputs.get("cu_seqlens") is None and context_of(model) is None
    if not known:
        yield
        return
    _install()
    token = _KNOWN_UNPACKED.set(True)
    try:
        yield
    finally:
        _KNOWN_UNPACKED.reset(token)


# transformers' own check, as imported (the wrapper below takes its place in ``masking_utils``);
# a release without it has nothing to answer: the hint is then nothing
_transformers_check = getattr(masking_utils, "find_packed_sequence_indices", None)


def _answered(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' ``find_packed_sequence_indices``: None inside ``unpacked_rows``, its own
    answer everywhere else."""
    if _KNOWN_UNPACKED.get() or _transformers_check is None:
        return None
    return _transformers_check(position_ids)


def _install() -> None:
    """The wrapper in transformers' place, once per process (transformers looks the check up by
    name when it builds a mask, so the wrapper is what it calls)."""
    if _transformers_check is not None and masking_utils.find_packed_sequence_indices is not _answered:
        masking_utils.find_packed_sequence_indices = _answered
