"""A bucket of weights going out: its names known up front, each tensor gathered when it is taken.

A refit's sender packs a bucket into a byte buffer; were the bucket's full tensors gathered
first, its peak would be the buffers in flight plus one whole gathered bucket. Taken one at a
time, each full tensor is copied into the buffer and freed before the next is gathered: the
peak is the buffers plus the largest tensor. The gathers are collective, so every rank takes
every tensor of a bucket, in order, whether it uses it or not (``drain``): the producer drains
what a consumer left before it gathers the next bucket (``streaming.weight_buckets``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Pair = tuple[str, torch.Tensor]


class Bucket:
    """``(name, tensor)`` pairs, an iterator: each pair made when it is taken and held by the
    taker alone. ``names``: every name of the bucket, in order, before anything is taken."""

    __slots__ = ("_pairs", "names")

    def __init__(self, names: list[str], pairs: Iterator[Pair]) -> None:
        self.names = names
        self._pairs = pairs

    @classmethod
    def of(cls, pairs: list[Pair]) -> Bucket:
        """A bucket of tensors already made (the list is emptied as they are taken)."""
        return cls([name for name, _ in pairs], _popped(pairs))

    def __iter__(self) -> Bucket:
        return self

    def __next__(self) -> Pair:
        return next(self._pairs)

    def drain(self) -> None:
        """Take (make and drop) every pair not yet taken: a rank's part in the bucket's gathers."""
        for _ in self:
            pass


def one_by_one(bucket: Iterable[Pair]) -> Iterator[Pair]:
    """The pairs of ``bucket`` (a ``Bucket`` or a list, emptied as it goes), none held here once
    handed on."""
    if isinstance(bucket, list):
        return _popped(bucket)
    return iter(bucket)


def names_of(bucket: Iterable[Pair]) -> list[str]:
    """A bucket's names, nothing taken."""
    if isinstance(bucket, Bucket):
        return bucket.names
    assert isinstance(bucket, list), type(bucket)  # a generator's names cannot be read without taking
    return [name for name, _ in bucket]


def _popped(pairs: list[Pair]) -> Iterator[Pair]:
    pairs.reverse()
    while pairs:
        yield pairs.pop()
