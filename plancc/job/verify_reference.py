"""The unsharded model ``--verify`` trains beside the policy, in about the memory of the
policy itself rather than six times it.

The comparison needs the whole model's fp32 weights and gradients on every rank: each rank
compares its own shards with them. What it does not need is the rest of what a naive reference
holds, so:

* **the batch in chunks**: the reference runs the global batch a few rows at a time and sums
  the chunks' gradients (each chunk's NLL sum divided by the whole batch's token count: the
  one-pass mean's gradient, rounded differently only in the order of a sum, far below the
  1e-5 bars). A chunk holds no more logits than one rank of the policy does;
* **AdamW's moments split over the ranks**: every element's update is its own (AdamW is
  elementwise once the gradients are clipped, and the clip's norm is computed on every rank
  from the whole gradients), so each rank steps a 1/world slice of every tensor and the slices
  are broadcast back: 8/world bytes a parameter instead of 8, the same numbers;
* **the clip's norm summed in fp64**: torch's fp32 norm of a vocabulary-sized embedding's
  gradient is off by up to 3e-5 relative (Qwen3's 152k rows), and clipping scales every
  gradient by it; the sharded model's norm, summed over shards, is closer. The reference is
  meant to be the nearer one to exact;
* **fp64 only when fp32 misses**: what fp32 itself rounds away (the floor the bars widen to
  on models with large cancelling sums) is measured on an fp64 copy only when the fp32
  comparison misses its fixed bar, not on every run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dataflow import batched_experts
from ..engine.batches import default_token_mask
from ..engine.param_groups import trained_parameters

Batch = dict[str, torch.Tensor]


def nll_sum(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next-token NLL summed over the positions ``Policy`` counts, how many it counted):
    ``token_mask`` where the data has one, else ``default_token_mask``."""
    lp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    counted = (token_mask if token_mask is not None else default_token_mask(mask))[:, 1:].to(lp.dtype)
    return -(lp * counted).sum(), counted.sum()


def token_mean_loss(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean next-token NLL of the whole batch over the positions ``Policy`` counts: what
    ``token_nll`` sums to over every microbatch and rank."""
    total, count = nll_sum(logits, ids, mask, token_mask)
    return total / count


LOGITS_BUDGET = 64 << 20  # bytes of fp32 logits the reference holds at a time (above one row's)


def reference_chunk_rows(rows: int, seq_len: int, vocab: int) -> int:
    """How many rows of the global batch the reference runs at a time: as many as keep their
    fp32 logits within ``LOGITS_BUDGET`` (one at least). A tiny vocabulary runs the batch in one
    pass; a 152k one a row or two at a time, far less than any rank of the policy holds."""
    return max(1, min(rows, LOGITS_BUDGET // max(1, seq_len * vocab * 4)))


def _chunks(rows: int, size: int) -> list[slice]:
    return [slice(start, min(rows, start + size)) for start in range(0, rows, size)]


def _forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def _count(batch: Batch) -> torch.Tensor:
    """The whole batch's counted positions (the denominator every chunk's sum is divided by)."""
    counted = batch["token_mask"] if "token_mask" in batch else default_token_mask(batch["attention_mask"])
    return counted[:, 1:].sum()


def chunked_backward(model: nn.Module, batch: Batch, chunk_rows: int) -> float:
    """The batch's mean NLL under ``model``, its gradient accumulated into ``model``'s ``.grad``
    a chunk of rows at a time."""
    count = _count(batch).to(torch.float64 if _dtype(model) == torch.float64 else torch.float32)
    total = 0.0
    for rows in _chunks(batch["input_ids"].shape[0], chunk_rows):
        part = {name: value[rows] for name, value in batch.items()}
        chunk_sum, _ = nll_sum(_forward(model, part), part["input_ids"], part["attention_mask"], part.get("token_mask"))
        (chunk_sum / count).backward()
        total += chunk_sum.item()
    return total / count.item()


@torch.no_grad()
def chunked_loss(model: nn.Module, batch: Batch, chunk_rows: int) -> float:
    """The batch's mean NLL under ``model``, a chunk of rows at a time, without gradients."""
    total = 0.0
    for rows in _chunks(batch["input_ids"].shape[0], chunk_rows):
        part = {name: value[rows] for name, value in batch.items()}
        chunk_sum, _ = nll_sum(_forward(model, part), part["input_ids"], part["attention_mask"], part.get("token_mask"))
        total += chunk_sum.item()
    return total / _count(batch).item()


