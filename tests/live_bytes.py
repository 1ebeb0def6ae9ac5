"""The peak bytes of the tensors torch ops create while a block runs, counted by storage: a
storage counts from the op that made it until the last tensor object on it is gone. Storages
that existed before (the model's parameters and buffers, and views of them) are not counted.
Deterministic, unlike the process's resident memory: it measures what a piece of code holds,
not what the allocator kept. C++-internal buffers (a collective's own scratch) are not seen."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) is torch.Tensor and not t.is_meta:
                self._track(t)
        return out

    def _track(self, t):
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except RuntimeError:  # no storage of its own to count
            return
        if key == 0 or key in self.existing:
            return
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]
