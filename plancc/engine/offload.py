"""Device memory of a parallelized model and its optimizer, to pinned host memory and back.

Not ``module.to("cpu")``: that makes new tensors, FSDP2 then re-pads every sharded parameter
into fresh (pageable) storage, and the optimizer's references must be rebuilt. Instead every
device storage behind a parameter, a gradient or an optimizer state is copied into pinned host
memory and resized to nothing; ``onload`` gives it its size back and copies the bytes in. Every
tensor object -- FSDP's sharded parameters, the views into them, the optimizer's state -- stays
the one it was, so training goes on bitwise as if nothing happened (the way verl and NeMo-RL
free an FSDP model's memory between phases)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.local_tensors import local_tensor


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The model's parameters, their gradients and its buffers, as the local tensors that own
    device storage."""
    for param in model.parameters():
        yield local_tensor(param)
        if param.grad is not None:
            yield local_tensor(param.grad)
    for buffer in model.buffers():
        yield local_tensor(buffer)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The optimizer's state (AdamW's moments: twice the parameters' bytes)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield local_tensor(value)


def release_cached_memory() -> None:
    """Hand the memory freed by an offload back to the driver. Resizing a storage to nothing
    returns its block to torch's caching allocator, which keeps it for this process: another
    process on the GPU (a colocated vLLM / SGLang) could not allocate it. No-op without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class HostCopy:
    """The device storages a model and its optimizer hold, kept in pinned host memory while
    offloaded."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    copies: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def offload(cls, tensors: Iterator[torch.Tensor], reuse: list[torch.Tensor] | None = None) -> HostCopy:
        """Copy and free; ``reuse``: the pinned buffers of an earlier offload, taken again where
        the sizes match (allocating pinned memory is most of an offload's time)."""
        kept = cls()
        seen: set[int] = set()
        spare = list(reuse or [])
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.device.type == "cpu" or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            index = len(kept.copies)
            if index < len(spare) and spare[index].numel() == raw.numel():
                host = spare[index]
            else:
                host = torch.empty(raw.shape, dtype=torch.uint8, device="cpu", pin_memory=True)
            host.copy_(raw, non_blocking=True)
            kept.storages.append(storage)
            kept.copies.append(host)
        if kept.storages:
            torch.cuda.synchronize()  # the copies are done before the storages go
        for storage in kept.storages:
            storage.resize_(0)
        return kept

    def onload(self) -> list[torch.Tensor]:
        """Give every storage its bytes back; returns the pinned buffers, for the next offload."""
        for storage, host in zip(self.storages, self.copies, strict=True):
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=True)
        if self.storages:
            torch.cuda.synchronize()
        buffers, self.storages, self.copies = self.copies, [], []
        return buffers


_PART_NAMES = {"params": "parameters", "optimizer": "optimizer state"}
# the Policy calls that check what is offloaded, by index in the ranks' agreement
_CALLS = (
    "train",
    "logprobs",
    "logits",
    "reference_logprobs",
    "weights",
    "send_weights",
    "share_weights",
    "export_hf",
    "save",
    "load",
)


class Offloader:
    """The memory role of ``plancc.Policy``: which parts of a model and its optimizer are in host
    memory now, and the pinned buffers a later ``offload`` reuses (pinning is the slow part)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        beside_params: Callable[[], Iterable[torch.Tensor]] = tuple,
        device: str | torch.device = "cpu",
    ) -> None:
        """``beside_params``: device tensors that go with the parameters (a device reference's
        weights: ``ReferenceWeights.device_tensors``); ``device``: the policy's (where the ranks'
        agreement on what is offloaded is gathered)."""
        self.model, self.optimizer, self.beside_params = model, optimizer, beside_params
        self.device = device
        self._host: dict[str, HostCopy] = {}  # while offloaded, per part ("params", "optimizer")
        self._pinned: dict[str, list[torch.Tensor]] = {}

    @property
    def offloaded(self) -> list[str]:
        """The parts in host memory now, by name (empty when everything is on the device)."""
        return sorted(self._host)

    def require_onloaded(self, what: str, *, optimizer: bool = False) -> None:
        """Raise when what ``Policy.what`` reads is in host memory on any rank: the parameters
        always, the optimizer's state when ``optimizer`` (a training step, a checkpoint). Log-probs
        and weights out run with the optimizer's state alone offloaded (a colocated engine short
        of memory keeps it on the host until the next step).

        Agreed by every rank before the call's first collective (one gather of each rank's call
        and parts away): ``offload()`` called on some ranks only, or ranks calling different
        methods, are one error on every rank -- not one rank refusing while its peers wait in a
        collective it never joins (a hang, or "Connection closed by peer")."""
        mine = [
            _CALLS.index(what) if what in _CALLS else len(_CALLS),
            "params" in self._host,
            "optimizer" in self._host,
        ]
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            local = torch.tensor(mine, dtype=torch.int64, device=self.device)
            every = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(every, local)
            rows = torch.stack(every).tolist()
        calls = {row[0] for row in rows}
        if len(calls) > 1:
            said = ", ".join(
                f"rank {r} {_CALLS[row[0]] if row[0] < len(_CALLS) else '?'}" for r, row in enumerate(rows)
            )
            raise RuntimeError(
                f"Policy.{what}: the ranks called different methods ({said}); every rank of a policy makes "
                "the same calls in the same order"
            )
        away = [part for i, part in enumerate(("params", "optimizer"), start=1) if any(row[i] for row in rows)]
        away = [part for part in away if optimizer or part == "params"]
        if away:
            names = " and ".join(_PART_NAMES[part] for part in away)
            verb = "are" if away[0] == "params" else "is"  # "parameters ... are", "optimizer state is"
            index = 1 if away[0] == "params" else 2
            ranks = [r for r, row in enumerate(rows) if row[index]]
            where = (
                ""
                if len(ranks) == len(rows)
                else f" on rank{'s' if len(ranks) > 1 else ''} "
                + ", ".join(map(str, ranks))
                + " (offload() was called there alone)"
            )
            raise RuntimeError(f"Policy.{what}: the policy's {names} {verb} offloaded{where}; call onload() first")

    def offload(self, *, params: bool, optimizer: bool) -> None:
        """The chosen parts to pinned host memory, the freed device memory back to the driver.
        The caller reshards the model first (an FSDP unit's gathered copy is no parameter)."""
        for part, wanted in (("params", params), ("optimizer", optimizer)):
            if wanted and part not in self._host:
                self._host[part] = HostCopy.offload(self.tensors(part), reuse=self._pinned.get(part))
        release_cached_memory()

    def tensors(self, part: str) -> Iterator[torch.Tensor]:
        """The tensors of ``part`` ("params": the model's with what goes beside them; "optimizer":
        its state) whose device storage an offload moves."""
        if part == "params":
            yield from model_tensors(self.model)
            yield from self.beside_params()
        else:
            yield from optimizer_tensors(self.optimizer)

    def onload(self) -> None:
        """Every part back where it was (every tensor object the same)."""
        for part in list(self._host):
            self._pinned[part] = self._host.pop(part).onload()  # kept for the next offload
