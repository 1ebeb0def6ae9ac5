"""One microbatch through ``plancc.Policy``'s model: its log-probs (``forward``), and a training
pass with the caller's loss -- on its log-probs (``loss_pass``), or as a sum of per-token terms
whose gradient forms while the lm_head's logits are computed (``token_pass``, ``TokenTerms``).
Each pass scales its loss so that the gradients are the global batch's (``runtime.gradient_scale``)
and notes a refusal of the caller's function rather than raising it: every rank runs the same
passes, and the step is refused on every rank after the last backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime.fused_logprobs import targets_checked
from ..runtime.gradient_scale import loss_scale, token_loss_scale
from ..runtime.mesh import ParallelMesh
from ..runtime.token_loss import evaluated_positions, model_token_loss
from ..runtime.vocab_parallel_logprobs import fusable, token_logprobs
from .batches import BatchError, Microbatch
from .loss_contract import BatchTotals, LossFn, TokenLoss, call_loss


def forward(
    model: nn.Module, mesh: ParallelMesh, mb: Microbatch, *, entropy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A microbatch's log-probs (and entropy) at its rows' own positions."""
    with targets_checked():  # check_batch read the token ids, once per step
        result: Any = token_logprobs(  # type: ignore[call-overload]  # entropy is a bool here, not a Literal
            model,
            mb.input_ids,
            attention_mask=mb.attention_mask,
            cu_seqlens=mb.cu_seqlens,
            mesh=mesh,
            temperature=temperature,
            entropy=entropy,
            document_bounds=mb.starts,
        )
    if isinstance(result, tuple):
        return mb.unpack(result[0]), mb.unpack(result[1])
    return mb.unpack(result), None


def loss_pass(
    model: nn.Module,
    mesh: ParallelMesh,
    mb: Microbatch,
    loss_fn: LossFn,
    norm: BatchTotals,
    index: int,
    *,
    entropy: bool,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], str]:
    """One microbatch's forward and backward with a ``loss_fn``: (its loss, its metrics, the
    refusal of its loss or "")."""
    lp, ent = forward(model, mesh, mb, entropy=entropy, temperature=temperature)
    fields = dict(mb.fields)
    if ent is not None:
        fields["entropy"] = ent
    problem = ""
    try:
        loss, metrics = call_loss(loss_fn, lp, fields, norm, index)
    except BatchError as exc:  # the step is refused after the loop, on every rank
        problem = str(exc)
        loss, metrics = (lp * 0).sum(), {}  # the passes every rank runs; its gradient is dropped
    # the global loss's gradient (runtime.gradient_scale states the invariant)
    (loss * loss_scale(mesh.layout)).backward()  # even when not finite: every rank runs the same passes
    return loss.detach(), metrics, problem


def token_pass(
    model: nn.Module,
    mesh: ParallelMesh,
    mb: Microbatch,
    token_loss: TokenLoss,
    norm: BatchTotals,
    index: int,
    *,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], str]:
    """One microbatch's forward and backward with a ``token_loss``: the 3-matmul path
    (``runtime.token_loss``), or the log-probs path for a model that transforms its logits."""
    evaluated = evaluated_positions(
        model, mb.batch_positions(), attention_mask=mb.attention_mask, cu_seqlens=mb.cu_seqlens
    )
    terms = TokenTerms(token_loss, mb.per_token(evaluated), norm, index)
    if fusable(model):
        with targets_checked():  # check_batch read them, once per step
            loss = model_token_loss(
                model,
                mb.input_ids,
                evaluated,
                terms,
                attention_mask=mb.attention_mask,
                cu_seqlens=mb.cu_seqlens,
                temperature=temperature,
                document_bounds=mb.starts,
            )
    else:
        lp, _ = forward(model, mesh, mb, entropy=False, temperature=temperature)
        known = evaluated >= 0
        mine = torch.where(known, lp.reshape(-1)[evaluated.clamp(min=0)], torch.zeros_like(known, dtype=lp.dtype))
        loss = terms(mine, slice(0, mine.numel()))
    # each cp rank's loss is its positions' share: runtime.gradient_scale.token_loss_scale
    (loss * token_loss_scale(mesh.layout)).backward()
    return loss.detach(), terms.metrics, terms.problem


class TokenTerms:
    """A ``token_loss`` as the fused evaluator calls it, once per chunk of tokens: each chunk's
    fields sliced out, its metrics summed, and a refusal (the caller's function failed) noted
    rather than raised -- the evaluator runs collectives between chunks, and every rank must
    reach them all; the step is refused on every rank after the last backward."""

    def __init__(self, fn: TokenLoss, tokens: dict[str, torch.Tensor], norm: BatchTotals, microbatch: int) -> None:
        self.fn, self.tokens, self.norm, self.microbatch = fn, tokens, norm, microbatch
        self.metrics: dict[str, torch.Tensor | float] = {}
        self.problem = ""

    def __call__(self, lp: torch.Tensor, index: slice) -> torch.Tensor:
        if not self.problem:
            fields = {name: value[index] for name, value in self.tokens.items()}
            try:
                loss, metrics = call_loss(self.fn, lp, fields, self.norm, self.microbatch)
            except BatchError as exc:
                self.problem = str(exc)
            else:
                for key, value in metrics.items():
                    self.metrics[key] = self.metrics.get(key, 0.0) + value
                return loss
        # nothing, with a finite gradient of 0 (a log-prob may be -inf)
        return torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)).sum() * 0
