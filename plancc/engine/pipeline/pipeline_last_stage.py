"""What the last pipeline stage does with its microbatch's output (``engine.pipeline.pipeline_steps``): the
caller's loss on its rows' log-probs (``LastStageLoss``), or the log-probs, entropy or logits
kept for the caller (``LastStageLogprobs``, ``LastStageLogits``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from ...runtime.cp_context import CPContext, all_gather, load_balanced_indices
from ...runtime.vocab_parallel_logprobs import IGNORE_INDEX
from ..batches import BatchError
from ..loss_contract import call_loss
from .pipeline_rows import StepRows
from .pipeline_stages import PipelineRunner, next_token_targets

Loss = Callable[[torch.Tensor, dict[str, torch.Tensor], Any], Any]


class Recorded:
    """What the last stage's loss function saw over a step: the loss and metrics (device
    scalars, read once at the end) and the first refusal of the caller's function."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.metrics: dict[str, torch.Tensor | float] = {}
        self.problem = ""


def logprobs_of(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, cp: CPContext | None = None
) -> torch.Tensor:
    """``[rows, L]`` log p(ids[t] | ids[<t]) from the last stage's logits (0 at position 0);
    vocab-sharded logits through the vocab-parallel cross entropy. Under context parallelism the
    logits are this cp rank's positions (``runtime.cp_context``'s load-balanced shard): each predicts
    its next token, and the rows' log-probs are gathered whole (autograd-aware: a loss on them
    is every cp rank's copy of the whole loss, ``runtime.gradient_scale``)."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    if cp is not None:
        nexts = next_token_targets(ids)
        shard = load_balanced_indices(ids.shape[1], cp.size, cp.rank).to(ids.device)
        picked = _picked(scaled, nexts.index_select(1, shard)).view(ids.shape[0], -1)
        whole = all_gather(picked, cp.group, dim=1)  # position t predicts t + 1
        return torch.cat([torch.zeros_like(whole[:, :1]), whole[:, :-1]], 1)
    picked = _picked(scaled[:, :-1], ids[:, 1:]).view(ids.shape[0], -1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1)


def _picked(scaled: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Flat log p(target) at every position (0 where the target is ``IGNORE_INDEX``)."""
    if isinstance(scaled, DTensor):
        with loss_parallel():
            nll: Any = nn.functional.cross_entropy(
                scaled.flatten(0, 1),
                DTensor.from_local(targets.flatten(), scaled.device_mesh, [Replicate()]),
                reduction="none",
                ignore_index=IGNORE_INDEX,
            )
            return -nll.full_tensor()
    return -nn.functional.cross_entropy(
        scaled.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )


def entropy_of(logits: torch.Tensor, temperature: float, cp: CPContext | None = None) -> torch.Tensor:
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    logp = torch.log_softmax(full.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return all_gather(entropy, cp.group, dim=1) if cp is not None else entropy


class LastStageLoss:
    """The schedule's loss function: the caller's loss on a microbatch's log-probs, times the
    FSDP scale; what it returned recorded for the step's report."""

    def __init__(
        self,
        runner: PipelineRunner,
        fn: Loss,
        group: StepRows,
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
        cp = self.runner.cp
        lp = logprobs_of(logits, self.group.input_ids[rows], self.temperature, cp)
        if self.runner.inferring or self.group.is_filler(rows):  # torch's dry call, or a filler
            return (torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)) * 0).sum()
        extra = {"entropy": entropy_of(logits, self.temperature, cp)} if self.entropy else {}
        lp, fields = self.group.loss_view(lp, rows, extra)  # packed rows: the batch's rows again
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

    def __init__(
        self, group: StepRows, out: torch.Tensor, temperature: float, entropy: bool, cp: CPContext | None = None
    ) -> None:
        self.group, self.out, self.temperature, self.entropy, self.cp = group, out, temperature, entropy, cp

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        local = index.flatten()
        ids = self.group.input_ids[local]
        lp = logprobs_of(logits, ids, self.temperature, self.cp)
        if self.group.is_filler(local):
            return lp.sum() * 0
        self.group.place(self.out[0], lp, local, predicted=True)
        if self.entropy:
            self.group.place(self.out[1], entropy_of(logits, self.temperature, self.cp), local)
        return lp.sum() * 0


class LastStageLogits:
    """The forward-only schedule's loss function that keeps a microbatch's logits (the vocabulary
    gathered, and under context parallelism the positions) at their rows and positions of
    ``out`` [rows, S, V]."""

    def __init__(self, group: StepRows, out: torch.Tensor, cp: CPContext | None = None) -> None:
        self.group, self.out, self.cp = group, out, cp

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        local = index.flatten()
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        if self.cp is not None:
            full = all_gather(full, self.cp.group, dim=1)
        if self.group.is_filler(local):
            return full.sum() * 0
        self.group.place(self.out, full.float(), local)
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
