"""How ``Policy`` runs a step: the one place that knows whether the model is one part or a
rank's pipeline stages (torchtitan branches the same way, in its forward-backward step).

``Policy`` owns the model's parts (``ModelParts``), the optimizer, the schedule, the reference,
the weights out and the checkpoints, whatever the layout. A step executor runs the forward and
backward of a step over the parts and clips the gradients (``train_step``, returning a
``StepOutcome``: ``Policy`` then steps the optimizer and the schedule), and the forward of
``logprobs`` and ``logits``:

- ``PlainSteps`` (here): the model is one part; the batch is cut into microbatches (rows, a
  token budget, packing: ``engine.batches``), each microbatch's passes run one after the other
  (``engine.microbatch_passes``);
- ``PipelineSteps`` (``engine.pipeline.pipeline_steps``): the parts are this rank's stages, stepped by
  torch.distributed.pipelining's schedule (``engine.pipeline.pipeline_stages``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import SourceLoc
from ..runtime.gradnorm import global_grad_norm, local_gradients, scale_local_to_norm_
from ..runtime.local_tensors import full_value_quietly
from ..runtime.mesh import ParallelMesh
from ..runtime.stepping import require_stepped
from . import shards
from .batch_agreement import AgreedBatch, agreed_batch, raise_non_finite, settled_step
from .batches import Batch, Microbatch, Microbatching
from .loss_contract import LossFn, TokenLoss
from .microbatch_passes import forward, loss_pass, token_pass


@dataclass(frozen=True, slots=True)
class ModelParts:
    """What a rank holds of the model, and how the whole model's structure reads from it.

    ``model``: the rank's parameters at the model's names (the whole model, or its stages).
    ``whole``: the model's structure, which checkpoints, exports and the weights out are shaped
    by (``model`` itself without stages; the whole model on meta with them). ``values``: a
    tensor's full value by a ``whole`` name where ``model`` is not the whole (a pipeline's
    stages gather it and broadcast it over the pipeline), else None. ``aliases``: ``model``'s
    tensors a folder holds under another name (a tied weight's copy on the last stage);
    ``copies``: those copies' parameters, by id (weight decay spares them, as it spares the
    embedding)."""

    model: nn.Module
    whole: nn.Module
    weight_source: str
    values: Callable[[str], torch.Tensor] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    copies: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class TrainStep:
    """What one ``Policy.train`` call asks of a step: this rank's rows, the loss (one of a
    per-microbatch ``loss_fn`` or a per-token ``token_loss``), how the rows are cut, the
    sampler's temperature, whether the loss sees the entropy, and the clip (None or 0: none)."""

    batch: Batch
    loss_fn: LossFn | None
    token_loss: TokenLoss | None
    cut: Microbatching
    entropy: bool = False
    temperature: float = 1.0
    max_grad_norm: float | None = None


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """A step's forward and backward, agreed over the ranks and clipped, before the optimizer
    steps: the global batch's loss, the gradient norm before clipping, the loss's metrics summed
    over every dp rank, the global normalizers, the attended tokens and this rank's microbatches."""

    loss: float
    grad_norm: float
    metrics: dict[str, float]
    tokens: float
    sequences: float
    input_tokens: float
    microbatches: int


