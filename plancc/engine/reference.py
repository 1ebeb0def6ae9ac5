"""The frozen reference's weights beside the policy's, and the swap ``reference_logprobs`` makes:
this rank's shard of every parameter, copied in before the reference's forward and the policy's
own put back bitwise after, each way one ``_foreach_copy_`` into buffers allocated once.

Where they live (``Policy(reference=...)``):

- ``"device"`` (``True``, the default): the reference on the parameters' device, in the compute
  dtype (``param_dtype``: FSDP casts the fp32 master to it for every forward, so a bf16 copy
  computes the same log-probs as an fp32 one, bitwise), and the policy's weights kept aside on
  the device during the call. Device memory: the reference (2 bytes a parameter in bf16) and the
  kept weights (4) a rank; no host round trip (verl keeps a bf16 reference on the device too).
- ``"host"``: both in host memory (pinned on CUDA, copies non-blocking): no device memory, the
  policy's weights to the host and back and the reference in, every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

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
    """The reference's copy of ``shards`` (this rank's storage of every parameter, in order) and
    the buffers the swap keeps the policy's own in."""

    def __init__(self, shards: list[torch.Tensor], *, place: str, dtype: torch.dtype | None = None) -> None:
        self.place = place
        cuda = bool(shards) and shards[0].is_cuda
        if place == "device":
            self.weights = [t.detach().to(dtype or t.dtype, copy=True) for t in shards]
            self.kept = [torch.empty_like(t) for t in shards]
        else:
            pin = cuda and torch.cuda.is_available()
            self.weights = [_host(t, pin) for t in shards]
            self.kept = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in shards]

    @contextmanager
    def swapped_into(self, shards: Callable[[], list[torch.Tensor]]) -> Iterator[None]:
        """The policy's shards (``shards()``: this rank's storage, resharded first, written in
        place) hold the reference inside; afterwards exactly what they held before. Every copy is
        on the current stream, in order: nothing waits on the host (it never reads the kept
        weights), pinned host buffers included."""
        with torch.no_grad():
            own = shards()
            torch._foreach_copy_(self.kept, own, non_blocking=True)
            torch._foreach_copy_(own, self.weights, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(shards(), self.kept, non_blocking=True)


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = t.detach().to("cpu", copy=True)
    return copy.pin_memory() if pin else copy
