"""What kind of module a style may go on, and what a style does to it (``Layouts``): plain
values over ``torch.nn`` modules, with no DTensor import (``compiler.plain_placements``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from torch import nn

from .plain_placements import Placement


def is_experts_module(module: nn.Module) -> bool:
    """transformers' fused experts: a ``*Experts`` class whose weights are all expert-major (3-D
    matrices, 2-D biases, one leading experts dim) and that is called with the router's choice
    (Llama 4's experts take pre-routed tokens: not these)."""
    if not type(module).__name__.endswith("Experts"):
        return False
    params = list(module.parameters(recurse=False))
    if not any(p.dim() == 3 for p in params):
        return False
    if any(p.dim() == 0 or p.shape[0] != params[0].shape[0] for p in params):
        return False  # every weight per expert, or the experts' dim is not one dim to split
    arguments = inspect.signature(module.forward).parameters.values()
    # a skeleton's forward takes (*args, **kwargs): its class was recorded from a real one
    return any(a.kind is a.VAR_POSITIONAL for a in arguments) or len(arguments) >= 3


def expert_count(module: nn.Module) -> int:
    """The number of experts: the leading dim every expert weight shares."""
    return int(next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0])


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's bare parameters (not its submodules'): an attention block's per-head sinks."""
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p.dim() >= 1]


class ModuleKind(StrEnum):
    LINEAR = "linear"
    EMBEDDING = "embedding"
    NORM = "norm"
    ROTARY = "rotary"
    EXPERTS = "experts"  # transformers' fused experts of a mixture-of-experts layer
    OTHER = "other"


def module_kind(module: nn.Module) -> ModuleKind:
    if isinstance(module, nn.Linear):
        return ModuleKind.LINEAR
    if isinstance(module, nn.Embedding):
        return ModuleKind.EMBEDDING
    name = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm")):
        return ModuleKind.NORM
    if name.endswith("RotaryEmbedding"):
        return ModuleKind.ROTARY
    if is_experts_module(module):
        return ModuleKind.EXPERTS
    return ModuleKind.OTHER


@dataclass(frozen=True, kw_only=True, slots=True)
class Layouts:
    """What a built style does to its module's input, output and weight."""

    input: Placement | None
    output: Placement | None
    local_output: bool | None
    # weight placement on the tp axis per module kind; None where the style does not touch it
    weight: Mapping[ModuleKind, Placement] | None
