"""The frozen reference's weights beside the policy's, and the swap ``reference_logprobs`` makes.

Where they live (``Policy(reference=...)``):

- ``"device"`` (``True``, the default): the reference on the parameters' device, in the compute
  dtype (``param_dtype``: FSDP casts the fp32 master to it for every forward, so a bf16 copy
  computes the same log-probs as an fp32 one, bitwise); no host round trip (verl keeps a bf16
  reference on the device too). Device memory: the reference, 2 bytes a parameter in bf16, a
  rank. The swap moves no bytes: FSDP2 all-gathers each parameter from one flat tensor of this
  rank's shard (``FSDPParam._sharded_param_data``), and for the reference's forward that tensor
  is the reference's -- one attribute a parameter exchanged before and after, the policy's own
  storage untouched (before: every parameter copied aside, the reference copied in, the policy's
  copied back, three passes over a rank's shards a call, and a buffer the size of the shards).
  A model with a parameter FSDP does not hold swaps by copies, as ``"host"`` does, into device
  buffers allocated once.
- ``"host"``: both in host memory (pinned on CUDA, copies non-blocking): no device memory, the
  policy's weights to the host and back and the reference in, every call, each way one
  ``_foreach_copy_``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .shards import back_to_shards, fsdp_units, local_shards

PLACES = ("device", "host")


def reference_place(reference: bool | str) -> str | None:
    """``Policy(reference=...)`` as a place, or None for no reference."""
    if reference is False or reference is None:
        return None
    if reference is True:
        return "device"
    if reference not in PLACES:
        raise ValueError(f"reference={reference!r}: one of True, False, {', '.join(repr(p) for p in PLACES)}")
    return str(reference)


class ReferenceWeights:
    """The reference's copy of ``model``'s weights as they are now (this rank's shard of each
    parameter), and how ``reference_logprobs`` puts it in the policy's place."""

    def __init__(self, model: nn.Module, *, place: str, dtype: torch.dtype | None = None) -> None:
        self.place = place
        self.held = _fsdp_params(model) if place == "device" else None
        if self.held is not None:  # the flat shards FSDP gathers from, swapped by reference
            flats: list[torch.Tensor] = [held._sharded_param_data for held in self.held]
            self.weights = [flat.detach().to(dtype or flat.dtype, copy=True) for flat in flats]
            self.kept: list[torch.Tensor] = []
            return
        shards = local_shards(model)
        if place == "device":
            self.weights = [t.detach().to(dtype or t.dtype, copy=True) for t in shards]
            self.kept = [torch.empty_like(t) for t in shards]
        else:
            pin = bool(shards) and shards[0].is_cuda and torch.cuda.is_available()
            self.weights = [_host(t, pin) for t in shards]
            self.kept = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in shards]

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps on the parameters' device (none in place ``"host"``): what
        ``Policy.offload`` moves to the host with the parameters, so that an offloaded policy
        leaves the device to the rollout engine whole."""
        return [*self.weights, *self.kept] if self.place == "device" else []

    @contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[None]:
        """``model`` computes with the reference inside; afterwards its weights are exactly what
        they were. Every FSDP unit is back to its shards on both sides of the swap, so no
        gathered copy of one set of weights is used in place of the other."""
        if self.held is not None:
            back_to_shards(model)
            self._exchange()
            try:
                yield
            finally:
                back_to_shards(model)
                self._exchange()
            return
        # by copies, each on the current stream in order: nothing waits on the host (it never
        # reads the kept weights), pinned host buffers included
        with torch.no_grad():
            own = local_shards(model)
            torch._foreach_copy_(self.kept, own, non_blocking=True)
            torch._foreach_copy_(own, self.weights, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(local_shards(model), self.kept, non_blocking=True)

    def _exchange(self) -> None:
        """Each held parameter's flat shard and the reference's traded places."""
        assert self.held is not None
        for index, held in enumerate(self.held):
            held._sharded_param_data, self.weights[index] = self.weights[index], held._sharded_param_data


def _fsdp_params(model: nn.Module) -> list[Any] | None:
    """Every parameter's ``FSDPParam`` in ``model.parameters()`` order, or None when some
    parameter is not held by FSDP, or held in a way whose gather does not read its flat shard
    (a tensor subclass with its own pre-all-gather)."""
    back_to_shards(model)
    found = {}
    for _, group in fsdp_units(model):
        for held in group.fsdp_params if group is not None else ():
            found[id(held.sharded_param)] = held
    every = [found.get(id(param)) for param in model.parameters()]
    if any(held is None or hasattr(held._sharded_local_tensor, "fsdp_pre_all_gather") for held in every):
        return None
    return every


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = t.detach().to("cpu", copy=True)
    return copy.pin_memory() if pin else copy
