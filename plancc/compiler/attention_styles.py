"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite) under tensor parallelism.

MLA compresses keys and values into a latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` features)
plus one rotary key of ``qk_rope_head_dim`` features shared by every head. The latent is
normalized and expanded per head by ``kv_b_proj`` (colwise: heads split over tp, its input
gradient all-reduced by the colwise style); the rotary key skips ``kv_b_proj`` and meets each
rank's heads directly, so each rank's gradient of it covers its own heads only. The projection
stays whole, and the gradient of its rotary slice is summed over tp (transformers' own
``mla_kv_a_proj``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .expert_styles import sum_gradients_over


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
