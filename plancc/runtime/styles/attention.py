"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite) under tensor parallelism.

MLA compresses keys and values into a latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` features)
plus one rotary key of ``qk_rope_head_dim`` features shared by every head. The latent is
normalized and expanded per head by ``kv_b_proj`` (colwise: heads split over tp, its input
gradient all-reduced by the colwise style); the rotary key skips ``kv_b_proj`` and meets each
rank's heads directly, so each rank's gradient of it covers its own heads only. The projection
stays whole, and the gradient of its rotary slice is summed over tp (transformers' own
``mla_kv_a_proj``).

Attention blocks with parameters of their own, one per head (gpt-oss's and Granite-SWA's
learned sinks), shard them with the heads: ``per_head_params``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ...compiler.kinds import own_parameters
from .block_input import BlockInput
from .experts import local_parameters_during_forward, sum_gradients_over


class LatentKeyValueProjection(ParallelStyle):
    """``kv_a_proj_with_mqa`` whole; the gradient of its last ``rope_dim`` outputs summed over tp."""

    def __init__(self, *, rope_dim: int | None = None):
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope = self.rope_dim
        if not rope:  # the mla-rope-dim check reports this with the plan's line
            raise ValueError("mla_kv_a_proj needs rope_dim: the config's qk_rope_head_dim")

        def sum_rotary_gradients(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            latent, rotary = output.split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, sum_gradients_over(rotary, device_mesh)], dim=-1)

        module.register_forward_hook(sum_rotary_gradients)
        return module


class PerHeadParameters(ParallelStyle):
    """A head-split attention block's own per-head parameters (gpt-oss-style sinks, one per
    head) sharded with the heads: ``Shard(0)`` over tp, and the block's forward sees this rank's
    heads' entries as plain tensors (transformers' ``local_params``).

    Left whole, each rank's attention would meet all heads' sinks with its own heads only (a
    shape error), or, replicated, form their gradients from its own heads (a partial sum).

    ``input_layouts`` (``replicate``, or ``shard(1)`` under SP) also lays out the block's input
    once for its projections, as ``shared_input`` / ``gather_seq_input`` do on a block with no
    style of its own: one collective for the summed input gradients of q, k and v."""

    def __init__(self, *, input_layouts: Placement | None = None, src_data_rank: int | None = 0):
        self.input_layouts = input_layouts
        self.src_data_rank = src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.input_layouts is not None:  # the block's input, as shared_input / gather_seq_input lay it out
            BlockInput(input_layouts=self.input_layouts)._apply(module, device_mesh)
        params = own_parameters(module)
        if not params:  # a layer without sinks (style-module-kind reports a rule where none has them)
            return module
        tp = device_mesh.size()
        for name, param in params:
            if param.shape[0] % tp:
                raise ValueError(f"{type(module).__name__}.{name}: {param.shape[0]} heads do not split over tp={tp}")
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        local_parameters_during_forward(module)
        return module
