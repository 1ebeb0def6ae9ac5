"""The contract between ``Policy.train`` and a caller's loss, shared by the engine with and
without pipeline stages: the global batch's normalizers (``BatchTotals``), how a loss is called and
refused (``call_loss``), the sampling temperature's rule, and the error of a diverged step."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .batches import BatchError

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], "BatchTotals"], tuple[torch.Tensor, Mapping[str, Any]]]
# (log-probs [n], every field at those n tokens, norm) -> loss, or (loss, metrics)
TokenLoss = Callable[[torch.Tensor, dict[str, torch.Tensor], "BatchTotals"], Any]

# the coldest temperature whose log-probs are finite: fp32 logits of ~1e3 times 1/t stay far
# below fp32's 3e38 (at 1e-40, 1/t itself is inf in fp32 and every log-prob NaN)
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True, slots=True)
class BatchTotals:
    """The normalizers of one global batch, the same on every rank: ``tokens`` is the sum of
    ``token_mask`` (default: every attended position after the first) and ``sequences`` the
    rows with ``sample_mask`` (default: every row), over every data-parallel rank's slice.

    Why global: a loss normalized per microbatch or per rank (``mean`` over what it sees) weighs
    a token by how many tokens happen to share its microbatch, so gradient accumulation and data
    parallelism change the gradient. Divide by ``norm.tokens`` (or ``norm.sequences``) and every
    microbatch's loss is its exact share of the global batch's loss."""

    tokens: float
    sequences: float


def call_loss(loss_fn: LossFn, lp: torch.Tensor, fields: dict[str, torch.Tensor], norm: BatchTotals, index: int) -> Any:
    """The caller's loss on one microbatch, refused (as a ``BatchError``) when it fails or is not a
    scalar (a non-finite one is backpropagated first, then refused: ``_raise_non_finite``)."""
    try:
        result = loss_fn(lp, fields, norm)
    except KeyError as exc:
        raise BatchError(
            f"microbatch {index}: the loss reads field {exc} that the batch lacks (fields: {sorted(fields)})"
        ) from None
    except Exception as exc:  # the caller's code: say where it failed, on every rank
        raise BatchError(f"microbatch {index}: the loss raised {type(exc).__name__}: {exc}") from None
    loss, metrics = result if isinstance(result, tuple) else (result, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BatchError(f"microbatch {index}: the loss must be a scalar tensor, got {shape}")
    return loss.reshape(()), _checked_metrics(metrics, index)


# what a step reports itself (``Policy.train``'s result): a loss's metric of one of these names would
# replace the step's own figure in what the caller reads
STEP_KEYS = frozenset({"loss", "grad_norm", "lr", "tokens", "sequences", "input_tokens", "microbatches", "seconds"})


def _checked_metrics(metrics: Any, index: int) -> dict[str, torch.Tensor | float]:
    """A loss's metrics as the step sums them, or a ``BatchError`` naming the one that cannot be
    (refused on every rank after the loop, as a failing loss is): a name the step's own keys
    use, a name that is not a word, a value that is no scalar."""
    if not isinstance(metrics, Mapping):
        raise BatchError(
            f"microbatch {index}: the loss's metrics must be a mapping of names to scalars, got "
            f"{type(metrics).__name__}"
        )
    kept: dict[str, torch.Tensor | float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name.strip():
            raise BatchError(
                f"microbatch {index}: the loss returned a metric named {name!r}; a metric's name is a non-empty string"
            )
        if name in STEP_KEYS:
            raise BatchError(
                f"microbatch {index}: the loss returned a metric named {name!r}, which would replace "
                f"the step's own {name!r} in what train() returns (the step's keys: "
                f"{', '.join(sorted(STEP_KEYS))}); rename it (e.g. 'my_{name}')"
            )
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            kept[name] = value.detach().reshape(())  # stays where it is: summed there, read once per step
        elif isinstance(value, int | float):
            kept[name] = float(value)
        else:
            what = (
                f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            )
            raise BatchError(
                f"microbatch {index}: the loss's metric {name!r} is {what}; a metric is a number or a "
                "one-element tensor (summed over the batch)"
            )
    return kept


def check_temperature(temperature: float) -> None:
    """The one rule for a sampling temperature, in ``train``, ``logprobs`` and
    ``reference_logprobs`` alike: a finite number above 0 (0 is greedy decoding, which has no
    log-probs; an infinite one makes every token equally likely)."""
    if not isinstance(temperature, int | float) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature {temperature!r} is not a sampling temperature: it must be finite and > 0")
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature!r} is below {MIN_TEMPERATURE:g}: fp32 logits divided by it overflow "
            "(log-probs NaN); a sampler that cold is greedy decoding, which has no log-probs"
        )


class NonFiniteError(ArithmeticError):
    """A training step whose loss or gradient norm is not finite: the optimizer did not step.

    Divergence, not bad input: not a ``BatchError`` (it used to be one), so a caller
    catching bad batches does not swallow it. ``except (BatchError, NonFiniteError)`` catches
    both."""

    def __init__(self, *, loss: float, grad_norm: float, microbatch: int | None, parameter: str | None) -> None:
        self.loss, self.grad_norm, self.microbatch, self.parameter = loss, grad_norm, microbatch, parameter
        where = f" (from microbatch {microbatch} on this rank)" if microbatch is not None else ""
        first = f"; first non-finite gradient: {parameter}" if parameter else ""
        super().__init__(
            f"not finite: loss {loss:.6g}, gradient norm {grad_norm:.6g}{where}{first}; the optimizer did not step"
        )
