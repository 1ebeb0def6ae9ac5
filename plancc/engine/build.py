"""A parallelized model from a plan, a model name and a mesh: built on meta, parallelized,
then filled -- from a Hugging Face folder's safetensors, or with the seeded initial weights an
unsharded model built with the same seed has (every rank builds that full model on the CPU and
keeps its shards: right for presets and tests; real models come from a folder)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compiler.plan import Plan
from ..models import build_model
from ..runtime.materialize import materialize
from ..runtime.mesh import ParallelMesh
from ..runtime.parallelize import parallelize
from ..runtime.weights import has_safetensors, load_hf_weights


def from_folder(model: str | None) -> bool:
    return bool(model) and Path(str(model)).is_dir() and has_safetensors(str(model))


def load_weights(model: nn.Module, source: str | None, config: PretrainedConfig, device: str, seed: int) -> str:
    """Fill a parallelized meta model; returns where its weights came from."""
    if source is not None and from_folder(source):
        materialize(model, device)
        load_hf_weights(model, str(source))
        return f"safetensors from {source}"
    torch.manual_seed(seed)
    full = build_model(config, device="cpu")
    state = {k: v.to(device) for k, v in full.state_dict().items()}
    del full
    materialize(model, device, full_state_dict=state)
    return f"random init (seed {seed})"


def build_parallel_model(
    plan: Plan,
    source: str | None,
    config: PretrainedConfig,
    mesh: ParallelMesh,
    *,
    device: str,
    seed: int,
    param_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, str]:
    """The model built on meta, parallelized with the plan and filled; (model, weight source)."""
    model = build_model(copy.deepcopy(config), device="meta")  # its own config: cp changes it
    parallelize(model, plan, mesh, param_dtype=param_dtype)
    return model, load_weights(model, source, config, device, seed)
