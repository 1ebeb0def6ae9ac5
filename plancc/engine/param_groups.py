"""What the optimizer steps: the parameters that train (with LoRA, the adapters alone), in two
groups when weight decay is asked for.

Decay goes to the matrices (and MoE's stacked expert tensors); norms, biases and embeddings get
none, as torchtitan, TRL and nanoGPT exclude them: decaying a norm's gain or a bias pulls it
toward 0, where it means something (a gain of 1, no offset), and an embedding row decays only
on the steps its token is absent. A tied head is the embedding's tensor, so it is excluded with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class DecaySplit:
    """How many tensors (and elements) weight decay reaches, and how many it leaves alone."""

    decayed: int
    excluded: int
    decayed_numel: int
    excluded_numel: int


def trained_parameters(model: nn.Module, weight_decay: float | None, *, embeddings: Iterable[int] = ()) -> list[Any]:
    """What the optimizer gets: the trainable parameters as a list (``weight_decay`` None: the
    optimizer's own default applies to every one), or as two parameter groups, the matrices
    with ``weight_decay`` and the rest with none. ``embeddings``: ids of parameters that are an
    embedding's weight though no ``nn.Embedding`` holds them (a tied lm_head's copy on the last
    pipeline stage: decayed, it would leave its embedding)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if weight_decay is None:
        return trained
    excluded = _excluded(model) | set(embeddings)
    decay = [p for p in trained if id(p) not in excluded]
    rest = [p for p in trained if id(p) in excluded]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def decay_split(model: nn.Module) -> DecaySplit:
    """The trainable tensors weight decay reaches and those it excludes (the run's log says both)."""
    excluded = _excluded(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    out = [p for p in trained if id(p) in excluded]
    kept = [p for p in trained if id(p) not in excluded]
    return DecaySplit(
        decayed=len(kept),
        excluded=len(out),
        decayed_numel=sum(p.numel() for p in kept),
        excluded_numel=sum(p.numel() for p in out),
    )


def _excluded(model: nn.Module) -> set[int]:
    """The ids of the parameters no decay reaches: vectors (norm gains, biases) and embeddings."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {id(p) for p in model.parameters() if p.ndim < 2 or id(p) in embeddings}
