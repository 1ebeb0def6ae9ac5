"""Activation checkpointing of the plan's targets: full recompute, or selective (keep the
outputs of named operator groups, recompute the cheap rest).

Selective checkpointing trades memory for compute per operator, as torchtitan's "op" mode
does: keeping matmul outputs means backward recomputes only norms, activations and other
elementwise work; keeping collective outputs means backward never repeats a TP collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)


def _packets(namespace: str, names: Iterable[str]) -> tuple:
    ops = getattr(torch.ops, namespace)
    return tuple(getattr(ops, n) for n in names if hasattr(ops, n))  # kernels vary by build


# The vocabulary of `save:` in a plan (the schema's enum is this table's keys).
SAVE_GROUPS: Mapping[str, tuple] = {
    "matmul": _packets("aten", ["mm", "addmm", "bmm", "baddbmm"]),
    "attention": _packets(
        "aten",
        [
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_fused_attention_overrideable",
        ],
    ),
    "collectives": _packets(
        "_c10d_functional", ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"]
    ),
}


CHECKPOINTED = "_plancc_checkpointed"  # set on each module whose forward is recomputed in backward


def checkpointed_count(model: nn.Module) -> int:
    """How many of ``model``'s modules recompute their forward in backward."""
    return sum(1 for m in model.modules() if getattr(m, CHECKPOINTED, False))


def save_policy(groups: Iterable[str]) -> Callable[..., CheckpointPolicy]:
    """A selective-checkpoint policy: keep the outputs of ``groups``' operators."""
    keep = frozenset(op for group in groups for op in SAVE_GROUPS[group])

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(
    model: nn.Module, names: Iterable[str], saves: Mapping[str, tuple[str, ...]] | None = None
) -> None:
    """Recompute each target's ``forward`` in backward instead of keeping its activations;
    targets in ``saves`` keep the outputs of the named operator groups.

    Only ``forward`` itself is checkpointed, not the module's hooks: TP styles that gather
    inputs in a pre-hook (``gather_seq_input``) must run once, not again on an input they
    already gathered. Patching the instance keeps module names (state-dict keys, plan
    globs) unchanged, unlike ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``.
    """
    modules = dict(model.named_modules())
    saves = saves or {}
    for name in names:
        module = modules[name]
        extra: dict[str, Any] = {}
        if saves.get(name):
            extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_policy(saves[name]))

        def forward(
            *args: Any, _inner: Callable[..., Any] = module.forward, _extra: dict[str, Any] = extra, **kwargs: Any
        ) -> Any:
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **_extra, **kwargs)

        module.forward = forward  # per instance, on purpose (see above)
        setattr(module, CHECKPOINTED, True)