class StepExecutor(Protocol):
    def train_step(self, step: TrainStep, optimizer: torch.optim.Optimizer) -> StepOutcome: ...

    def logprobs(
        self, batch: Batch, cut: Microbatching, *, entropy: bool, temperature: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def logits(self, batch: Batch) -> torch.Tensor: ...

    def tied_copies_identical(self) -> bool: ...


class PlainSteps:
    """The step over one part: microbatches one after the other (see the module's docstring)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, config: PretrainedConfig, device: str, where: SourceLoc):
        """``where``: the plan's location, named when a step would leave a parameter unstepped."""
        self.model, self.mesh, self.config, self.device, self.where = model, mesh, config, device, where

    def train_step(self, step: TrainStep, optimizer: torch.optim.Optimizer) -> StepOutcome:
        layout, cut, token_loss = self.mesh.layout, step.cut, step.token_loss
        agreed = self._agreed(step.batch, cut)
        batch, norm, plan, spans = agreed.batch, agreed.totals, agreed.microbatches, agreed.spans
        if not self.model.training:  # every module's flag: a walk of the model, not free on each step
            self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor | float] = {}
        # Nothing reads the device inside the loop (a GPU's queue never stalls on the host): a
        # microbatch whose loss the caller's function refused is noted and agreed on after the
        # last backward, whether each loss is finite is read once at the end, metrics are summed
        # where they are.
        refused = ""  # this rank's first refused microbatch
        finite: list[torch.Tensor] = []
        try:
            for index, rows in enumerate(plan):
                mb = Microbatch.of(batch, rows, multiple=layout.sequence_multiple, pack=cut.pack, spans=spans)
                if token_loss is not None:
                    loss, metrics, problem = token_pass(
                        self.model, self.mesh, mb, token_loss, norm, index, temperature=step.temperature
                    )
                else:
                    assert step.loss_fn is not None, "one loss is given (Policy.train checked)"
                    loss, metrics, problem = loss_pass(
                        self.model,
                        self.mesh,
                        mb,
                        step.loss_fn,
                        norm,
                        index,
                        entropy=step.entropy,
                        temperature=step.temperature,
                    )
                refused = refused or problem
                finite.append(torch.isfinite(loss))
                loss_sum += loss.to(torch.float64)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
            params = [p for p in self.model.parameters() if p.grad is not None]
            # the norm is read with the step's verdicts and sums (one read of the device, not two);
            # what clipping scales is found before that read, while the device runs the backward
            clipped = local_gradients(params)
            gradient_norm = global_grad_norm(params, clipped)
            # the shares are the dp ranks' (a token loss's: dp x cp, each cp rank its positions)
            shares = layout.dp * (layout.cp if token_loss is not None else 1)
            settled = settled_step(refused, finite, loss_sum, sums, shares, self.device, gradient_norm)
            if settled.not_finite or not math.isfinite(settled.grad_norm):
                raise_non_finite(self.model, finite, settled.loss, settled.grad_norm, self.device)
            scale_local_to_norm_(clipped, settled.grad_norm, step.max_grad_norm or math.inf)
            require_stepped(self.model, optimizer, where=self.where)
        except BaseException:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is kept
            shards.back_to_shards(self.model)
            raise
        return StepOutcome(
            loss=settled.loss,
            grad_norm=settled.grad_norm,
            metrics=dict(settled.metrics),
            tokens=norm.tokens,
            sequences=norm.sequences,
            input_tokens=agreed.input_tokens,
            microbatches=len(plan),
        )

    def logprobs(
        self, batch: Batch, cut: Microbatching, *, entropy: bool, temperature: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        agreed = self._agreed(batch, cut)
        batch, plan, spans = agreed.batch, agreed.microbatches, agreed.spans
        rows_total, seq = batch["input_ids"].shape
        out = torch.zeros((rows_total, seq), dtype=torch.float32, device=self.device)
        ent_out = torch.zeros_like(out) if entropy else None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for rows in plan:
                    mb = Microbatch.of(
                        batch, rows, multiple=self.mesh.layout.sequence_multiple, pack=cut.pack, spans=spans
                    )
                    lp, ent = forward(self.model, self.mesh, mb, entropy=entropy, temperature=temperature)
                    out[rows] = lp
                    if ent_out is not None and ent is not None:
                        ent_out[rows] = ent
        finally:
            self.model.train(was_training)
        return (out, ent_out) if ent_out is not None else out

    def logits(self, batch: Batch) -> torch.Tensor:
        """The model's own logits of the rows (a cp rank's positions, a tp rank's whole
        vocabulary): what ``--verify`` compares with the unsharded model."""
        with torch.no_grad():
            return full_value_quietly(self.model(**batch, use_cache=False).logits)

    def tied_copies_identical(self) -> bool:
        return True  # one part: a tied weight is one tensor

    def _agreed(self, batch: Batch, cut: Microbatching) -> AgreedBatch:
        vocab = getattr(self.config.get_text_config(), "vocab_size", None)
        return agreed_batch(
            batch,
            self.mesh,
            device=self.device,
            vocab_size=vocab,
            micro_batch_size=cut.micro_batch_size,
            max_tokens=cut.max_tokens,
        )


def step_metrics(outcome: StepOutcome, lr: float, seconds: float) -> dict[str, float]:
    """``Policy.train``'s return: the outcome's numbers by the names users read."""
    return {
        "loss": outcome.loss,
        "grad_norm": outcome.grad_norm,
        "lr": lr,
        "tokens": outcome.tokens,
        "sequences": outcome.sequences,
        "input_tokens": outcome.input_tokens,
        "microbatches": float(outcome.microbatches),
        "seconds": seconds,
        **outcome.metrics,
    }