@torch.no_grad()
def chunked_logits(model: nn.Module, batch: Batch, chunk_rows: int) -> torch.Tensor:
    """``model``'s logits of the batch's rows, computed a chunk of rows at a time."""
    parts = []
    for rows in _chunks(batch["input_ids"].shape[0], chunk_rows):
        parts.append(_forward(model, {name: value[rows] for name, value in batch.items()}))
    return torch.cat(parts)


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def clip_exactly(model: nn.Module, max_norm: float) -> float:
    """``clip_grad_norm_`` with the norm summed in fp64, a slice of each gradient at a time
    (no fp64 copy of a whole embedding's gradient); the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        for part in grad.reshape(-1).split(1 << 22):
            squares += part.double().square().sum().cpu()
    norm = float(squares.sqrt())
    scale = clip_scale(norm, max_norm)
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return norm


def clip_scale(norm: float, max_grad_norm: float) -> float:
    """What ``clip_grad_norm_`` multiplies the gradients by, given the norm before clipping (a
    ``max_grad_norm`` of 0 clips nothing, as ``Policy``'s)."""
    if not max_grad_norm:
        return 1.0
    return min(1.0, max_grad_norm / (norm + 1e-6))


class SplitAdamW:
    """AdamW over a model whose weights every rank holds whole, with each rank keeping the
    moments of a 1/world slice of every tensor (its flat elements ``[a, b)``) and the stepped
    slices broadcast back to every rank after each step.

    The slices are views of the weights, so the optimizer updates them in place; a step is
    the whole model's AdamW step, computed once over the ranks instead of on every one."""

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float | None) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.views: dict[str, nn.Parameter] = {}
        for name, p in self.named:
            a, b = self._bounds(p.numel(), self.rank)
            self.views[name] = nn.Parameter(p.detach().view(-1)[a:b])
        groups = trained_parameters(model, weight_decay)
        by_id = {id(p): name for name, p in self.named}
        mine: list[Any] = [
            {**g, "params": [self.views[by_id[id(p)]] for p in g["params"]]}
            if isinstance(g, dict)
            else self.views[by_id[id(g)]]
            for g in groups
        ]
        self.optimizer = torch.optim.AdamW(mine, lr=lr)

    def _bounds(self, numel: int, rank: int) -> tuple[int, int]:
        per = math.ceil(numel / self.world)
        return min(numel, rank * per), min(numel, (rank + 1) * per)

    def load(self, state: dict[str, Any], lr: float) -> None:
        """Take this rank's slices of a whole optimizer state (``get_optimizer_state_dict``'s full
        form, keyed by parameter name), at the rate ``lr`` (as ``Policy.load`` keeps this run's)."""
        for name, p in self.named:
            whole = state["state"].get(name)
            if whole is None:
                continue
            a, b = self._bounds(p.numel(), self.rank)
            self.optimizer.state[self.views[name]] = {
                key: value.clone() if key == "step" else value.reshape(-1)[a:b].clone().to(p.device)
                for key, value in whole.items()
            }
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Step this rank's slices, from the whole (clipped) gradients, then hand every slice to
        every rank; the gradients are cleared."""
        for name, p in self.named:
            view = self.views[name]
            if p.grad is None:
                view.grad = None
                continue
            a, b = self._bounds(p.numel(), self.rank)
            view.data = p.data.view(-1)[a:b]  # the weights' storage now (the fp64 look replaces it)
            view.grad = p.grad.reshape(-1)[a:b]
        self.optimizer.step()
        for name, p in self.named:
            flat = p.data.view(-1)
            for owner in range(self.world):
                a, b = self._bounds(p.numel(), owner)
                if b > a:
                    dist.broadcast(flat[a:b], src=owner)
            p.grad = None
            self.views[name].grad = None


@contextmanager
def in_fp64(model: nn.Module, wanted: set[str]) -> Iterator[None]:
    """``model`` in fp64 for a while, in place (fp32 -> fp64 -> fp32 is exact), its gradients put
    aside and only the parameters ``wanted`` taking new ones; afterwards every tensor is back
    in its dtype with its gradient. An fp64 copy beside it would hold twice the weights and all
    the gradients again."""
    dtypes: dict[int, torch.dtype] = {}
    grads: dict[int, torch.Tensor | None] = {}
    flags: dict[int, bool] = {}
    tensors = [p for _, p in model.named_parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    for name, p in model.named_parameters():
        grads[id(p)], flags[id(p)] = p.grad, p.requires_grad
        p.grad = None
        p.requires_grad_(name in wanted)
    for t in tensors:
        if t.is_floating_point():
            dtypes[id(t)] = t.dtype
            t.data = t.data.double()
    try:
        yield
    finally:
        for t in tensors:
            if id(t) in dtypes:
                t.data = t.data.to(dtypes[id(t)])
        for p in model.parameters():
            p.grad = grads[id(p)]
            p.requires_grad_(flags[id(p)])


def fp64_floor(
    reference: nn.Module, batch: Batch, *, wanted: set[str], clip_scale: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(the first row's logits, the ``wanted`` parameters' gradients times ``clip_scale``) of
    ``reference`` in fp64 (at its current weights) on ``batch``, a row at a time: what fp32
    rounds away.
    None where the model cannot run in fp64 (a modeling file that computes in fp32 on purpose,
    a router casting its input)."""
    with in_fp64(reference, wanted):
        try:
            with batched_experts(reference):
                if wanted:  # (only the logits missed: no gradients to take)
                    chunked_backward(reference, batch, 1)
                logits = chunked_logits(reference, {name: value[:1] for name, value in batch.items()}, 1)
        except RuntimeError:
            return None
        # the clip's scale is the fp32 run's (its norm is over every gradient, and the parameters
        # not wanted took none here), itself summed in fp64: the floor is fp32's error in the
        # gradients, as the scale is the same on both sides
        grads = {n: p.grad * clip_scale for n, p in reference.named_parameters() if p.grad is not None}
    return logits, grads
