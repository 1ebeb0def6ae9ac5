"""What the last pipeline stage does with its microbatch's output (``engine.pipelined``): the
caller's loss on its rows' log-probs (``LastStageLoss``), or the log-probs, entropy or logits
kept for the caller (``LastStageLogprobs``, ``LastStageLogits``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from ..runtime.pipeline import PipelineRunner
from .batches import BatchError
from .loss_contract import call_loss
from .pipeline_rows import RowGroup

Loss = Callable[[torch.Tensor, dict[str, torch.Tensor], Any], Any]


class Recorded:
    """What the last stage's loss function saw over a step: the loss and metrics (device
    scalars, read once at the end) and the first refusal of the caller's function."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.metrics: dict[str, torch.Tensor | float] = {}
        self.problem = ""


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[rows, L]`` log p(ids[t] | ids[<t]) from the last stage's logits (0 at position 0);
    vocab-sharded logits through the vocab-parallel cross entropy."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    targets = ids[:, 1:]
    if isinstance(scaled, DTensor):
        with loss_parallel():
            nll: Any = nn.functional.cross_entropy(
                scaled[:, :-1].flatten(0, 1),
                DTensor.from_local(targets.flatten(), scaled.device_mesh, [Replicate()]),
                reduction="none",
            )
            picked = -nll.full_tensor()
    else:
        picked = -nn.functional.cross_entropy(scaled[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    return torch.cat([torch.zeros_like(picked.view(ids.shape[0], -1)[:, :1]), picked.view(ids.shape[0], -1)], 1)


def entropy_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    logp = torch.log_softmax(full.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class LastStageLoss:
    """The schedule's loss function: the caller's loss on a microbatch's log-probs, times the
    FSDP scale; what it returned recorded for the step's report."""

    def __init__(
        self,
        runner: PipelineRunner,
        fn: Loss,
        group: RowGroup,
        norm: Any,
        scale: float,
        temperature: float,
        entropy: bool,
        recorded: Recorded,
    ) -> None:
        self.runner, self.fn, self.group, self.norm, self.scale = runner, fn, group, norm, scale
        self.temperature, self.entropy, self.recorded = temperature, entropy, recorded

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = index.flatten()
        fields = {name: value[rows] for name, value in self.group.fields.items()}
        lp = logprobs_of(logits, fields["input_ids"], self.temperature)
        if self.runner.inferring or self.group.is_filler(rows):  # torch's dry call, or a filler
            return (torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)) * 0).sum()
        if self.entropy:
            fields["entropy"] = entropy_of(logits, self.temperature)
        try:
            loss, metrics = call_loss(self.fn, lp, fields, self.norm, 0)
        except BatchError as exc:
            self.recorded.problem = self.recorded.problem or str(exc)
            return (lp * 0).sum()
        self.recorded.loss = self.recorded.loss + loss.detach().double()
        for key, value in metrics.items():
            self.recorded.metrics[key] = self.recorded.metrics.get(key, 0.0) + value
        return loss * self.scale


class LastStageLogprobs:
    """The forward-only schedule's loss function: a microbatch's log-probs (and entropy) into
    their rows and positions of ``out`` [2, rows, S]."""

    def __init__(self, group: RowGroup, out: torch.Tensor, temperature: float, entropy: bool) -> None:
        self.group, self.out, self.temperature, self.entropy = group, out, temperature, entropy

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        local = index.flatten()
        ids = self.group.input_ids[local]
        lp = logprobs_of(logits, ids, self.temperature)
        if self.group.is_filler(local):
            return lp.sum() * 0
        rows = torch.tensor(self.group.rows, device=lp.device)[local]
        length = self.group.length  # the row's own positions (not sequence parallelism's padding)
        cols = torch.tensor(self.group.start, device=lp.device)[local][:, None] + torch.arange(length, device=lp.device)
        self.out[0][rows[:, None], cols] = lp[:, :length]
        if self.entropy:
            self.out[1][rows[:, None], cols] = entropy_of(logits, self.temperature)[:, :length]
        return lp.sum() * 0


class LastStageLogits:
    """The forward-only schedule's loss function that keeps a microbatch's logits (the vocabulary
    gathered) at their rows and positions of ``out`` [rows, S, V]."""

    def __init__(self, group: RowGroup, out: torch.Tensor) -> None:
        self.group, self.out = group, out

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        local = index.flatten()
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        if self.group.is_filler(local):
            return full.sum() * 0
        rows = torch.tensor(self.group.rows, device=full.device)[local]
        length = self.group.length
        cols = torch.tensor(self.group.start, device=full.device)[local][:, None] + torch.arange(
            length, device=full.device
        )
        self.out[rows[:, None], cols] = full[:, :length].float()
        return full.sum() * 0


def per_token(token_loss: Loss) -> Loss:
    """A ``token_loss`` as a per-microbatch loss: its predicted tokens (every position after a
    row's first) flat, each field at those tokens (a per-row field at each token's row)."""

    def loss(lp: torch.Tensor, fields: dict[str, torch.Tensor], norm: Any) -> Any:
        rows, length = lp.shape
        tokens = {}
        for name, value in fields.items():
            if value.dim() >= 2 and value.shape[:2] == (rows, length):
                tokens[name] = value[:, 1:].flatten(0, 1)
            else:
                tokens[name] = value.repeat_interleave(length - 1, dim=0)
        return token_loss(lp[:, 1:].flatten(), tokens, norm)

    return loss
