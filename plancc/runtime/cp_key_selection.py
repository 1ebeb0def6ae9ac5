"""Attention layers that pick their keys from the keys' own activations, under context parallelism.

Two kinds of layer in transformers choose, from activations over the whole sequence, which
keys each query attends to:
- DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4, dots3-note): a
  small attention of its own scores every key for every query and keeps the top ``k``;
- Doge's dynamic mask: a per-key bias ``exp(A * softplus(dt_proj(v)))`` added to every query's
  scores, and only the ``keep_window_size`` best keys kept.
Under context parallelism a layer sees its rank's shard of the sequence only, so each would
pick among its own shard's keys. What both need from the other ranks is one vector per key --
the indexer's key, Doge's ``dt`` -- which is what the CP attention already gathers for its own
keys. So:
- the indexer is handed a cache whose ``update_indexer`` (the one call every indexer makes with
  its keys when a cache is given) returns every rank's keys in sequence order: its scores are
  ``[B, S/cp, S]`` against the whole sequence, under the CP mask (global positions, documents,
  padding) given to its layer in place of the model's, and the indices it picks are indices of
  the gathered sequence; the layer hands them to the CP attention (``indices=``), which masks
  with them;
- Doge's ``prepare_dynamic_mask`` is given every key's ``dt`` (all-gathered with its gradient:
  the backward reduce-scatters it to the ranks that computed it) and the CP mask.
Both then attend through a dense ``[B, H, S/cp, S]`` mask: their selection is per query and key,
as it is in the unsharded layer (whose mask is ``[B, H, S, S]``), so a rank holds a cp-th of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..sequence_mixing import has_dynamic_mask, is_indexer
from .cp_context import SELECTS_KEYS, CPContext, all_gather
from .document_attention import sliding_window


def select_keys_over_the_sequence(model: nn.Module, ctx: CPContext) -> None:
    """Give every indexer and dynamic mask of ``model`` the keys of the whole sequence (the
    layers' classes are read, not changed: hooks and an instance attribute)."""
    for module in model.modules():
        # an attention with an indexer, or with none of its own (GLM-MoE-DSA's shared layers
        # reuse the previous layer's picks): it passes the picks to the CP attention
        indexer = getattr(module, "indexer", False)
        if indexer is None or (isinstance(indexer, nn.Module) and is_indexer(indexer)):
            module.register_forward_pre_hook(_CPMask(ctx, module), with_kwargs=True)
            module.__dict__[SELECTS_KEYS] = True
        if is_indexer(module):
            module.register_forward_pre_hook(_GatheredIndexerKeys(ctx), with_kwargs=True)
        if has_dynamic_mask(module):
            module.__dict__["prepare_dynamic_mask"] = _DynamicMask(ctx, module)
            module.__dict__[SELECTS_KEYS] = True


class _CPMask:
    """The layer's ``attention_mask``: the CP mask ``[B, 1, S/cp, S]`` (bool) where the model's
    mask function gave none -- what the indexer scores against and the layer narrows."""

    def __init__(self, ctx: CPContext, module: nn.Module) -> None:
        self.ctx, self.window = ctx, sliding_window(module, {})

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = self.ctx.mask(self.window)
        return args, kwargs


class _IndexerKeys:
    """What the indexer takes for a cache: its keys ``[B, S/cp, D]`` in, every rank's ``[B, S, D]``
    out, in the order of the sequence."""

    def __init__(self, ctx: CPContext) -> None:
        self.ctx = ctx

    def update_indexer(self, key: torch.Tensor, layer_idx: int) -> torch.Tensor:
        batch = self.ctx.batch
        documents = batch.bounds if batch is not None and batch.bounds is not None else self.ctx.cu_seqlens
        return all_gather(key, self.ctx.group, dim=1, cu_seqlens=documents)


class _GatheredIndexerKeys:
    """Forward pre-hook of an indexer: its cache is the gatherer (training passes none)."""

    def __init__(self, ctx: CPContext) -> None:
        self.keys = _IndexerKeys(ctx)

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if kwargs.get("past_key_values") is not None:
            raise ValueError(
                f"{type(module).__name__} was given a cache under context parallelism: generation with a "
                "cache is not sharded by sequence (run it with --cp 1)"
            )
        kwargs["past_key_values"] = self.keys
        return args, kwargs


class _DynamicMask:
    """Doge's ``prepare_dynamic_mask`` with every key's ``dt`` and the CP mask."""

    def __init__(self, ctx: CPContext, module: nn.Module) -> None:
        self.ctx, self.module = ctx, module
        self.own = type(module).prepare_dynamic_mask  # type: ignore[attr-defined]

    def __call__(
        self,
        hidden_states: torch.Tensor,
        dt_states: torch.Tensor,
        keep_window_size: int = 2048,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = self.ctx.batch
        documents = batch.bounds if batch is not None and batch.bounds is not None else self.ctx.cu_seqlens
        every_dt = all_gather(dt_states, self.ctx.group, dim=2, cu_seqlens=documents)  # [B, Hkv, S]
        if attention_mask is None:
            attention_mask = self.ctx.mask(sliding_window(self.module, {}))
        result: torch.Tensor = self.own(self.module, hidden_states, every_dt, keep_window_size, attention_mask)
        return result
